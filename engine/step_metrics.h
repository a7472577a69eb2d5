// What one optimizer step did (Engine::last_metrics()): remat-train writes
// it as a JSON line. The engine's own metrics are fields here, each described
// once by its row in step_metrics.cc (its JSON name): a new one is its field
// here and its row there. The counters' metrics (ZeRO's traffic, stored
// inputs' and activation offload's bytes, ...) are in `counters`, by their
// keys: each is a row of its stats type's field table, in the library that
// counts (runtime/field_table.h), so a new counter needs no edit here.
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
  double step_ms = 0, fwd_ms = 0, bwd_ms = 0, opt_ms = 0;
  int64_t mem_base_bytes = 0, mem_peak_bytes = 0, mem_act_peak_bytes = 0, mem_fwd_held_bytes = 0;
  // The most bytes checkpoint regions held over the step's forwards, and
  // activation offload's host and kept bytes at the last forward's end.
  int64_t ckpt_saved_bytes = 0, act_host_bytes = 0, act_kept_bytes = 0;
  // Bytes through every collective (the counters' and the engine's own), and
  // ZeRO's of them.
  int64_t comm_bytes = 0, zero_comm_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  // zero_optimization.offload_optimizer: the bytes held in host memory for
  // the optimizer (float32 masters, their gradients and the optimizer state).
  // Written only when `offload_optimizer`: the other runs' keys stay as they are.
  bool offload_optimizer = false;
  int64_t host_optimizer_bytes = 0;
  // zero_optimization.offload_param: stage 3's parameter shards and their
  // gradients held in host memory. Written only when `offload_param`.
  bool offload_param = false;
  int64_t host_parameter_bytes = 0;
  // offload_param.device "nvme": the shards' bytes in the file on disk (those
  // within max_in_cpu, and the gradients, are in host_parameter_bytes).
  // Written only when `nvme_parameters`.
  // And the bytes of shards in that file the step read (its gathers, the
  // optimizer) and rewrote (the optimizer), through the kernel's page cache.
  bool nvme_parameters = false;
  int64_t nvme_parameter_bytes = 0, nvme_parameter_read_bytes = 0, nvme_parameter_written_bytes = 0;
  // offload_optimizer.device "nvme": the state file's bytes on disk, and the
  // bytes the step read and wrote there and how long it took (the host
  // buffers are in host_optimizer_bytes). Written only when `nvme_optimizer`.
  bool nvme_optimizer = false;
  int64_t nvme_state_bytes = 0, nvme_read_bytes = 0, nvme_written_bytes = 0;
  // And the float32 masters' file (its page-padded bytes on disk; the host
  // keeps their gradients in host_optimizer_bytes), and the bytes of masters
  // there the step's optimizer read and rewrote, through the page cache.
  int64_t nvme_master_bytes = 0, nvme_master_read_bytes = 0, nvme_master_written_bytes = 0;
  double nvme_step_ms = 0;
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
  // The metrics a step's share of the counters gives (Counters::metrics), by
  // key, each in its own type: e.g. "recompute_ms", "tp_comm_bytes" (of
  // comm_bytes, the tensor-parallel mappings': with a checkpointed block's
  // collectives recomputed, a step's count rises by their forward bytes),
  // "ckpt_offloaded_bytes", "act_offloaded_bytes", "param_bytes",
  // "grad_peak_bytes", "reduce_wait_ms", "buckets_reduced". Each key's
  // meaning is its field's comment, where the table names it.
  nlohmann::json counters;
  // One of them: m.counter("tp_comm_bytes"), m.counter<double>("recompute_ms").
  template <class T = int64_t>
  T counter(const char* key) const {
    return counters.at(key).get<T>();
  }

  // Every counter's metric at zero, the rest as above.
  StepMetrics();
  // The metrics a step's share of the counters (Counters::since) gives:
  // `counters`, and comm_bytes and zero_comm_bytes (the counters'
  // collectives only). The others are zero.
  static StepMetrics from_counters(const Counters& step);
  // One object: every field by its name (the cuda_ ones on a CUDA device),
  // the counters' metrics, grad_norm when clipping is on, skipped when true,
  // and the plan's keys; with loss scaling (fp16), its fields and skipped always.
  nlohmann::json to_json() const;
};

}  // namespace remat
