#include "engine/engine.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <optional>
#include <set>

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "engine/export.h"
#include "engine/optim.h"
#include "engine/step_counters.h"
#include "engine/save/dir_lock.h"
#include "engine/save/train_state.h"
#include "nn/saved_tensors_hooks.h"
#include "parallel/layers.h"
#include "parallel/zero.h"
#include "rng/rng_tracker.h"
#include "runtime/agreement.h"
#include "runtime/communicator.h"
#include "runtime/context.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Models that a live engine trains: a second initialize() of one is refused.
std::mutex g_live_mutex;
std::set<const torch::nn::Module*>& live_models() {
  static std::set<const torch::nn::Module*> models;
  return models;
}

// Settings that would have no effect are pointed out (config.h: ineffective_settings).
void warn_ineffective(const Config& c) {
  for (const auto& warning : ineffective_settings(c)) log_rank0().warn("{}", warning);
}

bool gradients_finite(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> checks;
  for (const auto& p : parameters) {
    if (p.grad().defined() && p.grad().numel() > 0) checks.push_back(at::isfinite(p.grad()).all());
  }
  return checks.empty() || at::stack(checks).all().item<bool>();
}

// The dotted path of the model's block list: the one given, else the only
// ModuleList the model holds.
std::string block_path(torch::nn::Module& model, const std::string& given) {
  if (!given.empty()) {
    try {
      find_block_list(model, given);
    } catch (const Error& e) {
      throw ConfigError(str("remat::initialize: EngineOptions::blocks is '", given, "': ", e.what(),
                            " (set EngineOptions::blocks to the dotted path of the model's ModuleList of "
                            "blocks, or leave it empty to use the one ModuleList the model holds)"));
    }
    return given;
  }
  std::vector<std::string> lists;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(item.value().get())) lists.push_back(item.key());
  }
  if (lists.size() == 1) return lists[0];
  if (lists.empty()) {
    throw ConfigError(str("remat::initialize: the model (", module_type(model), " with children ",
                          describe_children(model), ") holds no torch::nn::ModuleList of blocks. remat "
                          "shards and checkpoints a model block by block: keep the blocks in a ModuleList "
                          "registered on the model and call each through remat::forward(block, ...) "
                          "(docs/engine.md, the model contract)"));
  }
  std::string names;
  for (const auto& l : lists) names += (names.empty() ? "'" : ", '") + l + "'";
  throw ConfigError(str("remat::initialize: the model holds several ModuleLists (", names,
                        "): name the one of its blocks in EngineOptions::blocks"));
}

std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return "Adam";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "SGD";
  return typeid(optimizer).name();
}

// What a micro-step starts from outside its activations: every parameter's
// and shard's storage once, the optimizer's state (before its first step,
// what it will allocate then) and, with gradient accumulation, the gradients
// held between micro-batches. For device_memory_budget_bytes. `live`: the
// tracker's count at the step's start, when known: what it holds beyond the
// parameters and the optimizer state allocated so far (the batch, whatever
// the caller keeps) is held through the step as well.
std::pair<int64_t, std::string> resident_state(torch::nn::Module& model, parallel::ZeroModel& zero,
                                               const torch::optim::Optimizer& optimizer, int64_t accumulation,
                                               int64_t live = 0) {
  std::set<const void*> seen;
  int64_t params = 0, local_trainable = 0, model_trainable = 0;
  auto count = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) params += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : model.parameters()) {
    count(p);
    if (p.requires_grad()) model_trainable += static_cast<int64_t>(p.numel() * p.element_size());
  }
  for (const auto& b : model.buffers()) count(b);
  for (const auto& p : zero.parameters()) {
    count(p);
    if (p.requires_grad()) local_trainable += static_cast<int64_t>(p.numel() * p.element_size());
  }
  int64_t state = optimizer_state_bytes(optimizer);
  const int64_t other = std::max<int64_t>(0, live - params - state);
  std::string note;
  if (state == 0) {
    const std::string type = optimizer_type(optimizer);
    if (type == "AdamW" || type == "Adam") {
      state = 2 * local_trainable;
      note = " (to be allocated at the first step)";
    } else if (const auto* sgd = dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(sgd->param_groups().at(0).options());
      state = o.momentum() > 0 ? local_trainable : 0;
      if (state > 0) note = " (to be allocated at the first step)";
    } else {
      note = " (an optimizer remat does not know: its state is not counted)";
    }
  }
  // Held between micro-batches: the stage's rule (parallel/zero_memory.h).
  const int64_t grads = accumulation > 1 ? zero.gradient_hold(model_trainable, local_trainable).between_micro_batches : 0;
  const auto mib = [](int64_t b) { return str(std::round(static_cast<double>(b) / 10485.76) / 100, " MiB"); };
  return {params + state + grads + other,
          str("parameters and buffers ", mib(params), " + optimizer state ", mib(state), note,
              grads > 0 ? str(" + gradients held between micro-batches ", mib(grads)) : std::string(),
              other > 0 ? str(" + other tensors live at the step's start (the batch among them) ", mib(other))
                        : std::string())};
}

// The elements of one of the optimizer's tensors that belong to parameters
// no rank gave a gradient this step, with their values and optimizer state
// before the step.
struct UnusedElements {
  at::Tensor tensor;  // one of ZeroModel::parameters()
  std::vector<parallel::ShardSegment> segments;
  std::vector<at::Tensor> values;
  std::vector<std::map<std::string, at::Tensor>> state;
};

// The optimizer state of `tensor` by name, without its step count (none for
// an optimizer remat does not know: its values alone are then kept).
std::map<std::string, at::Tensor> moments_of(const torch::optim::Optimizer& optimizer, const at::Tensor& tensor) {
  std::map<std::string, at::Tensor> out;
  try {
    out = optimizer_state_of(optimizer, tensor);
  } catch (const Error&) {
  }
  out.erase("step");
  return out;
}

