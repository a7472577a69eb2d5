#include "checkpointing/checkpoint.h"


#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>

#include "checkpointing/internal/region.h"
#include "checkpointing/internal/state.h"
#include "nn/autograd_state.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat {

// checkpointing/internal/: the region and the state.
using internal::TensorMeta;
using internal::Region;
using internal::Clock;
using internal::ms_since;
using internal::add_profile;
using internal::synchronize_if;
using internal::collect_tensors;
using internal::with_tensors;
using internal::placeholders;
using internal::make_region;
using internal::store_inputs;
using internal::record_input_versions;
using internal::check_input_versions;
using internal::RngReplay;
using internal::restore_rng_after_throw;
using internal::run_fn;
using internal::log_op_sequences;
using internal::checkpoint_non_reentrant;
using internal::CheckpointingState;


CheckpointOptions& default_checkpoint_options() { return CheckpointingState::current().defaults; }

void configure_checkpointing(const RegionSettings& config, const ParallelLayout* mpu) {
  const std::string invalid = check_region_settings(config);
  if (!invalid.empty()) throw ConfigError("config error: " + invalid);
  auto& options = default_checkpoint_options();
  options.synchronize = config.synchronize_checkpoint_boundary;
  options.profile = config.profile;
  options.reentrant = config.reentrant;
  options.save_collectives = config.save_collectives;
  InputStorageOptions storage;
  if (config.partition_activations) {
    if (mpu == nullptr) {
      throw ConfigError("activation_checkpointing.partition_activations needs the tensor-parallel "
                        "group: pass the parallel layout to remat::configure_checkpointing");
    }
    storage.partition_group = mpu->tp_group();
  }
  storage.offload = config.cpu_checkpointing;
  static_cast<OffloadSettings&>(storage) = config;
  if (config.contiguous_memory_optimization) {
    storage.contiguous = std::make_shared<ContiguousBuffers>(*config.number_checkpoints);
  }
  options.storage = storage;
  if (config.partition_activations || config.cpu_checkpointing) {
    log_rank0().info("checkpointing configured: partition_activations {} (tensor-parallel size {}), "
                     "cpu_checkpointing {}, contiguous_memory_optimization {}",
                     config.partition_activations, mpu ? mpu->dims().tp : 1, config.cpu_checkpointing,
                     config.contiguous_memory_optimization);
  }
}

