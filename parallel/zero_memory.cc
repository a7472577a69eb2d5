#include "parallel/zero_memory.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <map>

#include "parallel/zero_options.h"

namespace remat::parallel {
namespace {

// Stage 3 with the optimizer offloaded, in a window's last micro-step: the
// persistent parameters' gradients, whole on every rank until the
// backward's end, beside the largest unit's reduced shard before it goes to
// the host.
int64_t stage3_offloaded_peak(const ZeroOptions& options, const MixedPrecision& mixed, int shard_group,
                              const std::vector<ParameterCount>& params) {
  const int64_t persistence = stage3_persistence_threshold(options, mixed);
  std::map<int, int64_t> unit_shard;
  int64_t persistent = 0;
  for (const ParameterCount& p : params) {
    if (!p.trainable) continue;
    if (p.numel < persistence) {
      persistent += p.numel;
    } else {
      unit_shard[p.unit] += (p.numel + shard_group - 1) / shard_group;
    }
  }
  int64_t largest = 0;
  for (const auto& [unit, elements] : unit_shard) largest = std::max(largest, elements);
  return persistent + largest;
}

}  // namespace

bool optimizer_on_host(const ZeroOptions& options) {
  return options.stage >= 1 && options.offload_optimizer.enabled();
}

// Every gradient, whole, from the backward to the step.
GradientHold data_parallel_gradients(int64_t trainable, int64_t /*local_trainable: the same*/) {
  return {trainable, trainable};
}

// Every rank stores every parameter and steps every trainable one.
StateElements data_parallel_state(const std::vector<ParameterCount>& params) {
  StateElements s;
  for (const ParameterCount& p : params) {
    s.stored += p.numel;
    if (p.trainable) s.trainable += p.numel;
  }
  s.local_trainable = s.trainable;
  s.gradients = data_parallel_gradients(s.trainable, s.local_trainable);
  return s;
}

// Each gradient is moved into its bucket's flat buffer; the rank keeps its
// shard's. Between micro-batches stage 1 holds every gradient, stage 2 its
// shard's.
GradientHold stage12_gradients(const ZeroOptions& options, int64_t trainable, int64_t local_trainable) {
  return {trainable + local_trainable, options.stage == 1 ? trainable : local_trainable};
}

// Every rank stores every parameter whole; its optimizer steps 1/N of the
// trainable ones.
StateElements stage12_state(const ZeroOptions& options, int shard_group, const std::vector<ParameterCount>& params) {
  StateElements s;
  for (const ParameterCount& p : params) {
    s.stored += p.numel;
    if (p.trainable) s.trainable += p.numel;
  }
  s.local_trainable = (s.trainable + shard_group - 1) / shard_group;
  s.gradients = stage12_gradients(options, s.trainable, s.local_trainable);
  s.bucket = std::min<int64_t>(s.trainable, options.reduce_bucket_size);
  return s;
}

// The shards' gradients alone, from the reduce-scatter to the step.
GradientHold stage3_gradients(int64_t /*trainable*/, int64_t local_trainable) {
  return {local_trainable, local_trainable};
}

// Each parameter below the persistence threshold whole (none with mixed precision),
// every other one in 1/N; at most two units' sharded parameters gathered at
// once: the unit computing and the one prefetched beside it (the next in
// forward, the previous in backward), when it is within the prefetch size
// and the two within stage3_max_live_parameters. offload_param: the shards
// on the host (StateElements::host_shards).
StateElements stage3_state(const ZeroOptions& options, const MixedPrecision& mixed, int shard_group,
                           const std::vector<ParameterCount>& params) {
  const int64_t persistence = stage3_persistence_threshold(options, mixed);
  StateElements s;
  std::map<int, int64_t> unit_sharded;  // block -> its sharded elements
  std::map<int, int64_t> unit_shard_trained;  // unit (-1: the root) -> its trained shards' elements
  for (const ParameterCount& p : params) {
    if (p.trainable) s.trainable += p.numel;
    const bool persistent = p.numel < persistence;
    const int64_t local = persistent ? p.numel : (p.numel + shard_group - 1) / shard_group;
    s.stored += local;
    if (p.trainable) s.local_trainable += local;
    if (!persistent && p.unit >= 0) unit_sharded[p.unit] += p.numel;
    if (persistent) continue;
    s.host_shards += local;
    if (p.trainable) {
      s.host_trainable += local;
      unit_shard_trained[p.unit] += local;
    }
  }
  s.gradients = stage3_gradients(s.trainable, s.local_trainable);
  if (options.offload_param.on_nvme()) {
    // The units' shards placed in order, each kind (replicated or split
    // over the tensor-parallel ranks, trained or frozen: the stage's order)
    // a shard of its own: in memory while within max_in_cpu, else in the file.
    std::map<int, std::array<int64_t, 4>> unit_kinds;  // unit -> elements of each kind
    for (const ParameterCount& p : params) {
      if (p.numel < persistence) continue;
      unit_kinds.try_emplace(p.unit, std::array<int64_t, 4>{});
      unit_kinds[p.unit][(p.tp_sharded ? 2 : 0) + (p.trainable ? 0 : 1)] += p.numel;
    }
    int64_t in_cpu = 0;
    auto place = [&](const std::array<int64_t, 4>& kinds) {
      for (const int64_t whole : kinds) {
        const int64_t shard = (whole + shard_group - 1) / shard_group;
        if (shard == 0 || in_cpu + shard <= options.offload_param.max_in_cpu) {
          in_cpu += shard;
          continue;
        }
        s.disk_shards += shard;
      }
    };
    for (const auto& [unit, kinds] : unit_kinds) {
      if (unit >= 0) place(kinds);  // the root is flattened last
    }
    if (auto root = unit_kinds.find(-1); root != unit_kinds.end()) place(root->second);
    s.disk_shard_bytes = (4 * s.disk_shards + 4095) / 4096 * 4096;  // laid end to end, up to the page
  }
  if (options.offload_param.enabled()) {
    // The device keeps the persistent parameters and their gradients, and a
    // unit's reduced shard until it is copied into the host shard's gradient.
    int64_t largest = 0;
    for (const auto& [unit, elements] : unit_shard_trained) largest = std::max(largest, elements);
    s.stored -= s.host_shards;
    const int64_t persistent_trained = s.local_trainable - s.host_trainable;
    s.gradients = {persistent_trained + largest, persistent_trained};
  } else {
    s.host_shards = s.host_trainable = 0;
  }
  for (auto it = unit_sharded.begin(); it != unit_sharded.end(); ++it) {
    auto next = std::next(it);
    const bool adjacent = next != unit_sharded.end() && next->first == it->first + 1;
    const bool prefetched = adjacent && next->second <= options.stage3_prefetch_bucket_size &&
                            it->second + next->second <= options.stage3_max_live_parameters;
    s.gathered = std::max(s.gathered, it->second + (prefetched ? next->second : 0));
  }
  return s;
}

StateElements state_elements(const ZeroOptions& options, const MixedPrecision& mixed, int shard_group,
                             const std::vector<ParameterCount>& params, int64_t accumulation) {
  StateElements s;
  switch (options.stage) {
    case 0: s = data_parallel_state(params); break;
    case 1:
    case 2: s = stage12_state(options, shard_group, params); break;
    default: s = stage3_state(options, mixed, shard_group, params); break;
  }
  // Stages 0-2: every parameter is whole on every rank, its 16-bit copy too.
  if (mixed.enabled() && options.stage < 3) s.compute_copies = s.stored;
  if (masters_on_host(options, mixed)) {
    s.compute_copies = s.stored;
    s.host_frozen = s.stored - (options.stage < 3 ? s.trainable : s.local_trainable);
    s.stored = 0;
  }
  if (optimizer_on_host(options)) {
    // The host masters: what the optimizer steps, less offload_param's shards (masters already).
    s.optimizer_on_host = true;
    s.host_masters = s.local_trainable - s.host_trainable;
    // Accumulating, the shards stay on the device between micro-batches:
    // the gradients' peak is the stage's own.
    if (accumulation <= 1) {
      s.gradients.peak =
          options.stage < 3 ? s.trainable : stage3_offloaded_peak(options, mixed, shard_group, params);
    }
  }
  return s;
}

}  // namespace remat::parallel
