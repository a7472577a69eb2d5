#include "parallel/zero.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <set>

#include "nn/module_call.h"
#include "parallel/grad_norm.h"
#include "parallel/internal/master_policy.h"
#include "parallel/internal/sharding_strategy.h"
#include "parallel/internal/zero_offload.h"
#include "parallel/nvme_tensor_file.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/outcome.h"

namespace remat::parallel {

namespace {

// Mixed precision: the floating-point tensors a module is called with
// through remat::forward, cast to the compute dtype (the model cannot know
// it: an image reaching a patch embedding's Conv2d is float32). Sits in the
// sharding slot of every module that has no sharding hook of its own.
class CastInputsHook final : public ModuleHook {
 public:
  explicit CastInputsHook(at::ScalarType dtype) : dtype_(dtype) {}
  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override {
    std::vector<c10::IValue> cast;
    cast.reserve(args.size());
    for (const auto& a : args) {
      if (a.isTensor() && a.toTensor().is_floating_point() && a.toTensor().scalar_type() != dtype_) {
        cast.emplace_back(a.toTensor().to(dtype_));
      } else {
        cast.push_back(a);
      }
    }
    return next(cast);
  }

 private:
  at::ScalarType dtype_;
};

// Every replica starts from data-parallel rank 0's weights, whatever each
// rank initialised (another seed, another file): a rank that built its
// model differently would otherwise train its own model.
void start_from_rank0(torch::nn::Module& model, Communicator& dp) {
  c10::NoGradGuard no_grad;
  std::vector<std::shared_ptr<Work>> pending;
  std::vector<at::Tensor> tensors;
  for (const auto& p : model.parameters()) tensors.push_back(p.detach());
  for (const auto& b : model.buffers()) tensors.push_back(b.detach());
  for (auto& t : tensors) {
    REMAT_CHECK(t.is_contiguous(), "ZeroModel: a parameter or buffer is not contiguous");
    pending.push_back(dp.broadcast(t, {0}));
  }
  for (auto& w : pending) w->wait();
}

// Each NVMe offload comes with its file, and nothing else does: offload_param
// "nvme" at stage 3, offload_optimizer "nvme" at stages 1-3.
void check_nvme_files(const ZeroOptions& config, const NvmeFiles& nvme) {
  auto check = [](bool wanted, const NvmeTensorFile* file, const char* section, const char* field) {
    if (wanted == (file != nullptr)) return;
    throw ConfigError(wanted ? str("ZeroModel: zero_optimization.", section, ".device \"nvme\" keeps its tensors in "
                                   "a file the caller opens: pass a parallel::NvmeTensorFile (made with this rank's "
                                   "nvme_path and section \"", section, "\") as NvmeFiles::", field)
                             : str("ZeroModel: NvmeFiles::", field, " given, but zero_optimization.", section,
                                   ".device is not \"nvme\" (or the stage does not offload it): leave it out"));
  };
  check(config.stage == 3 && config.offload_param.on_nvme(), nvme.parameters.get(), "offload_param", "parameters");
  check(config.stage > 0 && config.offload_optimizer.on_nvme(), nvme.masters.get(), "offload_optimizer", "masters");
}

}  // namespace

ZeroModel::ZeroModel(torch::nn::Module& model,
                     const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                     std::shared_ptr<Communicator> dp_group, const ZeroOptions& config,
                     const MixedPrecision& mixed, std::vector<at::Tensor> sharded_tp,
                     NvmeFiles nvme)
    : stage_(config.stage), optimizer_on_host_(optimizer_on_host(config)), model_(model), dp_group_(dp_group),
      sharded_tp_(std::move(sharded_tp)) {
  if (std::string bad = check_mixed_precision(mixed); !bad.empty()) throw ConfigError(bad);
  const std::string invalid = check_zero_options(config);
  if (!invalid.empty()) throw ConfigError("config error: " + invalid);
  const int dp = dp_group->size(), rank = dp_group->rank();
  DpGroups groups{dp_group, dp_group, nullptr};
  const int hybrid = config.hybrid_shard_size;
  if (std::string bad = check_hybrid_shard_size(config, dp); !bad.empty()) throw ConfigError(bad);
  if (hybrid > 0 && hybrid < dp) {
    // Groups of `hybrid` consecutive data-parallel ranks shard; the ranks at
    // the same place in each group replicate.
    groups.shard = dp_group->split(rank / hybrid, rank);
    groups.replicate = dp_group->split(rank % hybrid, rank);
    log_rank0().info("zero stage {}: hybrid sharding, data-parallel size {} = shard {} x replicate {} "
                     "(sharded within consecutive ranks, replicated across groups)",
                     config.stage, dp, hybrid, dp / hybrid);
  }
  if (dp > 1) start_from_rank0(model, *dp_group);
  shard_group_ = groups.shard;
  replicate_group_ = groups.replicate;
  check_nvme_files(config, nvme);
  nvme_ = nvme;
  policy_ = std::make_unique<MasterPolicy>(config, mixed, std::move(nvme));
  switch (config.stage) {
    case 0: strategy_ = make_data_parallel(model, dp_group, config, *policy_); break;
    case 1:
    case 2: strategy_ = make_stage12(model, groups, sharded_tp_, config, *policy_); break;
    default: strategy_ = make_stage3(model, units, groups, sharded_tp_, config, *policy_); break;
  }
  if (config.offload_param.enabled()) {
    // The stage's shards: what it steps, less the model's own (persistent) parameters.
    std::set<const void*> model_params;
    for (const auto& p : model.parameters()) model_params.insert(p.unsafeGetTensorImpl());
    for (const auto& t : strategy_->parameters()) {
      if (!model_params.count(t.unsafeGetTensorImpl())) host_shards_.push_back(t);
    }
    // A rank whose disk could not hold its shards stops every data-parallel rank here.
    log_offload_param(config.offload_param, host_shards_, nvme_.parameters.get());
  }
  if (config.offload_optimizer.enabled()) {
    // The policy's host mode: the strategy's reduced gradient shards go to
    // the host, the stepped masters come back before the strategy reads them.
    policy_->start_host_mode(strategy_->parameters(), config.offload_optimizer, host_shards_,
                             strategy_->host_masters());
  }
  // A rank whose disk could not hold its tensors stops every rank here: the
  // files' ranks (the job's, with tensor parallelism more than the
  // data-parallel group, whose other ranks would wait in their next
  // collective), else the data-parallel ones.
  if (nvme_.parameters || nvme_.masters) {
    agree_on_outcome(nvme_.ranks ? *nvme_.ranks : *dp_group, "placing tensors on NVMe", [&] {
      if (nvme_.parameters) nvme_.parameters->check();
      if (nvme_.masters) nvme_.masters->check();
    });
  }
  arrivals_ = std::make_unique<Arrivals>(model);
  if (mixed.enabled()) {
    auto hook = std::make_shared<CastInputsHook>(mixed.compute_dtype);
    for (const auto& m : model.modules(/*include_self=*/false)) {
      if (module_hook(*m, HookSlot::kSharding) != nullptr) continue;  // stage 3's units cast in their own
      set_module_hook(*m, HookSlot::kSharding, hook);
      cast_hooked_.push_back(m);
    }
    cast_hook_ = hook;
    const char* dtype = dtype_name(mixed.compute_dtype);
    log_rank0().info("{}: float32 masters, the model computes with {} copies{}; gradients accumulated in "
                     "float32, reduced in {}; floating-point inputs of {} modules' remat::forward calls cast to {}",
                     dtype, dtype, config.stage == 3 ? " gathered per unit" : " made once per step",
                     dtype_name(mixed.reduce_dtype), cast_hooked_.size(), dtype);
  }
}

// A flag per model parameter, set by a post hook on its gradient
// accumulator (autograd may run it on a device thread: atomics).
struct ZeroModel::Arrivals {
  explicit Arrivals(torch::nn::Module& model)
      : flags(model.parameters().size()), hooks([this](size_t, size_t k) { flags[k] = true; }) {
    const auto params = model.parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].requires_grad()) hooks.add(params[k], 0, k);
    }
  }
  std::vector<std::atomic<bool>> flags;
  GradientHooks hooks;
};

