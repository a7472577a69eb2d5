// ZeRO stages 1 and 2 (see zero.h): whole parameters on every rank, laid out
// in gradient buckets; each rank's optimizer steps its 1/N of every bucket.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <deque>
#include <unordered_set>

#include "parallel/internal/sharding_strategy.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat::parallel {
namespace {

// Parameters whose gradients arrive together, in one flat buffer padded to a
// multiple of the shard group's size; rank r owns [r * chunk, (r + 1) * chunk).
struct Bucket {
  bool tp_sharded = false;
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  std::vector<char> arrived;  // gradient of params[k] arrived in this backward
  size_t arrivals = 0;
  int64_t numel = 0, padded = 0, chunk = 0;
  at::Tensor flat;   // [padded] float32: the parameters are views of it (mixed precision: of `compute`); none under masters_on_host
  at::Tensor compute;  // mixed precision: [padded] 16-bit copy of flat, made when flat changed
  at::Tensor shard;  // a leaf sharing flat's [r * chunk, +chunk): the optimizer's parameter (masters_on_host: compute's)
  at::Tensor master;  // masters_on_host: the shard's float32 value, in host memory
  int64_t shard_version = 0;  // shard._version() when flat was last made whole
  at::Tensor grad;   // [padded] gradients collected for the reduce (contiguous_gradients)
  at::Tensor input, output;  // of the reduction in flight
  std::shared_ptr<Work> pending;
  bool launched = false;  // reduced (or in flight) since the last finish_backward
  bool done_in_backward = false;  // its reduction was seen complete before the backward ended
};

class Stage12 final : public ShardingStrategy {
 public:
  static constexpr size_t kMaxInFlight = 2;

  Stage12(torch::nn::Module& model, const DpGroups& groups, const std::vector<at::Tensor>& sharded_tp,
          const ZeroOptions& options, MasterPolicy& policy);
  ~Stage12() override;

  std::vector<at::Tensor> parameters() const override;
  std::vector<at::Tensor> host_masters() const override;
  std::vector<ShardLayout> layout() const override;
  std::vector<FullUnitSource> full_units() override;
  // The buckets made whole again from the stepped shards (when they changed).
  void sync_parameters() override;
  GradientHold gradient_hold(int64_t trainable, int64_t local_trainable) const override {
    return stage12_gradients(options_, trainable, local_trainable);
  }
  void begin_forward() override { sync_parameters(); }
  // An edit may lie in one rank's shard alone: every rank gathers.
  void after_write() override {
    stepped_ = true;
    sync_parameters();
  }
  void leave_whole() override;
  void begin_backward(bool synchronize) override;
  void abandon_backward() override;
  at::Tensor finish_forward(const at::Tensor& loss) override;
  void finish_backward(bool synchronize) override;
  std::vector<GradGroup> grad_groups(const std::vector<at::Tensor>& sharded_tp,
                                     const std::shared_ptr<Communicator>& tp) const override;
  ZeroStats stats() const override;
  void reset_peak() override { stats_.peak_grad_bytes = grad_bytes_now(); }

 private:
  // A parameter's gradient was accumulated (AccumulateGrad's post hook).
  void on_gradient(size_t bucket, size_t index);
  void progress();
  bool stale() const;
  void launch(size_t b);
  void complete(size_t b);
  int64_t grad_bytes_now() const;
  void flatten_bucket(Bucket& b);
  // The bucket's float32 values, whole: flat, or gathered from the host masters.
  at::Tensor whole_master(const Bucket& b);
  // What the bucket's float32 gradients are made in.
  at::TensorOptions grad_options(const Bucket& b) const {
    return b.compute.defined() ? b.compute.options().dtype(at::kFloat) : b.flat.options();
  }
  void track_grad_bytes() { stats_.peak_grad_bytes = std::max(stats_.peak_grad_bytes, grad_bytes_now()); }

