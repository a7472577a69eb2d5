// Non-reentrant checkpoint regions: fn runs with grad inside a saved-tensor
// hooks scope, so the region's graph is the plain one, but every tensor
// autograd saves inside is replaced by a slot. The first slot unpacked in a
// backward recomputes fn (under the forward's RNG state) and fills every slot
// still alive, stopping as soon as the last one is filled; each unpack takes
// its slot's tensor, so a later backward (retain_graph) recomputes again.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <any>
#include <mutex>

#include "checkpointing/region.h"
#include "checkpointing/state.h"
#include "nn/saved_tensors_hooks.h"
#include "runtime/error.h"

namespace remat {
namespace {

struct Frame;

// One tensor the region's forward saved for backward (what pack returned).
struct Slot {
  std::shared_ptr<Frame> frame;  // the region lives while any of its slots does
  size_t index = 0;
  c10::VariableVersion version{c10::VariableVersion::DISABLED};
  uint32_t saved_version = 0;
  at::Tensor recomputed;  // filled by a recompute, taken by unpack (under frame->mutex)
};

// Thrown by the recompute's pack once every slot is filled: the rest of fn
// does not run.
struct StopRecompute {};

// Non-reentrant regions running fn on this thread (forward or recompute): a
// region inside another leaves its inputs to the outer one.
thread_local int t_region_depth = 0;
struct InsideRegion {
  InsideRegion() { ++t_region_depth; }
  ~InsideRegion() { --t_region_depth; }
};

struct Frame {
  std::shared_ptr<Region> region;
  // The inputs kept as they are, saved after fn returned and outside this
  // region's scope: an enclosing region or offloading scope packs them like
  // any other saved tensor.
  std::vector<torch::autograd::SavedVariable> inputs;
  std::vector<bool> stored;  // per input: kept in region->stored instead
  std::vector<std::weak_ptr<Slot>> slots;
  std::vector<TensorMeta> metas;  // per slot, as the forward saved it
  std::recursive_mutex mutex;
  bool recomputing = false;

