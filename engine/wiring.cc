// initialize(), init_distributed() and the Engine's construction: the
// wiring of the floors below for a model, in its documented order (engine.h),
// and its undoing in the destructor.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "engine/auto_values.h"
#include "engine/engine.h"
#include "engine/internal/device.h"
#include "engine/internal/engine_impl.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "optim/options.h"
#include "nn/saved_tensors_hooks.h"
#include "parallel/layers.h"
#include "parallel/nvme_optimizer.h"
#include "parallel/nvme_tensor_file.h"
#include "parallel/zero.h"
#include "rng/rng_tracker.h"
#include "runtime/agreement.h"
#include "runtime/communicator.h"
#include "runtime/context.h"
#include "runtime/device_memory.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/outcome.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

using internal::Phase;

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

// The config's "auto" values still open (a caller such as remat-train may
// have decided them), from the device this rank trains on. An "auto"
// micro-batch that only a measurement gives (EngineOptions::micro_batch) is
// left to decide_micro_batch, after the wiring it is measured through.
// Whether it was left.
bool decide_autos(Config& c, at::Device device, int dp, bool measurable) {
  const bool cuda = device.is_cuda();
  decide_precision_autos(c, device.str(), cuda, cuda && cuda_computes_bf16(device.has_index() ? device.index() : 0));
  const bool measured = measurable && c.is_undecided_auto("train_micro_batch_size_per_gpu") &&
                        !(c.train_batch_size && c.gradient_accumulation_steps);
  if (!measured) decide_batch_autos(c, dp);
  return measured;
}

// Every rank runs what the others run: ranks configured differently would
// hang in a collective only some of them make, or train diverging replicas.
void require_same_config(Communicator& world, const Config& config, at::Device device) {
  std::map<std::string, std::string> settings;
  // train.device auto resolves on each rank: a job whose ranks train on
  // different kinds of device could not reduce their gradients together.
  settings["the device type this rank trains on (train.device resolved)"] = c10::DeviceTypeName(device.type(), true);
  const nlohmann::json flat = nlohmann::json::parse(config.to_json()).flatten();
  for (const auto& item : flat.items()) {
    std::string key = item.key().substr(1);
    std::replace(key.begin(), key.end(), '/', '.');
    // A value remat decided from "auto" on each rank (the micro-batch from the
    // memory each rank has) differs where the ranks' devices do: say so.
    if (config.is_auto(key)) {
      key += " (\"auto\", decided by each rank from its own device and memory: give it a number in the config)";
    }
    settings[key] = item.value().dump();
  }
  require_same_settings(world, settings, "configurations");
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

}  // namespace

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
  s.wire_memory();
  s.wire_layout(config_);
  s.wire_device(*model_, config_);
  const int dp = s.layout->dims().dp;
  const bool measured = decide_autos(config_, s.placed, dp, static_cast<bool>(s.options.micro_batch.loss));
  require_same_config(*s.world, config_, s.placed);
  warn_ineffective(config_);
  if (!measured) s.batch = config_.resolve_batch(dp);
  torch::nn::Module& model = *model_;
  model_parallel_manual_seed(static_cast<uint64_t>(config_.train.seed), *s.layout);
  // fp16: refused here where the device cannot compute it, before anything is wired.
  if (config_.fp16.enabled) {
    s.loss_scaling = internal::wire_loss_scaling(config_.fp16, s.placed, s.options.fp16_scaler_at_float32);
  }
  const auto params = model.parameters();
  s.trains = std::any_of(params.begin(), params.end(), [](const at::Tensor& p) { return p.requires_grad(); });
  const auto sharded = parallel::sharded_parameters(model);
  const std::string blocks = block_path(model, s.options.blocks);
  auto block_list = find_block_list(model, blocks);
  s.wire_checkpointing(model, config_, blocks, static_cast<int64_t>(block_list->size()));
  s.wire_sharding(model, config_, *block_list, sharded);
  if (measured) s.decide_micro_batch(model, config_);
  for (const auto& line : auto_lines(config_)) log_rank0().info("{}", line);
  s.check_device_budget(model);
  s.wire_identity(model, config_);
  s.wire_meter(model, config_);
  s.lr = optim::learning_rate(config_.optimizer, config_.scheduler, 1);
}

