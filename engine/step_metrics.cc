#include "engine/step_metrics.h"

#include <functional>
#include <vector>

#include "engine/internal/field_table.h"
#include "engine/step_counters.h"

namespace remat {
namespace {

template <class T>
struct Exactly {
  using type = T;
};

// One metric: its JSON name and member, and for those a step's counters give,
// where in them it is read.
struct MetricRow {
  template <class T>
  MetricRow(const char* name, T StepMetrics::*member, typename Exactly<T>::type (*from)(const Counters&) = nullptr)
      : field(name, member) {
    if (from != nullptr) copy = [member, from](StepMetrics& m, const Counters& c) { m.*member = from(c); };
  }
  internal::Field<StepMetrics> field;
  std::function<void(StepMetrics&, const Counters&)> copy;  // null: the engine's meter fills it
};

const std::vector<MetricRow>& metric_rows() {
  using C = const Counters&;
  static const std::vector<MetricRow> rows = {
      {"step", &StepMetrics::step},
      {"loss", &StepMetrics::loss},
      {"lr", &StepMetrics::lr},
      {"step_ms", &StepMetrics::step_ms},
      {"fwd_ms", &StepMetrics::fwd_ms},
      {"bwd_ms", &StepMetrics::bwd_ms},
      {"opt_ms", &StepMetrics::opt_ms},
      {"recompute_ms", &StepMetrics::recompute_ms, [](C c) { return c.recompute_ms; }},
      {"mem_base_bytes", &StepMetrics::mem_base_bytes},
      {"mem_peak_bytes", &StepMetrics::mem_peak_bytes},
      {"mem_act_peak_bytes", &StepMetrics::mem_act_peak_bytes},
      {"mem_fwd_held_bytes", &StepMetrics::mem_fwd_held_bytes},
      {"ckpt_saved_bytes", &StepMetrics::ckpt_saved_bytes},
      {"ckpt_offloaded_bytes", &StepMetrics::ckpt_offloaded_bytes, [](C c) { return c.stored.offloaded_bytes; }},
      {"ckpt_gathered_bytes", &StepMetrics::ckpt_gathered_bytes, [](C c) { return c.stored.gathered_bytes; }},
      {"act_offloaded_bytes", &StepMetrics::act_offloaded_bytes, [](C c) { return c.offload.offloaded_bytes; }},
      {"act_restored_bytes", &StepMetrics::act_restored_bytes, [](C c) { return c.offload.restored_bytes; }},
      {"act_host_bytes", &StepMetrics::act_host_bytes},
      {"act_kept_bytes", &StepMetrics::act_kept_bytes},
      {"comm_bytes", &StepMetrics::comm_bytes, [](C c) { return c.comm_bytes(); }},
      {"zero_comm_bytes", &StepMetrics::zero_comm_bytes, [](C c) { return c.zero.collective_bytes(); }},
      {"tp_comm_bytes", &StepMetrics::tp_comm_bytes, [](C c) { return c.tensor_parallel_comm_bytes; }},
      {"param_bytes", &StepMetrics::param_bytes, [](C c) { return c.zero.param_bytes; }},
      {"grad_bytes", &StepMetrics::grad_bytes, [](C c) { return c.zero.grad_bytes; }},
      {"grad_peak_bytes", &StepMetrics::grad_peak_bytes, [](C c) { return c.zero.peak_grad_bytes; }},
      {"optimizer_state_bytes", &StepMetrics::optimizer_state_bytes},
      {"peak_gathered_param_bytes", &StepMetrics::peak_gathered_param_bytes,
       [](C c) { return c.zero.peak_gathered_bytes; }},
      {"reduce_wait_ms", &StepMetrics::reduce_wait_ms, [](C c) { return c.zero.reduce_wait_ms; }},
      {"buckets_reduced", &StepMetrics::buckets_reduced, [](C c) { return c.zero.buckets_reduced; }},
      {"buckets_done_in_backward", &StepMetrics::buckets_done_in_backward,
       [](C c) { return c.zero.buckets_done_in_backward; }},
  };
  return rows;
}

// The caching allocator's metrics, written on a CUDA device only.
const internal::FieldTable<StepMetrics>& cuda_rows() {
  static const internal::FieldTable<StepMetrics> rows = {
      {"cuda_allocated_bytes", &StepMetrics::cuda_allocated_bytes},
      {"cuda_peak_allocated_bytes", &StepMetrics::cuda_peak_allocated_bytes},
      {"cuda_reserved_bytes", &StepMetrics::cuda_reserved_bytes},
      {"cuda_peak_reserved_bytes", &StepMetrics::cuda_peak_reserved_bytes},
  };
  return rows;
}

// With loss scaling only (fp16), so that a float32 run's keys stay as they are.
const internal::FieldTable<StepMetrics>& loss_scaling_fields() {
  static const internal::FieldTable<StepMetrics> fields = {{"loss_scale", &StepMetrics::loss_scale},
                                                           {"overflows", &StepMetrics::overflows}};
  return fields;
}

}  // namespace

StepMetrics StepMetrics::from_counters(const Counters& step) {
  StepMetrics m;
  for (const auto& row : metric_rows()) {
    if (row.copy) row.copy(m, step);
  }
  return m;
}

nlohmann::json StepMetrics::to_json() const {
  nlohmann::json m = nlohmann::json::object();
  for (const auto& row : metric_rows()) row.field.write(*this, m);
  if (cuda_allocator) internal::write_fields(cuda_rows(), *this, m);
  if (grad_norm >= 0) m["grad_norm"] = grad_norm;
  if (skipped || loss_scale > 0) m["skipped"] = skipped;
  if (loss_scale > 0) internal::write_fields(loss_scaling_fields(), *this, m);
  if (offload_optimizer) m["host_optimizer_bytes"] = host_optimizer_bytes;
  if (offload_param) m["host_parameter_bytes"] = host_parameter_bytes;
  for (const auto& [key, value] : plan.items()) m[key] = value;
  return m;
}

}  // namespace remat
