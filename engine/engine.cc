#include "engine/engine.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "engine/export.h"
#include "engine/internal/decisions.h"
#include "engine/internal/engine_impl.h"
#include "engine/internal/step_meter.h"
#include "engine/internal/unused_parameters.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "engine/step_counters.h"
#include "engine/save/dir_lock.h"
#include "engine/save/storage.h"
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
#include "runtime/output_file.h"
#include "runtime/runtime.h"
namespace remat {
namespace {

using internal::Phase;

bool gradients_finite(const std::vector<at::Tensor>& parameters) {
  // Host tensors apart (offload_param's shards beside the persistent parameters on a device).
  std::vector<at::Tensor> checks, host;
  for (const auto& p : parameters) {
    if (p.grad().defined() && p.grad().numel() > 0) {
      at::Tensor finite = at::isfinite(p.grad()).all();
      (finite.is_cpu() ? host : checks).push_back(finite);
    }
  }
  for (const auto* group : {&checks, &host}) {
    if (!group->empty() && !at::stack(*group).all().item<bool>()) return false;
  }
  return true;
}

}  // namespace

const ParallelLayout& Engine::layout() const { return *impl_->layout; }
torch::optim::Optimizer& Engine::optimizer() const { return *impl_->optimizer; }
parallel::ZeroModel& Engine::sharding() const { return *impl_->zero; }
const std::shared_ptr<Context>& Engine::context() const { return impl_->context; }
at::Device Engine::device() const { return impl_->placed; }

at::Tensor Engine::to_device(const at::Tensor& t) const {
  if (!t.defined() || t.device() == impl_->placed) return t;
  return t.to(impl_->placed, /*non_blocking=*/t.is_pinned());
}

std::vector<at::Tensor> Engine::to_device(const std::vector<at::Tensor>& tensors) const {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(to_device(t));
  return out;
}

bool Engine::is_gradient_accumulation_boundary() const {
  return micro_steps_ + 1 >= impl_->batch.gradient_accumulation_steps;
}

double Engine::get_lr() const { return impl_->lr; }

double Engine::next_learning_rate() const {
  return optim::learning_rate(config_.optimizer, config_.scheduler, global_steps_ - skipped_steps_ + 1);
}

const MicroBatchSearch* Engine::micro_batch_search() const { return impl_->search ? &*impl_->search : nullptr; }

at::Tensor Engine::forward(const std::function<at::Tensor()>& fn, const std::vector<int64_t>& plan_key) {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  s.check_forward_order();
  if (micro_steps_ == 0) {
    // The first micro-step of an optimizer step.
    s.lr = next_learning_rate();
    optim::set_learning_rate(*s.optimizer, s.lr);
    if (s.auto_plan) s.plan_blocks(*model_, config_, fn, plan_key);
    // Gradients set to none, as LibTorch 2.x's zero_grad does. Before the
    // base is read: the last step's gradients are not this step's memory.
    s.zero->zero_grad();
    s.zero->take_gradient_arrivals();  // a profiling step's are not this step's
    s.meter.begin_step();
    s.loss_sum = 0;
  }
  s.meter.begin_forward();
  at::Tensor loss = s.run_forward(*model_, config_, fn);
  s.meter.end_forward();
  s.phase = Phase::kForwarded;
  return loss;
}

void Engine::Impl::check_forward_order() const {
  if (phase == Phase::kForwarded) {
    throw Error("remat::Engine::forward: the previous forward's loss has not been through backward(): call "
                "backward(loss) after each forward (for a forward without backward, use evaluate())");
  }
  if (phase == Phase::kBackwarded) {
    throw Error("remat::Engine::forward: step() was not called after the last backward(): call step() after "
                "every backward (it steps the optimizer only at the accumulation boundary)");
  }
  REMAT_CHECK(gathered_scopes == 0, "remat::Engine::forward inside a GatheredParameters scope: end the scope "
              "first (a training forward gathers and frees the parameters itself)");
}

// variant auto: the blocks planned for this plan key (a profiling run of
// `fn` when the key is new).
void Engine::Impl::plan_blocks(torch::nn::Module& model, const Config& config, const std::function<at::Tensor()>& fn,
                               const std::vector<int64_t>& plan_key) {
  // One forward and backward of this micro-batch per profiling run, scaled
  // as backward() scales it (the same tensors as the step's); the planner
  // puts the RNG back, the gradients are dropped by forward().
  auto profile_step = [&] {
    forward_backward(model, config, fn, static_cast<double>(batch.gradient_accumulation_steps));
  };
  meter.begin_planning();
  if (device_budget_bytes) {
    auto [state, what] = internal::resident_state(model, *zero, *optimizer, batch.gradient_accumulation_steps,
                                                  device == c10::DeviceType::CPU, memory->current(device));
    planner->set_state_bytes(state, std::move(what));
  }
  const bool planned = planner->ensure(plan_key, profile_step);
  meter.end_planning(planned);
  if (planned) {
    const auto& choices = planner->plan()->choices;
    regions = static_cast<int>(std::count_if(choices.begin(), choices.end(), [](BlockChoice c) {
      return c != BlockChoice::kKeep && c != BlockChoice::kOffloadActivations;
    }));
  }
}

void Engine::Impl::forward_backward(torch::nn::Module& model, const Config& config,
                                    const std::function<at::Tensor()>& fn, double divide_by) {
  zero->begin_forward();
  std::unique_ptr<OffloadActivations> offload;
  if (config.activation_offloading.enabled) {
    offload = std::make_unique<OffloadActivations>(config.activation_offloading, &model);
  }
  at::Tensor loss = zero->finish_forward(fn());
  offload.reset();
  zero->begin_backward(/*synchronize=*/true);
  (loss / divide_by).backward();
  zero->finish_backward(/*synchronize=*/true);
}

// The model's forward under the sharding and activation offloading.
// The user's forward. A forward that mixes devices (a batch left on the CPU
// with the model on a GPU) fails in LibTorch's first kernel that sees both:
// that error is the user's to fix in the loop, so it says where the model is
// and how a batch gets there.
at::Tensor Engine::Impl::call_forward(const std::function<at::Tensor()>& fn) const {
  try {
    return fn();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (what.find("Expected all tensors to be on the same device") == std::string::npos &&
        what.find("is not on the expected device") == std::string::npos) {
      throw;
    }
    throw Error(str("remat::Engine::forward: the forward mixed devices (", what.substr(0, what.find('\n')),
                    "); the model is on ", placed.str(),
                    ": move each batch, and every tensor the forward takes from outside, with "
                    "engine->to_device(t) (docs/engine.md, \"The device\")"));
  }
}

at::Tensor Engine::Impl::run_forward(torch::nn::Module& model, const Config& config,
                                     const std::function<at::Tensor()>& fn) {
  // On a memory trace: what the forward allocates (and no scope below
  // claims) is the activations autograd keeps.
  TraceSpan span("phase", "forward");
  MemoryCategoryScope activations(MemoryCategory::kSavedActivations);
  zero->begin_forward();
  std::unique_ptr<OffloadActivations> offload;
  try {
    if (config.activation_offloading.enabled) {
      offload = std::make_unique<OffloadActivations>(config.activation_offloading, &model);
    }
    at::Tensor loss = call_forward(fn);
    if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
      throw Error(str("remat::Engine::forward: the function must return the loss, a one-element tensor that "
                      "requires grad (got ",
                      loss.defined() ? str(loss.sizes(), loss.requires_grad() ? "" : ", not requiring grad")
                                     : std::string("an undefined tensor"),
                      "); for a forward without backward, use evaluate()"));
    }
    return zero->finish_forward(loss);
  } catch (...) {
    // Whatever the forward left gathered is freed; the next forward starts
    // clean (its regions and graph die with the exception's stack).
    offload.reset();
    zero->end_evaluation();
    throw;
  }
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
  s.meter.begin_backward();
  try {
    TraceSpan span("phase", "backward");
    s.zero->begin_backward(/*synchronize=*/boundary);
    (s.loss_scaling ? s.loss_scaling->scale_loss(scaled) : scaled).backward();
    s.zero->finish_backward(/*synchronize=*/boundary);
    s.meter.end_backward();
  } catch (...) {
    // The accumulation window is dropped (its gradients and partial
    // reductions with it): the next forward starts a new one.
    s.zero->abandon_backward();
    micro_steps_ = 0;
    s.phase = Phase::kIdle;
    throw;
  }
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
  double grad_norm = -1;
  const Impl::Verdict verdict = s.check_gradients();
  const bool skipped = s.skip_step(step, verdict, config_);
  if (!skipped) grad_norm = s.update(*model_, config_, verdict.arrived);
  const double loss = s.mean_loss();
  const Counters& counters = s.meter.read_counters();
  if (global_steps_ == 0 && s.regions > 0 && counters.recomputes == 0) {
    throw Error(str("remat::Engine: the checkpointing policy marks ", s.regions, " blocks but none ran as a "
                    "checkpoint region in this step's backward: the model calls its blocks directly. Call each "
                    "block through remat::forward(block, ...) (docs/engine.md, the model contract)"));
  }
  const auto& plan = s.planner->plan();
  last_metrics_ = s.meter.finish_step({step, loss, s.lr, grad_norm, skipped}, plan ? &*plan : nullptr);
  if (s.loss_scaling) {
    last_metrics_.loss_scale = s.loss_scaling->last().used_scale;
    last_metrics_.overflows = s.loss_scaling->overflows();
  }
  const StepMetrics& m = last_metrics_;
  if (config_.wall_clock_breakdown && (step % config_.steps_per_print == 0 || step == 1)) {
    log_rank0().info("step {} wall clock: forward {:.1f} ms, backward {:.1f} ms (recompute {:.1f}), "
                     "optimizer {:.1f} ms, whole step {:.1f} ms", step, m.fwd_ms, m.bwd_ms, m.counters.value("recompute_ms", 0.0),
                     m.opt_ms, m.step_ms);
  }
  // Gradients cleared: the next step starts without them.
  s.zero->zero_grad();
  global_steps_ = step;
  if (skipped) ++skipped_steps_;
  s.lr = next_learning_rate();
  span.reset();
  s.meter.finish_trace(last_metrics_);
  return !skipped;
}