// The memory metrics' tracker: the caller's, or the engine's own.
void Engine::Impl::wire_memory() {
  if (options.memory) {
    memory = options.memory;
  } else {
    MemoryTrackerOptions tracking;
    tracking.keep_allocations = true;  // what trace_memory starts from
    own_memory = std::make_unique<MemoryTracker>(tracking);
    memory = own_memory.get();
  }
}

void Engine::Impl::wire_layout(const Config& config) {
  layout = options.layout ? options.layout : init_distributed(config, options.backend);
  world = layout->world();
  if (layout->dims().tp != config.tensor_parallel.size) {
    throw ConfigError(str("remat::initialize: tensor_parallel.size is ", config.tensor_parallel.size,
                          " but the layout given in EngineOptions::layout has tensor-parallel size ",
                          layout->dims().tp, ": build the layout with init_distributed(config) from the "
                          "same config"));
  }
}

namespace {

// device_memory_budget_bytes "auto": the budget of the device the model's
// parameters are on (the CPU without any), logged on rank 0.
void resolve_device_budget(torch::nn::Module& model, MemoryBudget& budget) {
  c10::Device device(c10::DeviceType::CPU);
  for (const auto& p : model.parameters()) {
    device = p.device();
    break;
  }
  const DeviceBudget b = auto_device_budget(device, "activation_checkpointing.device_memory_budget_bytes");
  log_rank0().info("device_memory_budget_bytes auto ({}): {}", device.str(), b.text());
  budget.device_memory_budget_bytes = b.budget;
  budget.device_memory_budget_auto = false;
}

}  // namespace

// The config's activation_checkpointing section becomes the defaults every
// region starts from. Regions are timed whatever its profile key says: the
// recompute time goes into the metrics. Non-reentrant regions and
// activation offloading answer autograd's saved-tensor hooks query through
// remat's engine: installed before any backward.
void Engine::Impl::wire_checkpointing(torch::nn::Module& model, const Config& config, const std::string& blocks,
                                      int64_t n_blocks) {
  install_saved_tensors_hooks_engine();
  ActivationCheckpointingOptions checkpointing = config.activation_checkpointing;
  checkpointing.profile = true;
  if (config.tensor_parallel.sequence_parallel_active() && checkpointing.partition_activations) {
    // A region's input is this rank's own chunk of the sequence, different on
    // every rank of the group: splitting it again and gathering the pieces
    // would rebuild another rank's chunk.
    checkpointing.partition_activations = false;
    log_rank0().info("activation_checkpointing.partition_activations is not applied with "
                     "tensor_parallel.sequence_parallel: each region already keeps 1/{} of its input "
                     "(its own tokens), with no all-gather in the recompute", config.tensor_parallel.size);
  }
  configure_checkpointing(checkpointing, layout.get());
  policy = PolicyOptions(config.activation_checkpointing);
  policy.blocks = blocks;
  // variant auto: planned from a profiling step at the first step (and again
  // for every new plan key).
  auto_plan = policy.variant == CheckpointVariant::kAuto;
  regions = auto_plan ? 0 : apply_activation_checkpointing(model, policy);
  PlannerOptions planner_options;
  planner_options.blocks = blocks;
  static_cast<MemoryBudget&>(planner_options) = config.activation_checkpointing;
  if (auto_plan && planner_options.device_memory_budget_auto) resolve_device_budget(model, planner_options);
  device_budget_bytes = planner_options.device_memory_budget_bytes;
  planner_options.offload = config.activation_offloading;
  planner_options.report_dir = options.plan_report_dir;
  // A budget the model cannot be planned for (the knee of one block) stops the run here.
  if (auto_plan) check_planner_options(model, planner_options);
  planner = std::make_unique<ActivationPlanner>(model, planner_options, world.get());
  // Activation offloading: each forward runs inside a scope; the head stays.
  prepare_output_head(model, config.activation_offloading);
  const auto& number_checkpoints = config.activation_checkpointing.number_checkpoints;
  // The planner profiles every block as a region: each may need a slot.
  if (auto_plan && number_checkpoints && *number_checkpoints < n_blocks) {
    throw ConfigError(str("activation_checkpointing.variant is auto, which may checkpoint every block, but "
                          "number_checkpoints is ", *number_checkpoints, ": set number_checkpoints to the "
                          "number of blocks (", n_blocks, ")",
                          config.activation_checkpointing.contiguous_memory_optimization ? "" : " or leave it out"));
  }
  if (number_checkpoints && regions > *number_checkpoints) {
    throw ConfigError(str("activation_checkpointing.number_checkpoints is ", *number_checkpoints,
                          " but the policy marks ", regions, " regions per forward: set it to ", regions,
                          " (or leave it out)"));
  }
}

