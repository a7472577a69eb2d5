// The model state one rank holds, in bytes, for the estimator
// (engine/memory_estimate.cc) and the engine's budget check
// (resident_state.cc): parallel's memory rule (parallel/zero_memory.h: what
// each rank holds and where, offload in it) over the parameters' sizes,
// priced at the optimizer's state bytes per element.
//
//   const StateBytes s = state_bytes(params, /*element_bytes=*/4, config, /*stage=*/3,
//                                    /*shard_group=*/8, /*accumulation=*/1);
//   // s.params + s.grads + s.optimizer on the device; s.host_optimizer + s.host_params on the host
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config.h"
#include "parallel/zero_memory.h"

namespace remat::internal {

// One stage's model state, per rank.
struct StateBytes {
  int64_t params = 0, grads = 0, optimizer = 0, gathered = 0, comm = 0;
  int64_t host_optimizer = 0;  // offload_optimizer: what the host holds
  // offload_optimizer.device "nvme": the state file's bytes under nvme_path
  // (the moments, each sub-group's arrays padded to 4096); host_optimizer
  // then holds the masters, their gradients and the buffers, not the moments.
  int64_t disk = 0;
  // offload_optimizer.device "nvme": the float32 masters' file (not in
  // host_optimizer, which keeps their gradients).
  int64_t disk_masters = 0;
  // offload_param (stage 3): the float32 shards and their gradients on the
  // host, and without offload_optimizer the optimizer's state of them.
  int64_t host_params = 0;
  // offload_param "nvme": the shards' bytes in its file (not in host_params).
  int64_t disk_params = 0;
  int64_t full_trainable = 0;  // every trainable parameter's bytes (a stage-0 backward's gradients)
};

// The accumulation window's micro-steps (1 where the batch sizes do not resolve here).
int64_t accumulation_of(const Config& config, int dp);

// `stage`'s state of `params` (`element_bytes` each: the model's) sharded
// within groups of `shard_group` ranks, offloaded as `config` asks;
// `accumulation`: the micro-steps of a window.
StateBytes state_bytes(const std::vector<parallel::ParameterCount>& params, int64_t element_bytes,
                       const Config& config, int stage, int shard_group, int64_t accumulation);

}  // namespace remat::internal
