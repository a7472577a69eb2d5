// Non-reentrant checkpoint regions: fn runs with grad inside a saved-tensor
// hooks scope, so the region's graph is the plain one, but every tensor
// autograd saves inside is replaced by a slot. The first slot unpacked in a
// backward recomputes fn (under the forward's RNG state) and fills every slot
// still alive, stopping as soon as the last one is filled; each unpack takes
// its slot's tensor, so a later backward (retain_graph) recomputes again.
// A backward that fn runs itself (torch::autograd::grad inside fn) unpacks
// slots while the forward is still running. The forward keeps no saved tensor
// (that would make its peak a plain forward's): a slot whose tensor something
// else still holds (fn's locals, the caller, a parameter) is read from there,
// and the others are recomputed from the region's arguments, under the
// forward's starting RNG state. In the recompute, that backward runs on the
// recompute's own graph.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <any>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <typeinfo>

#include "checkpointing/internal/region.h"
#include "checkpointing/internal/state.h"
#include "nn/saved_tensors_hooks.h"
#include "runtime/error.h"
#include "runtime/memory_trace.h"

namespace remat {

// checkpointing/internal/: the region and the state.
using internal::TensorMeta;
using internal::Region;
using internal::Clock;
using internal::ms_since;
using internal::add_profile;
using internal::synchronize_if;
using internal::make_region;
using internal::store_inputs;
using internal::record_input_versions;
using internal::check_input_versions;
using internal::RngReplay;
using internal::restore_rng_after_throw;
using internal::run_fn;

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
// does not run. The pack may run inside a backward that fn itself runs
// (torch::autograd::grad in fn), and the autograd engine hands on only
// std::exceptions to its caller.
struct StopRecompute : std::exception {
  const char* what() const noexcept override { return "checkpoint: recompute complete"; }
};

// A tensor the forward saved, referenced without keeping it alive: while fn
// runs, a backward inside fn reads it from whoever else still holds it.
class Held {
 public:
  explicit Held(const at::Tensor& t)
      : tensor_(t.getIntrusivePtr()), storage_(c10::intrusive_ptr<c10::StorageImpl>()) {
    // A plain strided tensor also by its storage and place in it: a view fn
    // dropped (Linear saves weight.t()) is rebuilt while its base lives.
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (typeid(*impl) == typeid(c10::TensorImpl) && t.layout() == at::kStrided &&
        t.has_storage() && (t.is_cpu() || t.is_cuda()) && !impl->is_wrapped_number() &&
        !t.is_conj() && !t.is_neg() && !t._is_zerotensor()) {
      storage_ = t.storage().getWeakStorageImpl();
      offset_ = t.storage_offset();
      strides_ = t.strides().vec();
    }
  }

  // The tensor, or undefined when nothing holds its data any more.
  at::Tensor get(const TensorMeta& meta) const {
    auto impl = tensor_.lock();
    if (impl) return at::Tensor(std::move(impl)).detach();
    auto storage = storage_.lock();
    if (!storage || !fits(*storage, meta)) return at::Tensor();
    at::NoGradGuard no_grad;
    return at::empty({0}, at::TensorOptions().dtype(meta.dtype).device(meta.device))
        .set_(c10::Storage(std::move(storage)), offset_, meta.sizes, strides_);
  }
  bool alive(const TensorMeta& meta) const {
    if (!tensor_.expired()) return true;
    auto storage = storage_.lock();
    return storage && fits(*storage, meta);
  }

 private:
  // Whether the storage still has the bytes the tensor covers (storage
  // released by resizing it to nothing, as sharded parameters are, does not).
  bool fits(const c10::StorageImpl& storage, const TensorMeta& meta) const {
    int64_t end = offset_ + 1;
    for (size_t d = 0; d < meta.sizes.size(); ++d) {
      if (meta.sizes[d] == 0) return true;
      end += (meta.sizes[d] - 1) * strides_[d];
    }
    const auto item = static_cast<int64_t>(c10::elementSize(meta.dtype));
    return static_cast<int64_t>(storage.nbytes()) >= end * item;
  }

  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor_;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_;
  int64_t offset_ = 0;
  std::vector<int64_t> strides_;
};

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
  // While fn runs in the forward, for a backward inside it: each slot's
  // tensor, not kept; the arguments as the caller passed them (the caller
  // holds them for the call) and their versions, to recompute the rest from.
  std::vector<Held> held;
  std::vector<at::Tensor> forward_inputs;
  std::vector<uint32_t> forward_versions;
  bool forward_running = false;
  std::thread::id forward_thread;
  std::recursive_mutex mutex;
  bool recomputing = false;