// A non-finite loss or gradient (DeepSpeed's overflow check): every rank
// sees the same verdict, so all stop or all skip together. In the same
// reduction, which parameters got a gradient on any rank.
Engine::Impl::Verdict Engine::Impl::check_gradients() {
  const at::Tensor arrivals = zero->take_gradient_arrivals();
  // On the model's device, as the gradients it checks: the backend takes them.
  at::Tensor checks = at::zeros({2 + arrivals.numel()}, at::TensorOptions().dtype(at::kDouble).device(placed));
  checks[0] = std::isfinite(loss_sum) ? 0.0 : 1.0;
  checks[1] = gradients_finite(zero->parameters()) ? 0.0 : 1.0;
  checks.narrow(0, 2, arrivals.numel()).copy_(arrivals);
  if (world->size() > 1) {
    world->allReduce(checks, {ReduceOp::kMax})->wait();
    meter.count_comm(checks.nbytes());
  }
  const at::Tensor nonfinite = checks.narrow(0, 0, 2);
  Verdict verdict;
  verdict.arrived = checks.narrow(0, 2, arrivals.numel());
  verdict.bad_loss = nonfinite[0].item<double>() > 0;
  verdict.bad_grads = nonfinite[1].item<double>() > 0;
  return verdict;
}

bool Engine::Impl::skip_step(int64_t step, const Verdict& verdict, const Config& config) {
  const bool bad_loss = verdict.bad_loss, bad_grads = verdict.bad_grads;
  if (loss_scaling) {
    // fp16: a non-finite step is an overflow of the scale (train.on_nonfinite does not apply).
    const auto update = loss_scaling->record(step, bad_loss || bad_grads);
    if (update.skip) {
      optimizer->zero_grad();
    } else {
      internal::LossScaling::unscale(zero->parameters(), update.used_scale);
    }
    return update.skip;
  }
  if (!bad_loss && !bad_grads) return false;
  const std::string what = str(bad_loss ? "the loss" : "", bad_loss && bad_grads ? " and " : "",
                               bad_grads ? "the gradients" : "");
  if (config.train.on_nonfinite == "stop") {
    throw Error(str("step ", step, ": ", what, " went non-finite (nan or inf; local loss ", loss_sum,
                    "). Stopped before updating or saving anything of this step. "
                    "Lower optimizer.params.lr, set gradient_clipping, or set "
                    "train.on_nonfinite=skip to drop such steps"));
  }
  log_rank0().warn("step {}: {} went non-finite: this step's update is skipped "
                   "(train.on_nonfinite=skip)", step, what);
  optimizer->zero_grad();
  return true;
}

