#include "parallel/zero_options.h"

#include "runtime/error.h"

namespace remat::parallel {

std::string check_zero_options(const ZeroOptions& z) {
  std::string problems;
  auto add = [&](const std::string& problem) { problems += (problems.empty() ? "" : "\n") + problem; };
  if (z.stage < 0 || z.stage > 3) {
    add(str("'zero_optimization.stage' = ", z.stage, " must be 0, 1, 2 or 3"));
  }
  if (z.reduce_bucket_size < 1) {
    add(str("'zero_optimization.reduce_bucket_size' = ", z.reduce_bucket_size,
            " must be at least 1 (elements per reduce)"));
  }
  if (z.allgather_bucket_size < 1) {
    add(str("'zero_optimization.allgather_bucket_size' = ", z.allgather_bucket_size,
            " must be at least 1 (elements per all-gather)"));
  }
  if (z.hybrid_shard_size < 0) {
    add(str("'zero_optimization.hybrid_shard_size' = ", z.hybrid_shard_size,
            " must be >= 0 (0 shards over every data-parallel rank)"));
  }
  if (z.hybrid_shard_size > 0 && z.stage == 0) {
    add(str("'zero_optimization.hybrid_shard_size' = ", z.hybrid_shard_size,
            " shards within groups, but stage 0 shards nothing: set zero_optimization.stage "
            "to 1, 2 or 3, or leave hybrid_shard_size out"));
  }
  if (z.stage3_prefetch_bucket_size < 0) {
    add(str("'zero_optimization.stage3_prefetch_bucket_size' = ", z.stage3_prefetch_bucket_size,
            " must be >= 0 (0 turns prefetching off)"));
  }
  if (z.stage3_param_persistence_threshold < 0) {
    add(str("'zero_optimization.stage3_param_persistence_threshold' = ", z.stage3_param_persistence_threshold,
            " must be >= 0"));
  }
  const OffloadOptimizerOptions& off = z.offload_optimizer;
  if (off.device == OffloadDevice::kNvme) {
    add("'zero_optimization.offload_optimizer.device' = \"nvme\": remat offloads the optimizer to host memory "
        "only: set it to \"cpu\" (or \"none\")");
  }
  if (off.enabled() && z.stage == 0) {
    add("'zero_optimization.offload_optimizer.device' = \"cpu\" needs a sharded optimizer: set "
        "zero_optimization.stage to 1, 2 or 3, or offload_optimizer.device to \"none\"");
  }
  if (off.buffer_count < 1) {
    add(str("'zero_optimization.offload_optimizer.buffer_count' = ", off.buffer_count, " must be at least 1"));
  }
  if (!(off.ratio > 0 && off.ratio <= 1)) {
    add(str("'zero_optimization.offload_optimizer.ratio' = ", off.ratio, " must be in (0, 1]"));
  }
  return problems;
}

const std::vector<std::string>& offload_device_names() {
  static const std::vector<std::string> names = {"none", "cpu", "nvme"};
  return names;
}

const std::vector<std::string>& reduce_dtype_names() {
  static const std::vector<std::string> names = {"default", "fp32", "bf16"};
  return names;
}

const std::vector<std::string>& grad_accum_dtype_names() {
  static const std::vector<std::string> names = {"fp32"};
  return names;
}

std::string check_bf16_options(const Bf16Options& bf16, const ZeroOptions& /*zero*/) {
  if (!bf16.enabled && bf16.reduce_dtype == ReduceDtype::kBf16) {
    return "communication_data_type \"bf16\" reduces gradients in bf16, but bf16.enabled is false (the "
           "gradients are float32): set bf16.enabled true, or communication_data_type \"fp32\"";
  }
  return "";
}

std::string check_hybrid_shard_size(const ZeroOptions& zero, int dp) {
  const int hybrid = zero.hybrid_shard_size;
  if (hybrid <= 0 || (hybrid <= dp && dp % hybrid == 0)) return "";
  std::string divisors;
  for (int k = 1; k <= dp; ++k) {
    if (dp % k == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(k);
  }
  return str("zero_optimization.hybrid_shard_size ", hybrid, " must divide the data-parallel size ", dp,
             " (world size / tensor_parallel.size) into equal groups: use one of ", divisors);
}

}  // namespace remat::parallel