  at::Tensor unpack(Slot& slot);
  void recompute();
  std::vector<at::Tensor> recompute_inputs();
};

at::Tensor Frame::unpack(Slot& slot) {
  const std::string& name = region->options.name;
  if (slot.version.enabled() && slot.version.current_version() != slot.saved_version) {
    throw Error(str(name, ": a tensor the region saved for backward (saved tensor #", slot.index,
                    ", ", metas[slot.index].str(), ") was modified in place after it was saved "
                    "(its version went from ", slot.saved_version, " to ",
                    slot.version.current_version(), "); the gradient would use the changed "
                    "value: clone() the tensor before changing it in place, or change a copy"));
  }
  std::lock_guard<std::recursive_mutex> lock(mutex);
  if (recomputing) {
    throw Error(str(name, ": the region's recompute needed one of its own saved tensors; fn "
                    "must not run backward inside itself"));
  }
  if (!slot.recomputed.defined()) recompute();
  at::Tensor out = std::move(slot.recomputed);
  slot.recomputed = at::Tensor();
  REMAT_CHECK(out.defined(), name, ": the recompute did not fill saved tensor #", slot.index);
  return out;
}

std::vector<at::Tensor> Frame::recompute_inputs() {
  Region& r = *region;
  check_input_versions(r);
  std::vector<at::Tensor> restored;
  if (r.stored) restored = r.stored->restore();
  std::vector<at::Tensor> values;
  for (size_t i = 0; i < r.n_tensors; ++i) {
    at::Tensor v;
    if (stored[i]) {
      v = restored.at(i);
    } else {
      try {
        v = inputs[i].unpack();
      } catch (const c10::Error& e) {
        throw Error(str(r.options.name, ": tensor argument ", i, " of the region cannot be read "
                        "for its recompute: ", e.what_without_backtrace()));
      }
    }
    // The recompute builds a graph of its own, cut off from the caller's:
    // only what it saves is used.
    at::Tensor d = v.detach();
    if (r.input_requires_grad[i]) d.requires_grad_(true);
    values.push_back(d);
  }
  return values;
}

void Frame::recompute() {
  auto start = Clock::now();
  Region& r = *region;
  const std::string& name = r.options.name;
  synchronize_if(r.options.synchronize);
  recomputing = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{recomputing};
  std::vector<at::Tensor> values = recompute_inputs();
  size_t next = 0;
  bool stopped = false;
  std::vector<std::string> ops;
  {
    RngReplay replay(r);
    at::AutoGradMode grad(true);
    saved_tensors_hooks scope(
        [&](const at::Tensor& t) -> std::any {
          if (next >= slots.size()) {
            throw Error(str(name, ": the recompute saved more tensors for backward than the "
                            "forward (", slots.size(), "); fn must compute the same thing both "
                            "times (data-dependent control flow or state changed between "
                            "forward and backward?)"));
          }
          if (r.options.determinism_check) {
            const TensorMeta now = TensorMeta::of(t);
            if (now != metas[next]) {
              throw Error(str(name, ": saved tensor #", next, " of the recompute is ", now.str(),
                              " but the forward saved ", metas[next].str(), "; fn must compute "
                              "the same thing both times (turn the check off with "
                              "CheckpointOptions::determinism_check = false only if you know "
                              "why)"));
            }
          }
          if (auto slot = slots[next].lock()) slot->recomputed = t.detach();
          if (++next == slots.size()) throw StopRecompute{};
          return std::any();
        },
        [name](const std::any&) -> at::Tensor {
          throw Error(str(name, ": backward ran through the graph of the region's recompute"));
        });
    try {
      InsideRegion inside;
      run_fn(r, values, SelectiveOpScope::Mode::kReplay, ops);
    } catch (const StopRecompute&) {
      stopped = true;
    }
  }
  if (!stopped) {
    throw Error(str(name, ": the recompute saved ", next, " tensors for backward but the forward "
                    "saved ", slots.size(), "; fn must compute the same thing both times "
                    "(data-dependent control flow or state changed between forward and "
                    "backward?)"));
  }
  CheckpointingState::get().recomputes++;
  synchronize_if(r.options.synchronize);
  if (r.options.profile) {
    RegionProfile delta;
    delta.recomputes = 1;
    delta.recompute_ms = ms_since(start);
    delta.backward_ms = delta.recompute_ms;  // the backward itself is the graph's own
    add_profile(name, delta);
  }
}

}  // namespace

c10::IValue checkpoint_non_reentrant(const CheckpointFn& fn, std::vector<c10::IValue> args,
                                     const CheckpointOptions& options) {
  auto start = Clock::now();
  std::vector<at::Tensor> inputs;
  auto frame = std::make_shared<Frame>();
  frame->region = make_region(fn, std::move(args), options, inputs);
  Region& r = *frame->region;
  synchronize_if(options.synchronize);
  if (options.preserve_rng_state) r.rng = capture_rng();
  // Inside another non-reentrant region the inputs are the outer region's
  // (it recomputes them): they are not stored here (partitioned, offloaded,
  // in a contiguous slot). Under any enclosing scope (a region, activation
  // offloading) the inputs saved as they are are that scope's, not counted here.
  const bool nested = t_region_depth > 0;
  const bool enclosed = saved_tensors_hooks_active();
  frame->stored = nested ? std::vector<bool>(inputs.size(), false)
                         : store_inputs(r, inputs, frame->region);
  int64_t saved_bytes = r.stored ? r.stored->kept_bytes() : 0;
  c10::IValue output;
  {
    std::weak_ptr<Frame> weak = frame;
    saved_tensors_hooks scope(
        [weak](const at::Tensor& t) -> std::any {
          auto f = weak.lock();
          REMAT_CHECK(f != nullptr, "checkpoint: a saved tensor outlived its region's forward");
          auto slot = std::make_shared<Slot>();
          slot->frame = f;
          slot->index = f->slots.size();
          if (!t.is_inference()) {
            slot->version = t.unsafeGetTensorImpl()->version_counter();
            slot->saved_version = t._version();
          }
          f->slots.push_back(slot);
          f->metas.push_back(TensorMeta::of(t));
          return slot;
        },
        [](const std::any& packed) {
          const auto& slot = std::any_cast<const std::shared_ptr<Slot>&>(packed);
          return slot->frame->unpack(*slot);
        });
    try {
      InsideRegion inside;
      output = run_fn(r, inputs, SelectiveOpScope::Mode::kRecord, r.forward_ops);
    } catch (...) {
      restore_rng_after_throw(r);
      throw;
    }
  }
  // Only the generators fn drew from need replaying.
  if (options.preserve_rng_state) drop_unchanged(r.rng);
  // Versions as fn left them (fn may update an argument itself, such as
  // running statistics): changes from here on are refused at the recompute.
  record_input_versions(r, inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (frame->stored[i]) {
      frame->inputs.emplace_back();
      continue;
    }
    frame->inputs.emplace_back(inputs[i], /*is_output=*/false);
    if (!enclosed) saved_bytes += covered_bytes(inputs[i]);
  }
  r.count(saved_bytes + r.selective.bytes);
  synchronize_if(options.synchronize);
  if (options.profile) {
    RegionProfile delta;
    delta.calls = 1;
    delta.forward_ms = ms_since(start);
    add_profile(options.name, delta);
  }
  return output;
}

}  // namespace remat
