// The model state one rank holds under a ZeRO stage, in bytes, for the
// estimator (engine/memory_estimate.cc): the stage's memory rule
// (parallel/zero_memory.h, which the engine's live accounting applies too)
// over the parameters' sizes, with the optimizer offloaded as asked and
// stage 3's parameters as the config offloads them.
//
//   const StateBytes s = state_bytes(inputs, config, /*stage=*/3, /*shard_group=*/8, /*accumulation=*/0);
//   // s.params + s.grads + s.optimizer on the device; s.host_optimizer + s.host_params on the host
#pragma once

#include <cstdint>

#include "engine/config.h"
#include "engine/memory_estimate.h"

namespace remat::internal {

// One stage's model state, per rank.
struct StateBytes {
  int64_t params = 0, grads = 0, optimizer = 0, gathered = 0, comm = 0;
  int64_t host_optimizer = 0;  // offload_optimizer: what the host holds
  // offload_param (stage 3): the float32 shards and their gradients on the
  // host, and without offload_optimizer the optimizer's state of them.
  int64_t host_params = 0;
  int64_t full_trainable = 0;  // every trainable parameter's bytes (a stage-0 backward's gradients)
};

// The accumulation window's micro-steps (1 where the batch sizes do not resolve here).
int64_t accumulation_of(const Config& config, int dp);

// `stage`'s state sharded within groups of `shard_group` ranks;
// `accumulation`: the micro-steps of a window, when the optimizer is
// offloaded (0: it is not).
StateBytes state_bytes(const MemoryEstimateInputs& in, const Config& config, int stage, int shard_group,
                       int64_t accumulation);

}  // namespace remat::internal