// A parameter no forward used on any rank (`arrived`: take_gradient_arrivals()
// reduced over every rank) is not stepped, as a plain LibTorch loop leaves a
// parameter whose .grad is undefined alone: the reduction handed the optimizer
// zeros for it, which weight decay or momentum would act on. An optimizer
// tensor holding only such parameters loses its gradient (so the optimizer
// skips it and keeps no state for it); one that also holds used parameters is
// stepped, and the unused elements are put back by put_back_unused.
std::vector<UnusedElements> leave_unused_alone(parallel::ZeroModel& zero, torch::nn::Module& model,
                                               const at::Tensor& arrived, const torch::optim::Optimizer& optimizer) {
  std::set<std::string> unused;
  const at::Tensor flags = arrived.contiguous();
  const auto got = flags.accessor<double, 1>();
  int64_t k = 0;
  for (const auto& item : model.named_parameters()) {
    if (item.value().requires_grad() && got[k] == 0) unused.insert(item.key());
    ++k;
  }
  std::vector<UnusedElements> held;
  if (unused.empty()) return held;
  const auto tensors = zero.parameters();
  const auto layout = zero.layout();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].grad().defined()) continue;
    UnusedElements e{tensors[i], {}, {}, {}};
    bool any_used = false;
    for (const auto& seg : layout[i].segments) {
      if (unused.count(seg.name)) {
        e.segments.push_back(seg);
      } else {
        any_used = true;
      }
    }
    if (e.segments.empty()) continue;
    if (!any_used) {
      tensors[i].mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor flat = tensors[i].detach().view({-1});
    const auto moments = moments_of(optimizer, tensors[i]);
    for (const auto& seg : e.segments) {
      e.values.push_back(flat.narrow(0, seg.shard_offset, seg.length).clone());
      std::map<std::string, at::Tensor> state;
      for (const auto& [field, value] : moments) {
        state[field] = value.reshape({-1}).narrow(0, seg.shard_offset, seg.length).clone();
      }
      e.state.push_back(std::move(state));
    }
    held.push_back(std::move(e));
  }
  return held;
}

// After the optimizer step: the unused elements' values and state as they
// were (state the step created for them starts at zero, as it would have).
void put_back_unused(const std::vector<UnusedElements>& held, const torch::optim::Optimizer& optimizer) {
  at::NoGradGuard no_grad;
  for (const auto& e : held) {
    const at::Tensor flat = e.tensor.detach().view({-1});
    const auto moments = moments_of(optimizer, e.tensor);
    for (size_t j = 0; j < e.segments.size(); ++j) {
      const auto& seg = e.segments[j];
      flat.narrow(0, seg.shard_offset, seg.length).copy_(e.values[j]);
      for (const auto& [field, value] : moments) {
        at::Tensor slice = value.view({-1}).narrow(0, seg.shard_offset, seg.length);
        auto before = e.state[j].find(field);
        if (before == e.state[j].end()) {
          slice.zero_();
        } else {
          slice.copy_(before->second);
        }
      }
    }
  }
}

enum class Phase { kIdle, kForwarded, kBackwarded };

}  // namespace

struct Engine::Impl {
  // Checkpointing defaults and counters, offloading and tensor-parallel
  // counters and the RNG tracker of this engine alone: installed for each of
  // its calls (regions keep it for their backward).
  std::shared_ptr<Context> context = Context::create();
  EngineOptions options;
  std::shared_ptr<ParallelLayout> layout;
  std::shared_ptr<Communicator> world;
  BatchSizes batch;
  std::unique_ptr<MemoryTracker> own_memory;
  MemoryTracker* memory = nullptr;
  c10::DeviceType device = c10::DeviceType::CPU;  // where the model's memory is counted
  PolicyOptions policy;
  bool auto_plan = false;
  int regions = 0;
  std::unique_ptr<ActivationPlanner> planner;
  std::unique_ptr<parallel::ZeroModel> zero;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  SaveIdentity identity;
  std::unique_ptr<SaveDirLock> save_lock;
  std::string save_lock_dir, loaded_dir;
  int gathered_scopes = 0;
  // trace_memory: the file of the next step's timeline, and its recording.
  std::string trace_path;
  int trace_samples = 0;
  std::unique_ptr<MemoryTrace> trace;

  // The step in progress.
  Phase phase = Phase::kIdle;
  double lr = 0;
  bool planned = false;
  double plan_ms = 0;
  int64_t base = 0, saved = 0, act_host = 0, act_kept = 0, fwd_held = 0, act_peak = 0, step_peak = 0;
  int64_t micro_base = 0;
  Counters before;
  Clock::time_point start, forward_end;
  double fwd_ms = 0, bwd_ms = 0, loss_sum = 0;

  TrainShards shards(const torch::nn::Module& model) const { return train_shards(*zero, *layout, model); }