  DpGroups groups_;
  ZeroOptions options_;
  // The policy's masters_on_host (master_policy.h): the device keeps the
  // 16-bit copies alone (no flat); the float32 masters are the buckets'
  // `master` and frozen_'s host masters, in host memory.
  std::map<const void*, std::string> names_;
  std::vector<Bucket> buckets_;  // in the order their gradients are expected
  size_t next_launch_ = 0;       // buckets reduce in order, the same on every rank
  std::deque<size_t> in_flight_;  // launched, not yet completed (overlap_comm)
  // Stage 2 with overlap_comm reduces during every backward; stage 1 during
  // the one announced as the last micro-step (begin_backward(true)).
  bool overlapping_ = false;
  bool overlap_by_default() const { return options_.overlap_comm && options_.stage == 2; }
  // Frozen parameters (requires_grad false): whole on every rank, in no
  // bucket, never given a gradient (what the optimizer skips); under mixed
  // precision the model computes with 16-bit copies of their masters.
  WholeCopies frozen_;
  // The shards received gradients (a step may follow) since the buckets were
  // last made whole. An optimizer may update a shard without bumping its
  // version counter (LibTorch 1.13's SGD writes through .data()), so the
  // version counter alone cannot tell that a step happened.
  bool stepped_ = false;
  // Totals and peaks, counted in place; stats() adds the bytes held now.
  ZeroStats stats_;
  GradientHooks hooks_;  // last: its hooks stop before the buckets go
};

Stage12::Stage12(torch::nn::Module& model, const DpGroups& groups,
                 const std::vector<at::Tensor>& sharded_tp, const ZeroOptions& options, MasterPolicy& policy)
    : ShardingStrategy(policy), groups_(groups), options_(options), names_(parameter_names(model)),
      hooks_([this](size_t b, size_t k) { on_gradient(b, k); }) {
  const int n = groups_.shard->size();
  std::unordered_set<const void*> tp_sharded;
  for (const auto& p : sharded_tp) tp_sharded.insert(p.unsafeGetTensorImpl());
  // Reverse registration order is the order backward produces gradients in
  // (the head first, the embeddings last); each kind (tensor-parallel
  // sharded or replicated) fills its own buckets, as their norms sum over
  // different groups.
  std::vector<at::Tensor> params = model.parameters();
  std::reverse(params.begin(), params.end());
  int open[2] = {-1, -1};
  std::vector<at::Tensor> frozen;
  for (const auto& p : params) {
    if (!p.requires_grad()) {
      frozen.push_back(p);
      continue;
    }
    REMAT_CHECK(p.scalar_type() == at::kFloat, "ZeroModel: parameters must be float32 (",
                names_.at(p.unsafeGetTensorImpl()), " is ", c10::toString(p.scalar_type()), ")");
    const int kind = tp_sharded.count(p.unsafeGetTensorImpl()) ? 1 : 0;
    if (open[kind] < 0 || buckets_[open[kind]].numel + p.numel() > options_.reduce_bucket_size) {
      open[kind] = static_cast<int>(buckets_.size());
      buckets_.emplace_back();
      buckets_.back().tp_sharded = kind == 1;
    }
    Bucket& b = buckets_[open[kind]];
    b.params.push_back(p);
    b.offsets.push_back(b.numel);
    b.numel += p.numel();
  }
  torch::NoGradGuard no_grad;
  int64_t total = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    flatten_bucket(buckets_[i]);
    total += buckets_[i].numel;
    for (size_t k = 0; k < buckets_[i].params.size(); ++k) hooks_.add(buckets_[i].params[k], i, k);
  }
  frozen_.install(policy, frozen, names_);
  overlapping_ = overlap_by_default();
  int64_t frozen_numel = 0;
  for (const auto& p : frozen) frozen_numel += p.numel();
  log_rank0().info("zero stage {}: {} parameter elements in {} gradient buckets (reduce_bucket_size {}), "
                   "optimizer state{} sharded over {} data-parallel ranks{}{}{}",
                   options_.stage, total, buckets_.size(), options_.reduce_bucket_size,
                   options_.stage == 2 ? " and gradients" : "", n,
                   options_.overlap_comm ? "; reductions overlap the backward" : "",
                   frozen_numel > 0 ? str("; ", frozen_numel, " frozen elements kept whole") : std::string(),
                   policy.masters_on_host() ? str("; the device keeps ", dtype_name(policy.compute_dtype()),
                                       " parameters alone, their float32 masters in host memory (offload_optimizer)")
                                 : std::string());
}

