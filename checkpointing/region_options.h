// The options of one checkpoint region (remat::checkpoint, checkpoint.h):
// how it recomputes, what it keeps, and how its inputs are stored
// (partitioned, offloaded, contiguous: stored_inputs.h). Their own room, so
// that the regions' internal state (internal/state.h, internal/region.h)
// holds them without including the API that runs regions.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "checkpointing/options.h"
#include "nn/ivalue_codec.h"

namespace remat {

class Communicator;
class ContiguousBuffers;  // stored_inputs.h

// offload_min_bytes, offload_max_in_flight and offload_keep_last come from
// OffloadSettings (checkpointing/options.h), where they are documented.
struct InputStorageOptions : OffloadSettings {
  // Keep 1/size of each input on each rank of this group (null or size 1: whole).
  std::shared_ptr<Communicator> partition_group;
  bool offload = false;
  // Slots for the kept tensors (null: each is its own allocation).
  std::shared_ptr<ContiguousBuffers> contiguous;

  bool partitioned() const;
  // Whether any input is stored rather than kept as it is.
  bool active() const { return partitioned() || offload; }
};

struct CheckpointOptions {
  // Reentrant (a custom autograd Function) or non-reentrant (saved-tensor
  // hooks) regions: see above. activation_checkpointing.reentrant in JSON.
  bool reentrant = false;
  // Replay the forward's RNG state during recompute (dropout matches bitwise).
  bool preserve_rng_state = true;
  // Compare the recomputed outputs' shape, dtype and device with the forward's.
  bool determinism_check = true;
  // Log the op sequences of forward and recompute (debug level).
  bool debug = false;
  // Synchronize the device at region boundaries (synchronize_checkpoint_boundary).
  bool synchronize = false;
  // Time forward, recompute and backward per region (see checkpoint_profile()).
  bool profile = false;
  // Names the region in errors, logs and the profile.
  std::string name = "checkpoint";
  // selective_op: these ops' outputs are kept from the forward and reused by the
  // recompute (see selective_op.h and resolve_save_ops). Null: recompute all.
  std::shared_ptr<const std::set<std::string>> save_ops;
  // Also keep the outputs of the tensor-parallel collectives
  // (collective_save_ops()) so that the recompute communicates nothing, at the
  // cost of holding them until the backward. activation_checkpointing.save_collectives.
  bool save_collectives = false;
  // Partitioned, offloaded and contiguous storage of the inputs (stored_inputs.h).
  InputStorageOptions storage;
};

using CheckpointFn = IValueFn;

// Per-region timings, aggregated until reset.
struct RegionProfile {
  int64_t calls = 0;
  int64_t recomputes = 0;
  double forward_ms = 0;
  double recompute_ms = 0;
  double backward_ms = 0;  // recompute plus the backward through it
};

}  // namespace remat
