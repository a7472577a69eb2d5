#include "parallel/zero.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/types.h>  // clip_grad.h needs torch::Tensor declared first
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <unordered_set>

#include "nn/autograd_state.h"
#include "nn/module_call.h"
#include "runtime/communicator.h"
#include "runtime/config.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {

ZeroOptions ZeroOptions::from_config(const ZeroConfig& c, bool bf16) {
  if (bf16 && c.stage != 3) {
    throw ConfigError("bf16.enabled computes in bf16 from fp32 master shards: it needs "
                      "zero_optimization.stage 3 (set it, or turn bf16 off)");
  }
  if (c.stage == 1 || c.stage == 2) {
    throw ConfigError(str("zero_optimization.stage ", c.stage,
                          " is not implemented: use 0 (data parallel, all-reduce) or 3 "
                          "(parameters, gradients and optimizer state sharded)"));
  }
  ZeroOptions o;
  o.stage = c.stage;
  o.param_persistence_threshold = c.stage3_param_persistence_threshold;
  o.reduce_bucket_size = std::max<int64_t>(c.reduce_bucket_size, 1);
  o.prefetch_bucket_size = c.stage3_prefetch_bucket_size;
  o.bf16 = bf16;
  return o;
}

namespace {

// A unit's parameters of one kind in one flat buffer.
struct FlatGroup {
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0, padded = 0, shard_numel = 0;
  bool tp_sharded = false;
  at::Tensor full;   // [padded]; its storage holds data only while gathered
  at::Tensor shard;  // this rank's [shard_numel], the optimizer's parameter
  std::shared_ptr<Work> pending;
  int64_t bytes() const { return padded * static_cast<int64_t>(full.element_size()); }
};

// The parameters are views of `full`: emptying its storage frees them all,
// and refilling it restores them in place (autograd's saved references to
// the parameters see the data again).
void release_storage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t, int64_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = impl->allocator() ? impl->allocator() : c10::GetAllocator(t.device().type());
  impl->set_data_ptr_noswap(allocator->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

std::string param_name(std::string s) {
  for (auto& c : s) {
    if (c == '.') c = '_';
  }
  return s;
}

}  // namespace

struct ZeroModel::Unit {
  std::string name;
  const torch::nn::Module* module = nullptr;  // null: the root unit
  size_t index = 0;
  std::vector<FlatGroup> groups;
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

// ---------------------------------------------------------------------------
// Unit boundaries in autograd: the backward of ExitUnit (at the unit's output)
// runs before the unit's own backward and gathers; the backward of EnterUnit
// (at its input) runs after it and reduces.

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The model and unit a node belongs to; the ZeroModel must outlive the graphs
// built through it.
struct Pointers {
  ZeroModel* zero;
  ZeroModel::Unit* unit;
};

Pointers kept(AutogradContext* ctx) { return kept_in<Pointers>(ctx, "unit"); }

}  // namespace

// A unit's call through remat::forward (the sharding slot, outside any
// checkpoint region): its parameters are gathered around it.
class ZeroUnitHook final : public ModuleHook {
 public:
  ZeroUnitHook(ZeroModel* zero, ZeroModel::Unit* unit) : zero_(zero), unit_(unit) {}
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
  friend class ZeroModel;
  ZeroModel* zero_;
  ZeroModel::Unit* unit_;
};

c10::IValue ZeroUnitHook::run(const std::vector<c10::IValue>& args, const IValueFn& next) {
  auto signature_error = [&] {
    return Error(str("remat::forward: ", unit_->module->name(), " is a sharded unit, and sharded "
                     "units take one tensor and return one tensor; wrap its other arguments in "
                     "the module"));
  };
  if (args.size() != 1 || !args[0].isTensor()) throw signature_error();
  return run(args[0].toTensor(), [&](const at::Tensor& x) {
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
  ZeroModel::Unit* next = zero_->next_unit(u, +1);
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

ZeroModel::ZeroModel(torch::nn::Module& model,
                     const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                     std::shared_ptr<Communicator> dp_group, ZeroOptions options,
                     std::vector<at::Tensor> sharded_tp)
    : model_(model), dp_(std::move(dp_group)), options_(options), sharded_tp_(std::move(sharded_tp)) {
  REMAT_CHECK(options_.stage == 0 || options_.stage == 3, "ZeroModel: stage must be 0 or 3, got ",
              options_.stage);
  if (options_.stage == 0) {
    all_params_ = model_.parameters();
    return;
  }
  const int n = dp_->size(), r = dp_->rank();
  std::unordered_set<const void*> tp_sharded;
  for (const auto& p : sharded_tp_) tp_sharded.insert(p.unsafeGetTensorImpl());
  std::unordered_set<const void*> in_units;
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> unit_params;
  std::vector<const torch::nn::Module*> unit_modules;
  std::map<const torch::nn::Module*, std::string> names;
  for (const auto& item : model_.named_modules()) names[item.value().get()] = item.key();
  for (const auto& m : units) {
    REMAT_CHECK(names.count(m.get()), "ZeroModel: a unit is not a submodule of the model");
    std::vector<at::Tensor> ps;
    for (const auto& p : m->parameters()) {
      if (in_units.insert(p.unsafeGetTensorImpl()).second) ps.push_back(p);
    }
    unit_params.emplace_back(names[m.get()], ps);
    unit_modules.push_back(m.get());
  }
  std::vector<at::Tensor> root;
  for (const auto& p : model_.parameters()) {
    if (!in_units.count(p.unsafeGetTensorImpl())) root.push_back(p);
  }
  unit_params.emplace_back("root", root);
  unit_modules.push_back(nullptr);

  REMAT_CHECK(!options_.bf16 || options_.stage == 3, "ZeroModel: bf16 needs stage 3");
  if (options_.bf16) options_.param_persistence_threshold = 0;  // every parameter gets an fp32 master
  const at::ScalarType compute = options_.bf16 ? at::kBFloat16 : at::kFloat;
  state_ = std::make_shared<torch::nn::Module>("ZeroState");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < unit_params.size(); ++i) {
    auto unit = std::make_unique<Unit>();
    unit->name = unit_params[i].first;
    unit->module = unit_modules[i];
    unit->index = i;
    FlatGroup kinds[2];  // [0]: replicated across tensor-parallel ranks, [1]: tp-sharded
    kinds[1].tp_sharded = true;
    for (const auto& p : unit_params[i].second) {
      if (p.numel() < options_.param_persistence_threshold) {
        persistent_.push_back(p);
        continue;
      }
      REMAT_CHECK(p.scalar_type() == at::kFloat, "ZeroModel: parameters must be float32 (",
                  unit->name, " has ", c10::toString(p.scalar_type()), ")");
      auto& g = kinds[tp_sharded.count(p.unsafeGetTensorImpl()) ? 1 : 0];
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
      g.shard = g.full.narrow(0, r * g.shard_numel, g.shard_numel).clone().requires_grad_(true);
      if (compute != at::kFloat) g.full = at::zeros({g.padded}, g.full.options().dtype(compute));
      for (size_t k = 0; k < g.params.size(); ++k) {
        auto& p = g.params[k];
        p.set_data(g.full.narrow(0, g.offsets[k], p.numel()).view(p.sizes()));
      }
      release_storage(g.full);
      state_->register_parameter(
          str(param_name(unit->name), "__", g.tp_sharded ? "tp_sharded" : "replicated"), g.shard);
      unit->groups.push_back(std::move(g));
    }
    units_.push_back(std::move(unit));
  }
  for (size_t k = 0; k < persistent_.size(); ++k) {
    state_->register_parameter(str("persistent_", k), persistent_[k]);
  }
  for (auto& unit : units_) {
    if (unit->module != nullptr) {
      set_module_hook(*unit->module, HookSlot::kSharding, std::make_shared<ZeroUnitHook>(this, unit.get()));
    }
  }
  int64_t total = 0, sharded = 0;
  for (const auto& p : model_.parameters()) total += p.numel();
  for (const auto& u : units_) {
    for (const auto& g : u->groups) sharded += g.numel;
  }
  log_rank0().info("zero stage 3: {} units, {} of {} parameter elements sharded over {} "
                   "data-parallel ranks ({} kept whole: below stage3_param_persistence_threshold {}); "
                   "compute in {}, shards in float32",
                   units_.size(), sharded, total, n, total - sharded,
                   options_.param_persistence_threshold, c10::toString(compute));
}

ZeroModel::~ZeroModel() {
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

std::vector<at::Tensor> ZeroModel::parameters() const {
  if (options_.stage == 0) return all_params_;
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    for (const auto& g : u->groups) out.push_back(g.shard);
  }
  for (const auto& p : persistent_) out.push_back(p);
  return out;
}

void ZeroModel::track_gathered(int64_t delta) {
  gathered_bytes_ += delta;
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
}

void ZeroModel::track_gathered_units(int delta) {
  gathered_units_ += delta;
  peak_gathered_units_ = std::max(peak_gathered_units_, gathered_units_);
}

void ZeroModel::gather(Unit& unit, bool wait) {
  if (!unit.gathered) {
    unit.gathered = true;
    unit.gathers++;
    track_gathered_units(+1);
    for (auto& g : unit.groups) {
      allocate_storage(g.full, g.bytes());
      at::Tensor input = g.shard.detach().to(g.full.scalar_type());
      g.pending = dp_->allGather(g.full, input);
      allgather_bytes_ += g.bytes();
      track_gathered(g.bytes());
    }
  }
  if (wait) wait_gathered(unit);
}

void ZeroModel::wait_gathered(Unit& unit) {
  for (auto& g : unit.groups) {
    if (g.pending) {
      g.pending->wait();
      g.pending = nullptr;
    }
  }
}

void ZeroModel::free(Unit& unit) {
  if (!unit.gathered) return;
  wait_gathered(unit);
  for (auto& g : unit.groups) {
    release_storage(g.full);
    track_gathered(-g.bytes());
  }
  unit.gathered = false;
  track_gathered_units(-1);
}

void ZeroModel::reduce(Unit& unit) {
  const int n = dp_->size();
  for (auto& g : unit.groups) {
    at::Tensor flat = at::zeros({g.padded}, g.shard.options().requires_grad(false));
    for (size_t k = 0; k < g.params.size(); ++k) {
      auto& p = g.params[k];
      if (p.grad().defined()) flat.narrow(0, g.offsets[k], p.numel()).copy_(p.grad().reshape({-1}));
      p.mutable_grad() = at::Tensor();
    }
    at::Tensor by_rank = flat.view({n, g.shard_numel});
    at::Tensor shard_grad = at::empty({g.shard_numel}, flat.options());
    for (int64_t o = 0; o < g.shard_numel; o += options_.reduce_bucket_size) {
      const int64_t len = std::min(options_.reduce_bucket_size, g.shard_numel - o);
      at::Tensor input = by_rank.narrow(1, o, len).contiguous();
      at::Tensor out = at::empty({len}, flat.options());
      dp_->reduceScatter(out, input, {ReduceOp::kAvg})->wait();
      reducescatter_bytes_ += static_cast<int64_t>(input.nbytes());
      shard_grad.narrow(0, o, len).copy_(out);
    }
    if (g.shard.grad().defined()) {
      g.shard.mutable_grad().add_(shard_grad);
    } else {
      g.shard.mutable_grad() = shard_grad;
    }
  }
  free(unit);
  unit.reduced = true;
}

void ZeroModel::all_reduce_buckets(const std::vector<at::Tensor>& params) {
  size_t start = 0;
  while (start < params.size()) {
    std::vector<at::Tensor> bucket;
    int64_t elements = 0;
    size_t end = start;
    while (end < params.size() && (bucket.empty() || elements + params[end].numel() <= options_.reduce_bucket_size)) {
      auto& p = params[end];
      // A parameter without a gradient on this rank takes part with zeros,
      // so every rank reduces the same buffer.
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      bucket.push_back(p.grad().reshape({-1}));
      elements += p.numel();
      ++end;
    }
    at::Tensor flat = at::cat(bucket);
    if (dp_->size() > 1) {
      dp_->allReduce(flat, {ReduceOp::kAvg})->wait();
      allreduce_bytes_ += 2 * static_cast<int64_t>(flat.nbytes());
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

ZeroModel::Unit* ZeroModel::next_unit(const Unit& unit, int direction) {
  // Blocks are units_[0 .. size-2], the root last; the root's neighbour going
  // backward is the last block.
  const int64_t blocks = static_cast<int64_t>(units_.size()) - 1;
  int64_t i = unit.module == nullptr ? blocks : static_cast<int64_t>(unit.index);
  i += direction;
  if (i == blocks && direction > 0) return units_.back().get();  // the head needs it next
  if (i < 0 || i >= blocks) return nullptr;
  Unit* next = units_[i].get();
  if (next->padded_numel() > options_.prefetch_bucket_size) return nullptr;
  return next;
}

void ZeroModel::begin_forward() {
  if (options_.stage == 3) gather(*units_.back(), /*wait=*/true);
}

at::Tensor ZeroModel::finish_forward(const at::Tensor& loss) {
  if (options_.stage == 0) return loss;
  Unit& root = *units_.back();
  if (!at::GradMode::is_enabled() || !loss.requires_grad()) {
    free(root);
    return loss;
  }
  // The root stays gathered for the head's backward (the first to run).
  root.ran = true;
  return ZeroUnitHook::Exit::apply(loss, Pointers{this, &root});
}

void ZeroModel::finish_backward(bool synchronize) {
  if (options_.stage == 0) {
    if (synchronize) all_reduce_buckets(all_params_);
    return;
  }
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
  if (synchronize) all_reduce_buckets(persistent_);
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

void ZeroModel::end_evaluation() {
  for (auto& u : units_) free(*u);
}

double ZeroModel::clip_grad_norm(double max_norm, const std::shared_ptr<Communicator>& tp_group) {
  const bool tp = tp_group && tp_group->size() > 1;
  if (options_.stage == 0 && !tp) {
    return torch::nn::utils::clip_grad_norm_(all_params_, max_norm);
  }
  std::unordered_set<const void*> tp_sharded;
  for (const auto& p : sharded_tp_) tp_sharded.insert(p.unsafeGetTensorImpl());
  // [shards sharded over tp, shards replicated over tp, whole sharded over tp, whole replicated]
  double sq[4] = {0, 0, 0, 0};
  auto add = [](double& acc, const at::Tensor& g) {
    if (g.defined()) {
      double v = g.norm().item<double>();
      acc += v * v;
    }
  };
  std::vector<at::Tensor> all;
  if (options_.stage == 3) {
    for (const auto& u : units_) {
      for (const auto& g : u->groups) {
        add(sq[g.tp_sharded ? 0 : 1], g.shard.grad());
        all.push_back(g.shard);
      }
    }
  }
  for (const auto& p : options_.stage == 3 ? persistent_ : all_params_) {
    add(sq[tp_sharded.count(p.unsafeGetTensorImpl()) ? 2 : 3], p.grad());
    all.push_back(p);
  }
  at::Tensor shards = at::tensor({sq[0], sq[1]}, at::kDouble);
  if (options_.stage == 3 && dp_->size() > 1) dp_->allReduce(shards)->wait();
  at::Tensor over_tp = at::tensor({shards[0].item<double>(), sq[2]}, at::kDouble);
  if (tp) tp_group->allReduce(over_tp)->wait();
  const double total = std::sqrt(over_tp[0].item<double>() + shards[1].item<double>() +
                                 over_tp[1].item<double>() + sq[3]);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : all) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return total;
}

ZeroStats ZeroModel::stats() const {
  ZeroStats s;
  for (const auto& p : parameters()) {
    s.param_bytes += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) s.grad_bytes += static_cast<int64_t>(p.grad().nbytes());
  }
  s.gathered_bytes = gathered_bytes_;
  s.peak_gathered_bytes = peak_gathered_bytes_;
  s.peak_gathered_units = peak_gathered_units_;
  s.allgather_bytes = allgather_bytes_;
  s.reducescatter_bytes = reducescatter_bytes_;
  s.allreduce_bytes = allreduce_bytes_;
  return s;
}

void ZeroModel::reset_peak() {
  peak_gathered_bytes_ = gathered_bytes_;
  peak_gathered_units_ = gathered_units_;
}

std::map<std::string, int64_t> ZeroModel::gather_counts() const {
  std::map<std::string, int64_t> out;
  for (const auto& u : units_) out[u->name] = u->gathers;
  return out;
}

std::map<std::string, int64_t> ZeroModel::unit_numels() const {
  std::map<std::string, int64_t> out;
  for (const auto& u : units_) {
    int64_t n = 0;
    for (const auto& g : u->groups) n += g.numel;
    out[u->name] = n;
  }
  return out;
}

std::map<std::string, int64_t> ZeroModel::unit_padded_numels() const {
  std::map<std::string, int64_t> out;
  for (const auto& u : units_) out[u->name] = u->padded_numel();
  return out;
}

}  // namespace remat