// The optimizer step over the parameters some rank gave a gradient; returns
// the gradient norm before clipping (-1: clipping is off).
double Engine::Impl::update(torch::nn::Module& model, const Config& config, const at::Tensor& arrived) {
  double grad_norm = -1;
  meter.begin_optimizer();
  const auto unused = internal::leave_unused_alone(*zero, model, arrived, *optimizer);
  if (config.gradient_clipping > 0) {
    grad_norm = zero->clip_grad_norm(config.gradient_clipping, layout->tp_group());
  }
  {
    MemoryCategoryScope state(MemoryCategory::kOptimizerState);
    try {
      optimizer->step();
    } catch (const std::runtime_error& e) {
      // A rate so large that the update's scalar (AdamW's lr / (1 - beta1^t))
      // leaves float: c10's checked conversion throws a message naming no setting.
      const std::string what = e.what();
      if (what.find("cannot be converted to type") == std::string::npos) throw;
      throw ConfigError(str("the optimizer step at learning rate ", lr, " overflows the parameters' arithmetic (",
                            what, "): lower optimizer.params.lr (and the scheduler's warmup_max_lr)"));
    }
  }
  internal::put_back_unused(unused, *optimizer);
  // Every rank's parameters read right between steps (stages 1 and 2 gather the stepped shards).
  zero->after_step();
  meter.end_optimizer();
  return grad_norm;
}