void reset_checkpoint_buffers() {
  auto& contiguous = default_checkpoint_options().storage.contiguous;
  if (contiguous) contiguous->reset();
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Moves the cache's tensors out (to hand them to autograd), leaving placeholders.
variable_list take_cached_tensors(SelectiveCache& cache) {
  variable_list out;
  for (auto& entry : cache.entries) {
    for (auto& v : entry.returns) {
      if (v.isTensor() && v.toTensor().defined() && !v.toTensor().is_meta()) {
        out.push_back(v.toTensor());
        v = c10::IValue(at::empty({0}, at::TensorOptions().device(at::kMeta)));
      }
    }
  }
  return out;
}

// Puts tensors taken by take_cached_tensors back, in the same order.
void put_cached_tensors(SelectiveCache& cache, const variable_list& tensors) {
  size_t next = 0;
  for (auto& entry : cache.entries) {
    for (auto& v : entry.returns) {
      if (v.isTensor() && v.toTensor().defined()) v = c10::IValue(tensors.at(next++));
    }
  }
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // Inputs come as a TensorList: autograd tracks tensors only in that form.
  static variable_list forward(AutogradContext* ctx, std::shared_ptr<Region> region,
                               at::TensorList inputs) {
    auto start = Clock::now();
    synchronize_if(region->options.synchronize);
    if (region->options.preserve_rng_state) region->rng = capture_rng();
    variable_list real(inputs.begin(), inputs.begin() + region->n_tensors);
    // Inputs kept as they are go to autograd; stored ones to region->stored.
    variable_list to_save = real;
    int64_t saved_bytes = 0;
    const std::vector<bool> store = store_inputs(*region, real, region);
    if (region->stored) {
      saved_bytes += region->stored->kept_bytes();
      for (size_t i = 0; i < store.size(); ++i) {
        if (store[i]) to_save[i] = at::Tensor();
      }
    }
    for (const auto& t : to_save) saved_bytes += covered_bytes(t);
    c10::IValue output;
    try {
      at::NoGradGuard no_grad;
      output = run_fn(*region, real, SelectiveOpScope::Mode::kRecord, region->forward_ops);
    } catch (const c10::Error& e) {
      restore_rng_after_throw(*region);
      // fn ran a backward of its own (torch::autograd::grad) on what it
      // computed, which has no graph here.
      const std::string detail = e.what_without_backtrace();
      if (detail.find("does not require grad") == std::string::npos) throw;
      throw Error(str(region->options.name, ": fn runs a backward (torch::autograd::grad or "
                      "backward()) inside a reentrant region, whose forward runs without grad, "
                      "so what fn computes has no graph; use a non-reentrant region "
                      "(CheckpointOptions::reentrant = false, activation_checkpointing.reentrant: "
                      "false), which supports it (detail: ", detail, ")"));
    } catch (...) {
      // fn drew from the generators before it threw: put them back, so a
      // failed call leaves the RNG where it found it.
      restore_rng_after_throw(*region);
      throw;
    }
    // Only the generators fn drew from need replaying.
    if (region->options.preserve_rng_state) drop_unchanged(region->rng);
    // Versions as fn left them (autograd records its saved tensors' versions
    // at this point too): changes after the forward are what backward refuses.
    record_input_versions(*region, real);
    // Inputs and kept op outputs go to autograd, which frees them after a
    // backward without retain_graph.
    for (auto& t : take_cached_tensors(region->selective)) to_save.push_back(t);
    ctx->save_for_backward(to_save);
    region->count(saved_bytes + region->selective.bytes);
    std::vector<at::Tensor> outs;
    collect_tensors(output, outs, region->options.name + " output");
    variable_list non_differentiable;
    for (auto& t : outs) {
      region->outputs.push_back(TensorMeta::of(t));
      // autograd attaches the outputs to this region's node. fn may return a
      // tensor the region did not create (an input, a view of one, a
      // parameter, a captured tensor, or one tensor twice): attaching that
      // tensor itself would rewrite its history, and the recompute, returning
      // it again, would lead back into this node. A fresh alias per output
      // takes the history instead; values and storage are shared.
      t = t.detach();
      if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
        non_differentiable.push_back(t);
      }
    }
    ctx->mark_non_differentiable(non_differentiable);
    region->forward_output = output;
    keep_in(ctx, "region", region);
    synchronize_if(region->options.synchronize);
    if (region->options.profile) {
      RegionProfile delta;
      delta.calls = 1;
      delta.forward_ms = ms_since(start);
      add_profile(*region, delta);
    }
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto start = Clock::now();
    std::shared_ptr<Region> region = kept_in<std::shared_ptr<Region>>(ctx, "region");
    // The recompute runs in the forward's context (its defaults for regions
    // nested in fn, its RNG tracker, its counters), on whatever thread this is.
    ContextScope scope(region->context);
    const std::string& name = region->options.name;
    variable_list saved = saved_inputs(ctx, *region);
    synchronize_if(region->options.synchronize);
    variable_list detached;
    std::vector<std::string> recompute_ops;
    const c10::IValue output = recompute(*region, std::move(saved), detached, recompute_ops);
    region->state->recomputes++;
    double recompute_ms = ms_since(start);
    log_op_sequences(*region, recompute_ops);
    std::vector<at::Tensor> outs;
    collect_tensors(output, outs, name + " output");
    if (region->options.determinism_check) check_outputs(*region, outs);
    backward_from_outputs(*region, outs, grad_outputs);
    // After a backward that does not retain the graph autograd has freed what
    // it kept (inputs, selective-op outputs); stored inputs go the same way.
    if (!torch::autograd::get_current_graph_task_keep_graph()) {
      if (region->stored) region->stored->release();
      region->count(-region->counted_bytes);
    }

    variable_list result{at::Tensor()};  // for the region argument
    for (auto& d : detached) result.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    if (region->has_dummy) result.emplace_back();
    synchronize_if(region->options.synchronize);
    if (region->options.profile) {
      RegionProfile delta;
      delta.recomputes = 1;
      delta.recompute_ms = recompute_ms;
      delta.backward_ms = ms_since(start);
      add_profile(*region, delta);
    }
    return result;
  }

  // What the forward saved (the inputs, then the kept op outputs), checked:
  // a backward that may run through this region, a first one (or one after
  // retain_graph), inputs not changed in place since.
  static variable_list saved_inputs(AutogradContext* ctx, Region& region) {
    const std::string& name = region.options.name;
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      throw Error(str(name, ": torch::autograd::grad (or backward with `inputs`) cannot run "
                      "through a checkpointed region of the reentrant mode, whose recompute "
                      "accumulates into .grad(); call backward() on the loss and read the "
                      "gradients from .grad(), or use a non-reentrant region "
                      "(CheckpointOptions::reentrant = false, activation_checkpointing.reentrant: "
                      "false), which supports it"));
    }
    variable_list saved;
    try {
      saved = ctx->get_saved_variables();
    } catch (const c10::Error& e) {
      const std::string detail = e.what_without_backtrace();
      if (detail.find("a second time") != std::string::npos) {
        throw Error(str(name, ": backward ran through this region a second time, but its saved "
                        "inputs were released by the first backward; pass retain_graph=true to "
                        "the first backward() to backpropagate twice (detail: ", detail, ")"));
      }
      check_input_versions(region);  // the clearer message when an input changed in place
      throw Error(str(name, ": the region's saved tensors cannot be read: ", detail));
    }
    // Inputs stored outside autograd have no check of their own.
    check_input_versions(region);
    return saved;
  }

  // Restores the inputs (`saved`, as saved_inputs returns them) into
  // `detached`, leaves that take the gradients, and runs fn again on them with
  // grad and the forward's RNG, replaying the kept op outputs.
  static c10::IValue recompute(Region& region, variable_list saved, variable_list& detached,
                               std::vector<std::string>& recompute_ops) {
    // On a memory trace: the span of the restore and the recompute, and what
    // the recompute allocates counts as saved activations.
    std::optional<TraceSpan> span(std::in_place, "recompute", region.options.name);
    std::optional<MemoryCategoryScope> activations(std::in_place, MemoryCategory::kSavedActivations);

    // The kept op outputs follow the inputs in the saved list.
    put_cached_tensors(region.selective, variable_list(saved.begin() + region.n_tensors, saved.end()));
    saved.resize(region.n_tensors);
    if (region.stored) {
      auto restored = region.stored->restore();
      for (size_t i = 0; i < saved.size(); ++i) {
        if (restored[i].defined()) saved[i] = restored[i];
      }
    }
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor d = saved[i].detach();
      d.requires_grad_(region.input_requires_grad[i]);
      detached.push_back(d);
    }
    c10::IValue output;
    {
      RngReplay replay(region);
      at::AutoGradMode grad(true);
      output = run_fn(region, detached, SelectiveOpScope::Mode::kReplay, recompute_ops);
    }
    activations.reset();
    span.reset();
    take_cached_tensors(region.selective);  // autograd owns them again
    if (region.selective.next != region.selective.entries.size()) {
      throw Error(str(region.options.name, ": the recompute used ", region.selective.next, " of the ",
                      region.selective.entries.size(),
                      " op outputs the forward saved; the region must run the same ops both "
                      "times"));
    }
    return output;
  }

  // Backward from the recomputed outputs that require grad and got one.
  static void backward_from_outputs(const Region& region, const std::vector<at::Tensor>& outs,
                                    const variable_list& grad_outputs) {
    variable_list roots, grads;
    for (size_t i = 0; i < outs.size() && i < grad_outputs.size(); ++i) {
      if (outs[i].requires_grad() && grad_outputs[i].defined()) {
        if (region.node != nullptr && outs[i].grad_fn().get() == region.node) {
          throw Error(str(region.options.name, ": the recompute returned (as output ", i, ") a tensor that this "
                          "region itself produced in its forward; backward through it would "
                          "enter the region again. fn must compute its outputs from its "
                          "arguments, not return results of an earlier call"));
        }
        roots.push_back(outs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
  }

  static void check_outputs(const Region& region, const std::vector<at::Tensor>& outs) {
    const std::string& name = region.options.name;
    if (outs.size() != region.outputs.size()) {
      throw Error(str(name, ": the recompute returned ", outs.size(),
                      " tensors but the forward returned ", region.outputs.size(),
                      "; fn must compute the same thing both times (data-dependent control "
                      "flow or state changed between forward and backward?)"));
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      const TensorMeta now = TensorMeta::of(outs[i]);
      const TensorMeta& then = region.outputs[i];
      if (now != then) {
        throw Error(str(name, ": output ", i, " of the recompute is ", now.str(),
                        " but the forward produced ", then.str(),
                        "; fn must compute the same thing both times (turn the check off with "
                        "CheckpointOptions::determinism_check = false only if you know why)"));
      }
    }
  }

};

}  // namespace

c10::IValue checkpoint_ivalues(const CheckpointFn& fn, std::vector<c10::IValue> args,
                               const CheckpointOptions& options) {
  if (!at::GradMode::is_enabled()) return fn(args);  // evaluation: keep nothing
  if (!options.reentrant) return checkpoint_non_reentrant(fn, std::move(args), options);

  std::vector<at::Tensor> inputs;
  auto region = make_region(fn, std::move(args), options, inputs);
  // With no input requiring grad the region would be cut off from backward and
  // parameters used inside fn would get no gradient: a dummy input keeps it on
  // the graph.
  if (std::none_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); })) {
    inputs.push_back(at::empty({0}).requires_grad_(true));
    region->has_dummy = true;
  }
  variable_list outs = CheckpointFunction::apply(region, at::TensorList(inputs));
  for (const auto& t : outs) {
    if (t.grad_fn()) {
      region->node = t.grad_fn().get();
      break;
    }
  }
  c10::IValue result = with_tensors(region->forward_output, outs);
  region->forward_output = c10::IValue();
  return result;
}