bool ZeroModel::offloads_optimizer() const { return policy_->host_mode(); }

ZeroModel::~ZeroModel() {
  for (const auto& weak : cast_hooked_) {
    auto m = weak.lock();
    if (m && module_hook(*m, HookSlot::kSharding) == cast_hook_) set_module_hook(*m, HookSlot::kSharding, nullptr);
  }
}

at::Tensor ZeroModel::take_gradient_arrivals() {
  at::Tensor out = at::zeros({static_cast<int64_t>(arrivals_->flags.size())}, at::kFloat);
  float* data = out.data_ptr<float>();
  for (size_t k = 0; k < arrivals_->flags.size(); ++k) data[k] = arrivals_->flags[k].exchange(false) ? 1.0f : 0.0f;
  return out;
}

std::vector<at::Tensor> ZeroModel::parameters() const {
  return policy_->optimizer_tensors(strategy_->parameters(), /*settle=*/true);  // the caller may write them
}

std::vector<at::Tensor> ZeroModel::device_parameters() const {
  std::vector<at::Tensor> out;
  std::set<const void*> host;
  for (const auto& t : host_shards_) host.insert(t.unsafeGetTensorImpl());
  for (const auto& t : strategy_->parameters()) {
    if (!host.count(t.unsafeGetTensorImpl())) out.push_back(t);
  }
  return out;
}

