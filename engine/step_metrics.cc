#include "engine/step_metrics.h"

#include "engine/internal/field_table.h"
#include "engine/step_counters.h"

namespace remat {
namespace {

// The engine's own metrics (the counters' are in their stats types' tables).
const FieldTable<StepMetrics>& metric_rows() {
  static const FieldTable<StepMetrics> rows = {
      {"step", &StepMetrics::step},
      {"loss", &StepMetrics::loss},
      {"lr", &StepMetrics::lr},
      {"step_ms", &StepMetrics::step_ms},
      {"fwd_ms", &StepMetrics::fwd_ms},
      {"bwd_ms", &StepMetrics::bwd_ms},
      {"opt_ms", &StepMetrics::opt_ms},
      {"mem_base_bytes", &StepMetrics::mem_base_bytes},
      {"mem_peak_bytes", &StepMetrics::mem_peak_bytes},
      {"mem_act_peak_bytes", &StepMetrics::mem_act_peak_bytes},
      {"mem_fwd_held_bytes", &StepMetrics::mem_fwd_held_bytes},
      {"ckpt_saved_bytes", &StepMetrics::ckpt_saved_bytes},
      {"act_host_bytes", &StepMetrics::act_host_bytes},
      {"act_kept_bytes", &StepMetrics::act_kept_bytes},
      {"comm_bytes", &StepMetrics::comm_bytes},
      {"zero_comm_bytes", &StepMetrics::zero_comm_bytes},
      {"optimizer_state_bytes", &StepMetrics::optimizer_state_bytes},
  };
  return rows;
}

// The caching allocator's metrics, written on a CUDA device only.
const FieldTable<StepMetrics>& cuda_rows() {
  static const FieldTable<StepMetrics> rows = {
      {"cuda_allocated_bytes", &StepMetrics::cuda_allocated_bytes},
      {"cuda_peak_allocated_bytes", &StepMetrics::cuda_peak_allocated_bytes},
      {"cuda_reserved_bytes", &StepMetrics::cuda_reserved_bytes},
      {"cuda_peak_reserved_bytes", &StepMetrics::cuda_peak_reserved_bytes},
  };
  return rows;
}

// With loss scaling only (fp16), so that a float32 run's keys stay as they are.
const FieldTable<StepMetrics>& loss_scaling_fields() {
  static const FieldTable<StepMetrics> fields = {{"loss_scale", &StepMetrics::loss_scale},
                                                           {"overflows", &StepMetrics::overflows}};
  return fields;
}

}  // namespace

StepMetrics::StepMetrics() : counters(nlohmann::json::object()) {
  internal::write_values(Counters().metrics(), counters);
}

StepMetrics StepMetrics::from_counters(const Counters& step) {
  StepMetrics m;
  internal::write_values(step.metrics(), m.counters);
  m.comm_bytes = step.comm_bytes();
  m.zero_comm_bytes = step.zero.collective_bytes();
  return m;
}

nlohmann::json StepMetrics::to_json() const {
  nlohmann::json m = nlohmann::json::object();
  internal::write_fields(metric_rows(), *this, m);
  for (const auto& [key, value] : counters.items()) m[key] = value;
  if (cuda_allocator) internal::write_fields(cuda_rows(), *this, m);
  if (grad_norm >= 0) m["grad_norm"] = grad_norm;
  if (skipped || loss_scale > 0) m["skipped"] = skipped;
  if (loss_scale > 0) internal::write_fields(loss_scaling_fields(), *this, m);
  if (offload_optimizer) m["host_optimizer_bytes"] = host_optimizer_bytes;
  if (offload_param) m["host_parameter_bytes"] = host_parameter_bytes;
  if (nvme_parameters) {
    m["nvme_parameter_bytes"] = nvme_parameter_bytes;
    m["nvme_parameter_read_bytes"] = nvme_parameter_read_bytes;
    m["nvme_parameter_written_bytes"] = nvme_parameter_written_bytes;
  }
  if (nvme_optimizer) {
    m["nvme_state_bytes"] = nvme_state_bytes;
    m["nvme_master_bytes"] = nvme_master_bytes;
    m["nvme_master_read_bytes"] = nvme_master_read_bytes;
    m["nvme_master_written_bytes"] = nvme_master_written_bytes;
    m["nvme_read_bytes"] = nvme_read_bytes;
    m["nvme_written_bytes"] = nvme_written_bytes;
    m["nvme_step_ms"] = nvme_step_ms;
  }
  for (const auto& [key, value] : plan.items()) m[key] = value;
  return m;
}

}  // namespace remat