  // The memory timeline: what is live at the start is split by what holds it.
  void start_trace(torch::nn::Module& model) {
    std::vector<MemoryTrace::Known> known;
    // Parameters gathered on use (stage 3) are views of their gathered units.
    if (!zero->parameters_gathered_on_use()) {
      for (const auto& p : model.parameters()) known.push_back({p, MemoryCategory::kParameters});
    }
    for (const auto& p : zero->parameters()) known.push_back({p, MemoryCategory::kParameters});
    for (const auto& t : optimizer_state_tensors(*optimizer)) known.push_back({t, MemoryCategory::kOptimizerState});
    trace = std::make_unique<MemoryTrace>(*memory, known);
  }
  // Gradients autograd allocated count as gradients over their whole life.
  void classify_gradients(torch::nn::Module& model) const {
    for (const auto& p : model.parameters()) classify_memory(p.grad(), MemoryCategory::kGradients);
    for (const auto& p : zero->parameters()) classify_memory(p.grad(), MemoryCategory::kGradients);
  }
  void finish_trace(const Config& config, const StepMetrics& m) {
    const auto recorded = std::move(trace);
    const std::string path = std::move(trace_path);
    trace_path.clear();
    recorded->stop();
    const auto& variant = checkpoint_variant_name(config.activation_checkpointing.variant);
    nlohmann::json other = {{"step", m.step},
                            {"rank", world->rank()},
                            {"device", c10::DeviceTypeName(device, /*lower_case=*/true)},
                            {"zero_stage", zero->stage()},
                            {"activation_checkpointing", variant},
                            {"gradient_accumulation_steps", batch.gradient_accumulation_steps},
                            {"mem_base_bytes", m.mem_base_bytes},
                            {"mem_peak_bytes", m.mem_peak_bytes}};
    ChromeTraceOptions chrome;
    chrome.max_samples = trace_samples;
    chrome.pid = world->rank();
    chrome.process_name = str("remat rank ", world->rank());
    try {
      recorded->write(path, chrome, other);
    } catch (const Error& e) {
      // An auxiliary output: its failure costs neither this step nor the saves after it.
      log().warn("{}; the memory timeline of step {} is not written, and training goes on", e.what(), m.step);
      return;
    }
    log().info("memory timeline of step {} written to '{}'", m.step, path);
  }
};

nlohmann::json StepMetrics::to_json() const {
  nlohmann::json m = {{"step", step},
                      {"loss", loss},
                      {"lr", lr},
                      {"step_ms", step_ms},
                      {"fwd_ms", fwd_ms},
                      {"bwd_ms", bwd_ms},
                      {"opt_ms", opt_ms},
                      {"recompute_ms", recompute_ms},
                      {"mem_base_bytes", mem_base_bytes},
                      {"mem_peak_bytes", mem_peak_bytes},
                      {"mem_act_peak_bytes", mem_act_peak_bytes},
                      {"ckpt_saved_bytes", ckpt_saved_bytes},
                      {"act_offloaded_bytes", act_offloaded_bytes},
                      {"act_restored_bytes", act_restored_bytes},
                      {"act_host_bytes", act_host_bytes},
                      {"act_kept_bytes", act_kept_bytes},
                      {"mem_fwd_held_bytes", mem_fwd_held_bytes},
                      {"ckpt_offloaded_bytes", ckpt_offloaded_bytes},
                      {"ckpt_gathered_bytes", ckpt_gathered_bytes},
                      {"comm_bytes", comm_bytes},
                      {"zero_comm_bytes", zero_comm_bytes},
                      {"tp_comm_bytes", tp_comm_bytes},
                      {"param_bytes", param_bytes},
                      {"grad_bytes", grad_bytes},
                      {"grad_peak_bytes", grad_peak_bytes},
                      {"optimizer_state_bytes", optimizer_state_bytes},
                      {"peak_gathered_param_bytes", peak_gathered_param_bytes},
                      {"reduce_wait_ms", reduce_wait_ms},
                      {"buckets_reduced", buckets_reduced},
                      {"buckets_done_in_backward", buckets_done_in_backward}};
  if (grad_norm >= 0) m["grad_norm"] = grad_norm;
  if (skipped) m["skipped"] = true;
  for (const auto& [key, value] : plan.items()) m[key] = value;
  return m;
}

std::shared_ptr<ParallelLayout> init_distributed(const Config& config, const std::string& backend) {
  auto world = Runtime::init().world(parse_backend(backend));
  auto layout = std::make_shared<ParallelLayout>(world, ParallelDims::from_world(world->size(),
                                                                                 config.tensor_parallel.size));
  // The model is built after this: every rank initialises it from the same
  // seed (sharding then starts every replica from rank 0's values anyway).
  at::manual_seed(static_cast<uint64_t>(config.train.seed));
  return layout;
}