// The bucket's parameters copied into its flat buffer and made views of it
// (mixed precision: of its 16-bit copy; masters_on_host: the copy alone stays on the
// device, this rank's float32 shard going to the host).
void Stage12::flatten_bucket(Bucket& b) {
  const int n = groups_.shard->size(), r = groups_.shard->rank();
  b.padded = std::max<int64_t>((b.numel + n - 1) / n * n, n);
  b.chunk = b.padded / n;
  b.arrived.assign(b.params.size(), 0);
  b.flat = at::zeros({b.padded}, b.params[0].options().requires_grad(false));
  for (size_t k = 0; k < b.params.size(); ++k) {
    b.flat.narrow(0, b.offsets[k], b.params[k].numel()).copy_(b.params[k].detach().reshape({-1}));
  }
  // Mixed precision: the model computes from a 16-bit copy of the bucket (installed
  // before the hooks: a parameter's dtype is fixed from here on).
  if (policy().mixed()) b.compute = b.flat.to(policy().compute_dtype());
  const at::Tensor& installed = policy().mixed() ? b.compute : b.flat;
  for (size_t k = 0; k < b.params.size(); ++k) {
    auto& p = b.params[k];
    p.set_data(installed.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
  }
  if (policy().masters_on_host()) {
    b.master = policy().host_master(b.flat.narrow(0, r * b.chunk, b.chunk));
    b.shard = b.compute.narrow(0, r * b.chunk, b.chunk).detach().requires_grad_(true);
    b.flat = at::Tensor();
  } else {
    b.shard = b.flat.narrow(0, r * b.chunk, b.chunk).detach().requires_grad_(true);
  }
  b.shard_version = b.shard._version();
}

Stage12::~Stage12() {
  for (auto& b : buckets_) {
    try {
      if (b.pending) b.pending->wait();
    } catch (...) {
    }
  }
}

std::vector<at::Tensor> Stage12::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.shard);
  for (const auto& p : frozen_.stepped()) out.push_back(p);
  return out;
}

std::vector<at::Tensor> Stage12::host_masters() const {
  if (!policy().masters_on_host()) return {};
  std::vector<at::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.master);
  for (const auto& m : frozen_.host_masters()) out.push_back(m);
  return out;
}

