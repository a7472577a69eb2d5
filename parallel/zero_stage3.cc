// ZeRO stage 3 (see zero.h): units' parameters flattened, sharded over the
// data-parallel group, gathered around each use and reduce-scattered back.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>

#include <unordered_set>

#include "nn/autograd_state.h"
#include "nn/module_call.h"
#include "parallel/internal/sharding_strategy.h"
#include "parallel/internal/zero_units.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat::parallel {
namespace {

// A unit's parameters of one kind in one flat buffer.
struct FlatGroup {
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0, padded = 0, shard_numel = 0;
  bool tp_sharded = false;
  bool frozen = false;  // requires_grad false: gathered for use, never reduced or stepped
  at::Tensor full;   // [padded]; its storage holds data only while gathered
  at::Tensor shard;  // this rank's [shard_numel], the optimizer's parameter (masters_on_host: 16-bit)
  at::Tensor master;  // masters_on_host: the shard's float32 value, in host memory
  std::shared_ptr<Work> pending;
  int64_t bytes() const { return padded * static_cast<int64_t>(full.element_size()); }
};

struct Unit {
  std::string name;
  const torch::nn::Module* module = nullptr;  // null: the root unit
  size_t index = 0;
  std::vector<FlatGroup> groups;
  std::vector<at::Tensor> persistent;  // its parameters kept whole (in Stage3::persistent_ too)
  bool gathered = false;
  bool ran = false;      // ran forward since the last finish_backward
  bool reduced = false;  // reduced since the last finish_backward
  int64_t gathers = 0;
  int64_t padded_numel() const {
    int64_t n = 0;
    for (const auto& g : groups) n += g.padded;
    return n;
  }
};

class Stage3 final : public ShardingStrategy {
 public:
  Stage3(torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
         const DpGroups& groups, const std::vector<at::Tensor>& sharded_tp, const ZeroOptions& options,
         MasterPolicy& policy);
  ~Stage3() override;

  // The model's parameters are views of their units' flat buffers.
  bool parameters_gathered_on_use() const override { return true; }
  GradientHold gradient_hold(int64_t trainable, int64_t local_trainable) const override {
    return stage3_gradients(trainable, local_trainable);
  }

  std::vector<at::Tensor> parameters() const override;
  std::vector<at::Tensor> host_masters() const override;
  std::vector<ShardLayout> layout() const override;
  std::vector<FullUnitSource> full_units() override;
  void begin_forward() override;
  at::Tensor finish_forward(const at::Tensor& loss) override;
  void finish_backward(bool synchronize) override;
  void end_evaluation() override;
  void abandon_backward() override;
  std::vector<GradGroup> grad_groups(const std::vector<at::Tensor>& sharded_tp,
                                     const std::shared_ptr<Communicator>& tp) const override;
  ZeroStats stats() const override;
  void reset_peak() override;
  std::map<std::string, int64_t> gather_counts() const override;
  std::map<std::string, int64_t> unit_numels() const override;
  std::map<std::string, int64_t> unit_padded_numels() const override;

 private:
  friend class ZeroUnitHook;
  // A unit's parameters flattened by kind into buffers of the compute
  // dtype, each rank keeping its shard as the policy says (those below the
  // persistence threshold kept whole in persistent_).
  std::unique_ptr<Unit> flatten_unit(const UnitParameters& unit, size_t index,
                                     const std::unordered_set<const void*>& tp_sharded);
  void gather(Unit& unit, bool wait);
  void wait_gathered(Unit& unit);
  void read_ahead(const Unit& unit);
  void free(Unit& unit);
  void reduce(Unit& unit);
  Unit* next_unit(const Unit& unit, int direction);
  bool root_data_needed_in_backward(const at::Tensor& x) const;
  void track_gathered(int64_t delta);
  void track_gathered_units(int delta);
  // The gradients on the device (the shards' unless on the host, the persistent parameters'); their
  // peak since reset_peak(), `in_flight` bytes of a shard on its way to the host beside them.
  int64_t device_grad_bytes() const;
  void track_grad_peak(int64_t in_flight = 0) {
    stats_.peak_grad_bytes = std::max(stats_.peak_grad_bytes, device_grad_bytes() + in_flight);
  }