Engine::Engine(std::shared_ptr<torch::nn::Module> module, Config config, EngineOptions options)
    : model_(std::move(module)), config_(std::move(config)), impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  s.options = std::move(options);
  REMAT_CHECK(model_ != nullptr, "remat::initialize: the model is null");
  if (s.options.memory) {
    s.memory = s.options.memory;
  } else {
    MemoryTrackerOptions tracking;
    tracking.keep_allocations = true;  // what trace_memory starts from
    s.own_memory = std::make_unique<MemoryTracker>(tracking);
    s.memory = s.own_memory.get();
  }
  s.layout = s.options.layout ? s.options.layout : init_distributed(config_, s.options.backend);
  s.world = s.layout->world();
  if (s.layout->dims().tp != config_.tensor_parallel.size) {
    throw ConfigError(str("remat::initialize: tensor_parallel.size is ", config_.tensor_parallel.size,
                          " but the layout given in EngineOptions::layout has tensor-parallel size ",
                          s.layout->dims().tp, ": build the layout with init_distributed(config) from the "
                          "same config"));
  }
  // Every rank runs what the others run: ranks configured differently would
  // hang in a collective only some of them make, or train diverging replicas.
  {
    std::map<std::string, std::string> settings;
    const nlohmann::json flat = nlohmann::json::parse(config_.to_json()).flatten();
    for (const auto& item : flat.items()) {
      std::string key = item.key().substr(1);
      std::replace(key.begin(), key.end(), '/', '.');
      settings[key] = item.value().dump();
    }
    require_same_settings(*s.world, settings, "configurations");
  }
  warn_ineffective(config_);
  s.batch = config_.resolve_batch(s.layout->dims().dp);
  torch::nn::Module& model = *model_;
  model_parallel_manual_seed(static_cast<uint64_t>(config_.train.seed), *s.layout);
  for (const auto& p : model.parameters()) {
    s.device = p.device().type();
    break;
  }
  const auto sharded = parallel::sharded_parameters(model);
  const std::string blocks = block_path(model, s.options.blocks);
  auto block_list = find_block_list(model, blocks);

  // The config's activation_checkpointing section becomes the defaults every
  // region starts from. Regions are timed whatever its profile key says: the
  // recompute time goes into the metrics. Non-reentrant regions and
  // activation offloading answer autograd's saved-tensor hooks query through
  // remat's engine: installed before any backward.
  install_saved_tensors_hooks_engine();
  ActivationCheckpointingConfig checkpointing = config_.activation_checkpointing;
  checkpointing.profile = true;
  if (config_.tensor_parallel.sequence_parallel_active() && checkpointing.partition_activations) {
    // A region's input is this rank's own chunk of the sequence, different on
    // every rank of the group: splitting it again and gathering the pieces
    // would rebuild another rank's chunk.
    checkpointing.partition_activations = false;
    log_rank0().info("activation_checkpointing.partition_activations is not applied with "
                     "tensor_parallel.sequence_parallel: each region already keeps 1/{} of its input "
                     "(its own tokens), with no all-gather in the recompute", config_.tensor_parallel.size);
  }
  configure_checkpointing(checkpointing, s.layout.get());
  s.policy = PolicyOptions(config_.activation_checkpointing);
  s.policy.blocks = blocks;
  // variant auto: planned from a profiling step at the first step (and again
  // for every new plan key).
  s.auto_plan = s.policy.variant == CheckpointVariant::kAuto;
  s.regions = s.auto_plan ? 0 : apply_activation_checkpointing(model, s.policy);
  PlannerOptions planner_options;
  planner_options.blocks = blocks;
  static_cast<MemoryBudget&>(planner_options) = config_.activation_checkpointing;
  planner_options.offload = config_.activation_offloading;
  planner_options.report_dir = s.options.plan_report_dir;
  // A budget the model cannot be planned for (the knee of one block) stops the run here.
  if (s.auto_plan) check_planner_options(model, planner_options);
  s.planner = std::make_unique<ActivationPlanner>(model, planner_options, s.world.get());
  // Activation offloading: each forward runs inside a scope; the head stays.
  prepare_output_head(model, config_.activation_offloading);
  const auto& number_checkpoints = config_.activation_checkpointing.number_checkpoints;
  const int64_t n_blocks = static_cast<int64_t>(block_list->size());
  // The planner profiles every block as a region: each may need a slot.
  if (s.auto_plan && number_checkpoints && *number_checkpoints < n_blocks) {
    throw ConfigError(str("activation_checkpointing.variant is auto, which may checkpoint every block, but "
                          "number_checkpoints is ", *number_checkpoints, ": set number_checkpoints to the "
                          "number of blocks (", n_blocks, ")",
                          config_.activation_checkpointing.contiguous_memory_optimization ? "" : " or leave it out"));
  }
  if (number_checkpoints && s.regions > *number_checkpoints) {
    throw ConfigError(str("activation_checkpointing.number_checkpoints is ", *number_checkpoints,
                          " but the policy marks ", s.regions, " regions per forward: set it to ", s.regions,
                          " (or leave it out)"));
  }
  // Sharding over the data-parallel group; the optimizer steps what the
  // sharding hands it.
  std::vector<std::shared_ptr<torch::nn::Module>> units(block_list->begin(), block_list->end());
  parallel::ZeroOptions zero_options = config_.zero_optimization;
  zero_options.progress_in_hooks = knobs::reduce_progress_in_hooks();
  s.zero = std::make_unique<parallel::ZeroModel>(model, units, s.layout->dp_group(), zero_options, config_.bf16,
                                                 sharded);
  s.optimizer = s.options.optimizer ? s.options.optimizer(s.zero->parameters())
                                    : make_optimizer(config_.optimizer, s.zero->parameters());
  REMAT_CHECK(s.optimizer != nullptr, "remat::initialize: EngineOptions::optimizer returned no optimizer");
  // A whole-device budget the model state alone fills is refused before any step.
  if (const auto& device = config_.activation_checkpointing.device_memory_budget_bytes; device && s.auto_plan) {
    const auto [state, what] = resident_state(model, *s.zero, *s.optimizer, s.batch.gradient_accumulation_steps);
    if (*device <= state) {
      throw ConfigError(str("activation_checkpointing.device_memory_budget_bytes = ", *device,
                            " is below the model state alone: ", what, " = ", state, " bytes per rank, before any "
                            "activation. Raise the budget above that, or shard the state (a higher "
                            "zero_optimization.stage, more data-parallel ranks)"));
    }
  }
  // Every setting the saved state's meaning depends on: a resume with
  // another value is refused naming it. train.seed: the random state comes
  // from the save, but a caller's data order may come from the seed. (The
  // tensor-parallel size is not one: a save is re-sliced for another.)
  s.identity.model_signature = s.options.model_signature;
  s.identity.run_id = new_run_id(*s.world);
  s.identity.settings = {{"optimizer.type", optimizer_type(*s.optimizer)},
                         {"train.seed", std::to_string(config_.train.seed)}};
  s.identity.seed = static_cast<uint64_t>(config_.train.seed);
  for (const auto& item : model.named_parameters()) {
    s.identity.parameters.emplace_back(item.key(), item.value().sizes().vec());
  }
  s.lr = learning_rate(config_.optimizer, config_.scheduler, 1);
}

Engine::~Engine() {
  {
    ContextScope scope(impl_->context);
    // The model is left whole with its trained values, ready for anything
    // else (collective; skipped while an exception unwinds, when the other
    // ranks may not be here).
    if (std::uncaught_exceptions() == 0 && impl_->zero && impl_->phase == Phase::kIdle) {
      try {
        impl_->zero->leave_whole();
      } catch (const std::exception& e) {
        log().error("remat::Engine: leaving the model whole failed: {}", e.what());
      }
    }
    impl_->zero.reset();
    drop_module_hooks(*impl_->context);  // the policy's marks; the model may be trained again
  }
  std::lock_guard<std::mutex> lock(g_live_mutex);
  live_models().erase(model_.get());
}

