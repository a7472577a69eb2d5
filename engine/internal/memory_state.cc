#include "engine/internal/memory_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <vector>

#include "parallel/zero_memory.h"
#include "parallel/zero_options.h"
#include "runtime/error.h"

namespace remat::internal {
namespace {

// Optimizer state bytes per trainable element of the optimizer's type.
int64_t optimizer_bytes_per_element(const OptimizerConfig& o) {
  if (o.type == "SGD") return o.momentum > 0 ? 4 : 0;
  return 8;  // AdamW, Adam: two moments
}

// zero_optimization.offload_optimizer (parallel/zero_offload.h): the host
// holds the float32 master of every element the optimizer steps, its
// gradient buffer and the optimizer's state (what a run's metrics report as
// host_optimizer_bytes); the device keeps its parameters (the stage gathers
// from them; under bf16 or fp16 the 16-bit ones alone, the frozen masters on
// the host too: parallel::masters_on_host) and, in the last micro-step,
// drops each gradient shard as its reduction ends: stages 1-2 hold the
// buckets' whole gradients, stage 3 its largest unit's shard and the
// persistent parameters' (what a run reports as grad_peak_bytes).
// Accumulating, the shards stay on the device between micro-batches: the
// gradients as without offload. offload_param's host shards are the masters
// themselves: no copy of them, no gradient buffer.
void offload_optimizer_state(StateBytes& s, const parallel::StateElements& e, const MemoryEstimateInputs& in,
                             const parallel::ZeroOptions& z, const parallel::MixedPrecision& mixed, int n,
                             int64_t eb, int64_t accumulation) {
  s.host_optimizer = (e.local_trainable - e.host_trainable) * (4 + 4) + s.optimizer + e.host_frozen * 4;
  s.optimizer = 0;
  if (accumulation > 1) return;
  if (z.stage < 3) {
    s.grads = e.trainable * eb;
    return;
  }
  // Stage 3: the persistent parameters' gradients, whole on every rank until
  // the backward's end, beside the largest unit's reduced shard.
  const int64_t persistence = parallel::stage3_persistence_threshold(z, mixed);
  std::map<int, int64_t> unit_shard;
  int64_t persistent = 0;
  for (const ParameterSize& p : in.parameters) {
    if (!p.trainable) continue;
    if (p.numel < persistence) {
      persistent += p.numel;
    } else {
      unit_shard[p.unit] += (p.numel + n - 1) / n;
    }
  }
  int64_t largest = 0;
  for (const auto& [unit, elements] : unit_shard) largest = std::max(largest, elements);
  s.grads = (persistent + largest) * eb;
}

}  // namespace

int64_t accumulation_of(const Config& config, int dp) {
  try {
    return config.resolve_batch(dp).gradient_accumulation_steps;
  } catch (const Error&) {
    return 1;
  }
}

StateBytes state_bytes(const MemoryEstimateInputs& in, const Config& config, int stage, int n,
                       int64_t accumulation) {
  parallel::ZeroOptions z = config.zero_optimization;
  z.stage = stage;
  z.offload_optimizer.device = accumulation > 0 ? parallel::OffloadDevice::kCpu : parallel::OffloadDevice::kNone;
  // bf16 or fp16: float32 masters (stage 3: shards, every parameter sharded,
  // units gathered in 16 bits; stages 0-2: whole, each with a 16-bit copy the
  // model computes with). in.element_bytes is the profiled model's (2 in a
  // live 16-bit profile, whose backward allocated 16-bit gradients).
  const parallel::MixedPrecision mixed = parallel::mixed_precision(config.bf16, config.fp16.enabled);
  const bool half = mixed.compute_dtype != at::kFloat;
  const int64_t eb = half ? 4 : in.element_bytes;
  const int64_t gathered_eb = half ? 2 : in.element_bytes;
  const int64_t per_opt = optimizer_bytes_per_element(config.optimizer);
  std::vector<parallel::ParameterCount> params;
  params.reserve(in.parameters.size());
  for (const ParameterSize& p : in.parameters) params.push_back({p.numel, p.trainable, p.unit});
  const parallel::StateElements e = parallel::state_elements(z, mixed, n, params);
  StateBytes s;
  s.params = e.stored * eb + e.compute_copies * 2;
  s.grads = e.gradients.peak * eb;
  s.optimizer = e.local_trainable * per_opt;
  s.gathered = e.gathered * gathered_eb;
  // The buffers of the collectives: stages 1-2's gradient bucket (inside
  // grads), stage 3's gathered units.
  s.comm = e.bucket * eb + s.gathered;
  s.full_trainable = e.trainable * in.element_bytes;
  // offload_param: float32 shards and gradients on the host (4 bytes each).
  s.host_params = (e.host_shards + e.host_trainable) * 4;
  if (accumulation > 0) {
    offload_optimizer_state(s, e, in, z, mixed, n, eb, accumulation);
  } else {
    // LibTorch's optimizer makes its state beside what it steps: the host shards' on the host.
    s.host_params += e.host_trainable * per_opt;
    s.optimizer -= e.host_trainable * per_opt;
  }
  return s;
}

}  // namespace remat::internal