  std::shared_ptr<Communicator> dp_;         // the shard group
  std::shared_ptr<Communicator> replicate_;  // hybrid: the ranks holding the same shards
  std::shared_ptr<Communicator> all_dp_;     // every data-parallel rank
  std::map<const void*, std::string> names_;
  ZeroOptions options_;
  int64_t persistence_threshold_ = 0;        // elements: stage3_persistence_threshold (zero_options.h)
  std::vector<std::unique_ptr<Unit>> units_;  // blocks in order, then the root
  // The policy says where the shards live (master_policy.h): on the device;
  // offload_param's host tensors (persistent_ on the device); or under
  // masters_on_host 16-bit on the device, their float32 masters
  // (FlatGroup::master) in host memory.
  std::vector<at::Tensor> persistent_;
  // A root parameter's backward needs its data after the first unit's
  // backward (e.g. a LayerNorm before the first block): the root is gathered
  // again then. Decided at each forward from the graph that reaches the
  // first unit's input.
  bool root_needed_before_first_unit_ = false;
  // Between begin_forward and finish_forward (or end_evaluation): a backward
  // through a unit then is refused (refuse_backward_inside_forward).
  bool in_forward_ = false;
  void refuse_backward_inside_forward(const Unit& unit) const;
  int gathered_units_ = 0;  // units gathered now (stats_ keeps their peak)
  // Totals and peaks, counted in place; stats() adds the bytes held now.
  ZeroStats stats_;
};

// ---------------------------------------------------------------------------
// Unit boundaries in autograd: the backward of ExitUnit (at the unit's output)
// runs before the unit's own backward and gathers; the backward of EnterUnit
// (at its input) runs after it and reduces.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The model and unit a node belongs to; the model must outlive the graphs
// built through it.
struct Pointers {
  Stage3* zero;
  Unit* unit;
};

Pointers kept(AutogradContext* ctx) { return kept_in<Pointers>(ctx, "unit"); }

// A unit's call through remat::forward (the sharding slot, outside any
// checkpoint region): its parameters are gathered around it.
class ZeroUnitHook final : public ModuleHook {
 public:
  ZeroUnitHook(Stage3* zero, Unit* unit) : zero_(zero), unit_(unit) {}
  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override;
  at::Tensor run(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& body);

  struct Enter : torch::autograd::Function<Enter> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dummy,
                              Pointers unit) {
      keep_in(ctx, "unit", unit);
      return x.view_as(x);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
      auto p = kept(ctx);
      p.zero->reduce(*p.unit);
      // What runs next is the backward of the root's part before the first
      // unit: gather the root if that part needs its parameters' data.
      if (p.unit->index == 0 && p.zero->root_needed_before_first_unit_) {
        p.zero->gather(*p.zero->units_.back(), /*wait=*/true);
      }
      return {grads[0], at::Tensor(), at::Tensor()};
    }
  };

  struct Exit : torch::autograd::Function<Exit> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, Pointers unit) {
      keep_in(ctx, "unit", unit);
      return y.view_as(y);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
      auto p = kept(ctx);
      p.zero->refuse_backward_inside_forward(*p.unit);
      // Once a block's backward begins the head's is done; the embeddings'
      // backward needs no weights: the root's parameters can go (its
      // gradients stay until finish_backward reduces them).
      if (p.unit->module != nullptr) p.zero->free(*p.zero->units_.back());
      p.zero->gather(*p.unit, /*wait=*/true);
      // The unit before this one is needed next: fetch it during this backward.
      if (auto* previous = p.zero->next_unit(*p.unit, -1)) p.zero->gather(*previous, /*wait=*/false);
      return {grads[0], at::Tensor()};
    }
  };

 private:
  Stage3* zero_;
  Unit* unit_;
};

c10::IValue ZeroUnitHook::run(const std::vector<c10::IValue>& args, const IValueFn& next) {
  auto signature_error = [&] {
    return Error(str("remat::forward: ", unit_->module->name(), " is a sharded unit, and sharded "
                     "units take one tensor and return one tensor; wrap its other arguments in "
                     "the module"));
  };
  if (args.size() != 1 || !args[0].isTensor()) throw signature_error();
  at::Tensor input = args[0].toTensor();
  // Mixed precision: a floating-point input computes in that dtype (as ZeroModel's cast hook).
  const MasterPolicy& policy = zero_->policy();
  if (policy.mixed() && input.is_floating_point() && input.scalar_type() != policy.compute_dtype()) {
    input = input.to(policy.compute_dtype());
  }
  return run(input, [&](const at::Tensor& x) {
    c10::IValue y = next({c10::IValue(x)});
    if (!y.isTensor()) throw signature_error();
    return y.toTensor();
  });
}

