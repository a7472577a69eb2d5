// What one optimizer step did (Engine::last_metrics()): remat-train writes
// it as a JSON line. Each field is described once, by its row in
// step_metrics.cc (its JSON name, and for the counters' metrics where it
// comes from): a new metric is its field here and its row there.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

namespace remat {

struct Counters;

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;  // mean over micro-steps and data-parallel ranks
  double lr = 0;
  double grad_norm = -1;  // before clipping; -1: clipping is off
  bool skipped = false;   // non-finite, dropped (train.on_nonfinite skip, or fp16's overflow)
  // fp16: the loss scale this step's gradients carried (0: no loss scaling),
  // and the steps skipped for overflow since training began (saves keep it).
  double loss_scale = 0;
  int64_t overflows = 0;
  double step_ms = 0, fwd_ms = 0, bwd_ms = 0, opt_ms = 0, recompute_ms = 0;
  int64_t mem_base_bytes = 0, mem_peak_bytes = 0, mem_act_peak_bytes = 0, mem_fwd_held_bytes = 0;
  int64_t ckpt_saved_bytes = 0, ckpt_offloaded_bytes = 0, ckpt_gathered_bytes = 0;
  int64_t act_offloaded_bytes = 0, act_restored_bytes = 0, act_host_bytes = 0, act_kept_bytes = 0;
  int64_t comm_bytes = 0, zero_comm_bytes = 0, param_bytes = 0, grad_bytes = 0, grad_peak_bytes = 0;
  // Of comm_bytes, the tensor-parallel mappings' (parallel/mappings.h): with a
  // checkpointed block's collectives recomputed, this step's count rises by
  // their forward bytes; with activation_checkpointing.save_collectives it does not.
  int64_t tp_comm_bytes = 0;
  int64_t optimizer_state_bytes = 0, peak_gathered_param_bytes = 0;
  // zero_optimization.offload_optimizer: the bytes held in host memory for
  // the optimizer (float32 masters, their gradients and the optimizer state).
  // Written only when `offload_optimizer`: the other runs' keys stay as they are.
  bool offload_optimizer = false;
  int64_t host_optimizer_bytes = 0;
  // zero_optimization.offload_param: stage 3's parameter shards and their
  // gradients held in host memory. Written only when `offload_param`.
  bool offload_param = false;
  int64_t host_parameter_bytes = 0;
  // Data-parallel gradient reduction (stages 0-2): the milliseconds spent
  // blocked on it, in the backward or after it (with overlap_comm, the
  // communication the backward did not hide), the gradient buckets reduced,
  // and how many of them were seen complete before the backward ended.
  double reduce_wait_ms = 0;
  int64_t buckets_reduced = 0, buckets_done_in_backward = 0;
  // On a CUDA device, LibTorch's caching allocator (runtime/device_memory.h):
  // the bytes in tensors and those it holds from the driver (reserved, the
  // cached blocks included), at the step's end and their peaks over the
  // step. Written only when `cuda_allocator` (the model on a CUDA device of a
  // CUDA LibTorch): a CPU run's metrics have none of these keys.
  bool cuda_allocator = false;
  int64_t cuda_allocated_bytes = 0, cuda_peak_allocated_bytes = 0;
  int64_t cuda_reserved_bytes = 0, cuda_peak_reserved_bytes = 0;
  // variant auto: the plan in force (empty otherwise).
  nlohmann::json plan = nlohmann::json::object();

  // The metrics a step's share of the counters (Counters::since) gives;
  // comm_bytes counts the counters' collectives only. The others are zero.
  static StepMetrics from_counters(const Counters& step);
  // One object: every field by its name (the cuda_ ones on a CUDA device),
  // grad_norm when clipping is on, skipped when true, and the plan's keys;
  // with loss scaling (fp16), its fields and skipped always.
  nlohmann::json to_json() const;
};

}  // namespace remat
