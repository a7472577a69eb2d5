// The engine's state in and out, between steps: saves (written, loaded,
// their folder's lock), the exported model, memory traces, evaluation and
// the scope that gathers the parameters.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "engine/engine.h"
#include "engine/export.h"
#include "engine/internal/decisions.h"
#include "engine/internal/engine_impl.h"
#include "engine/internal/loss_scaling.h"
#include "engine/internal/step_meter.h"
#include "engine/save/dir_lock.h"
#include "engine/save/storage.h"
#include "engine/save/train_state.h"
#include "parallel/zero.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"
#include "runtime/output_file.h"

namespace remat {

using internal::Phase;

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
  return save_checkpoint(dir, client_state, SaveOptions{config_.train.async_save});
}

std::string Engine::save_checkpoint(const std::string& dir, const nlohmann::json& client_state,
                                    SaveOptions options) {
  Impl& s = *impl_;
  if (micro_steps_ != 0 || s.phase != Phase::kIdle) {
    throw Error(str("remat::Engine::save_checkpoint: called inside a gradient accumulation window (micro-step ",
                    micro_steps_ + (s.phase == Phase::kIdle ? 0 : 1), " of ", s.batch.gradient_accumulation_steps,
                    "): the gradients of this window are not part of a save. Save after the step() that ends "
                    "the window (is_gradient_accumulation_boundary())"));
  }
  s.complete_saves(/*wait=*/true);  // one save in the background at a time
  use_save_dir(dir, {});
  ContextScope scope(s.context);  // its RNG tracker is saved
  TrainPosition position;
  position.step = global_steps_;
  position.skipped_steps = skipped_steps_;
  position.client_state = client_state.dump();
  if (s.loss_scaling) position.loss_scaler = s.loss_scaling->save();
  position.decisions = internal::decisions_json(config_, s.batch, s.layout->dims().dp, s.device_budget_bytes,
                                                s.search ? &*s.search : nullptr);
  if (options.async) {
    s.pending_save =
        std::make_unique<BackgroundSave>(dir, position, s.shards(*model_), *s.optimizer, s.identity, *s.world);
  } else {
    save_train_state(dir, position, s.shards(*model_), *s.optimizer, s.identity, *s.world);
  }
  char folder[32];
  std::snprintf(folder, sizeof folder, "step_%08lld", static_cast<long long>(global_steps_));
  return dir + "/" + folder;
}

void Engine::wait_for_saves() {
  ContextScope scope(impl_->context);
  impl_->complete_saves(/*wait=*/true);
}

bool Engine::save_pending() const { return impl_->pending_save != nullptr; }

void Engine::Impl::complete_saves(bool wait) {
  if (!pending_save) return;
  bool complete = false;
  try {
    if (wait) {
      pending_save->finish(*world);
      complete = true;
    } else {
      complete = pending_save->poll(*world);
    }
  } catch (...) {
    pending_save.reset();  // failed on every rank alike: nothing left to complete
    throw;
  }
  if (complete) pending_save.reset();
}

void Engine::Impl::throw_agreed(std::exception_ptr error) {
  try {
    complete_saves(/*wait=*/true);
  } catch (const std::exception& e) {
    // The save failed too (on every rank alike): said here, the step's error is the one thrown.
    log_rank0().error("{}", e.what());
  }
  std::rethrow_exception(error);
}

void Engine::use_save_dir(const std::string& dir, SaveDirOptions options) {
  Impl& s = *impl_;
  if (s.save_lock && s.save_lock_dir == dir) return;
  s.complete_saves(/*wait=*/true);  // a save being written keeps its folder's lock until complete
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
  s.complete_saves(/*wait=*/true);  // a save being written completes first
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

int64_t Engine::export_model(const std::string& path, const ExportOptions& options) {
  if (impl_->phase != Phase::kIdle) {
    throw Error("remat::Engine::export_model: called between forward() and step(): export between steps");
  }
  check_spares_saves("remat::Engine::export_model", path, impl_->save_lock_dir, impl_->loaded_dir);
  ContextScope scope(impl_->context);
  impl_->complete_saves(/*wait=*/true);  // a save being written completes first
  ExportOptions with_step = options;
  with_step.metadata.emplace("remat_step", std::to_string(global_steps_));
  return remat::export_model(path, *impl_->zero, *model_, *impl_->world, export_dtype(), with_step);
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
