#include "checkpointing/checkpoint.h"
#include "checkpointing/state.h"

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

#include "checkpointing/op_recorder.h"
#include "checkpointing/selective_op.h"
#include "nn/autograd_state.h"
#include "rng/rng_tracker.h"
#include "runtime/config.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"

namespace remat {

CheckpointingState& CheckpointingState::get() {
  static CheckpointingState state;
  return state;
}

CheckpointOptions& default_checkpoint_options() { return CheckpointingState::get().defaults; }

void configure_checkpointing(const ActivationCheckpointingConfig& config,
                             const ParallelLayout* mpu) {
  const std::string invalid = check_activation_checkpointing(config);
  if (!invalid.empty()) throw ConfigError("config error: " + invalid);
  auto& options = default_checkpoint_options();
  options.synchronize = config.synchronize_checkpoint_boundary;
  options.profile = config.profile;
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
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void add_profile(const std::string& name, const RegionProfile& delta) {
  auto& state = CheckpointingState::get();
  std::lock_guard<std::mutex> lock(state.profile_mutex);
  auto& p = state.profile[name];
  p.calls += delta.calls;
  p.recomputes += delta.recomputes;
  p.forward_ms += delta.forward_ms;
  p.recompute_ms += delta.recompute_ms;
  p.backward_ms += delta.backward_ms;
}

// ---------------------------------------------------------------------------
// Tensors inside nested values: collected in a fixed order and put back in the
// same order. Undefined tensors count as None, not as tensors.

void collect_tensors(const c10::IValue& v, std::vector<at::Tensor>& out, const std::string& where) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) {
      if (t.defined()) out.push_back(t);
    }
  } else if (v.isList()) {
    for (const auto& item : v.toListRef()) collect_tensors(item, out, where);
  } else if (v.isTuple()) {
    for (const auto& item : v.toTupleRef().elements()) collect_tensors(item, out, where);
  } else if (v.isGenericDict() || v.isObject() || v.isFuture() || v.isCapsule()) {
    throw Error(str(where, ": values of type ", v.tagKind(),
                    " are not supported; capture them in fn instead of passing them"));
  }
}

at::Tensor next_tensor(const std::vector<at::Tensor>& values, size_t& index) {
  REMAT_CHECK_LT(index, values.size(), "checkpoint: tensor structure changed");
  return values[index++];
}

c10::IValue replace_tensors(const c10::IValue& v, const std::vector<at::Tensor>& values,
                            size_t& index) {
  if (v.isTensor()) {
    return v.toTensor().defined() ? c10::IValue(next_tensor(values, index)) : v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> list;
    for (const at::Tensor& t : v.toTensorList().vec()) {
      list.push_back(t.defined() ? next_tensor(values, index) : t);
    }
    return c10::IValue(list);
  }
  if (v.isList()) {
    auto source = v.toList();
    c10::impl::GenericList list(source.elementType());
    for (const auto& item : v.toListRef()) list.push_back(replace_tensors(item, values, index));
    return c10::IValue(list);
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : v.toTupleRef().elements()) {
      items.push_back(replace_tensors(item, values, index));
    }
    return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
  }
  return v;
}

c10::IValue with_tensors(const c10::IValue& v, const std::vector<at::Tensor>& values) {
  size_t index = 0;
  c10::IValue out = replace_tensors(v, values, index);
  REMAT_CHECK_EQ(index, values.size(), "checkpoint: tensor structure changed");
  return out;
}

// Storage-free stand-ins, so that the region's structure holds no data.
std::vector<at::Tensor> placeholders(size_t n) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < n; ++i) out.push_back(at::empty({0}, at::TensorOptions().device(at::kMeta)));
  return out;
}

struct OutputMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  at::Device device;
};

std::string describe(const OutputMeta& m) {
  return str(c10::toString(m.dtype), " ", c10::IntArrayRef(m.sizes), " on ", m.device.str());
}

void synchronize_if(bool enabled) {
  if (enabled && torch::cuda::is_available()) torch::cuda::synchronize();
}

std::string join(const std::vector<std::string>& ops) {
  std::string out;
  for (const auto& op : ops) out += (out.empty() ? "" : " ") + op;
  return out;
}

}  // namespace

// Everything a region needs between forward and backward.
struct Region {
  CheckpointFn fn;
  CheckpointOptions options;
  c10::IValue args;  // tuple of the arguments, tensors replaced by placeholders
  size_t n_tensors = 0;
  bool has_dummy = false;
  std::vector<bool> input_requires_grad;
  RngSnapshot rng;
  c10::IValue forward_output;  // handed back to the caller, then dropped
  std::vector<OutputMeta> outputs;
  std::vector<std::string> forward_ops;
  SelectiveCache selective;
  // Inputs stored partitioned or offloaded; their places in the saved list
  // hold undefined tensors.
  std::unique_ptr<StoredInputs> stored;
  // Each input's version counter and its version at the forward: a change in
  // place before the recompute is an error (autograd skips its own check for
  // the inputs stored here, and its message would blame a second backward).
  std::vector<c10::VariableVersion> input_versions;
  std::vector<uint32_t> versions_at_forward;
  // The node the forward's outputs lead to (compared, never followed).
  const torch::autograd::Node* node = nullptr;

