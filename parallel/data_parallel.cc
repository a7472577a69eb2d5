// ZeRO stage 0: every rank holds every parameter, gradients are averaged
// (and the helpers the other stages share).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "parallel/internal/sharding_strategy.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat::parallel {

void all_reduce_gradients(const std::vector<at::Tensor>& all_params, Communicator& dp,
                          int64_t bucket_size, int64_t& bytes) {
  // A frozen parameter (requires_grad false) never gets a gradient: one of
  // zeros would let weight decay or momentum move it.
  std::vector<at::Tensor> trainable;
  for (const auto& p : all_params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  const std::vector<at::Tensor>& params = trainable;
  size_t start = 0;
  while (start < params.size()) {
    std::vector<at::Tensor> bucket;
    int64_t elements = 0;
    size_t end = start;
    while (end < params.size() && (bucket.empty() || elements + params[end].numel() <= bucket_size)) {
      auto& p = params[end];
      // A parameter without a gradient on this rank takes part with zeros,
      // so every rank reduces the same buffer.
      if (!p.grad().defined()) {
        MemoryCategoryScope gradients(MemoryCategory::kGradients);
        p.mutable_grad() = at::zeros_like(p);
      }
      bucket.push_back(p.grad().reshape({-1}));
      elements += p.numel();
      ++end;
    }
    MemoryCategoryScope buffers(MemoryCategory::kCommunication);
    at::Tensor flat = at::cat(bucket);
    if (dp.size() > 1) {
      dp.allReduce(flat, {ReduceOp::kAvg})->wait();
      bytes += 2 * static_cast<int64_t>(flat.nbytes());
    }
    int64_t offset = 0;
    for (size_t i = start; i < end; ++i) {
      auto& p = params[i];
      p.mutable_grad().view(-1).copy_(flat.narrow(0, offset, p.numel()));
      offset += p.numel();
    }
    start = end;
  }
}

void timed_wait(Work& work, double& ms) {
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split_by(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& subset) {
  std::unordered_set<const void*> in;
  for (const auto& p : subset) in.insert(p.unsafeGetTensorImpl());
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> out;
  for (const auto& p : params) (in.count(p.unsafeGetTensorImpl()) ? out.first : out.second).push_back(p);
  return out;
}

std::map<const void*, std::string> parameter_names(const torch::nn::Module& model) {
  std::map<const void*, std::string> out;
  for (const auto& item : model.named_parameters()) out.emplace(item.value().unsafeGetTensorImpl(), item.key());
  return out;
}

ShardLayout flat_layout(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                        const std::map<const void*, std::string>& names, int64_t begin,
                        int64_t length) {
  ShardLayout out;
  for (size_t k = 0; k < params.size(); ++k) {
    const int64_t lo = std::max(begin, offsets[k]);
    const int64_t hi = std::min(begin + length, offsets[k] + params[k].numel());
    if (lo >= hi) continue;
    out.segments.push_back({names.at(params[k].unsafeGetTensorImpl()), lo - offsets[k], lo - begin, hi - lo});
  }
  return out;
}

struct GradientHooks::Target {
  Arrived arrived;  // empty once the hooks' owner is gone
};

namespace {

class GradientArrived final : public torch::autograd::FunctionPostHook {
 public:
  GradientArrived(std::shared_ptr<GradientHooks::Target> target, size_t bucket, size_t index)
      : target_(std::move(target)), bucket_(bucket), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (target_->arrived) target_->arrived(bucket_, index_);
    return outputs;
  }

 private:
  std::shared_ptr<GradientHooks::Target> target_;
  size_t bucket_, index_;
};

}  // namespace

GradientHooks::GradientHooks(Arrived arrived) : target_(std::make_shared<Target>()) {
  target_->arrived = std::move(arrived);
}

GradientHooks::~GradientHooks() { target_->arrived = nullptr; }

void GradientHooks::add(const at::Tensor& param, size_t bucket, size_t index) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<GradientArrived>(target_, bucket, index));
  accumulators_.push_back(std::move(accumulator));
}