at::Tensor Stage12::whole_master(const Bucket& b) {
  if (!policy().masters_on_host()) return b.flat;
  Communicator& group = *groups_.shard;
  at::Tensor mine = b.master.to(b.compute.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (group.size() == 1) return mine;
  MemoryCategoryScope buffers(MemoryCategory::kCommunication);
  at::Tensor whole = at::empty({b.padded}, mine.options());
  group.allGather(whole, mine)->wait();
  stats_.allgather_bytes += static_cast<int64_t>(whole.nbytes());
  return whole;
}

std::vector<ShardLayout> Stage12::layout() const {
  std::vector<ShardLayout> out;
  const int64_t r = groups_.shard->rank();
  for (const auto& b : buckets_) out.push_back(flat_layout(b.params, b.offsets, names_, r * b.chunk, b.chunk));
  for (const auto& p : frozen_.stepped()) out.push_back(flat_layout({p}, {0}, names_, 0, p.numel()));
  return out;
}

std::vector<ShardingStrategy::FullUnitSource> Stage12::full_units() {
  sync_parameters();
  std::vector<FullUnitSource> out;
  // A bucket at a time: its float32 values whole (gathered where only the
  // host masters hold them), each parameter a view of them.
  for (const auto& b : buckets_) {
    FullUnitSource source;
    for (const auto& p : b.params) source.names.push_back(names_.at(p.unsafeGetTensorImpl()));
    source.gather = [this, &b, names = source.names] {
      const at::Tensor whole = whole_master(b);
      ZeroModel::FullUnit unit;
      for (size_t k = 0; k < b.params.size(); ++k) {
        const at::Tensor& p = b.params[k];
        unit.emplace_back(names[k], whole.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
      }
      return unit;
    };
    out.push_back(std::move(source));
  }
  // Frozen parameters: whole on every rank, one at a time.
  const auto& frozen = frozen_.stepped();
  for (size_t i = 0; i < frozen.size(); ++i) {
    const std::string& name = names_.at(frozen[i].unsafeGetTensorImpl());
    out.push_back({{name}, [this, i, name] {
                     const at::Tensor& p = frozen_.stepped()[i];
                     return ZeroModel::FullUnit{
                         {name, policy().masters_on_host() ? frozen_.host_masters()[i].to(p.device(), at::kFloat)
                                                           : p.detach()}};
                   }});
  }
  return out;
}

bool Stage12::stale() const {
  if (stepped_) return true;
  for (const auto& b : buckets_) {
    if (b.shard._version() != b.shard_version) return true;
  }
  // Mixed precision: a load or a write into a frozen parameter's master.
  return frozen_.changed();
}

// Every rank stepped its shards: the buckets are made whole again, by one
// all-gather per piece of at most allgather_bucket_size elements (or one
// broadcast per rank's shard).
void Stage12::sync_parameters() {
  if (!stale()) return;
  Communicator& group = *groups_.shard;
  const int n = group.size();
  torch::NoGradGuard no_grad;
  // Read as they are (no gather): whole already, copied into by offload_optimizer.
  for (const auto& p : frozen_.stepped()) before_read(p);
  if (n == 1) {
    for (const auto& b : buckets_) before_read(b.shard);
  }
  if (n > 1) {
    MemoryCategoryScope buffers(MemoryCategory::kCommunication);
    struct InFlight {
      std::shared_ptr<Work> work;
      at::Tensor input, output, target;  // target: where output goes, when not in place
    };
    std::vector<InFlight> flights;
    for (auto& b : buckets_) {
      // Gathered in float32 into flat (and copied into the 16-bit copy
      // after), or under masters_on_host in 16 bits into the copy itself:
      // the same bits, as rounding is elementwise.
      at::Tensor& whole = policy().masters_on_host() ? b.compute : b.flat;
      before_read(b.shard);  // this bucket's copy from the host; the later ones' go on
      if (!options_.allgather_partitions) {
        for (int q = 0; q < n; ++q) {
          at::Tensor part = whole.narrow(0, q * b.chunk, b.chunk);
          flights.push_back({group.broadcast(part, {q}), part, at::Tensor(), at::Tensor()});
        }
        stats_.allgather_bytes += static_cast<int64_t>(whole.nbytes());
        continue;
      }
      const int64_t piece = std::max<int64_t>(options_.allgather_bucket_size / n, 1);
      if (piece >= b.chunk) {
        at::Tensor input = b.shard.detach().clone();
        flights.push_back({group.allGather(whole, input), input, at::Tensor(), at::Tensor()});
      } else {
        at::Tensor by_rank = whole.view({n, b.chunk});
        for (int64_t o = 0; o < b.chunk; o += piece) {
          const int64_t len = std::min(piece, b.chunk - o);
          at::Tensor input = b.shard.detach().narrow(0, o, len).clone();
          at::Tensor output = at::empty({n * len}, whole.options());
          flights.push_back({group.allGather(output, input), input, output, by_rank.narrow(1, o, len)});
        }
      }
      stats_.allgather_bytes += static_cast<int64_t>(whole.nbytes());
    }
    for (auto& f : flights) {
      f.work->wait();
      if (f.target.defined()) f.target.copy_(f.output.view(f.target.sizes()));
    }
  }
  frozen_.refresh();
  for (auto& b : buckets_) {
    if (policy().mixed() && !policy().masters_on_host()) b.compute.copy_(b.flat);  // the compute copy, once per step
    b.shard_version = b.shard._version();
  }
  stepped_ = false;
}

void Stage12::leave_whole() {
  sync_parameters();
  if (!policy().mixed()) return;
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.flat = whole_master(b);
    for (size_t k = 0; k < b.params.size(); ++k) {
      auto& p = b.params[k];
      p.set_data(b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
    }
    b.compute = at::Tensor();
  }
  frozen_.leave_whole();
}

at::Tensor Stage12::finish_forward(const at::Tensor& loss) {
  if (stale()) {
    throw Error(str("zero stage ", options_.stage, ": the optimizer changed the parameter shards since the "
                    "parameters were last gathered, so this forward used stale weights; call "
                    "begin_forward() before each forward"));
  }
  return loss;
}

void Stage12::on_gradient(size_t bi, size_t k) {
  Bucket& b = buckets_[bi];
  at::Tensor& p = b.params[k];
  if (b.launched) {
    throw Error(str("zero stage ", options_.stage, ": a gradient of '", names_.at(p.unsafeGetTensorImpl()),
                    "' arrived after its bucket was reduced in this backward (a parameter used by two "
                    "separate backward passes of one micro-step); call finish_backward() between them"));
  }
  if (policy().mixed() && !options_.contiguous_gradients && p.grad().defined() && p.grad().scalar_type() != at::kFloat) {
    // Kept on the parameter across micro-steps: in float32, so that autograd
    // adds the next ones' 16-bit gradients into float32.
    torch::NoGradGuard no_grad;
    MemoryCategoryScope gradients(MemoryCategory::kGradients);
    p.mutable_grad() = p.grad().to(at::kFloat);
  }
  if (options_.contiguous_gradients && p.grad().defined()) {
    torch::NoGradGuard no_grad;
    MemoryCategoryScope gradients(MemoryCategory::kGradients);
    classify_memory(p.grad(), MemoryCategory::kGradients);
    if (!b.grad.defined()) b.grad = at::zeros({b.padded}, grad_options(b));
    b.grad.narrow(0, b.offsets[k], p.numel()).add_(p.grad().reshape({-1}));
    track_grad_bytes();
    p.mutable_grad() = at::Tensor();
  }
  if (!b.arrived[k]) {
    b.arrived[k] = 1;
    ++b.arrivals;
  }
  if (options_.stage == 2 || overlapping_) {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].arrivals == buckets_[next_launch_].params.size()) {
      launch(next_launch_++);
    }
  }
  if (overlapping_) progress();
}