std::vector<HeldTensors> ZeroModel::holding() const {
  const StatePart model_part =
      strategy_->parameters_gathered_on_use() ? StatePart::kGatheredOnUse : StatePart::kParameters;
  std::vector<HeldTensors> out = {{model_part, Place::kDevice, model_.parameters()}};
  HeldTensors device{StatePart::kStepped, Place::kDevice, {}};
  HeldTensors masters{StatePart::kStepped, Place::kHostOptimizer, {}};
  HeldTensors shards{StatePart::kStepped, Place::kHostParameters, {}};
  std::set<const void*> on_host;
  for (const auto& t : host_shards_) on_host.insert(t.unsafeGetTensorImpl());
  const std::vector<at::Tensor> stepped = parameters(), kept = strategy_->parameters();
  for (size_t i = 0; i < stepped.size(); ++i) {
    const at::Tensor& t = stepped[i];
    if (on_host.count(t.unsafeGetTensorImpl())) {
      shards.tensors.push_back(t);
    } else if (!t.is_same(kept[i])) {
      masters.tensors.push_back(t);  // offload_optimizer's host copy of kept[i]
    } else {
      device.tensors.push_back(t);
    }
  }
  for (HeldTensors* part : {&device, &masters, &shards}) {
    if (!part->tensors.empty()) out.push_back(std::move(*part));
  }
  out.push_back({StatePart::kOptimizerState, optimizer_on_host_ ? Place::kHostOptimizer : Place::kDevice, {}});
  return out;
}

void ZeroModel::zero_grad() {
  const auto tensors = policy_->optimizer_tensors(strategy_->parameters(), /*settle=*/false);
  for (auto t : tensors) t.mutable_grad() = at::Tensor();
}
std::vector<ShardLayout> ZeroModel::layout() const { return strategy_->layout(); }
int ZeroModel::shard_size() const { return shard_group_->size(); }
int ZeroModel::replicate_size() const { return replicate_group_ ? replicate_group_->size() : 1; }

std::vector<std::pair<std::string, at::Tensor>> ZeroModel::full_parameters() {
  std::map<std::string, at::Tensor> full;
  for_each_full_unit([&](FullUnit& unit) {
    for (auto& [name, value] : unit) full[name] = value.clone();
  });
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model_.named_parameters()) out.emplace_back(item.key(), full.at(item.key()));
  return out;
}

