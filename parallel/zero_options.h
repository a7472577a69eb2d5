// ZeRO's options (parallel::ZeroModel, parallel/zero.h), each declared once
// with its default and validated here. engine/config.cc binds the JSON
// sections zero_optimization and bf16 onto these structs (and fp16.enabled
// into MixedPrecision); messages name the JSON keys, since that is where
// users set them.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat::parallel {

// Where the optimizer's float32 master shards, their gradients and the
// optimizer state live (DeepSpeed's zero_optimization.offload_optimizer):
// kNone on the model's device; kCpu in host memory, the optimizer stepping
// there (ZeroModel, zero.h); kNvme the same, but the optimizer's state in a
// file under nvme_path (parallel/nvme_optimizer.h). For offload_param: kCpu
// the shards in host memory, kNvme in a file under nvme_path
// (parallel/nvme_tensor_file.h).
enum class OffloadDevice { kNone, kCpu, kNvme };
// The JSON names of OffloadDevice, by value.
const std::vector<std::string>& offload_device_names();

struct OffloadOptimizerOptions {
  OffloadDevice device = OffloadDevice::kNone;
  // The host tensors page-locked, where this LibTorch can pin (a CUDA build);
  // elsewhere they are ordinary host memory and a log line says so.
  bool pin_memory = false;
  // DeepSpeed's tuning of its own offload pipeline, accepted so that a
  // copied config loads: none of them changes what is computed here
  // (ZeroModel logs the ones set). ratio: the share DeepSpeed offloads
  // (remat offloads the whole optimizer state).
  // With kNvme: the host buffers the state streams through (at least 2).
  int buffer_count = 4;
  bool fast_init = false;
  double ratio = 1.0;
  // With kNvme: the folder (on a fast local disk) under which each rank
  // keeps its file; DeepSpeed's null elsewhere.
  std::optional<std::string> nvme_path;
  // DeepSpeed's switches for overlapping its swaps with the step: remat's
  // NVMe step always overlaps them (accepted either way, said when set).
  bool pipeline = false, pipeline_read = false, pipeline_write = false;
  // The masters and their gradients in host memory (kCpu and kNvme).
  bool enabled() const { return device != OffloadDevice::kNone; }
  bool on_nvme() const { return device == OffloadDevice::kNvme; }
};

// Stage 3's parameter shards in host memory (DeepSpeed's
// zero_optimization.offload_param): kCpu keeps each unit's float32 shards as
// host tensors, copied to the device for each gather (zero_stage3.cc); kNvme
// the same tensors mapped from a file under nvme_path, read ahead of each
// gather (parallel/nvme_tensor_file.h).
struct OffloadParamOptions {
  OffloadDevice device = OffloadDevice::kNone;
  // The host shards page-locked, where this LibTorch can pin (a CUDA build);
  // elsewhere ordinary host memory, and a log line says so.
  bool pin_memory = false;
  // DeepSpeed's tuning of its own parameter-offload buffers, accepted so that
  // a copied config loads: they change nothing computed here (logged when
  // set; with kNvme the kernel's page cache stands for the buffers).
  int buffer_count = 5;
  int64_t buffer_size = 100000000;
  // With kNvme: the shard elements kept in host memory (the first units'),
  // the rest in the file; DeepSpeed's default, 1e9, keeps a model below a
  // billion elements per rank wholly in memory.
  int64_t max_in_cpu = 1000000000;
  // With kNvme: the folder (on a fast local disk) under which each rank
  // keeps its file; DeepSpeed's null elsewhere.
  std::optional<std::string> nvme_path;
  // The shards are host tensors (kCpu and kNvme).
  bool enabled() const { return device != OffloadDevice::kNone; }
  bool on_nvme() const { return device == OffloadDevice::kNvme; }
};