at::Tensor ZeroUnitHook::run(const at::Tensor& x,
                             const std::function<at::Tensor(const at::Tensor&)>& body) {
  auto& u = *unit_;
  // The root unit's parameters served the embeddings; the head needs them
  // again after the last block, which fetches them ahead.
  zero_->free(*zero_->units_.back());
  zero_->gather(u, /*wait=*/true);
  Unit* next = zero_->next_unit(u, +1);
  if (next != nullptr) zero_->gather(*next, /*wait=*/false);
  // The head runs right after the last block, outside any unit call: its
  // parameters must have arrived by then.
  auto head_ready = [&] {
    if (next != nullptr && next->module == nullptr) zero_->wait_gathered(*next);
  };
  if (!at::GradMode::is_enabled()) {  // evaluation: no backward will come
    at::Tensor y = body(x);
    zero_->free(u);
    head_ready();
    return y;
  }
  if (u.index == 0) zero_->root_needed_before_first_unit_ = zero_->root_data_needed_in_backward(x);
  const Pointers p{zero_, unit_};
  // The dummy keeps Enter on the graph when x does not require grad.
  static thread_local at::Tensor dummy = at::empty({0}).requires_grad_(true);
  at::Tensor y = Exit::apply(body(Enter::apply(x, dummy, p)), p);
  zero_->free(u);
  head_ready();
  u.ran = true;
  return y;
}

// ---------------------------------------------------------------------------

Stage3::Stage3(torch::nn::Module& model,
               const std::vector<std::shared_ptr<torch::nn::Module>>& units,
               const DpGroups& groups, const std::vector<at::Tensor>& sharded_tp,
               const ZeroOptions& options, MasterPolicy& policy)
    : ShardingStrategy(policy), dp_(groups.shard), replicate_(groups.replicate), all_dp_(groups.dp),
      names_(parameter_names(model)), options_(options),
      persistence_threshold_(stage3_persistence_threshold(options, policy.precision())) {
  std::unordered_set<const void*> tp_sharded;
  for (const auto& p : sharded_tp) tp_sharded.insert(p.unsafeGetTensorImpl());
  const at::ScalarType compute = policy.compute_dtype();
  torch::NoGradGuard no_grad;
  const std::vector<UnitParameters> unit_params = unit_parameters(model, units);
  for (size_t i = 0; i < unit_params.size(); ++i) {
    units_.push_back(flatten_unit(unit_params[i], i, tp_sharded));
  }
  for (auto& unit : units_) {
    if (unit->module != nullptr) {
      set_module_hook(*unit->module, HookSlot::kSharding, std::make_shared<ZeroUnitHook>(this, unit.get()));
    }
  }
  int64_t total = 0, sharded = 0;
  for (const auto& p : model.parameters()) total += p.numel();
  for (const auto& u : units_) {
    for (const auto& g : u->groups) sharded += g.numel;
  }
  log_rank0().info("zero stage 3: {} units, {} of {} parameter elements sharded over {} "
                   "data-parallel ranks ({} kept whole: below the persistence threshold in use, {}); "
                   "compute in {}, shards in {}",
                   units_.size(), sharded, total, dp_->size(), total - sharded, persistence_threshold_,
                   c10::toString(compute),
                   policy.masters_on_host() ? str(c10::toString(compute), " (their float32 masters in host memory: offload_optimizer)")
                                 : std::string("float32"));
}