void ZeroModel::for_each_full_unit(const std::function<void(FullUnit&)>& fn) {
  policy_->push(false);
  policy_->settle();  // rare: every copy back ended before anything is read
  std::map<std::string, size_t> order;
  for (const auto& item : model_.named_parameters()) order.emplace(item.key(), order.size());
  auto first = [&](const ShardingStrategy::FullUnitSource& s) {
    size_t i = order.size();
    for (const auto& name : s.names) i = std::min(i, order.at(name));
    return i;
  };
  // The same order on every rank: each source's first parameter.
  auto sources = strategy_->full_units();
  std::stable_sort(sources.begin(), sources.end(), [&](const auto& a, const auto& b) { return first(a) < first(b); });
  c10::NoGradGuard no_grad;
  for (auto& source : sources) {
    FullUnit unit = source.gather();
    std::sort(unit.begin(), unit.end(), [&](const auto& a, const auto& b) { return order.at(a.first) < order.at(b.first); });
    fn(unit);
  }
}

void ZeroModel::after_step() {
  // The optimizer read and rewrote each tensor it stepped (those with a
  // gradient); only the NVMe offloads' files count them.
  const bool on_disk = nvme_.parameters || nvme_.masters;
  for (const auto& t : on_disk ? policy_->optimizer_tensors(strategy_->parameters(), /*settle=*/false)
                               : std::vector<at::Tensor>{}) {
    if (!t.grad().defined()) continue;
    const auto bytes = static_cast<int64_t>(t.nbytes());
    if (nvme_.parameters && nvme_.parameters->on_disk(t)) {
      stepped_param_disk_bytes_ += bytes;
    } else if (nvme_.masters && nvme_.masters->on_disk(t)) {
      stepped_master_disk_bytes_ += bytes;
    }
  }
  policy_->push(true);
  strategy_->sync_parameters();
}
void ZeroModel::after_load() {
  policy_->push(true);
  strategy_->sync_parameters();
}
bool ZeroModel::parameters_gathered_on_use() const { return strategy_->parameters_gathered_on_use(); }
GradientHold ZeroModel::gradient_hold(int64_t trainable, int64_t local_trainable) const {
  return strategy_->gradient_hold(trainable, local_trainable);
}

ZeroModel::WholeParameters ZeroModel::install_whole_parameters(bool as_computed, bool keep_values) {
  WholeParameters out;
  policy_->push(false);
  if (!strategy_->parameters_gathered_on_use()) {
    strategy_->sync_parameters();  // what a push copied, gathered (and waited for) before it is read
    // Whole already. Where they are 16-bit copies of float32 masters, what
    // the scope leaves unchanged must not be written back rounded.
    if (keep_values && policy_->mixed()) {
      for (const auto& item : model_.named_parameters()) out.values[item.key()] = item.value().detach().clone();
    }
    return out;
  }
  auto full = full_parameters();
  std::map<std::string, at::Tensor> by_name(full.begin(), full.end());
  c10::NoGradGuard no_grad;
  for (auto& item : model_.named_parameters()) {
    at::Tensor p = item.value();
    auto it = by_name.find(item.key());
    if (it == by_name.end()) continue;
    out.restore.emplace_back(p, p.data());
    p.set_data((as_computed ? it->second.to(p.scalar_type()) : it->second).view(p.sizes()));
  }
  if (keep_values) {
    for (const auto& item : model_.named_parameters()) out.values[item.key()] = item.value().detach().clone();
  }
  return out;
}

void ZeroModel::write_back_parameters(std::map<std::string, at::Tensor> edited,
                                      const std::map<std::string, at::Tensor>& began_with) {
  c10::NoGradGuard no_grad;
  // Rank 0's edit for every data-parallel replica, then each rank's pieces
  // of what changed (a parameter that began the scope with the same value
  // keeps its float32 shard as it is, whatever the compute type).
  for (auto it = edited.begin(); it != edited.end();) {
    if (dp_group_->size() > 1) dp_group_->broadcast(it->second, {0})->wait();
    auto before = began_with.find(it->first);
    if (before != began_with.end() && at::equal(before->second, it->second)) {
      it = edited.erase(it);
    } else {
      ++it;
    }
  }
  const auto tensors = parameters();
  const auto shards = layout();
  for (size_t i = 0; i < tensors.size(); ++i) {
    REMAT_CHECK(tensors[i].is_contiguous(), "GatheredParameters: a sharded tensor is not contiguous");
    at::Tensor flat = tensors[i].detach().view({-1});
    for (const auto& seg : shards[i].segments) {
      auto it = edited.find(seg.name);
      if (it == edited.end()) continue;
      flat.narrow(0, seg.shard_offset, seg.length)
          .copy_(it->second.reshape({-1}).narrow(0, seg.param_offset, seg.length));
    }
  }
  policy_->push(true);
  strategy_->after_write();
}

