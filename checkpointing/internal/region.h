// One checkpoint region's state between its forward and its recompute, and
// the pieces the two kinds of region share (internal to checkpointing/):
// reentrant regions (checkpoint.cc, a custom autograd Function that runs fn
// without a graph and backpropagates through the recompute) and non-reentrant
// ones (non_reentrant.cc, fn runs with grad and what autograd saves inside is
// recomputed through saved-tensor hooks).
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpointing/region_options.h"
#include "checkpointing/selective_op.h"
#include "checkpointing/stored_inputs.h"
#include "rng/rng_tracker.h"
#include "runtime/context.h"

namespace torch {
namespace autograd {
struct Node;
}
}  // namespace torch

namespace remat::internal {

struct CheckpointingState;

struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  at::Device device;

  static TensorMeta of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type(), t.device()}; }
  bool operator==(const TensorMeta& o) const {
    return sizes == o.sizes && dtype == o.dtype && device == o.device;
  }
  bool operator!=(const TensorMeta& o) const { return !(*this == o); }
  std::string str() const;
};

// Everything a region needs between forward and backward.
struct Region {
  // The context current at the forward, and its checkpointing state: the
  // recompute runs under it and the region counts into it (make_region sets both).
  std::shared_ptr<Context> context;
  CheckpointingState* state = nullptr;
  CheckpointFn fn;
  CheckpointOptions options;
  c10::IValue args;  // tuple of the arguments, tensors replaced by placeholders
  size_t n_tensors = 0;
  bool has_dummy = false;
  std::vector<bool> input_requires_grad;
  RngSnapshot rng;
  c10::IValue forward_output;  // handed back to the caller, then dropped
  std::vector<TensorMeta> outputs;
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
  void count(int64_t bytes);
  int64_t counted_bytes = 0;
  ~Region();
};

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start);
// Adds `delta` to the profile of the region's name in the region's context.
void add_profile(const Region& region, const RegionProfile& delta);
void synchronize_if(bool enabled);

// Tensors inside nested values, collected in a fixed order and put back in the
// same order. Undefined tensors count as None, not as tensors.
void collect_tensors(const c10::IValue& v, std::vector<at::Tensor>& out, const std::string& where);
c10::IValue with_tensors(const c10::IValue& v, const std::vector<at::Tensor>& values);
// Storage-free stand-ins, so that the region's structure holds no data.
std::vector<at::Tensor> placeholders(size_t n);

// A new region for `fn` on `args` (grad mode on) in the current context:
// options, the arguments' structure, which inputs require grad. `inputs`
// receives the tensor inputs.
std::shared_ptr<Region> make_region(const CheckpointFn& fn, std::vector<c10::IValue> args,
                                    const CheckpointOptions& options, std::vector<at::Tensor>& inputs);

// Registers a region with stored inputs (checkpoint_stored_tensors).
void track_region(const std::shared_ptr<Region>& region);

// Stores the inputs `options.storage` selects (partitioned, offloaded,
// contiguous) in region.stored; returns which were stored.
std::vector<bool> store_inputs(Region& region, const std::vector<at::Tensor>& inputs,
                               const std::shared_ptr<Region>& owner);

// Records the inputs' versions now: later changes are refused by check_input_versions.
void record_input_versions(Region& region, const std::vector<at::Tensor>& inputs);
// An input changed in place since record_input_versions would be recomputed
// from the changed value: an Error naming the input and what to do.
void check_input_versions(const Region& region);

// Puts the RNG state the forward saw in place, and the current one back afterwards.
class RngReplay {
 public:
  explicit RngReplay(const Region& region);
  ~RngReplay();
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  bool active_;
  RngSnapshot now_;
};

// Puts the forward's RNG state back after fn threw half-way (the caller then
// rethrows fn's exception, whatever the restore says).
void restore_rng_after_throw(const Region& region);

// Runs the region's fn on `tensors` with the selective-op cache recording or
// replaying, and the op recorder on when debugging (its ops go to `ops`).
c10::IValue run_fn(Region& region, const std::vector<at::Tensor>& tensors,
                   SelectiveOpScope::Mode mode, std::vector<std::string>& ops);

// Logs the op sequences of forward and recompute (options.debug) and warns
// when they differ.
void log_op_sequences(const Region& region, const std::vector<std::string>& recompute_ops);

// The non-reentrant region's forward (non_reentrant.cc).
c10::IValue checkpoint_non_reentrant(const CheckpointFn& fn, std::vector<c10::IValue> args,
                                     const CheckpointOptions& options);

}  // namespace remat::internal