// The step's loss: the mean over micro-steps (summed already) and data-parallel ranks.
double Engine::Impl::mean_loss() {
  at::Tensor loss_t = at::full({1}, loss_sum, at::TensorOptions().dtype(at::kDouble).device(placed));
  const auto& dp_group = layout->dp_group();
  if (dp_group->size() > 1) {
    dp_group->allReduce(loss_t, {ReduceOp::kAvg})->wait();
    meter.count_comm(loss_t.nbytes());
  }
  return loss_t.item<double>();
}

namespace {

// An output of the engine's (`flag`) must not land in the saves it keeps or
// loaded (`loaded`: a save root, or a step folder in one).
void check_spares_saves(const std::string& flag, const std::string& path, const std::string& save_dir,
                        std::string loaded) {
  if (!loaded.empty() && save::step_of(std::filesystem::path(loaded).lexically_normal().filename().string()) >= 0) {
    loaded = save::root_of(loaded);
  }
  check_outputs_spare_inputs({{flag, path}},
                             {{"the save folder", save_dir, true, "which holds this run's saves and their lock",
                               save_folder_entries()},
                              {"the save loaded from", loaded, true, "the save this run resumed",
                               save_folder_entries()}});
}

}  // namespace

void Engine::trace_memory(const std::string& path, int max_samples) {
  Impl& s = *impl_;
  check_spares_saves("remat::Engine::trace_memory", path, s.save_lock_dir, s.loaded_dir);
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
  if (s.meter.recording()) {
    throw Error("remat::Engine::trace_memory: a timeline of the step in progress is recording: call it between "
                "steps (after the step() that ends one)");
  }
  s.meter.record_next_step(path, max_samples);
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
  position.skipped_steps = skipped_steps_;
  position.client_state = client_state.dump();
  if (s.loss_scaling) position.loss_scaler = s.loss_scaling->save();
  position.decisions = internal::decisions_json(config_, s.batch, s.layout->dims().dp, s.device_budget_bytes,
                                                s.search ? &*s.search : nullptr);
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
  skipped_steps_ = position.skipped_steps;
  s.zero->after_load();  // the model's parameters from the loaded shards
  if (s.loss_scaling && !position.loss_scaler.empty()) {
    s.loss_scaling->load(position.loss_scaler);
  } else if (s.loss_scaling) {
    log_rank0().info("the save in '{}' holds no fp16 loss scaler state: the scale starts at {}", dir,
                     s.loss_scaling->scale());
  }
  if (const std::string change = internal::batch_change(position.decisions, s.batch, s.layout->dims().dp);
      !change.empty()) {
    log_rank0().warn("{}", change);
  }
  s.loaded_dir = dir;
  s.lr = next_learning_rate();
  if (const int64_t k = config_.scheduler.last_batch_iteration; k != -1 && config_.scheduler.type != "none") {
    log_rank0().info("scheduler.params.last_batch_iteration = {}: the schedule goes on from the save's step {} "
                     "shifted by {} steps (as in the run that saved it, if it had this value: saves do not "
                     "record it)", k, global_steps_, k + 1);
  }
  return nlohmann::json::parse(position.client_state);
}

int64_t Engine::export_model(const std::string& path) {
  if (impl_->phase != Phase::kIdle) {
    throw Error("remat::Engine::export_model: called between forward() and step(): export between steps");
  }
  check_spares_saves("remat::Engine::export_model", path, impl_->save_lock_dir, impl_->loaded_dir);
  ContextScope scope(impl_->context);
  return remat::export_model(path, *impl_->zero, *model_, *impl_->world, export_dtype());
}

at::ScalarType Engine::export_dtype() const {
  if (!config_.deepspeed_tuning.gather_16bit_weights_on_model_save) return at::kFloat;
  return config_.bf16.enabled ? at::kBFloat16 : config_.fp16.enabled ? at::kHalf : at::kFloat;
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