  at::Tensor unpack(Slot& slot);
  void recompute(size_t upto);
  // Which of the first `limit` slots a recompute fills: every one after the
  // forward; during it, those whose tensors are gone.
  std::vector<bool> slots_to_fill(bool in_forward, size_t limit);
  // Runs fn on `values` with grad and the forward's RNG, each tensor it saves
  // filling the next slot (counted in `next`) until `limit`: whether it got
  // there (and stopped fn).
  bool run_filling_slots(const std::vector<at::Tensor>& values, bool in_forward, size_t limit,
                         const std::vector<bool>& fill, size_t& next);
  // The recompute's pack of saved tensor #`index`: checked against the
  // forward's, into its slot when `fill` says so.
  at::Tensor fill_slot(const at::Tensor& t, size_t index, const std::vector<bool>& fill);
  std::vector<at::Tensor> recompute_inputs();
  std::vector<at::Tensor> forward_values();
  void drop_recomputed();
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
  const TensorMeta& meta = metas[slot.index];
  // fn runs a backward of its own before returning.
  if (forward_running && !recomputing) {
    // A backward that builds a graph (create_graph) saves tensors. On GPU
    // tensors autograd runs it on its device threads, where this region's
    // hooks do not apply, while the recompute, itself on such a thread, would
    // hook them: forward and recompute would save different tensors. (Not run
    // here: no GPU.)
    if (at::GradMode::is_enabled() && !meta.device.is_cpu() &&
        std::this_thread::get_id() != forward_thread) {
      throw Error(str(name, ": fn runs a backward with create_graph=true on ", meta.device.str(),
                      " tensors, which autograd runs on its device threads, where the region "
                      "cannot see the tensors that backward saves; this is not supported: "
                      "compute that gradient outside the region, or checkpoint the parts of fn "
                      "before and after it as separate regions"));
    }
    at::Tensor t = held.at(slot.index).get(meta);
    if (t.defined()) return t;
  }
  if (recomputing) {
    throw Error(str(name, ": the region's recompute needed saved tensor #", slot.index, " of the "
                    "region's forward (", meta.str(), "): a backward inside fn reached the graph "
                    "of ", forward_running ? "the region's forward" : "an earlier call of the "
                    "region", ", through a tensor fn kept or captured from it; fn must compute "
                    "from its arguments (pass such a tensor as an argument)"));
  }
  if (!slot.recomputed.defined()) {
    recompute(slot.index);
    // What a backward inside fn had recomputed and did not read goes when
    // that backward ends (or, outside one, when fn returns).
    if (forward_running) {
      std::weak_ptr<Frame> weak = slot.frame;
      try {
        torch::autograd::Engine::get_default_engine().queue_callback([weak] {
          if (auto f = weak.lock()) f->drop_recomputed();
        });
      } catch (const c10::Error&) {
        // Not inside a backward: ForwardRunning drops them.
      }
    }
  }
  at::Tensor out = std::move(slot.recomputed);
  slot.recomputed = at::Tensor();
  REMAT_CHECK(out.defined(), name, ": the recompute did not fill saved tensor #", slot.index);
  return out;
}

// The region's arguments for a recompute while fn still runs.
std::vector<at::Tensor> Frame::forward_values() {
  const Region& r = *region;
  std::vector<at::Tensor> values;
  for (size_t i = 0; i < forward_inputs.size(); ++i) {
    const at::Tensor& v = forward_inputs[i];
    if (!v.is_inference() && v._version() != forward_versions[i]) {
      throw Error(str(r.options.name, ": a backward inside fn needs saved tensors that fn freed, "
                      "recomputed from the region's arguments, but fn changed tensor argument ",
                      i, " in place before it (its version went from ", forward_versions[i],
                      " to ", v._version(), "); change a copy of the argument instead"));
    }
    at::Tensor d = v.detach();
    if (r.input_requires_grad[i]) d.requires_grad_(true);
    values.push_back(d);
  }
  return values;
}