struct ZeroOptions {
  // 0: data parallel (gradients all-reduced); 1: optimizer state sharded;
  // 2: optimizer state and gradients sharded; 3: parameters too.
  int stage = 0;
  // Elements per gradient reduce collective (stages 1 and 2: per gradient
  // bucket, each bucket sharded on its own).
  int64_t reduce_bucket_size = 500000000;
  // Stages 1 and 2: gradients reduce-scattered into the shards (false: all-reduced,
  // each rank keeping its shard).
  bool reduce_scatter = true;
  // Stages 1 and 2: elements per all-gather of the updated parameters.
  int64_t allgather_bucket_size = 500000000;
  // Stages 1 and 2: the updated parameters come back by all-gather (false: one
  // broadcast per rank's shard).
  bool allgather_partitions = true;
  // Stage 3: a unit is prefetched only when it has at most this many elements.
  int64_t stage3_prefetch_bucket_size = 50000000;
  // Stage 3: the most elements of units gathered at once that a prefetch may
  // bring about (DeepSpeed's stage3_max_live_parameters): a unit is fetched
  // ahead only when it and the units still gathered fit. The unit a call needs
  // is gathered whatever this says, and the head's root unit is always
  // fetched during the last block.
  int64_t stage3_max_live_parameters = 1000000000;
  // Stage 3: parameters with fewer elements stay whole on every rank.
  int64_t stage3_param_persistence_threshold = 100000;
  // Stages 0, 1 and 2: each gradient bucket's reduction (stage 0 an
  // all-reduce, 1 and 2 a reduce-scatter) starts as soon as the backward has
  // accumulated all its gradients, in the same bucket order on every rank,
  // and runs while the backward goes on (waited for at finish_backward);
  // stages 0 and 1 do so in the last micro-step of an accumulation window
  // only. false: the buckets are reduced after the backward. Stage 3
  // overlaps by prefetching whatever this says.
  bool overlap_comm = false;
  // With overlap_comm: every gradient hook tests the reductions in flight,
  // which is what lets MPI's non-blocking collectives progress during the
  // backward (false: only for measuring how much that does; remat-train reads
  // it from REMAT_REDUCE_PROGRESS=off).
  bool progress_in_hooks = true;
  // Stages 1 and 2: each gradient is moved into its bucket's flat buffer as
  // soon as it is computed (and the parameter's own freed); false keeps
  // gradients on the parameters until their bucket is reduced.
  bool contiguous_gradients = true;
  // Stages 1-3: shard within groups of this many data-parallel ranks and
  // replicate across the groups (FSDP's HYBRID_SHARD); 0: one group of all.
  int hybrid_shard_size = 0;
  // Stages 1-3: the optimizer's masters, gradients and state on the host.
  OffloadOptimizerOptions offload_optimizer;
  // Stage 3 only: the parameter shards on the host.
  OffloadParamOptions offload_param;
};

// The dtype gradients are reduced in across data-parallel ranks (DeepSpeed's
// communication_data_type). kDefault: the compute dtype (bf16 under bf16,
// fp16 under fp16, float32 otherwise), as DeepSpeed chooses (for bf16 its PR
// #3370).
enum class ReduceDtype { kDefault, kFp32, kBf16, kFp16 };
// The JSON names of ReduceDtype, by value ("default" is never written: it is
// the key left out).
const std::vector<std::string>& reduce_dtype_names();

// The dtype gradients accumulate in across micro-steps (DeepSpeed's
// data_types.grad_accum_dtype): float32, DeepSpeed's default, the only one.
enum class GradAccumDtype { kFp32 };
const std::vector<std::string>& grad_accum_dtype_names();

// The JSON's bf16 section (with communication_data_type and data_types).
struct Bf16Options {
  bool enabled = false;
  ReduceDtype reduce_dtype = ReduceDtype::kDefault;
  GradAccumDtype grad_accum_dtype = GradAccumDtype::kFp32;
  // bf16 when enabled and reduce_dtype is kDefault.
  bool reduces_in_bf16() const {
    return reduce_dtype == ReduceDtype::kBf16 || (enabled && reduce_dtype == ReduceDtype::kDefault);
  }
};