std::unique_ptr<Unit> Stage3::flatten_unit(const UnitParameters& params, size_t index,
                                           const std::unordered_set<const void*>& tp_sharded) {
  const at::ScalarType compute = policy().compute_dtype();
  const int n = dp_->size(), r = dp_->rank();
  auto unit = std::make_unique<Unit>();
  unit->name = params.name;
  unit->module = params.module;
  unit->index = index;
  // [tp-sharded * 2 + frozen]: replicated across tensor-parallel ranks or
  // sharded over them, trained or frozen.
  FlatGroup kinds[4];
  for (int k = 0; k < 4; ++k) {
    kinds[k].tp_sharded = k >= 2;
    kinds[k].frozen = k % 2 == 1;
  }
  for (const auto& p : params.params) {
    if (p.numel() < persistence_threshold_) {
      persistent_.push_back(p);
      unit->persistent.push_back(p);
      continue;
    }
    REMAT_CHECK(p.scalar_type() == at::kFloat, "ZeroModel: parameters must be float32 (",
                unit->name, " has ", c10::toString(p.scalar_type()), ")");
    auto& g = kinds[(tp_sharded.count(p.unsafeGetTensorImpl()) ? 2 : 0) + (p.requires_grad() ? 0 : 1)];
    g.params.push_back(p);
    g.offsets.push_back(g.numel);
    g.numel += p.numel();
  }
  for (auto& g : kinds) {
    if (g.params.empty()) continue;
    g.padded = (g.numel + n - 1) / n * n;
    g.shard_numel = g.padded / n;
    g.full = at::zeros({g.padded}, g.params[0].options().requires_grad(false));
    for (size_t k = 0; k < g.params.size(); ++k) {
      g.full.narrow(0, g.offsets[k], g.params[k].numel()).copy_(g.params[k].reshape({-1}));
    }
    const at::Tensor mine = g.full.narrow(0, r * g.shard_numel, g.shard_numel);
    if (policy().masters_on_host()) g.master = policy().host_master(mine);
    g.shard = policy().stage3_shard(mine).requires_grad_(!g.frozen);
    if (compute != at::kFloat) g.full = at::zeros({g.padded}, g.full.options().dtype(compute));
    for (size_t k = 0; k < g.params.size(); ++k) {
      auto& p = g.params[k];
      p.set_data(g.full.narrow(0, g.offsets[k], p.numel()).view(p.sizes()));
    }
    release_storage(g.full);
    unit->groups.push_back(std::move(g));
  }
  return unit;
}

Stage3::~Stage3() {
  for (auto& unit : units_) {
    if (unit->module != nullptr) set_module_hook(*unit->module, HookSlot::kSharding, nullptr);
    try {
      for (auto& g : unit->groups) {
        if (g.pending) g.pending->wait();
      }
    } catch (...) {
    }
  }
}

std::vector<at::Tensor> Stage3::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    for (const auto& g : u->groups) out.push_back(g.shard);
  }
  for (const auto& p : persistent_) out.push_back(p);
  return out;
}

void Stage3::track_gathered(int64_t delta) {
  stats_.gathered_bytes += delta;
  stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, stats_.gathered_bytes);
}

void Stage3::track_gathered_units(int delta) {
  gathered_units_ += delta;
  stats_.peak_gathered_units = std::max(stats_.peak_gathered_units, gathered_units_);
}

void Stage3::gather(Unit& unit, bool wait) {
  if (!unit.gathered) {
    read_ahead(unit);
    unit.gathered = true;
    unit.gathers++;
    track_gathered_units(+1);
    for (auto& g : unit.groups) {
      {
        MemoryCategoryScope gathered(MemoryCategory::kGatheredUnits);
        allocate_storage(g.full, g.bytes());
      }
      MemoryCategoryScope buffers(MemoryCategory::kCommunication);
      before_read(g.shard);  // offload_optimizer: its copy from the host master ended
      if (policy().on_disk(g.shard)) stats_.disk_param_read_bytes += static_cast<int64_t>(g.shard.nbytes());
      at::Tensor input = g.shard.detach().to(g.full.device(), g.full.scalar_type());  // offload_param: to the device
      g.pending = dp_->allGather(g.full, input);
      stats_.allgather_bytes += g.bytes();
      track_gathered(g.bytes());
    }
  }
  if (wait) wait_gathered(unit);
}

void Stage3::wait_gathered(Unit& unit) {
  for (auto& g : unit.groups) {
    if (g.pending) {
      g.pending->wait();
      g.pending = nullptr;
      policy().release(g.shard);  // offload_param nvme: read again at the next gather or step
    }
  }
}

void Stage3::read_ahead(const Unit& unit) {
  // offload_param nvme: the unit after the one being gathered, in the
  // direction of the pass, is read from disk while this one computes.
  const int64_t blocks = static_cast<int64_t>(units_.size()) - 1;
  // The root (units_[blocks]) is gathered before the first block and again
  // for the head, after which the last block's backward comes.
  const int64_t i = static_cast<int64_t>(unit.index);
  const int64_t ahead = unit.module == nullptr ? (in_forward_ ? blocks - 1 : 0) : i + (in_forward_ ? 1 : -1);
  if (ahead < 0 || ahead > blocks) return;
  for (const auto& g : units_[ahead]->groups) policy().prefetch(g.shard);
}