void Frame::drop_recomputed() {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  if (!forward_running) return;
  for (const auto& weak : slots) {
    if (auto slot = weak.lock()) slot->recomputed = at::Tensor();
  }
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

// Fills the slots from a run of fn. While fn runs, it fills those up to
// `upto` (the one a backward inside fn reads) whose tensors are gone and stops
// there: a backward reads slots mostly from the last to the first, and the
// part of fn after the slot (the running backward, maybe) is not run again.
void Frame::recompute(size_t upto) {
  auto start = Clock::now();
  Region& r = *region;
  // The recompute runs in the forward's context (its defaults for regions
  // nested in fn, its RNG tracker, its counters), on whatever thread this is.
  ContextScope scope(r.context);
  const bool in_forward = forward_running;
  const size_t limit = in_forward ? upto + 1 : slots.size();
  const std::vector<bool> fill = slots_to_fill(in_forward, limit);
  synchronize_if(r.options.synchronize);
  // On a memory trace: the recompute's span; what it allocates counts as saved activations.
  TraceSpan span("recompute", r.options.name);
  MemoryCategoryScope activations(MemoryCategory::kSavedActivations);
  recomputing = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{recomputing};
  std::vector<at::Tensor> values = in_forward ? forward_values() : recompute_inputs();
  size_t next = 0;
  if (!run_filling_slots(values, in_forward, limit, fill, next)) {
    throw Error(str(r.options.name, ": the recompute saved ", next, " tensors for backward but the forward "
                    "saved ", in_forward ? "at least " : "", limit, "; fn must compute the same "
                    "thing both times (data-dependent control flow or state changed between "
                    "forward and backward?)"));
  }
  r.state->recomputes++;
  synchronize_if(r.options.synchronize);
  if (r.options.profile) {
    RegionProfile delta;
    delta.recomputes = 1;
    delta.recompute_ms = ms_since(start);
    // The backward itself is the graph's own; one inside fn is the forward's.
    if (!in_forward) delta.backward_ms = delta.recompute_ms;
    add_profile(r, delta);
  }
}

std::vector<bool> Frame::slots_to_fill(bool in_forward, size_t limit) {
  std::vector<bool> fill(limit, true);
  if (in_forward) {
    for (size_t i = 0; i < limit; ++i) {
      auto slot = slots[i].lock();
      fill[i] = slot && !slot->recomputed.defined() && !held[i].alive(metas[i]);
    }
  }
  return fill;
}

bool Frame::run_filling_slots(const std::vector<at::Tensor>& values, bool in_forward, size_t limit,
                              const std::vector<bool>& fill, size_t& next) {
  Region& r = *region;
  // Also puts the RNG back afterwards: the forward goes on as it would have.
  std::optional<RngReplay> replay;
  try {
    replay.emplace(r);
  } catch (const Error& e) {
    if (!in_forward) throw;
    throw Error(str(r.options.name, ": a backward inside fn needs saved tensors that fn freed, and "
                    "recomputing them needs the RNG state fn started with, which cannot be "
                    "put back here (", e.what(), "); run that backward outside the fork"));
  }
  at::AutoGradMode grad(true);
  saved_tensors_hooks scope(
      [&](const at::Tensor& t) -> std::any {
        at::Tensor kept = fill_slot(t, next, fill);
        if (++next == limit) throw StopRecompute{};
        // A backward inside fn (torch::autograd::grad) runs on the
        // recompute's own graph and reads it back.
        return kept;
      },
      [](const std::any& packed) { return std::any_cast<const at::Tensor&>(packed); });
  std::vector<std::string> ops;
  try {
    InsideRegion inside;
    run_fn(r, values, SelectiveOpScope::Mode::kReplay, ops);
  } catch (const StopRecompute&) {
    return true;
  }
  return false;
}

at::Tensor Frame::fill_slot(const at::Tensor& t, size_t index, const std::vector<bool>& fill) {
  const std::string& name = region->options.name;
  if (index >= slots.size()) {
    throw Error(str(name, ": the recompute saved more tensors for backward than the "
                    "forward (", slots.size(), "); fn must compute the same thing both "
                    "times (data-dependent control flow or state changed between "
                    "forward and backward?)"));
  }
  if (region->options.determinism_check) {
    const TensorMeta now = TensorMeta::of(t);
    if (now != metas[index]) {
      throw Error(str(name, ": saved tensor #", index, " of the recompute is ", now.str(),
                      " but the forward saved ", metas[index].str(), "; fn must compute "
                      "the same thing both times (turn the check off with "
                      "CheckpointOptions::determinism_check = false only if you know "
                      "why)"));
    }
  }
  at::Tensor kept = t.detach();
  if (fill[index]) {
    if (auto slot = slots[index].lock()) slot->recomputed = kept;
  }
  return kept;
}

// Marks the region's forward as running while fn runs, with the arguments a
// recompute inside it starts from. When fn returns or throws, what a backward
// inside fn recomputed and did not read goes: the outer backward recomputes
// as usual.
class ForwardRunning {
 public:
  ForwardRunning(Frame& frame, const std::vector<at::Tensor>& inputs) : frame_(frame) {
    std::lock_guard<std::recursive_mutex> lock(frame_.mutex);
    frame_.forward_running = true;
    frame_.forward_thread = std::this_thread::get_id();
    frame_.forward_inputs = inputs;
    for (const auto& t : inputs) {
      frame_.forward_versions.push_back(t.is_inference() ? 0 : t._version());
    }
  }
  ~ForwardRunning() {
    std::lock_guard<std::recursive_mutex> lock(frame_.mutex);
    frame_.drop_recomputed();
    frame_.forward_running = false;
    std::vector<Held>().swap(frame_.held);
    frame_.forward_inputs.clear();
    frame_.forward_versions.clear();
  }
  ForwardRunning(const ForwardRunning&) = delete;
  ForwardRunning& operator=(const ForwardRunning&) = delete;

 private:
  Frame& frame_;
};

}  // namespace

c10::IValue internal::checkpoint_non_reentrant(const CheckpointFn& fn, std::vector<c10::IValue> args,
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
          f->held.emplace_back(t);
          return slot;
        },
        [](const std::any& packed) {
          const auto& slot = std::any_cast<const std::shared_ptr<Slot>&>(packed);
          return slot->frame->unpack(*slot);
        });
    try {
      InsideRegion inside;
      ForwardRunning running(*frame, inputs);
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
    add_profile(r, delta);
  }
  return output;
}

}  // namespace remat