const ParallelLayout& Engine::layout() const { return *impl_->layout; }
torch::optim::Optimizer& Engine::optimizer() const { return *impl_->optimizer; }
parallel::ZeroModel& Engine::sharding() const { return *impl_->zero; }
const std::shared_ptr<Context>& Engine::context() const { return impl_->context; }

bool Engine::is_gradient_accumulation_boundary() const {
  return micro_steps_ + 1 >= impl_->batch.gradient_accumulation_steps;
}

double Engine::get_lr() const { return impl_->lr; }

at::Tensor Engine::forward(const std::function<at::Tensor()>& fn, const std::vector<int64_t>& plan_key) {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  if (s.phase == Phase::kForwarded) {
    throw Error("remat::Engine::forward: the previous forward's loss has not been through backward(): call "
                "backward(loss) after each forward (for a forward without backward, use evaluate())");
  }
  if (s.phase == Phase::kBackwarded) {
    throw Error("remat::Engine::forward: step() was not called after the last backward(): call step() after "
                "every backward (it steps the optimizer only at the accumulation boundary)");
  }
  REMAT_CHECK(s.gathered_scopes == 0, "remat::Engine::forward inside a GatheredParameters scope: end the scope "
              "first (a training forward gathers and frees the parameters itself)");
  if (micro_steps_ == 0) {
    // The first micro-step of an optimizer step.
    s.lr = learning_rate(config_.optimizer, config_.scheduler, global_steps_ + 1);
    set_learning_rate(*s.optimizer, s.lr);
    s.planned = false;
    if (s.auto_plan) {
      // One forward and backward of this micro-batch per profiling run; the
      // planner puts the RNG back, the gradients are dropped below.
      auto profile_step = [&] {
        s.zero->begin_forward();
        std::unique_ptr<OffloadActivations> offload;
        if (config_.activation_offloading.enabled) {
          offload = std::make_unique<OffloadActivations>(config_.activation_offloading, model_.get());
        }
        at::Tensor loss = s.zero->finish_forward(fn());
        offload.reset();
        s.zero->begin_backward(/*synchronize=*/true);
        // Scaled as backward() scales it: the same tensors as the step's.
        (loss / static_cast<double>(s.batch.gradient_accumulation_steps)).backward();
        s.zero->finish_backward(/*synchronize=*/true);
      };
      const auto t0 = Clock::now();
      if (config_.activation_checkpointing.device_memory_budget_bytes) {
        auto [state, what] = resident_state(*model_, *s.zero, *s.optimizer, s.batch.gradient_accumulation_steps,
                                            s.memory->current(s.device));
        s.planner->set_state_bytes(state, std::move(what));
      }
      s.planned = s.planner->ensure(plan_key, profile_step);
      if (s.planned) {
        s.plan_ms = ms_between(t0, Clock::now());
        const auto& choices = s.planner->plan()->choices;
        s.regions = static_cast<int>(std::count_if(choices.begin(), choices.end(), [](BlockChoice c) {
          return c != BlockChoice::kKeep && c != BlockChoice::kOffloadActivations;
        }));
      }
    }
    // Gradients set to none, as LibTorch 2.x's zero_grad does. Before the
    // base is read: the last step's gradients are not this step's memory.
    for (auto& p : s.zero->parameters()) p.mutable_grad() = at::Tensor();
    s.zero->take_gradient_arrivals();  // a profiling step's are not this step's
    if (!s.trace_path.empty() && !s.trace) s.start_trace(*model_);
    s.base = s.memory->current(s.device);
    s.memory->reset_peak();
    s.zero->reset_peak();
    s.before = Counters::read(s.zero.get());
    s.start = Clock::now();
    s.fwd_ms = s.bwd_ms = s.loss_sum = 0;
    s.saved = s.act_host = s.act_kept = s.fwd_held = s.act_peak = s.step_peak = 0;
  }
  s.step_peak = std::max(s.step_peak, s.memory->peak(s.device));
  s.micro_base = s.memory->current(s.device);
  s.memory->reset_peak();
  const auto t0 = Clock::now();
  at::Tensor loss;
  {
    // On a memory trace: what the forward allocates (and no scope below
    // claims) is the activations autograd keeps.
    TraceSpan span("phase", "forward");
    MemoryCategoryScope activations(MemoryCategory::kSavedActivations);
    s.zero->begin_forward();
    std::unique_ptr<OffloadActivations> offload;
    try {
      if (config_.activation_offloading.enabled) {
        offload = std::make_unique<OffloadActivations>(config_.activation_offloading, model_.get());
      }
      loss = fn();
      if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
        throw Error(str("remat::Engine::forward: the function must return the loss, a one-element tensor that "
                        "requires grad (got ",
                        loss.defined() ? str(loss.sizes(), loss.requires_grad() ? "" : ", not requiring grad")
                                       : std::string("an undefined tensor"),
                        "); for a forward without backward, use evaluate()"));
      }
      loss = s.zero->finish_forward(loss);
    } catch (...) {
      // Whatever the forward left gathered is freed; the next forward starts
      // clean (its regions and graph die with the exception's stack).
      offload.reset();
      s.zero->end_evaluation();
      throw;
    }
  }
  const Counters held = Counters::read();
  s.saved = std::max(s.saved, held.checkpoint_saved_bytes);
  s.act_host = std::max(s.act_host, held.offload.host_bytes);
  s.act_kept = std::max(s.act_kept, held.offload.kept_bytes);
  s.fwd_held = std::max(s.fwd_held, s.memory->current(s.device) - s.micro_base);
  s.forward_end = Clock::now();
  s.fwd_ms += ms_between(t0, s.forward_end);
  s.phase = Phase::kForwarded;
  return loss;
}