at::Device training_device(const Config& config, const std::string& spec) {
  const bool given = !spec.empty();
  return internal::resolve_device(given ? spec : config.train.device, Runtime::init().env().local_rank,
                                  internal::visible_cuda_devices(), given ? "EngineOptions::device" : "train.device");
}

void check_fp16_device(const Config& config, at::Device device) {
  if (!config.fp16.enabled) return;
  if (const std::string refusal = internal::fp16_refusal(device); !refusal.empty()) throw ConfigError(refusal);
}

// The device of this rank (train.device, or EngineOptions::device), the
// model placed there before anything records its parameters: the
// sharding's flat buffers, the optimizer's state and the meter all follow
// the parameters' device. Every rank learns of one rank's failure.
void Engine::Impl::wire_device(torch::nn::Module& model, const Config& config) {
  agree_on_outcome(*world, "placing the model on its device", [&] {
    placed = training_device(config, options.device);
    internal::make_current(placed);
    internal::place_model(model, placed);
  });
  device = placed.type();
}

namespace {

// The NVMe offloads' files (parallel/nvme_tensor_file.h): each rank's folders
// opened and locked before any collective of ZeroModel's, so that a problem
// on one rank stops every rank here. Without nvme_path, ZeroModel's check of
// its options says what is missing.
parallel::NvmeFiles open_nvme_files(const parallel::ZeroOptions& z, const std::shared_ptr<Communicator>& ranks) {
  Communicator& world = *ranks;
  parallel::NvmeFiles files;
  files.ranks = ranks;  // every rank of the job stops when one cannot place its tensors
  const std::string params_path = z.offload_param.nvme_path.value_or("");
  const std::string masters_path = z.offload_optimizer.nvme_path.value_or("");
  const bool params = z.stage == 3 && z.offload_param.on_nvme() && !params_path.empty();
  const bool masters = z.stage > 0 && z.offload_optimizer.on_nvme() && !masters_path.empty();
  if (!params && !masters) return files;
  agree_on_outcome(world, "opening the NVMe offload's files", [&] {
    if (params) {
      files.parameters = std::make_shared<parallel::NvmeTensorFile>(
          parallel::NvmeTensorFileOptions{params_path, world.rank(), z.offload_param.max_in_cpu, "offload_param",
                                          world.size()});
    }
    if (masters) {
      files.masters = std::make_shared<parallel::NvmeTensorFile>(
          parallel::NvmeTensorFileOptions{masters_path, world.rank(), 0, "offload_optimizer", world.size()});
    }
  });
  return files;
}

}  // namespace

// Sharding over the data-parallel group; the optimizer steps what the
// sharding hands it.
void Engine::Impl::wire_sharding(torch::nn::Module& model, const Config& config,
                                 const torch::nn::ModuleListImpl& blocks, const std::vector<at::Tensor>& sharded) {
  std::vector<std::shared_ptr<torch::nn::Module>> units(blocks.begin(), blocks.end());
  parallel::ZeroOptions zero_options = config.zero_optimization;
  zero_options.progress_in_hooks = knobs::reduce_progress_in_hooks();
  // bf16 or fp16 compute copies (fp16's loss scaler is wired before, in
  // wire_loss_scaling; its test seam keeps float32 compute).
  const bool fp16 = config.fp16.enabled && !options.fp16_scaler_at_float32;
  const parallel::MixedPrecision mixed = parallel::mixed_precision(config.bf16, fp16);
  zero = std::make_unique<parallel::ZeroModel>(model, units, layout->dp_group(), zero_options, mixed, sharded,
                                               open_nvme_files(zero_options, world));
  if (zero_options.offload_optimizer.on_nvme()) {
    if (options.optimizer) {
      throw ConfigError("zero_optimization.offload_optimizer.device \"nvme\" keeps remat's Adam state on disk, and "
                        "EngineOptions::optimizer gives an optimizer of its own: leave EngineOptions::optimizer "
                        "unset (optimizer.type chooses AdamW or Adam), or use offload_optimizer.device \"cpu\"");
    }
    agree_on_outcome(*world, "opening the NVMe optimizer state", [&] {
      parallel::NvmeOptimizerOptions nvme;
      nvme.nvme_path = config.zero_optimization.offload_optimizer.nvme_path.value_or("");
      nvme.rank = world->rank();
      nvme.world_size = world->size();
      nvme.sub_group_size = config.deepspeed_tuning.sub_group_size.value_or(nvme.sub_group_size);
      nvme.buffer_count = config.zero_optimization.offload_optimizer.buffer_count;
      nvme.io = config.aio.options();
      optimizer = parallel::make_nvme_optimizer(config.optimizer, zero->parameters(), nvme);
    });
  } else {
    optimizer = options.optimizer ? options.optimizer(zero->parameters())
                                  : optim::make_optimizer(config.optimizer, zero->parameters());
  }
  REMAT_CHECK(optimizer != nullptr, "remat::initialize: EngineOptions::optimizer returned no optimizer");
}