namespace {

// Parameters whose gradients are averaged by one all-reduce.
struct DpBucket {
  std::vector<at::Tensor> params;   // the model's (mixed precision: its compute copies)
  std::vector<at::Tensor> masters;  // what the optimizer steps (float32: params themselves)
  std::vector<char> arrived;  // gradient of params[k] accumulated in this backward
  size_t arrivals = 0;
  int64_t numel = 0;
  at::Tensor flat;  // the reduction's buffer while it is in flight
  std::shared_ptr<Work> pending;
  bool launched = false;      // since the last finish_backward
  bool done_in_backward = false;  // its reduction was seen complete before the backward ended
};

class DataParallel final : public ShardingStrategy {
 public:
  DataParallel(torch::nn::Module& model, std::shared_ptr<Communicator> dp, const ZeroOptions& options,
               MasterPolicy& policy)
      : ShardingStrategy(policy), dp_(std::move(dp)), options_(options), names_(parameter_names(model)),
        hooks_([this](size_t b, size_t k) { on_gradient(b, k); }) {
    const std::vector<at::Tensor> params = model.parameters();
    for (const auto& p : params) {
      REMAT_CHECK(!policy.mixed() || p.scalar_type() == at::kFloat, "ZeroModel with ",
                  dtype_name(policy.compute_dtype()), ": parameters must be float32 (",
                  names_.at(p.unsafeGetTensorImpl()), " is ", c10::toString(p.scalar_type()), ")");
    }
    // Before any hook is added (a parameter's dtype is fixed from here on).
    copies_.install(policy, params, names_);
    const auto& masters = copies_.stepped();
    // Buckets in reverse registration order, the order a backward produces
    // gradients in (the head first, the embeddings last). A frozen parameter
    // (requires_grad false) is in none: it never gets a gradient, since one of
    // zeros would let weight decay or momentum move it.
    for (size_t i = params.size(); i-- > 0;) {
      const at::Tensor& p = params[i];
      if (!p.requires_grad()) continue;
      if (buckets_.empty() || buckets_.back().numel + p.numel() > options_.reduce_bucket_size) {
        buckets_.emplace_back();
      }
      DpBucket& b = buckets_.back();
      b.params.push_back(p);
      b.masters.push_back(masters[i]);
      b.numel += p.numel();
    }
    for (size_t i = 0; i < buckets_.size(); ++i) {
      buckets_[i].arrived.assign(buckets_[i].params.size(), 0);
      if (options_.overlap_comm) {
        for (size_t k = 0; k < buckets_[i].params.size(); ++k) hooks_.add(buckets_[i].params[k], i, k);
      }
    }
    if (dp_->size() > 1) {
      log_rank0().info("zero stage 0: {} gradient buckets (reduce_bucket_size {}) all-reduced over {} "
                       "data-parallel ranks{}",
                       buckets_.size(), options_.reduce_bucket_size, dp_->size(),
                       options_.overlap_comm ? " while the backward runs (overlap_comm)" : " after the backward");
    }
  }

  ~DataParallel() override {
    for (auto& b : buckets_) {
      try {
        if (b.pending) b.pending->wait();
      } catch (...) {
      }
    }
  }

  std::vector<at::Tensor> parameters() const override { return copies_.stepped(); }

  GradientHold gradient_hold(int64_t trainable, int64_t local_trainable) const override {
    return data_parallel_gradients(trainable, local_trainable);
  }

  // One parameter at a time: every rank holds them whole.
  std::vector<FullUnitSource> full_units() override {
    std::vector<FullUnitSource> out;
    for (const auto& m : copies_.stepped()) {
      const std::string& name = names_.at(m.unsafeGetTensorImpl());
      out.push_back({{name}, [name, m] { return ZeroModel::FullUnit{{name, m.detach().to(at::kFloat)}}; }});
    }
    return out;
  }

  std::vector<ShardLayout> layout() const override {
    std::vector<ShardLayout> out;
    for (const auto& m : copies_.stepped()) out.push_back(flat_layout({m}, {0}, names_, 0, m.numel()));
    return out;
  }