void Stage12::begin_backward(bool synchronize) {
  overlapping_ = options_.overlap_comm && (options_.stage == 2 || synchronize);
}

// MPI's non-blocking collectives advance only inside MPI calls: testing the
// reductions in flight at every gradient lets them run during the backward.
void Stage12::progress() {
  if (!options_.progress_in_hooks) return;
  for (size_t bi : in_flight_) {
    Bucket& b = buckets_[bi];
    if (b.pending && !b.done_in_backward) {
      if (!b.pending->isCompleted()) break;
      b.done_in_backward = true;
    }
  }
}

void Stage12::launch(size_t bi) {
  Bucket& b = buckets_[bi];
  Communicator& group = *groups_.shard;
  torch::NoGradGuard no_grad;
  // On a memory trace the bucket and its reduced part are gradients (the
  // collective's own buffers are communication).
  MemoryCategoryScope gradients(MemoryCategory::kGradients);
  at::Tensor flat = b.grad.defined() ? b.grad : at::zeros({b.padded}, grad_options(b));
  b.grad = at::Tensor();
  for (size_t k = 0; k < b.params.size(); ++k) {
    auto& p = b.params[k];
    classify_memory(p.grad(), MemoryCategory::kGradients);
    if (p.grad().defined()) {
      flat.narrow(0, b.offsets[k], p.numel()).add_(p.grad().reshape({-1}));
      p.mutable_grad() = at::Tensor();
    }
  }
  b.launched = true;
  // Reduced in bf16 or fp16 (communication_data_type): the float32 sum rounded once.
  const bool replicated = groups_.replicate && groups_.replicate->size() > 1;
  const at::ScalarType reduce_dtype = policy().reduce_dtype();
  if (reduce_dtype != at::kFloat && (group.size() > 1 || replicated)) flat = flat.to(reduce_dtype);
  b.input = flat;
  if (group.size() == 1) {
    b.output = flat;
  } else if (options_.reduce_scatter) {
    b.output = at::empty({b.chunk}, flat.options());
    b.pending = group.reduceScatter(b.output, flat, {ReduceOp::kAvg});
    stats_.reducescatter_bytes += static_cast<int64_t>(flat.nbytes());
  } else {
    b.output = flat.narrow(0, group.rank() * b.chunk, b.chunk);
    b.pending = group.allReduce(b.input, {ReduceOp::kAvg});
    stats_.allreduce_bytes += 2 * static_cast<int64_t>(flat.nbytes());
  }
  track_grad_bytes();
  // Without overlap (or stage 1 reducing after the backward) each bucket's
  // full gradients go as soon as its reduction is done. Overlapping keeps at
  // most two reductions in flight, so that the buckets' full gradients do
  // not all wait for the end of the backward.
  if (!overlapping_) {
    complete(bi);
    return;
  }
  in_flight_.push_back(bi);
  while (!in_flight_.empty() && (in_flight_.size() > kMaxInFlight || !buckets_[in_flight_.front()].pending ||
                                 buckets_[in_flight_.front()].pending->isCompleted())) {
    complete(in_flight_.front());
    in_flight_.pop_front();
  }
}