void ZeroModel::leave_whole() {
  policy_->push(false);
  if (strategy_->parameters_gathered_on_use()) {
    install_whole_parameters(/*as_computed=*/false, /*keep_values=*/false);
  } else {
    strategy_->leave_whole();
  }
}

void ZeroModel::begin_forward() {
  policy_->push(false);
  strategy_->begin_forward();
}
at::Tensor ZeroModel::finish_forward(const at::Tensor& loss) { return strategy_->finish_forward(loss); }
void ZeroModel::begin_backward(bool synchronize) {
  policy_->begin_backward(synchronize);
  strategy_->begin_backward(synchronize);
}

void ZeroModel::finish_backward(bool synchronize) {
  strategy_->finish_backward(synchronize);
  policy_->end_backward();
  // The window's reduced gradient shards, complete: the rest to the host, for the step.
  if (synchronize) policy_->take_gradients();
}
void ZeroModel::end_evaluation() { strategy_->end_evaluation(); }

void ZeroModel::abandon_backward() {
  strategy_->abandon_backward();
  policy_->end_backward();
  for (auto& p : strategy_->parameters()) p.mutable_grad() = at::Tensor();
  policy_->drop_gradients();
  for (auto& p : model_.parameters()) p.mutable_grad() = at::Tensor();
  take_gradient_arrivals();
}

double ZeroModel::clip_grad_norm(double max_norm, const std::shared_ptr<Communicator>& tp_group) {
  auto groups = strategy_->grad_groups(sharded_tp_, tp_group);
  if (!policy_->host_mode() && host_shards_.empty()) return parallel::clip_grad_norm(groups, max_norm);
  // The gradients are the host masters'; the norms are summed on the device
  // the shards live on (the communicator's backend takes its tensors), the
  // model's where offload_param put the shards on the host.
  std::optional<at::Device> reduce_on;
  if (!host_shards_.empty() && !model_.parameters().empty()) reduce_on = model_.parameters().front().device();
  for (auto& g : groups) {
    for (auto& t : g.tensors) {
      if (!reduce_on) reduce_on = t.device();
      t = policy_->host_of(t);
    }
  }
  return parallel::clip_grad_norm(groups, max_norm, reduce_on);
}

ZeroStats ZeroModel::stats() const {
  ZeroStats s = strategy_->stats();
  if (policy_->host_mode()) s.host_bytes = policy_->host_bytes();
  for (const auto& t : host_shards_) {  // the strategy counted them as the device's
    const int64_t bytes = static_cast<int64_t>(t.nbytes());
    const int64_t grad = t.grad().defined() ? static_cast<int64_t>(t.grad().nbytes()) : 0;
    s.host_param_bytes += grad;
    if (!policy_->on_disk(t)) s.host_param_bytes += bytes;
    s.param_bytes -= bytes;
    s.grad_bytes -= grad;
  }
  if (nvme_.parameters) s.disk_param_bytes = nvme_.parameters->file_bytes();
  if (nvme_.masters) s.disk_master_bytes = nvme_.masters->file_bytes();
  s.disk_param_read_bytes += stepped_param_disk_bytes_;  // the strategy counted its gathers' reads
  s.disk_param_written_bytes += stepped_param_disk_bytes_;
  s.disk_master_read_bytes += stepped_master_disk_bytes_;
  s.disk_master_written_bytes += stepped_master_disk_bytes_;
  return s;
}
void ZeroModel::reset_peak() { strategy_->reset_peak(); }
std::map<std::string, int64_t> ZeroModel::gather_counts() const { return strategy_->gather_counts(); }
std::map<std::string, int64_t> ZeroModel::unit_numels() const { return strategy_->unit_numels(); }
std::map<std::string, int64_t> ZeroModel::unit_padded_numels() const {
  return strategy_->unit_padded_numels();
}

}  // namespace remat::parallel