void Engine::backward(const at::Tensor& loss) {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  if (s.phase != Phase::kForwarded) {
    throw Error(s.phase == Phase::kBackwarded
                    ? "remat::Engine::backward: called twice for one forward: call step() after backward(), "
                      "then forward() for the next micro-batch"
                    : "remat::Engine::backward: no forward() since the last step(): compute the loss with "
                      "engine.forward(fn) first");
  }
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    throw Error(str("remat::Engine::backward: the loss must be a one-element tensor that requires grad (got ",
                    loss.defined() ? str(loss.sizes(), loss.requires_grad() ? "" : ", not requiring grad")
                                   : std::string("an undefined tensor"),
                    "): pass the loss forward() returned"));
  }
  const bool boundary = is_gradient_accumulation_boundary();
  at::Tensor scaled = loss / static_cast<double>(s.batch.gradient_accumulation_steps);
  const auto t1 = Clock::now();
  try {
    TraceSpan span("phase", "backward");
    s.zero->begin_backward(/*synchronize=*/boundary);
    scaled.backward();
    s.zero->finish_backward(/*synchronize=*/boundary);
    if (s.trace) s.classify_gradients(*model_);
  } catch (...) {
    // The accumulation window is dropped (its gradients and partial
    // reductions with it): the next forward starts a new one.
    s.zero->abandon_backward();
    micro_steps_ = 0;
    s.phase = Phase::kIdle;
    throw;
  }
  s.act_peak = std::max(s.act_peak, s.memory->peak(s.device) - s.micro_base);
  s.bwd_ms += ms_between(t1, Clock::now());
  s.loss_sum += scaled.item<double>();
  s.phase = Phase::kBackwarded;
}

bool Engine::step() {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  if (s.phase != Phase::kBackwarded) {
    throw Error("remat::Engine::step: no backward() since the last step(): call backward(loss) on the loss "
                "forward() returned before each step()");
  }
  s.phase = Phase::kIdle;
  if (++micro_steps_ < s.batch.gradient_accumulation_steps) return false;
  micro_steps_ = 0;
  const int64_t step = global_steps_ + 1;
  std::optional<TraceSpan> span(std::in_place, "phase", "optimizer step");
  const auto& tc = config_.train;
  int64_t comm_bytes = 0;
  double opt_ms = 0, grad_norm = -1;
  // A non-finite loss or gradient (DeepSpeed's overflow check): every rank
  // sees the same verdict, so all stop or all skip together. In the same
  // reduction, which parameters got a gradient on any rank.
  const at::Tensor arrivals = s.zero->take_gradient_arrivals();
  at::Tensor checks = at::zeros({2 + arrivals.numel()}, at::kDouble);
  checks[0] = std::isfinite(s.loss_sum) ? 0.0 : 1.0;
  checks[1] = gradients_finite(s.zero->parameters()) ? 0.0 : 1.0;
  checks.narrow(0, 2, arrivals.numel()).copy_(arrivals);
  if (s.world->size() > 1) {
    s.world->allReduce(checks, {ReduceOp::kMax})->wait();
    comm_bytes += checks.nbytes();
  }
  const at::Tensor nonfinite = checks.narrow(0, 0, 2), arrived = checks.narrow(0, 2, arrivals.numel());
  const bool bad_loss = nonfinite[0].item<double>() > 0, bad_grads = nonfinite[1].item<double>() > 0;
  const bool skipped = bad_loss || bad_grads;
  if (skipped) {
    const std::string what = str(bad_loss ? "the loss" : "", bad_loss && bad_grads ? " and " : "",
                                 bad_grads ? "the gradients" : "");
    if (tc.on_nonfinite == "stop") {
      throw Error(str("step ", step, ": ", what, " went non-finite (nan or inf; local loss ", s.loss_sum,
                      "). Stopped before updating or saving anything of this step. "
                      "Lower optimizer.params.lr, set gradient_clipping, or set "
                      "train.on_nonfinite=skip to drop such steps"));
    }
    log_rank0().warn("step {}: {} went non-finite: this step's update is skipped "
                     "(train.on_nonfinite=skip)", step, what);
    s.optimizer->zero_grad();
  } else {
    const auto t_opt = Clock::now();
    const auto unused = leave_unused_alone(*s.zero, *model_, arrived, *s.optimizer);
    if (config_.gradient_clipping > 0) {
      grad_norm = s.zero->clip_grad_norm(config_.gradient_clipping, s.layout->tp_group());
    }
    {
      MemoryCategoryScope state(MemoryCategory::kOptimizerState);
      s.optimizer->step();
    }
    put_back_unused(unused, *s.optimizer);
    // Every rank's parameters read right between steps (stages 1 and 2 gather the stepped shards).
    s.zero->after_step();
    opt_ms = ms_between(t_opt, Clock::now());
  }
  at::Tensor loss_t = at::full({1}, s.loss_sum, at::kDouble);
  const auto& dp_group = s.layout->dp_group();
  if (dp_group->size() > 1) {
    dp_group->allReduce(loss_t, {ReduceOp::kAvg})->wait();
    comm_bytes += loss_t.nbytes();
  }
  const Counters counters = Counters::read(s.zero.get()).since(s.before);
  comm_bytes += counters.comm_bytes();
  if (global_steps_ == 0 && s.regions > 0 && counters.recomputes == 0) {
    throw Error(str("remat::Engine: the checkpointing policy marks ", s.regions, " blocks but none ran as a "
                    "checkpoint region in this step's backward: the model calls its blocks directly. Call each "
                    "block through remat::forward(block, ...) (docs/engine.md, the model contract)"));
  }
  s.step_peak = std::max(s.step_peak, s.memory->peak(s.device));

  StepMetrics m;
  m.step = step;
  m.loss = loss_t.item<double>();
  m.lr = s.lr;
  m.grad_norm = grad_norm;
  m.skipped = skipped;
  m.step_ms = ms_between(s.start, Clock::now());
  m.fwd_ms = s.fwd_ms;
  m.bwd_ms = s.bwd_ms;
  m.opt_ms = opt_ms;
  m.recompute_ms = counters.recompute_ms;
  m.mem_base_bytes = s.base;
  m.mem_peak_bytes = s.step_peak;
  m.mem_act_peak_bytes = s.act_peak;
  m.mem_fwd_held_bytes = s.fwd_held;
  m.ckpt_saved_bytes = s.saved;
  m.ckpt_offloaded_bytes = counters.stored.offloaded_bytes;
  m.ckpt_gathered_bytes = counters.stored.gathered_bytes;
  m.act_offloaded_bytes = counters.offload.offloaded_bytes;
  m.act_restored_bytes = counters.offload.restored_bytes;
  m.act_host_bytes = s.act_host;
  m.act_kept_bytes = s.act_kept;
  m.comm_bytes = comm_bytes;
  m.zero_comm_bytes = counters.zero.collective_bytes();
  m.tp_comm_bytes = counters.tensor_parallel_comm_bytes;
  m.param_bytes = counters.zero.param_bytes;
  m.grad_bytes = counters.zero.grad_bytes;
  m.grad_peak_bytes = counters.zero.peak_grad_bytes;
  m.optimizer_state_bytes = optimizer_state_bytes(*s.optimizer);
  m.peak_gathered_param_bytes = counters.zero.peak_gathered_bytes;
  m.reduce_wait_ms = counters.zero.reduce_wait_ms;
  m.buckets_reduced = counters.zero.buckets_reduced;
  m.buckets_done_in_backward = counters.zero.buckets_done_in_backward;
  if (const auto& plan = s.planner->plan()) {
    m.plan = {{"act_plan", plan->summary()},
              {"act_plan_budget_bytes", plan->budget_bytes},
              {"act_plan_predicted_peak_bytes", plan->predicted_peak},
              {"act_plan_extra_cpu_ms", plan->predicted_extra_cpu_ms},
              {"act_plan_extra_wall_ms", plan->predicted_extra_wall_ms},
              {"act_planned", s.planned}};
    if (plan->device_budget_bytes > 0) {
      m.plan["act_plan_device_budget_bytes"] = plan->device_budget_bytes;
      m.plan["act_plan_predicted_total_peak_bytes"] = plan->predicted_total_peak;
    }
    if (s.planned) m.plan["act_plan_ms"] = s.plan_ms;
  }
  last_metrics_ = std::move(m);
  if (config_.wall_clock_breakdown && (step % config_.steps_per_print == 0 || step == 1)) {
    log_rank0().info("step {} wall clock: forward {:.1f} ms, backward {:.1f} ms (recompute {:.1f}), "
                     "optimizer {:.1f} ms, whole step {:.1f} ms", step, last_metrics_.fwd_ms,
                     last_metrics_.bwd_ms, last_metrics_.recompute_ms, opt_ms, last_metrics_.step_ms);
  }
  // Gradients cleared: the next step starts without them.
  for (auto& p : s.zero->parameters()) p.mutable_grad() = at::Tensor();
  global_steps_ = step;
  s.lr = learning_rate(config_.optimizer, config_.scheduler, global_steps_ + 1);
  span.reset();
  if (s.trace) s.finish_trace(config_, last_metrics_);
  return !skipped;
}