void Stage12::complete(size_t bi) {
  Bucket& b = buckets_[bi];
  if (!b.input.defined()) return;
  if (b.pending) {
    timed_wait(*b.pending, stats_.reduce_wait_ms);
    b.pending = nullptr;
  }
  ++stats_.buckets_reduced;
  if (b.done_in_backward) ++stats_.buckets_done_in_backward;
  b.done_in_backward = false;
  torch::NoGradGuard no_grad;
  MemoryCategoryScope gradients(MemoryCategory::kGradients);
  at::Tensor g = b.output;  // this rank's [chunk] of the averaged bucket
  if (groups_.replicate && groups_.replicate->size() > 1) {
    g = g.contiguous();
    timed_wait(*groups_.replicate->allReduce(g, {ReduceOp::kAvg}), stats_.reduce_wait_ms);
    stats_.allreduce_bytes += 2 * static_cast<int64_t>(g.nbytes());
  }
  if (b.shard.grad().defined()) {
    b.shard.mutable_grad().add_(g);
  } else if (g.scalar_type() != at::kFloat) {
    b.shard.mutable_grad() = g.to(at::kFloat);
  } else {
    b.shard.mutable_grad() = g.is_alias_of(b.input) ? g.clone() : g;
  }
  b.input = b.output = at::Tensor();
  track_grad_bytes();
  gradient_reduced(b.shard);
}