void Stage3::free(Unit& unit) {
  if (!unit.gathered) return;
  wait_gathered(unit);
  for (auto& g : unit.groups) {
    release_storage(g.full);
    track_gathered(-g.bytes());
  }
  unit.gathered = false;
  track_gathered_units(-1);
}

void Stage3::reduce(Unit& unit) {
  const int n = dp_->size();
  for (auto& g : unit.groups) {
    if (g.frozen) continue;
    // On a memory trace: the whole gradients (autograd's) and this rank's
    // reduced shard are gradients; the flat copy and the buckets buffers.
    MemoryCategoryScope buffers(MemoryCategory::kCommunication);
    at::Tensor flat = at::zeros({g.padded}, g.shard.options().dtype(at::kFloat).requires_grad(false));
    for (size_t k = 0; k < g.params.size(); ++k) {
      auto& p = g.params[k];
      classify_memory(p.grad(), MemoryCategory::kGradients);
      if (p.grad().defined()) flat.narrow(0, g.offsets[k], p.numel()).copy_(p.grad().reshape({-1}));
      p.mutable_grad() = at::Tensor();
    }
    at::Tensor by_rank = flat.view({n, g.shard_numel});
    at::Tensor shard_grad;
    {
      MemoryCategoryScope gradients(MemoryCategory::kGradients);
      shard_grad = at::empty({g.shard_numel}, flat.options());
    }
    for (int64_t o = 0; o < g.shard_numel; o += options_.reduce_bucket_size) {
      const int64_t len = std::min(options_.reduce_bucket_size, g.shard_numel - o);
      at::Tensor input = by_rank.narrow(1, o, len).contiguous();
      // communication_data_type: the compute dtype by default.
      const bool reduced = n > 1 || (replicate_ && replicate_->size() > 1);
      if (policy().reduce_dtype() != at::kFloat && reduced) input = input.to(policy().reduce_dtype());
      at::Tensor out = at::empty({len}, input.options());
      dp_->reduceScatter(out, input, {ReduceOp::kAvg})->wait();
      stats_.reducescatter_bytes += static_cast<int64_t>(input.nbytes());
      if (replicate_ && replicate_->size() > 1) {
        replicate_->allReduce(out, {ReduceOp::kAvg})->wait();
        stats_.allreduce_bytes += 2 * static_cast<int64_t>(out.nbytes());
      }
      shard_grad.narrow(0, o, len).copy_(out);
    }
    if (policy().params_on_host()) track_grad_peak(static_cast<int64_t>(shard_grad.nbytes()));
    if (policy().params_on_host()) shard_grad = shard_grad.to(g.shard.device());
    if (g.shard.grad().defined()) {
      g.shard.mutable_grad().add_(shard_grad);
    } else {
      g.shard.mutable_grad() = shard_grad;
    }
    track_grad_peak();  // before offload_optimizer takes the shard to the host
    gradient_reduced(g.shard);
  }
  free(unit);
  unit.reduced = true;
}

Unit* Stage3::next_unit(const Unit& unit, int direction) {
  // Blocks are units_[0 .. size-2], the root last; the root's neighbour going
  // backward is the last block.
  const int64_t blocks = static_cast<int64_t>(units_.size()) - 1;
  int64_t i = unit.module == nullptr ? blocks : static_cast<int64_t>(unit.index);
  i += direction;
  if (i == blocks && direction > 0) return units_.back().get();  // the head needs it next
  if (i < 0 || i >= blocks) return nullptr;
  Unit* next = units_[i].get();
  if (next->padded_numel() > options_.stage3_prefetch_bucket_size) return nullptr;
  // stage3_max_live_parameters: the units gathered now and the one fetched ahead.
  int64_t live = next->padded_numel();
  for (const auto& u : units_) live += u->gathered && u.get() != next ? u->padded_numel() : 0;
  if (live > options_.stage3_max_live_parameters) return nullptr;
  return next;
}

