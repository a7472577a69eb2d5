#include "checkpointing/internal/region.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <mutex>

#include "checkpointing/internal/state.h"
#include "checkpointing/op_recorder.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory_trace.h"

namespace remat::internal {

std::string TensorMeta::str() const {
  return remat::str(c10::toString(dtype), " ", c10::IntArrayRef(sizes), " on ", device.str());
}

void Region::count(int64_t bytes) {
  counted_bytes += bytes;
  state->saved_bytes += bytes;
}

Region::~Region() {
  if (state != nullptr) state->saved_bytes -= counted_bytes;
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void add_profile(const Region& region, const RegionProfile& delta) {
  auto& state = *region.state;
  std::lock_guard<std::mutex> lock(state.profile_mutex);
  auto& p = state.profile[region.options.name];
  p.calls += delta.calls;
  p.recomputes += delta.recomputes;
  p.forward_ms += delta.forward_ms;
  p.recompute_ms += delta.recompute_ms;
  p.backward_ms += delta.backward_ms;
}

void synchronize_if(bool enabled) {
  if (enabled && torch::cuda::is_available()) torch::cuda::synchronize();
}

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

namespace {

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

std::string join(const std::vector<std::string>& ops) {
  std::string out;
  for (const auto& op : ops) out += (out.empty() ? "" : " ") + op;
  return out;
}

}  // namespace

c10::IValue with_tensors(const c10::IValue& v, const std::vector<at::Tensor>& values) {
  size_t index = 0;
  c10::IValue out = replace_tensors(v, values, index);
  REMAT_CHECK_EQ(index, values.size(), "checkpoint: tensor structure changed");
  return out;
}

std::vector<at::Tensor> placeholders(size_t n) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < n; ++i) out.push_back(at::empty({0}, at::TensorOptions().device(at::kMeta)));
  return out;
}

std::shared_ptr<Region> make_region(const CheckpointFn& fn, std::vector<c10::IValue> args,
                                    const CheckpointOptions& options,
                                    std::vector<at::Tensor>& inputs) {
  auto region = std::make_shared<Region>();
  region->context = Context::current_shared();
  region->state = &region->context->get<CheckpointingState>();
  region->fn = fn;
  region->options = options;
  c10::IValue packed(c10::ivalue::Tuple::create(std::move(args)));
  inputs.clear();
  collect_tensors(packed, inputs, options.name + " argument");
  region->n_tensors = inputs.size();
  region->args = with_tensors(packed, placeholders(inputs.size()));
  for (const auto& t : inputs) region->input_requires_grad.push_back(t.requires_grad());
  return region;
}

void track_region(const std::shared_ptr<Region>& region) {
  auto& state = *region->state;
  std::lock_guard<std::mutex> lock(state.regions_mutex);
  auto& regions = state.regions;
  regions.erase(std::remove_if(regions.begin(), regions.end(),
                               [](const auto& w) { return w.expired(); }),
                regions.end());
  regions.push_back(region);
}

std::vector<bool> store_inputs(Region& region, const std::vector<at::Tensor>& inputs,
                               const std::shared_ptr<Region>& owner) {
  std::vector<bool> store(inputs.size(), false);
  if (region.options.storage.active()) {
    store = StoredInputs::select(inputs, region.options.storage, region.options.name);
  }
  // On a memory trace, inputs kept as they are count as checkpoint inputs
  // (a parameter passed in stays a parameter); stored ones are counted where
  // they are stored.
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!store[i] && t.defined() && !(t.is_leaf() && t.requires_grad())) {
      classify_memory(t, MemoryCategory::kCheckpointInputs);
    }
  }
  if (std::count(store.begin(), store.end(), true) > 0) {
    region.stored = std::make_unique<StoredInputs>(inputs, store, region.options.storage,
                                                   region.options.name);
    track_region(owner);
  }
  return store;
}

void record_input_versions(Region& region, const std::vector<at::Tensor>& inputs) {
  region.input_versions.clear();
  region.versions_at_forward.clear();
  for (const auto& t : inputs) {
    region.input_versions.push_back(t.unsafeGetTensorImpl()->version_counter());
    region.versions_at_forward.push_back(t.is_inference() ? 0 : t._version());
  }
}

void check_input_versions(const Region& region) {
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

RngReplay::RngReplay(const Region& region) : active_(region.options.preserve_rng_state) {
  if (!active_) return;
  now_ = capture_rng();
  restore_rng(region.rng);
}

RngReplay::~RngReplay() {
  if (active_) restore_rng(now_);
}

void restore_rng_after_throw(const Region& region) {
  if (!region.options.preserve_rng_state) return;
  try {
    restore_rng(region.rng);
  } catch (const std::exception& e) {
    log().warn("{}: fn threw, and the RNG could not be put back: {}", region.options.name,
               e.what());
  }
}

c10::IValue run_fn(Region& region, const std::vector<at::Tensor>& tensors,
                   SelectiveOpScope::Mode mode, std::vector<std::string>& ops) {
  std::unique_ptr<OpRecorder> recorder;
  if (region.options.debug) recorder = std::make_unique<OpRecorder>();
  std::unique_ptr<SelectiveOpScope> selective;
  const SaveOps* save_ops = region.options.save_ops.get();
  SaveOps with_collectives;
  if (region.options.save_collectives) {
    static const SaveOps collectives = resolve_save_ops(collective_save_ops());
    with_collectives = collectives;
    if (save_ops) with_collectives.insert(save_ops->begin(), save_ops->end());
    save_ops = &with_collectives;
  }
  if (save_ops) selective = std::make_unique<SelectiveOpScope>(*save_ops, region.selective, mode);
  c10::IValue output = region.fn(with_tensors(region.args, tensors).toTupleRef().elements().vec());
  if (recorder) ops = recorder->ops();
  return output;
}

void log_op_sequences(const Region& region, const std::vector<std::string>& recompute_ops) {
  if (!region.options.debug) return;
  const std::string& name = region.options.name;
  log().debug("{} forward ops: {}", name, join(region.forward_ops));
  log().debug("{} recompute ops: {}", name, join(recompute_ops));
  if (recompute_ops != region.forward_ops) {
    log().warn("{}: the recompute ran other ops than the forward (see debug log)", name);
  }
}

}  // namespace remat::internal
