#include "engine/internal/memory_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "optim/options.h"
#include "parallel/zero_options.h"
#include "runtime/error.h"

namespace remat::internal {

int64_t accumulation_of(const Config& config, int dp) {
  try {
    return config.resolve_batch(dp).gradient_accumulation_steps;
  } catch (const Error&) {
    return 1;
  }
}

// What the rule's elements take: bf16 or fp16 keep float32 masters (stage 3:
// shards, every parameter sharded, units gathered in 16 bits; stages 0-2:
// whole, each with a 16-bit copy the model computes with); `element_bytes`
// is the profiled model's otherwise (2 in a live 16-bit profile, whose
// backward allocated 16-bit gradients). offload_optimizer: the host holds
// the float32 masters with their gradient buffers, the optimizer's state and
// the frozen parameters' float32 values (masters_on_host); LibTorch's
// optimizer otherwise makes its state beside what it steps: offload_param's
// host shards' on the host.
namespace {

int64_t aligned(int64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// offload_optimizer.device "nvme" (parallel/internal/nvme_optimizer_store.h):
// the file of `elements` elements' moments in sub-groups, and the buffers
// they stream through (no more than the sub-groups).
std::pair<int64_t, int64_t> nvme_file_and_buffers(const Config& config, int64_t elements) {
  const int64_t group = std::max<int64_t>(1, config.deepspeed_tuning.sub_group_size.value_or(1000000000));
  const int64_t groups = (elements + group - 1) / group;
  if (groups == 0) return {0, 0};
  const int64_t last = elements - (groups - 1) * group;
  const int64_t file = 2 * ((groups - 1) * aligned(4 * group) + aligned(4 * last));
  const int64_t record = 2 * aligned(4 * std::min(group, elements));
  const int64_t buffers = std::max<int64_t>(1, std::min<int64_t>(config.zero_optimization.offload_optimizer.buffer_count,
                                                                 groups));
  return {file, buffers * record};
}

}  // namespace

StateBytes state_bytes(const std::vector<parallel::ParameterCount>& params, int64_t element_bytes,
                       const Config& config, int stage, int n, int64_t accumulation) {
  parallel::ZeroOptions z = config.zero_optimization;
  z.stage = stage;
  const parallel::MixedPrecision mixed = parallel::mixed_precision(config.bf16, config.fp16.enabled);
  const bool half = mixed.compute_dtype != at::kFloat;
  const int64_t eb = half ? 4 : element_bytes;
  const int64_t gathered_eb = half ? 2 : element_bytes;
  const int64_t per_opt = optim::state_bytes_per_element(config.optimizer);
  const parallel::StateElements e = parallel::state_elements(z, mixed, n, params, accumulation);
  StateBytes s;
  s.params = e.stored * eb + e.compute_copies * 2;
  s.grads = e.gradients.peak * eb;
  s.gathered = e.gathered * gathered_eb;
  // The buffers of the collectives: stages 1-2's gradient bucket (inside
  // grads), stage 3's gathered units.
  s.comm = e.bucket * eb + s.gathered;
  s.full_trainable = e.trainable * element_bytes;
  // offload_param: float32 shards and gradients on the host (4 bytes each).
  // With its "nvme", the shards past max_in_cpu are on disk instead.
  s.host_params = (e.host_shards - e.disk_shards + e.host_trainable) * 4;
  s.disk_params = e.disk_shard_bytes;
  const int64_t state = e.local_trainable * per_opt;
  if (e.optimizer_on_host && config.zero_optimization.offload_optimizer.on_nvme() && per_opt == 8) {
    // The moments on disk, in the buffers on the host; the float32 masters
    // (the frozen ones' too) mapped from their own file, laid end to end:
    // the host keeps their gradients.
    const auto [file, buffers] = nvme_file_and_buffers(config, e.local_trainable);
    s.disk = file;
    s.disk_masters = aligned(4 * (e.host_masters + e.host_frozen));
    s.host_optimizer = e.host_masters * 4 + buffers;
  } else if (e.optimizer_on_host) {
    s.host_optimizer = e.host_masters * (4 + 4) + state + e.host_frozen * 4;
  } else {
    s.optimizer = state - e.host_trainable * per_opt;
    s.host_params += e.host_trainable * per_opt;
  }
  return s;
}

}  // namespace remat::internal