void Stage12::finish_backward(bool synchronize) {
  // Stage 2 reduces every micro-step (the shards' gradients accumulate),
  // stage 1 only at the last one (the full gradients accumulate).
  if (options_.stage == 1 && !synchronize && next_launch_ > 0) {
    throw Error("zero stage 1: this backward was announced as the last micro-step (begin_backward(true)) and "
                "started reducing gradients, but finish_backward(false) says it is not: pass the same "
                "synchronize flag to both");
  }
  if (options_.stage == 2 || synchronize) {
    if (overlapping_) progress();
    while (next_launch_ < buckets_.size()) launch(next_launch_++);
    for (size_t b : in_flight_) complete(b);
    in_flight_.clear();
    next_launch_ = 0;
    for (auto& b : buckets_) b.launched = false;
  }
  // The shards hold this step's gradients: whatever the optimizer does next,
  // the following forward gathers.
  if (synchronize) stepped_ = true;
  overlapping_ = overlap_by_default();
  for (auto& b : buckets_) {
    std::fill(b.arrived.begin(), b.arrived.end(), 0);
    b.arrivals = 0;
  }
}

void Stage12::abandon_backward() {
  for (auto& b : buckets_) {
    if (b.pending) {
      b.pending->wait();
      b.pending = nullptr;
    }
    b.input = b.output = b.grad = at::Tensor();
    b.launched = false;
    std::fill(b.arrived.begin(), b.arrived.end(), 0);
    b.arrivals = 0;
    b.shard.mutable_grad() = at::Tensor();
    for (auto& p : b.params) p.mutable_grad() = at::Tensor();
  }
  in_flight_.clear();
  next_launch_ = 0;
  overlapping_ = overlap_by_default();
  track_grad_bytes();
}

std::vector<GradGroup> Stage12::grad_groups(const std::vector<at::Tensor>& /*sharded_tp*/,
                                            const std::shared_ptr<Communicator>& tp) const {
  std::vector<GradGroup> out{{{}, {groups_.shard, tp}}, {{}, {groups_.shard}}};
  for (const auto& b : buckets_) out[b.tp_sharded ? 0 : 1].tensors.push_back(b.shard);
  return out;  // frozen parameters have no gradient
}

int64_t Stage12::grad_bytes_now() const {
  int64_t bytes = 0;
  for (const auto& b : buckets_) {
    if (b.shard.grad().defined()) bytes += static_cast<int64_t>(b.shard.grad().nbytes());
    if (b.grad.defined()) bytes += static_cast<int64_t>(b.grad.nbytes());
    if (b.input.defined()) bytes += static_cast<int64_t>(b.input.nbytes());
    if (b.output.defined() && !b.output.is_alias_of(b.input)) bytes += static_cast<int64_t>(b.output.nbytes());
    for (const auto& p : b.params) {
      if (p.grad().defined()) bytes += static_cast<int64_t>(p.grad().nbytes());
    }
  }
  return bytes;
}

ZeroStats Stage12::stats() const {
  ZeroStats s = stats_;
  for (const auto& b : buckets_) {
    if (b.flat.defined()) s.param_bytes += static_cast<int64_t>(b.flat.nbytes());
    if (b.compute.defined()) s.param_bytes += static_cast<int64_t>(b.compute.nbytes());
  }
  for (const auto& p : frozen_.stepped()) s.param_bytes += static_cast<int64_t>(p.nbytes());
  if (policy().mixed() && !policy().masters_on_host()) {
    for (const auto& p : frozen_.model()) s.param_bytes += static_cast<int64_t>(p.nbytes());
  }
  s.grad_bytes = grad_bytes_now();
  s.peak_grad_bytes = std::max(s.peak_grad_bytes, s.grad_bytes);
  return s;
}

}  // namespace

std::unique_ptr<ShardingStrategy> make_stage12(torch::nn::Module& model, const DpGroups& groups,
                                               const std::vector<at::Tensor>& sharded_tp,
                                               const ZeroOptions& options, MasterPolicy& policy) {
  return std::make_unique<Stage12>(model, groups, sharded_tp, options, policy);
}

}  // namespace remat::parallel
