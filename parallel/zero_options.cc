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
  if (z.stage3_max_live_parameters < 0) {
    add(str("'zero_optimization.stage3_max_live_parameters' = ", z.stage3_max_live_parameters,
            " must be >= 0 (0 turns prefetching off)"));
  }
  if (z.stage3_param_persistence_threshold < 0) {
    add(str("'zero_optimization.stage3_param_persistence_threshold' = ", z.stage3_param_persistence_threshold,
            " must be >= 0"));
  }
  const OffloadOptimizerOptions& off = z.offload_optimizer;
  const char* off_device = off.on_nvme() ? "nvme" : "cpu";
  if (off.enabled() && z.stage == 0) {
    add(str("'zero_optimization.offload_optimizer.device' = \"", off_device, "\" needs a sharded optimizer: set "
            "zero_optimization.stage to 1, 2 or 3, or offload_optimizer.device to \"none\""));
  }
  if (off.on_nvme() && (!off.nvme_path || off.nvme_path->empty())) {
    add("'zero_optimization.offload_optimizer.device' = \"nvme\" needs 'zero_optimization.offload_optimizer."
        "nvme_path': a folder on a fast local disk where each rank keeps its optimizer state");
  }
  if (off.on_nvme() && off.buffer_count < 2) {
    add(str("'zero_optimization.offload_optimizer.buffer_count' = ", off.buffer_count, " with device \"nvme\": "
            "the state streams through at least 2 host buffers (one stepped while the next is read); set 2 or "
            "more (DeepSpeed's default is 4)"));
  }
  // DeepSpeed's ranges for its own tuning (which changes nothing here): 0 included.
  if (off.buffer_count < 0) {
    add(str("'zero_optimization.offload_optimizer.buffer_count' = ", off.buffer_count, " must be >= 0"));
  }
  if (!(off.ratio >= 0 && off.ratio <= 1)) {
    add(str("'zero_optimization.offload_optimizer.ratio' = ", off.ratio, " must be in [0, 1]"));
  }
  const OffloadParamOptions& op = z.offload_param;
  if (op.enabled() && z.stage != 3) {
    add(str("'zero_optimization.offload_param.device' = \"", op.on_nvme() ? "nvme" : "cpu", "\" needs stage 3 (only stage 3 shards the "
            "parameters), but zero_optimization.stage is ", z.stage, ": set the stage to 3, or "
            "offload_param.device to \"none\""));
  }
  if (op.on_nvme() && (!op.nvme_path || op.nvme_path->empty())) {
    add("'zero_optimization.offload_param.device' = \"nvme\" needs 'zero_optimization.offload_param.nvme_path': "
        "a folder on a fast local disk where each rank keeps its parameter shards");
  }
  if (op.buffer_count < 0 || op.buffer_size < 0 || op.max_in_cpu < 0) {
    add(str("'zero_optimization.offload_param': buffer_count (", op.buffer_count, "), buffer_size (",
            op.buffer_size, ") and max_in_cpu (", op.max_in_cpu, ") must be >= 0"));
  }
  return problems;
}

int64_t stage3_persistence_threshold(const ZeroOptions& options, const MixedPrecision& mixed) {
  return mixed.enabled() ? 0 : options.stage3_param_persistence_threshold;
}

const std::vector<std::string>& offload_device_names() {
  static const std::vector<std::string> names = {"none", "cpu", "nvme"};
  return names;
}

const std::vector<std::string>& reduce_dtype_names() {
  static const std::vector<std::string> names = {"default", "fp32", "bf16", "fp16"};
  return names;
}

const std::vector<std::string>& grad_accum_dtype_names() {
  static const std::vector<std::string> names = {"fp32"};
  return names;
}

namespace {

at::ScalarType reduce_dtype_of(ReduceDtype reduce, at::ScalarType compute) {
  switch (reduce) {
    case ReduceDtype::kFp32: return at::kFloat;
    case ReduceDtype::kBf16: return at::kBFloat16;
    case ReduceDtype::kFp16: return at::kHalf;
    default: return compute;
  }
}

}  // namespace

MixedPrecision::MixedPrecision(const Bf16Options& bf16)
    : compute_dtype(bf16.enabled ? at::kBFloat16 : at::kFloat),
      reduce_dtype(reduce_dtype_of(bf16.reduce_dtype, compute_dtype)) {}

MixedPrecision mixed_precision(const Bf16Options& bf16, bool fp16) {
  MixedPrecision m(bf16);
  if (fp16 && !bf16.enabled) {
    m.compute_dtype = at::kHalf;
    m.reduce_dtype = reduce_dtype_of(bf16.reduce_dtype, at::kHalf);
  }
  return m;
}

const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    default: return c10::toString(dtype);
  }
}

bool masters_on_host(const ZeroOptions& options, const MixedPrecision& mixed) {
  return mixed.enabled() && options.stage >= 1 && options.offload_optimizer.enabled() &&
         !(options.stage == 3 && options.offload_param.enabled());
}

std::string check_mixed_precision(const MixedPrecision& m) {
  const at::ScalarType compute = m.compute_dtype, reduce = m.reduce_dtype;
  if (compute != at::kFloat && compute != at::kBFloat16 && compute != at::kHalf) {
    return str("the compute dtype is ", dtype_name(compute), ": remat computes in float32, bf16 (bf16.enabled) "
               "or fp16 (fp16.enabled)");
  }
  if (reduce == at::kFloat || reduce == compute) return "";
  const std::string r = dtype_name(reduce);
  if (reduce != at::kBFloat16 && reduce != at::kHalf) {
    return str("gradients cannot be reduced in ", r, ": set communication_data_type \"fp32\", \"bf16\" or \"fp16\"");
  }
  return str("communication_data_type \"", r, "\" reduces gradients in ", r, ", but ", r, ".enabled is false (",
             compute == at::kFloat ? std::string("the gradients are float32")
                                   : str("the model computes in ", dtype_name(compute)),
             reduce == at::kHalf ? "; an fp16 sum needs fp16's loss scaler to catch its overflows" : "",
             "): set ", r, ".enabled true, or communication_data_type \"fp32\"");
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