void Engine::trace_memory(const std::string& path, int max_samples) {
  Impl& s = *impl_;
  check_trace_path(path, "remat::Engine::trace_memory");
  if (max_samples < 4) {
    throw ConfigError(str("remat::Engine::trace_memory: max_samples is ", max_samples, ": give at least 4 (the first, "
                          "the last, and the lowest and highest between them)"));
  }
  if (!s.memory->keeps_allocations()) {
    throw ConfigError("remat::Engine::trace_memory: EngineOptions::memory is a MemoryTracker that does not keep its "
                      "allocations, so a timeline cannot split what is live by category: construct it with "
                      "MemoryTrackerOptions::keep_allocations = true, or leave EngineOptions::memory null");
  }
  if (s.trace) {
    throw Error("remat::Engine::trace_memory: a timeline of the step in progress is recording: call it between "
                "steps (after the step() that ends one)");
  }
  s.trace_path = path;
  s.trace_samples = max_samples;
}

struct Engine::EvaluationScope::Guards {
  explicit Guards(std::shared_ptr<Context> context) : scope(std::move(context)) {}
  ContextScope scope;
  at::NoGradGuard no_grad;
};

Engine::EvaluationScope::EvaluationScope(Engine& engine)
    : engine_(engine),
      was_training_(engine.model_->is_training()),
      guards_(std::make_unique<Guards>(engine.impl_->context)) {
  if (engine.impl_->phase == Phase::kForwarded) {
    throw Error("remat::Engine::evaluate: a training forward's loss has not been through backward() yet: "
                "call backward(loss) and step() first");
  }
  engine.model_->eval();
  engine.impl_->zero->begin_forward();
}

Engine::EvaluationScope::~EvaluationScope() {
  try {
    engine_.impl_->zero->end_evaluation();
  } catch (const std::exception& e) {
    log().error("remat::Engine::evaluate: freeing the gathered parameters failed: {}", e.what());
  }
  engine_.model_->train(was_training_);
}