// Mixed precision at every stage (FSDP2's MixedPrecisionPolicy: param_dtype,
// reduce_dtype): float32 master weights (stage 0: the parameters the
// optimizer steps; 1 and 2: the flat buffers whose shards it steps; 3: the
// shards) and optimizer state, copies of the parameters in `compute_dtype`
// installed in the model for forward and backward (stages 0-2: made once per
// optimizer step; stage 3: gathered in that dtype from the shards),
// gradients accumulated in float32 across micro-steps and reduced in
// `reduce_dtype`. Floating-point tensors passed to a module through
// remat::forward are cast to the compute dtype (what FSDP2 calls
// cast_forward_inputs). fp16's loss scaling is the caller's (the engine's):
// the library computes what the scaled loss gives.
struct MixedPrecision {
  // at::kFloat: off (the model computes with the masters themselves);
  // at::kBFloat16 (bf16.enabled) or at::kHalf (fp16.enabled).
  at::ScalarType compute_dtype = at::kFloat;
  // at::kFloat, or a 16-bit dtype equal to compute_dtype (check_mixed_precision).
  at::ScalarType reduce_dtype = at::kFloat;

  MixedPrecision() = default;
  // The bf16 section alone (fp16 off). Implicit: a Bf16Options passed where
  // a MixedPrecision is taken means what it always meant.
  MixedPrecision(const Bf16Options& bf16);  // NOLINT(google-explicit-constructor)
  bool enabled() const { return compute_dtype != at::kFloat; }
};

// The config's bf16 section and fp16.enabled (not both: engine/config.cc
// refuses that) as a MixedPrecision: communication_data_type's default is the
// compute dtype.
MixedPrecision mixed_precision(const Bf16Options& bf16, bool fp16);
// "float32", "bf16" or "fp16": the names the config and the logs use.
const char* dtype_name(at::ScalarType dtype);

// offload_optimizer under bf16 or fp16 at stages 1-3 (stage 3 without
// offload_param, whose shards are float32 host tensors already): the float32
// masters live in host memory alone, the optimizer's, and the device keeps
// their 16-bit copies (stages 1-2: whole, the model computes with them;
// stage 3: its shards, gathered from). The rule the strategies follow and
// the memory rules count (zero_memory.h).
bool masters_on_host(const ZeroOptions& options, const MixedPrecision& mixed);

// The persistence threshold stage 3 uses (parameters with fewer elements stay
// whole on every rank): options.stage3_param_persistence_threshold in
// float32; 0 under bf16 or fp16, where every parameter is sharded, since the
// float32 masters live in the shards and a parameter kept whole would have
// none beside its 16-bit copy. ZeroModel, the memory rules and the config's
// log line ask this.
int64_t stage3_persistence_threshold(const ZeroOptions& options, const MixedPrecision& mixed);


// The rules of ZeroOptions alone, written once: an empty string when valid,
// else every rule broken, one per line, each saying what is wrong and which
// key to change. ZeroModel checks these, and
// what needs the data-parallel size or the mixed precision, itself.
std::string check_zero_options(const ZeroOptions& options);

// Mixed precision's rules: a compute dtype of float32, bf16 or fp16, and
// gradients reduced in float32 or in the compute dtype (a float32 run keeps
// float32 gradients; an fp16 sum needs fp16's loss scaler to catch its
// overflows). Empty when valid.
std::string check_mixed_precision(const MixedPrecision& mixed);

// zero_optimization.hybrid_shard_size against the data-parallel size `dp`
// (world size / tensor_parallel.size): the groups must be equal. Empty when
// valid. ZeroModel checks it at the run, remat-estimate for its -np.
std::string check_hybrid_shard_size(const ZeroOptions& zero, int dp);

}  // namespace remat::parallel