  // Bytes counted in the saved-bytes total for this region: only what was
  // added is taken away, so a forward that throws half-way leaves the total
  // as it was.
  void count(int64_t bytes) {
    counted_bytes += bytes;
    CheckpointingState::get().saved_bytes += bytes;
  }
  int64_t counted_bytes = 0;
  ~Region() { CheckpointingState::get().saved_bytes -= counted_bytes; }
};

namespace {

void track_region(const std::shared_ptr<Region>& region) {
  auto& state = CheckpointingState::get();
  std::lock_guard<std::mutex> lock(state.regions_mutex);
  auto& regions = state.regions;
  regions.erase(std::remove_if(regions.begin(), regions.end(),
                               [](const auto& w) { return w.expired(); }),
                regions.end());
  regions.push_back(region);
}

// Restores the RNG the forward saw and puts back the current one afterwards.
class RngReplay {
 public:
  RngReplay(const Region& region) : active_(region.options.preserve_rng_state) {
    if (!active_) return;
    now_ = capture_rng();
    restore_rng(region.rng);
  }
  ~RngReplay() {
    if (active_) restore_rng(now_);
  }

 private:
  bool active_;
  RngSnapshot now_;
};

// Runs the region's fn on `tensors` with the selective-op cache recording or
// replaying, and the op recorder on when debugging (its ops go to `ops`).
c10::IValue run_fn(Region& region, const variable_list& tensors, SelectiveOpScope::Mode mode,
                   std::vector<std::string>& ops) {
  std::unique_ptr<OpRecorder> recorder;
  if (region.options.debug) recorder = std::make_unique<OpRecorder>();
  std::unique_ptr<SelectiveOpScope> selective;
  if (region.options.save_ops) {
    selective = std::make_unique<SelectiveOpScope>(*region.options.save_ops, region.selective, mode);
  }
  c10::IValue output = region.fn(with_tensors(region.args, tensors).toTupleRef().elements().vec());
  if (recorder) ops = recorder->ops();
  return output;
}

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
    if (region->options.storage.active()) {
      auto store = StoredInputs::select(real, region->options.storage, region->options.name);
      if (std::count(store.begin(), store.end(), true) > 0) {
        region->stored = std::make_unique<StoredInputs>(real, store, region->options.storage,
                                                        region->options.name);
        saved_bytes += region->stored->kept_bytes();
        for (size_t i = 0; i < store.size(); ++i) {
          if (store[i]) to_save[i] = at::Tensor();
        }
        track_region(region);
      }
    }
    for (const auto& t : to_save) saved_bytes += covered_bytes(t);
    c10::IValue output;
    try {
      at::NoGradGuard no_grad;
      output = run_fn(*region, real, SelectiveOpScope::Mode::kRecord, region->forward_ops);
    } catch (...) {
      // fn drew from the generators before it threw: put them back, so a
      // failed call leaves the RNG where it found it.
      // The caller gets fn's exception, whatever the restore says.
      if (region->options.preserve_rng_state) {
        try {
          restore_rng(region->rng);
        } catch (const std::exception& e) {
          log().warn("{}: fn threw, and the RNG could not be put back: {}", region->options.name,
                     e.what());
        }
      }
      throw;
    }
    // Versions as fn left them (autograd records its saved tensors' versions
    // at this point too): changes after the forward are what backward refuses.
    for (const auto& t : real) {
      region->input_versions.push_back(t.unsafeGetTensorImpl()->version_counter());
      region->versions_at_forward.push_back(t.is_inference() ? 0 : t._version());
    }
    // Inputs and kept op outputs go to autograd, which frees them after a
    // backward without retain_graph.
    for (auto& t : take_cached_tensors(region->selective)) to_save.push_back(t);
    ctx->save_for_backward(to_save);
    region->count(saved_bytes + region->selective.bytes);
    std::vector<at::Tensor> outs;
    collect_tensors(output, outs, region->options.name + " output");
    variable_list non_differentiable;
    for (auto& t : outs) {
      region->outputs.push_back({t.sizes().vec(), t.scalar_type(), t.device()});
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
      add_profile(region->options.name, delta);
    }
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto start = Clock::now();
    std::shared_ptr<Region> region = kept_in<std::shared_ptr<Region>>(ctx, "region");
    const std::string& name = region->options.name;
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      throw Error(str(name, ": torch::autograd::grad (or backward with `inputs`) cannot run "
                      "through a checkpointed region, whose recompute accumulates into .grad(); "
                      "call backward() on the loss and read the gradients from .grad()"));
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
      check_versions(*region);  // the clearer message when an input changed in place
      throw Error(str(name, ": the region's saved tensors cannot be read: ", detail));
    }
    // Inputs stored outside autograd have no check of their own.
    check_versions(*region);
    synchronize_if(region->options.synchronize);

    // The kept op outputs follow the inputs in the saved list.
    put_cached_tensors(region->selective,
                       variable_list(saved.begin() + region->n_tensors, saved.end()));
    saved.resize(region->n_tensors);
    if (region->stored) {
      auto restored = region->stored->restore();
      for (size_t i = 0; i < saved.size(); ++i) {
        if (restored[i].defined()) saved[i] = restored[i];
      }
    }
    variable_list detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor d = saved[i].detach();
      d.requires_grad_(region->input_requires_grad[i]);
      detached.push_back(d);
    }
    c10::IValue output;
    std::vector<std::string> recompute_ops;
    {
      RngReplay replay(*region);
      at::AutoGradMode grad(true);
      output = run_fn(*region, detached, SelectiveOpScope::Mode::kReplay, recompute_ops);
    }
    take_cached_tensors(region->selective);  // autograd owns them again
    if (region->selective.next != region->selective.entries.size()) {
      throw Error(str(name, ": the recompute used ", region->selective.next, " of the ",
                      region->selective.entries.size(),
                      " op outputs the forward saved; the region must run the same ops both "
                      "times"));
    }
    CheckpointingState::get().recomputes++;
    double recompute_ms = ms_since(start);
    if (region->options.debug) {
      log().debug("{} forward ops: {}", name, join(region->forward_ops));
      log().debug("{} recompute ops: {}", name, join(recompute_ops));
      if (recompute_ops != region->forward_ops) {
        log().warn("{}: the recompute ran other ops than the forward (see debug log)", name);
      }
    }
    std::vector<at::Tensor> outs;
    collect_tensors(output, outs, name + " output");
    if (region->options.determinism_check) check_outputs(*region, outs);

    variable_list roots, grads;
    for (size_t i = 0; i < outs.size() && i < grad_outputs.size(); ++i) {
      if (outs[i].requires_grad() && grad_outputs[i].defined()) {
        if (region->node != nullptr && outs[i].grad_fn().get() == region->node) {
          throw Error(str(name, ": the recompute returned (as output ", i, ") a tensor that this "
                          "region itself produced in its forward; backward through it would "
                          "enter the region again. fn must compute its outputs from its "
                          "arguments, not return results of an earlier call"));
        }
        roots.push_back(outs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
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
      add_profile(name, delta);
    }
    return result;
  }

  // An input changed in place since the forward would be recomputed from the
  // changed value: refuse, naming the input and what to do.
  static void check_versions(const Region& region) {
    for (size_t i = 0; i < region.input_versions.size(); ++i) {
      const auto& version = region.input_versions[i];
      if (!version.enabled()) continue;  // an inference tensor
      const uint32_t now = version.current_version();
      if (now != region.versions_at_forward[i]) {
        throw Error(str(region.options.name, ": tensor argument ", i, " was modified in place "
                        "after the region's forward (its version went from ",
                        region.versions_at_forward[i], " to ", now, "); the recompute needs the "
                        "value the forward saw: clone() the tensor before changing it in place, "
                        "or change a copy"));
      }
    }
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
      OutputMeta now{outs[i].sizes().vec(), outs[i].scalar_type(), outs[i].device()};
      const OutputMeta& then = region.outputs[i];
      if (now.sizes != then.sizes || now.dtype != then.dtype || now.device != then.device) {
        throw Error(str(name, ": output ", i, " of the recompute is ", describe(now),
                        " but the forward produced ", describe(then),
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

  auto region = std::make_shared<Region>();
  region->fn = fn;
  region->options = options;
  c10::IValue packed(c10::ivalue::Tuple::create(std::move(args)));
  std::vector<at::Tensor> inputs;
  collect_tensors(packed, inputs, options.name + " argument");
  region->n_tensors = inputs.size();
  region->args = with_tensors(packed, placeholders(inputs.size()));
  bool any_requires_grad = false;
  for (const auto& t : inputs) {
    region->input_requires_grad.push_back(t.requires_grad());
    any_requires_grad = any_requires_grad || t.requires_grad();
  }
  // With no input requiring grad the region would be cut off from backward and
  // parameters used inside fn would get no gradient: a dummy input keeps it on
  // the graph.
  if (!any_requires_grad) {
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
  auto& state = CheckpointingState::get();
  std::lock_guard<std::mutex> lock(state.profile_mutex);
  return state.profile;
}

std::map<std::string, RegionProfile> take_checkpoint_profile() {
  std::map<std::string, RegionProfile> profile;
  auto& state = CheckpointingState::get();
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

int64_t checkpoint_recompute_count() { return CheckpointingState::get().recomputes.load(); }

int64_t checkpoint_saved_bytes() { return CheckpointingState::get().saved_bytes.load(); }

std::vector<at::Tensor> checkpoint_stored_tensors() {
  std::vector<at::Tensor> out;
  auto& state = CheckpointingState::get();
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