std::string Engine::save_checkpoint(const std::string& dir, const nlohmann::json& client_state) {
  Impl& s = *impl_;
  if (micro_steps_ != 0 || s.phase != Phase::kIdle) {
    throw Error(str("remat::Engine::save_checkpoint: called inside a gradient accumulation window (micro-step ",
                    micro_steps_ + (s.phase == Phase::kIdle ? 0 : 1), " of ", s.batch.gradient_accumulation_steps,
                    "): the gradients of this window are not part of a save. Save after the step() that ends "
                    "the window (is_gradient_accumulation_boundary())"));
  }
  use_save_dir(dir, {});
  ContextScope scope(s.context);  // its RNG tracker is saved
  TrainPosition position;
  position.step = global_steps_;
  position.client_state = client_state.dump();
  save_train_state(dir, position, s.shards(*model_), *s.optimizer, s.identity, *s.world);
  char folder[32];
  std::snprintf(folder, sizeof folder, "step_%08lld", static_cast<long long>(global_steps_));
  return dir + "/" + folder;
}

void Engine::use_save_dir(const std::string& dir, SaveDirOptions options) {
  Impl& s = *impl_;
  if (s.save_lock && s.save_lock_dir == dir) return;
  // Continuing the saves it loaded from (a step folder in `dir`, or `dir`).
  if (!s.loaded_dir.empty() && s.loaded_dir.rfind(dir, 0) == 0) options.resuming = true;
  s.save_lock.reset();
  s.save_lock = std::make_unique<SaveDirLock>(dir, s.identity.run_id, *s.world, options);
  s.save_lock_dir = dir;
}

nlohmann::json Engine::load_checkpoint(const std::string& dir) {
  Impl& s = *impl_;
  if (micro_steps_ != 0 || s.phase != Phase::kIdle) {
    throw Error("remat::Engine::load_checkpoint: called inside a gradient accumulation window: load before "
                "the first forward of a step");
  }
  ContextScope scope(s.context);  // its RNG tracker is restored
  const TrainPosition position = load_train_state(dir, s.shards(*model_), *s.optimizer, s.identity, *s.world);
  global_steps_ = position.step;
  s.zero->after_load();  // the model's parameters from the loaded shards
  s.loaded_dir = dir;
  s.lr = learning_rate(config_.optimizer, config_.scheduler, global_steps_ + 1);
  return nlohmann::json::parse(position.client_state);
}

int64_t Engine::export_model(const std::string& path) {
  if (impl_->phase != Phase::kIdle) {
    throw Error("remat::Engine::export_model: called between forward() and step(): export between steps");
  }
  ContextScope scope(impl_->context);
  return remat::export_model(path, *impl_->zero, *model_, *impl_->world);
}

at::Tensor Engine::parameter(const std::string& name) const {
  for (const auto& item : model_->named_parameters()) {
    if (item.key() != name) continue;
    const at::Tensor& p = item.value();
    if (p.numel() > 0 && p.storage().nbytes() == 0) {
      throw Error(str("remat::Engine::parameter: '", name, "' is sharded by ZeRO stage 3 and not gathered here "
                      "(its storage is empty between uses): read it inside a remat::GatheredParameters scope"));
    }
    return p;
  }
  throw Error(str("remat::Engine::parameter: the model has no parameter '", name, "'"));
}

std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, Config config, EngineOptions options) {
  REMAT_CHECK(model != nullptr, "remat::initialize: the model is null");
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    if (!live_models().insert(model.get()).second) {
      throw Error(str("remat::initialize: this model (", module_type(*model), ") is already trained by another "
                      "live engine: one engine per model (destroy the first engine, or build a second model)"));
    }
  }
  try {
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& p = item.value();
      if (p.numel() > 0 && p.has_storage() && p.storage().nbytes() == 0) {
        throw ConfigError(str("remat::initialize: parameter '", item.key(), "' has no storage (", p.numel(),
                              " elements): the model is still sharded by a ZeRO stage 3 that was not gathered "
                              "back. Give initialize a model whose parameters hold their values"));
      }
    }
    if (!options.overrides.empty()) {
      config = parse_config(config.to_json(), "<the config given to initialize>", options.overrides);
    }
    return std::unique_ptr<Engine>(new Engine(model, std::move(config), std::move(options)));
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    live_models().erase(model.get());
    throw;
  }
}

std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, const std::string& config,
                                   EngineOptions options) {
  const auto first = config.find_first_not_of(" \t\r\n");
  std::vector<std::string> overrides = std::move(options.overrides);
  options.overrides.clear();
  Config parsed = first != std::string::npos && config[first] == '{'
                      ? parse_config(config, "<JSON text given to initialize>", overrides)
                      : load_config(config, overrides);
  return initialize(std::move(model), std::move(parsed), std::move(options));
}

std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, const nlohmann::json& config,
                                   EngineOptions options) {
  REMAT_CHECK(config.is_object(), "remat::initialize: the JSON config must be an object (got ", config.type_name(),
              ")");
  return initialize(std::move(model), config.dump(), std::move(options));
}

GatheredParameters::GatheredParameters(Engine& engine, bool modify) : engine_(engine), modify_(modify) {
  auto& s = engine.impl();
  if (s.phase == Phase::kForwarded) {
    throw Error("remat::GatheredParameters: a training forward's loss has not been through backward() yet: "
                "open the scope between steps");
  }
  // Parameters gathered on use (stage 3) get their whole values for the
  // scope; the other stages hold them whole already.
  {
    ContextScope scope(s.context);
    auto whole = s.zero->install_whole_parameters(/*as_computed=*/true, /*keep_values=*/modify);
    restore_ = std::move(whole.restore);
    installed_ = std::move(whole.values);
  }
  ++s.gathered_scopes;
}

GatheredParameters::~GatheredParameters() noexcept(false) {
  auto& s = engine_.impl();
  --s.gathered_scopes;
  std::map<std::string, at::Tensor> edited;
  if (modify_) {
    for (const auto& item : engine_.module().named_parameters()) edited[item.key()] = item.value().detach().clone();
  }
  for (auto& [p, data] : restore_) p.set_data(data);
  if (!modify_ || std::uncaught_exceptions() > 0) return;
  ContextScope scope(s.context);
  s.zero->write_back_parameters(std::move(edited), installed_);
}

}  // namespace remat