  // Mixed precision: the compute copies made again from the masters when
  // these changed (an optimizer step, a load, a write): once per step.
  void sync_parameters() override {
    if (!policy().mixed() || !(stepped_ || copies_.changed())) return;
    copies_.refresh();
    stepped_ = false;
  }
  void begin_forward() override { sync_parameters(); }
  void leave_whole() override {
    sync_parameters();
    copies_.leave_whole();
  }

  void begin_backward(bool synchronize) override {
    overlapping_ = options_.overlap_comm && synchronize && dp_->size() > 1;
  }

  void finish_backward(bool synchronize) override {
    if (!synchronize) {
      if (next_launch_ > 0) {
        throw Error("zero stage 0: this backward was announced as the last micro-step (begin_backward(true)) "
                    "and started reducing gradients, but finish_backward(false) says it is not: pass the same "
                    "synchronize flag to both");
      }
      for (auto& b : buckets_) {
        for (size_t k = 0; k < b.params.size(); ++k) policy().fold_gradient(b.params[k], b.masters[k]);
      }
      reset();
      return;
    }
    stepped_ = true;
    // Buckets the backward left (all, without overlap): a parameter that got
    // no gradient on this rank takes part with zeros, so every rank reduces
    // the same buffers in the same order.
    if (overlapping_) progress();
    std::vector<std::string> unused;
    while (next_launch_ < buckets_.size()) {
      DpBucket& b = buckets_[next_launch_];
      if (overlapping_) {
        for (size_t k = 0; k < b.params.size(); ++k) {
          if (!b.arrived[k]) unused.push_back(names_.at(b.params[k].unsafeGetTensorImpl()));
        }
      }
      launch(next_launch_++);
    }
    if (!unused.empty() && !unused_reported_) {
      unused_reported_ = true;
      log().info("zero stage 0: {} parameter(s) got no gradient in this backward ({}{}): their buckets, and "
                 "the ones after them, were reduced after the backward instead of during it (the result is "
                 "the same)",
                 unused.size(), unused.front(), unused.size() > 1 ? str(", ", unused[1], unused.size() > 2 ? ", ..." : "") : "");
    }
    torch::NoGradGuard no_grad;
    for (auto& b : buckets_) {
      if (b.pending) {
        timed_wait(*b.pending, stats_.reduce_wait_ms);
        b.pending = nullptr;
      }
      int64_t offset = 0;
      for (auto& m : b.masters) {
        m.mutable_grad().copy_(b.flat.narrow(0, offset, m.numel()).view_as(m));
        offset += m.numel();
      }
      ++stats_.buckets_reduced;
      if (b.done_in_backward) ++stats_.buckets_done_in_backward;
      b.flat = at::Tensor();
    }
    reset();
  }

  void abandon_backward() override {
    for (auto& b : buckets_) {
      try {
        if (b.pending) b.pending->wait();
      } catch (...) {
      }
      b.pending = nullptr;
      b.flat = at::Tensor();
    }
    reset();
  }

  std::vector<GradGroup> grad_groups(const std::vector<at::Tensor>& sharded_tp,
                                     const std::shared_ptr<Communicator>& tp) const override {
    // The masters of the tensor-parallel sharded parameters.
    std::unordered_set<const void*> in;
    for (const auto& p : sharded_tp) in.insert(p.unsafeGetTensorImpl());
    std::vector<at::Tensor> sharded, replicated;
    const auto &params = copies_.model(), &masters = copies_.stepped();
    for (size_t i = 0; i < params.size(); ++i) {
      (in.count(params[i].unsafeGetTensorImpl()) ? sharded : replicated).push_back(masters[i]);
    }
    return {{sharded, {tp}}, {replicated, {}}};
  }

  ZeroStats stats() const override {
    ZeroStats s = stats_;
    auto add = [&s](const at::Tensor& t) {
      s.param_bytes += static_cast<int64_t>(t.nbytes());
      if (t.grad().defined()) s.grad_bytes += static_cast<int64_t>(t.grad().nbytes());
    };
    for (const auto& p : copies_.model()) add(p);
    if (policy().mixed()) {
      for (const auto& m : copies_.stepped()) add(m);
    }
    s.peak_grad_bytes = s.grad_bytes;
    return s;
  }