// A whole-device budget the model state alone fills is refused before any
// step (the state held between micro-batches follows the batch).
void Engine::Impl::check_device_budget(torch::nn::Module& model) {
  const auto& budget = device_budget_bytes;
  if (!budget || !auto_plan) return;
  const auto [state, what] = internal::resident_state(model, *zero, *optimizer, batch.gradient_accumulation_steps,
                                                      device == c10::DeviceType::CPU);
  if (*budget <= state) {
    throw ConfigError(str("activation_checkpointing.device_memory_budget_bytes = ", *budget,
                          " is below the model state alone: ", what, " = ", state, " bytes per rank, before any "
                          "activation. Raise the budget above that, or shard the state (a higher "
                          "zero_optimization.stage, more data-parallel ranks)"));
  }
}

// Every setting the saved state's meaning depends on: a resume with
// another value is refused naming it. train.seed: the random state comes
// from the save, but a caller's data order may come from the seed. (The
// tensor-parallel size is not one: a save is re-sliced for another.)
void Engine::Impl::wire_identity(torch::nn::Module& model, const Config& config) {
  identity.model_signature = options.model_signature;
  identity.run_id = new_run_id(*world);
  identity.settings = {{"optimizer.type", optim::optimizer_name(*optimizer)},
                       {"train.seed", std::to_string(config.train.seed)}};
  identity.seed = static_cast<uint64_t>(config.train.seed);
  for (const auto& item : model.named_parameters()) {
    identity.parameters.emplace_back(item.key(), item.value().sizes().vec());
  }
}

void Engine::Impl::wire_meter(torch::nn::Module& model, const Config& config) {
  internal::StepMeterTargets targets;
  targets.memory = memory;
  targets.device = device;
  targets.model = &model;
  targets.zero = zero.get();
  targets.optimizer = optimizer.get();
  targets.offload_param = config.zero_optimization.offload_param.enabled();
  targets.nvme_parameters = config.zero_optimization.stage == 3 && config.zero_optimization.offload_param.on_nvme();
  targets.rank = world->rank();
  targets.trace_labels = {{"rank", world->rank()},
                          {"device", c10::DeviceTypeName(device, /*lower_case=*/true)},
                          {"zero_stage", zero->stage()},
                          {"activation_checkpointing",
                           checkpoint_variant_name(config.activation_checkpointing.variant)},
                          {"gradient_accumulation_steps", batch.gradient_accumulation_steps}};
  meter.attach(std::move(targets));
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
    std::map<const void*, std::string> first_name;  // each parameter's first state-dict name
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& p = item.value();
      const auto [first, fresh] = first_name.emplace(p.unsafeGetTensorImpl(), item.key());
      if (!fresh) {
        throw ConfigError(str("remat::initialize: parameter '", item.key(), "' is the same tensor as '",
                              first->second, "' (one parameter registered under two names, e.g. tied "
                              "embeddings): the optimizer, the sharding and the saves take each name for a "
                              "parameter of its own, which would train it twice over. Register it once and use it "
                              "in both places in the forward (e.g. the head computes at::linear(h, "
                              "embed->weight))"));
      }
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

}  // namespace remat