bool Stage3::root_data_needed_in_backward(const at::Tensor& x) const {
  std::unordered_set<const void*> root;
  for (const auto& g : units_.back()->groups) {
    for (const auto& p : g.params) {
      if (p.requires_grad()) root.insert(p.unsafeGetTensorImpl());
    }
  }
  return data_needed_in_backward(x, root);
}

void Stage3::begin_forward() {
  policy().release_all();  // offload_param nvme: what the step (or a save) read goes back to disk
  for (const auto& p : persistent_) before_read(p);  // read whole, without a gather
  gather(*units_.back(), /*wait=*/true);
  in_forward_ = true;
}

void Stage3::refuse_backward_inside_forward(const Unit& unit) const {
  if (!in_forward_) return;
  throw Error(str("zero stage 3: a backward through unit '", unit.name, "' ran inside the forward (between "
                  "begin_forward and finish_forward), e.g. torch::autograd::grad of an intermediate result, a "
                  "loss.backward() in the model code, or a backward from a loss that did not pass through "
                  "finish_forward(loss). Stage 3 gathers and reduces each unit once per training "
                  "backward, so a gradient taken inside the forward through sharded units is not supported: "
                  "take it outside the sharded blocks, or train at zero_optimization.stage 0, 1 or 2"));
}

at::Tensor Stage3::finish_forward(const at::Tensor& loss) {
  in_forward_ = false;
  Unit& root = *units_.back();
  if (!at::GradMode::is_enabled() || !loss.requires_grad()) {
    free(root);
    return loss;
  }
  // The root stays gathered for the head's backward (the first to run).
  root.ran = true;
  return ZeroUnitHook::Exit::apply(loss, Pointers{this, &root});
}

void Stage3::finish_backward(bool synchronize) {
  Unit& root = *units_.back();
  if (root.ran) {
    reduce(root);
  } else {
    for (const auto& g : root.groups) {
      for (const auto& p : g.params) {
        if (p.grad().defined()) {
          throw Error("zero stage 3: the root unit's parameters got gradients but the loss did not "
                      "pass through finish_forward(loss); call begin_forward() before the "
                      "forward and backpropagate from zero.finish_forward(loss)");
        }
      }
    }
  }
  if (synchronize) all_reduce_gradients(persistent_, *all_dp_, options_.reduce_bucket_size, stats_.allreduce_bytes);
  track_grad_peak();
  for (auto& u : units_) {
    if (u->ran && !u->reduced) {
      throw Error(str("zero stage 3: unit '", u->name, "' ran forward but its gradients were not "
                      "reduced in backward; call finish_backward() after backward() on a loss "
                      "that depends on every unit, and finish_forward() on that loss"));
    }
    for (const auto& g : u->groups) {
      for (const auto& p : g.params) {
        if (p.grad().defined()) {
          throw Error(str("zero stage 3: a parameter of unit '", u->name, "' received its gradient "
                          "after the unit was reduced; units must be called through "
                          "remat::forward"));
        }
      }
    }
    u->ran = u->reduced = false;
    free(*u);  // a prefetched unit that was not needed
  }
}

void Stage3::end_evaluation() {
  in_forward_ = false;
  for (auto& u : units_) free(*u);
}

void Stage3::abandon_backward() {
  in_forward_ = false;
  for (auto& u : units_) {
    free(*u);
    u->ran = u->reduced = false;
    for (auto& g : u->groups) {
      g.shard.mutable_grad() = at::Tensor();
      for (auto& p : g.params) p.mutable_grad() = at::Tensor();
    }
  }
  for (auto& p : persistent_) p.mutable_grad() = at::Tensor();
}

std::vector<GradGroup> Stage3::grad_groups(const std::vector<at::Tensor>& sharded_tp,
                                           const std::shared_ptr<Communicator>& tp) const {
  // Shards sharded over tp, shards replicated over tp, whole parameters
  // sharded over tp, whole replicated.
  std::vector<GradGroup> out{{{}, {dp_, tp}}, {{}, {dp_}}};
  for (const auto& u : units_) {
    for (const auto& g : u->groups) {
      if (!g.frozen) out[g.tp_sharded ? 0 : 1].tensors.push_back(g.shard);
    }
  }
  auto [sharded, replicated] = split_by(persistent_, sharded_tp);
  out.push_back({sharded, {tp}});
  out.push_back({replicated, {}});
  return out;
}