 private:
  // A gradient was accumulated (overlap_comm only): launch every bucket
  // that is complete, in order, and let the reductions in flight progress.
  void on_gradient(size_t bi, size_t k) {
    if (!overlapping_) return;
    DpBucket& b = buckets_[bi];
    if (b.launched) {
      throw Error(str("zero stage 0 with overlap_comm: a gradient of '", names_.at(b.params[k].unsafeGetTensorImpl()),
                      "' arrived after its bucket's all-reduce started (a parameter used by two separate "
                      "backward passes in one micro-step); call backward once per micro-step, or set "
                      "zero_optimization.overlap_comm false"));
    }
    if (!b.arrived[k]) {
      b.arrived[k] = 1;
      ++b.arrivals;
    }
    progress();
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].arrivals == buckets_[next_launch_].params.size()) {
      launch(next_launch_++);
    }
  }

  // MPI's non-blocking collectives advance only inside MPI calls: a test of
  // each reduction in flight at every gradient lets them run during the
  // backward (docs/parallel.md, "Overlapped gradient reduction").
  void progress() {
    if (!options_.progress_in_hooks) return;
    for (size_t i = first_in_flight_; i < next_launch_; ++i) {
      DpBucket& b = buckets_[i];
      if (b.pending && !b.done_in_backward) {
        if (!b.pending->isCompleted()) break;
        b.done_in_backward = true;
        first_in_flight_ = i + 1;
      }
    }
  }

  void launch(size_t bi) {
    DpBucket& b = buckets_[bi];
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < b.params.size(); ++k) {
      policy().fold_gradient(b.params[k], b.masters[k]);
      at::Tensor& m = b.masters[k];
      if (!m.grad().defined()) {
        MemoryCategoryScope gradients(MemoryCategory::kGradients);
        m.mutable_grad() = at::zeros_like(m);
      }
    }
    MemoryCategoryScope buffers(MemoryCategory::kCommunication);
    std::vector<at::Tensor> pieces;
    for (auto& m : b.masters) pieces.push_back(m.grad().reshape({-1}));
    b.flat = at::cat(pieces);
    // Reduced in bf16 or fp16 (communication_data_type): the float32 sum of
    // the window's micro-steps rounded once.
    if (policy().reduce_dtype() != at::kFloat && dp_->size() > 1) b.flat = b.flat.to(policy().reduce_dtype());
    b.launched = true;
    if (dp_->size() > 1) {
      b.pending = dp_->allReduce(b.flat, {ReduceOp::kAvg});
      stats_.allreduce_bytes += 2 * static_cast<int64_t>(b.flat.nbytes());
    }
  }

  void reset() {
    for (auto& b : buckets_) {
      std::fill(b.arrived.begin(), b.arrived.end(), 0);
      b.arrivals = 0;
      b.launched = false;
      b.done_in_backward = false;
    }
    next_launch_ = first_in_flight_ = 0;
    overlapping_ = false;
  }

  std::shared_ptr<Communicator> dp_;
  // The model's parameters and what the optimizer steps: themselves, or
  // under mixed precision their float32 masters (policy's WholeCopies).
  WholeCopies copies_;
  bool stepped_ = false;             // mixed: a step may have changed the masters since
  ZeroOptions options_;
  std::map<const void*, std::string> names_;
  std::vector<DpBucket> buckets_;  // in the order their gradients are expected
  GradientHooks hooks_;
  bool overlapping_ = false;       // this backward reduces as it goes
  bool unused_reported_ = false;
  size_t next_launch_ = 0;         // buckets launch in order, the same on every rank
  size_t first_in_flight_ = 0;     // buckets before it were seen complete in the backward
  // Totals and peaks, counted in place; stats() adds the bytes held now.
  ZeroStats stats_;
};

}  // namespace

std::unique_ptr<ShardingStrategy> make_data_parallel(torch::nn::Module& model,
                                                     std::shared_ptr<Communicator> dp,
                                                     const ZeroOptions& options, MasterPolicy& policy) {
  return std::make_unique<DataParallel>(model, std::move(dp), options, policy);
}

}  // namespace remat::parallel