std::map<std::string, RegionProfile> checkpoint_profile() {
  auto& state = CheckpointingState::current();
  std::lock_guard<std::mutex> lock(state.profile_mutex);
  return state.profile;
}

std::map<std::string, RegionProfile> take_checkpoint_profile() {
  std::map<std::string, RegionProfile> profile;
  auto& state = CheckpointingState::current();
  std::lock_guard<std::mutex> lock(state.profile_mutex);
  profile.swap(state.profile);
  return profile;
}

void log_checkpoint_profile_step(int64_t step) {
  for (const auto& [name, p] : take_checkpoint_profile()) {
    log_rank0().info(
        "step {} checkpoint profile {}: {} calls, {} recomputes, forward {:.3f} ms, recompute "
        "{:.3f} ms, backward {:.3f} ms",
        step, name, p.calls, p.recomputes, p.forward_ms, p.recompute_ms, p.backward_ms);
  }
}

int64_t checkpoint_recompute_count() { return CheckpointingState::current().recomputes.load(); }

int64_t checkpoint_saved_bytes() { return CheckpointingState::current().saved_bytes.load(); }

std::vector<at::Tensor> checkpoint_stored_tensors() {
  std::vector<at::Tensor> out;
  auto& state = CheckpointingState::current();
  std::lock_guard<std::mutex> lock(state.regions_mutex);
  for (const auto& w : state.regions) {
    if (auto region = w.lock()) {
      if (region->stored) {
        for (auto& t : region->stored->held_tensors()) out.push_back(t);
      }
    }
  }
  return out;
}

}  // namespace remat