std::vector<at::Tensor> Stage3::host_masters() const {
  if (!policy().masters_on_host()) return {};
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    for (const auto& g : u->groups) out.push_back(g.master);
  }
  out.resize(out.size() + persistent_.size());  // none with mixed precision
  return out;
}

std::vector<ShardLayout> Stage3::layout() const {
  std::vector<ShardLayout> out;
  const int64_t r = dp_->rank();
  for (const auto& u : units_) {
    for (const auto& g : u->groups) {
      out.push_back(flat_layout(g.params, g.offsets, names_, r * g.shard_numel, g.shard_numel));
    }
  }
  for (const auto& p : persistent_) out.push_back(flat_layout({p}, {0}, names_, 0, p.numel()));
  return out;
}

std::vector<ShardingStrategy::FullUnitSource> Stage3::full_units() {
  std::vector<FullUnitSource> out;
  // A unit at a time with its persistent parameters (so that a unit's
  // parameters come together, in their order), its groups gathered from the
  // float32 shards (whatever the compute type), each parameter a view of them.
  for (const auto& u : units_) {
    FullUnitSource source;
    for (const auto& g : u->groups) {
      for (const auto& p : g.params) source.names.push_back(names_.at(p.unsafeGetTensorImpl()));
    }
    for (const auto& p : u->persistent) source.names.push_back(names_.at(p.unsafeGetTensorImpl()));
    if (source.names.empty()) continue;
    source.gather = [this, unit = u.get()] {
      ZeroModel::FullUnit out;
      for (const auto& g : unit->groups) {
        at::Tensor full = at::empty({g.padded}, g.full.options().dtype(at::kFloat));
        before_read(g.shard);
        dp_->allGather(full, (policy().masters_on_host() ? g.master : g.shard).detach().to(full.device()))->wait();
        for (size_t k = 0; k < g.params.size(); ++k) {
          const auto& p = g.params[k];
          out.emplace_back(names_.at(p.unsafeGetTensorImpl()), full.narrow(0, g.offsets[k], p.numel()).view(p.sizes()));
        }
      }
      for (const auto& p : unit->persistent) {
        before_read(p);  // offload_optimizer: its copy from the host master ended
        out.emplace_back(names_.at(p.unsafeGetTensorImpl()), p.detach().to(at::kFloat));
      }
      return out;
    };
    out.push_back(std::move(source));
  }
  return out;
}

ZeroStats Stage3::stats() const {
  ZeroStats s = stats_;
  for (const auto& p : parameters()) {
    s.param_bytes += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) s.grad_bytes += static_cast<int64_t>(p.grad().nbytes());
  }
  s.peak_grad_bytes = std::max(s.peak_grad_bytes, device_grad_bytes());
  return s;
}

int64_t Stage3::device_grad_bytes() const {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) { bytes += t.grad().defined() ? static_cast<int64_t>(t.grad().nbytes()) : 0; };
  for (size_t i = 0; !policy().params_on_host() && i < units_.size(); ++i) {
    for (const auto& g : units_[i]->groups) add(g.shard);
  }
  for (const auto& p : persistent_) add(p);
  return bytes;
}

void Stage3::reset_peak() {
  stats_.peak_gathered_bytes = stats_.gathered_bytes;
  stats_.peak_gathered_units = gathered_units_;
  stats_.peak_grad_bytes = device_grad_bytes();
}

std::map<std::string, int64_t> Stage3::gather_counts() const {
  std::map<std::string, int64_t> out;
  for (const auto& u : units_) out[u->name] = u->gathers;
  return out;
}

std::map<std::string, int64_t> Stage3::unit_numels() const {
  std::map<std::string, int64_t> out;
  for (const auto& u : units_) {
    int64_t n = 0;
    for (const auto& g : u->groups) n += g.numel;
    out[u->name] = n;
  }
  return out;
}

std::map<std::string, int64_t> Stage3::unit_padded_numels() const {
  std::map<std::string, int64_t> out;
  for (const auto& u : units_) out[u->name] = u->padded_numel();
  return out;
}

}  // namespace

std::unique_ptr<ShardingStrategy> make_stage3(
    torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
    const DpGroups& groups, const std::vector<at::Tensor>& sharded_tp, const ZeroOptions& options,
    MasterPolicy& policy) {
  return std::make_unique<Stage3>(model, units, groups, sharded_tp, options, policy);
}

}  // namespace remat::parallel
