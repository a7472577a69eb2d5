// The field tables of the step's counters and metrics (step_counters.cc,
// step_metrics.cc): a step's share of each kind of counter, the metrics the
// counters give, and the metrics' JSON with its value types.
#include "engine/step_metrics.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <type_traits>
#include <variant>

#include "engine/internal/field_table.h"
#include "engine/step_counters.h"
#include "runtime/field_table.h"

namespace remat {
namespace {

TEST(StepCounters, TotalsAreDifferencesNowAndPeaksAsRead) {
  Counters before, now;
  before.recomputes = 2, now.recomputes = 5;                                // total
  before.recompute_ms = 1.5, now.recompute_ms = 4.0;                        // total
  before.checkpoint_saved_bytes = 100, now.checkpoint_saved_bytes = 40;     // now
  before.tensor_parallel_comm_bytes = 8, now.tensor_parallel_comm_bytes = 24;
  before.stored.kept_bytes = 9, now.stored.kept_bytes = 3;                  // now
  before.stored.gathered_bytes = 10, now.stored.gathered_bytes = 30;        // total
  before.stored.left_small_bytes = 1, now.stored.left_small_bytes = 2;      // total
  before.offload.offloaded_bytes = 64, now.offload.offloaded_bytes = 192;   // total
  before.offload.kept_tensors = 1, now.offload.kept_tensors = 4;            // total
  before.offload.host_bytes = 50, now.offload.host_bytes = 70;              // now
  before.zero.param_bytes = 7, now.zero.param_bytes = 7;                    // now
  before.zero.peak_gathered_units = 3, now.zero.peak_gathered_units = 2;    // peak
  before.zero.peak_grad_bytes = 300, now.zero.peak_grad_bytes = 200;        // peak
  before.zero.allgather_bytes = 10, now.zero.allgather_bytes = 25;          // total
  before.zero.reduce_wait_ms = 0.25, now.zero.reduce_wait_ms = 1.0;         // total
  before.zero.buckets_done_in_backward = 2, now.zero.buckets_done_in_backward = 6;

  const Counters step = now.since(before);
  EXPECT_EQ(step.recomputes, 3);
  EXPECT_EQ(step.recompute_ms, 2.5);
  EXPECT_EQ(step.checkpoint_saved_bytes, 40);
  EXPECT_EQ(step.tensor_parallel_comm_bytes, 16);
  EXPECT_EQ(step.stored.kept_bytes, 3);
  EXPECT_EQ(step.stored.gathered_bytes, 20);
  EXPECT_EQ(step.stored.left_small_bytes, 1);
  EXPECT_EQ(step.offload.offloaded_bytes, 128);
  EXPECT_EQ(step.offload.kept_tensors, 3);
  EXPECT_EQ(step.offload.host_bytes, 70);
  EXPECT_EQ(step.zero.param_bytes, 7);
  EXPECT_EQ(step.zero.peak_gathered_units, 2);
  EXPECT_EQ(step.zero.peak_grad_bytes, 200);
  EXPECT_EQ(step.zero.allgather_bytes, 15);
  EXPECT_EQ(step.zero.reduce_wait_ms, 0.75);
  EXPECT_EQ(step.zero.buckets_done_in_backward, 4);
  EXPECT_EQ(step.comm_bytes(), 20 + 16 + 15);
}

TEST(StepMetrics, FromCountersReadsEachMetricWhereItComesFrom) {
  Counters c;
  c.recompute_ms = 3.25;
  c.stored.offloaded_bytes = 11;
  c.stored.gathered_bytes = 12;
  c.offload.offloaded_bytes = 13;
  c.offload.restored_bytes = 14;
  c.tensor_parallel_comm_bytes = 15;
  c.zero.allgather_bytes = 100, c.zero.reducescatter_bytes = 200, c.zero.allreduce_bytes = 300;
  c.zero.param_bytes = 16, c.zero.grad_bytes = 17, c.zero.peak_grad_bytes = 18, c.zero.peak_gathered_bytes = 19;
  c.zero.reduce_wait_ms = 0.5, c.zero.buckets_reduced = 20, c.zero.buckets_done_in_backward = 21;
  c.checkpoint_saved_bytes = 999;  // the meter's peak over forwards, not this
  c.save_snapshot_bytes = 22;
  const StepMetrics m = StepMetrics::from_counters(c);
  EXPECT_EQ(m.counter<double>("recompute_ms"), 3.25);
  EXPECT_EQ(m.counter("ckpt_offloaded_bytes"), 11);
  EXPECT_EQ(m.counter("ckpt_gathered_bytes"), 12);
  EXPECT_EQ(m.counter("act_offloaded_bytes"), 13);
  EXPECT_EQ(m.counter("act_restored_bytes"), 14);
  EXPECT_EQ(m.counter("tp_comm_bytes"), 15);
  EXPECT_EQ(m.zero_comm_bytes, 600);
  EXPECT_EQ(m.comm_bytes, 12 + 15 + 600);
  EXPECT_EQ(m.counter("param_bytes"), 16);
  EXPECT_EQ(m.counter("grad_bytes"), 17);
  EXPECT_EQ(m.counter("grad_peak_bytes"), 18);
  EXPECT_EQ(m.counter("peak_gathered_param_bytes"), 19);
  EXPECT_EQ(m.counter<double>("reduce_wait_ms"), 0.5);
  EXPECT_EQ(m.counter("buckets_reduced"), 20);
  EXPECT_EQ(m.counter("buckets_done_in_backward"), 21);
  EXPECT_EQ(m.counter("save_snapshot_bytes"), 22);
  EXPECT_EQ(m.counters.size(), 14u) << "the counters' metrics: no more, no fewer";
  EXPECT_EQ(m.ckpt_saved_bytes, 0);
  EXPECT_EQ(m.step, 0);
  EXPECT_EQ(m.mem_peak_bytes, 0);
}

TEST(StepMetrics, JsonHasEveryFieldInItsOwnType) {
  StepMetrics m;
  m.step = 7;
  m.loss = 2.5;
  m.counters["act_offloaded_bytes"] = 1 << 20;
  nlohmann::json j = m.to_json();
  const std::set<std::string> doubles = {"loss", "lr", "step_ms", "fwd_ms", "bwd_ms", "opt_ms", "recompute_ms",
                                         "reduce_wait_ms"};
  const std::set<std::string> ints = {
      "step", "mem_base_bytes", "mem_peak_bytes", "mem_act_peak_bytes", "mem_fwd_held_bytes", "ckpt_saved_bytes",
      "ckpt_offloaded_bytes", "ckpt_gathered_bytes", "act_offloaded_bytes", "act_restored_bytes", "act_host_bytes",
      "act_kept_bytes", "comm_bytes", "zero_comm_bytes", "tp_comm_bytes", "param_bytes", "grad_bytes",
      "grad_peak_bytes", "optimizer_state_bytes", "peak_gathered_param_bytes", "buckets_reduced",
      "buckets_done_in_backward", "save_snapshot_bytes"};
  ASSERT_EQ(j.size(), doubles.size() + ints.size()) << j.dump();
  for (const auto& [key, value] : j.items()) {
    if (doubles.count(key)) {
      EXPECT_TRUE(value.is_number_float()) << key << ": " << value;
    } else {
      EXPECT_TRUE(ints.count(key) && value.is_number_integer()) << key << ": " << value;
    }
  }
  EXPECT_EQ(j["step"], 7);
  EXPECT_EQ(j["loss"], 2.5);
  EXPECT_EQ(j["act_offloaded_bytes"], 1 << 20);

  // Clipping on, a skipped step and a plan add their keys.
  m.grad_norm = 0.75;
  m.skipped = true;
  m.plan = {{"act_plan", "full,keep"}, {"act_planned", true}};
  j = m.to_json();
  EXPECT_EQ(j.size(), doubles.size() + ints.size() + 4);
  EXPECT_EQ(j["grad_norm"], 0.75);
  EXPECT_EQ(j["skipped"], true);
  EXPECT_EQ(j["act_plan"], "full,keep");
  EXPECT_EQ(j["act_planned"], true);

  // With loss scaling (fp16): its fields, and skipped whether true or not.
  StepMetrics scaled;
  scaled.loss_scale = 32768;
  scaled.overflows = 3;
  j = scaled.to_json();
  EXPECT_EQ(j.size(), doubles.size() + ints.size() + 3);
  EXPECT_TRUE(j["loss_scale"].is_number_float());
  EXPECT_EQ(j["loss_scale"], 32768.0);
  EXPECT_TRUE(j["overflows"].is_number_integer());
  EXPECT_EQ(j["overflows"], 3);
  EXPECT_EQ(j["skipped"], false);
  scaled.skipped = true;
  EXPECT_EQ(scaled.to_json()["skipped"], true);
}

// The recipe for a counter (docs/architecture.md), on a stats type of the
// test's own: its field, its row, its increment. The engine's generic
// readers (Counters::since's subtraction, Counters::metrics' listing and the
// JSON writer) take it up with no edit of theirs.
struct DemoStats {
  int64_t copies = 0;      // total: the field (edit 1)
  int64_t held_bytes = 0;  // now
  int peak_units = 0;      // peak
  double wait_ms = 0;      // total
  static const FieldTable<DemoStats>& fields();
};
const FieldTable<DemoStats>& DemoStats::fields() {
  static const FieldTable<DemoStats> table = {
      {"copies", FieldKind::kTotal, &DemoStats::copies, "demo_copies"},  // its row (edit 2)
      {"held_bytes", FieldKind::kNow, &DemoStats::held_bytes},
      {"peak_units", FieldKind::kPeak, &DemoStats::peak_units, "demo_peak_units"},
      {"wait_ms", FieldKind::kTotal, &DemoStats::wait_ms, "demo_wait_ms"},
  };
  return table;
}

TEST(CounterRecipe, AFieldAndItsRowReachTheStepAndItsMetrics) {
  DemoStats before, now;
  ++before.copies;  // its increment (edit 3), where the library counts
  before.held_bytes = 32, before.peak_units = 3, before.wait_ms = 0.25;
  now.copies = 5, now.held_bytes = 64, now.peak_units = 2, now.wait_ms = 1.0;
  subtract_totals(DemoStats::fields(), now, before);
  EXPECT_EQ(now.copies, 4) << "a total: the step's share";
  EXPECT_EQ(now.held_bytes, 64) << "now: as read";
  EXPECT_EQ(now.peak_units, 2) << "a peak: as read";
  EXPECT_EQ(now.wait_ms, 0.75);

  MetricValues metrics;
  append_metrics(DemoStats::fields(), now, metrics);
  nlohmann::json j = nlohmann::json::object();
  internal::write_values(metrics, j);
  EXPECT_EQ(j, nlohmann::json({{"demo_copies", 4}, {"demo_peak_units", 2}, {"demo_wait_ms", 0.75}}))
      << "held_bytes names no metric";
  EXPECT_TRUE(j["demo_copies"].is_number_integer());
  EXPECT_TRUE(j["demo_peak_units"].is_number_integer());
  EXPECT_TRUE(j["demo_wait_ms"].is_number_float());
}

// The real stats types: every row that names a metric reaches a step's
// metrics JSON under that key with the value counted, so a row added to
// ZeroStats, StoredInputStats or ActivationOffloadStats needs no engine edit.
template <class S>
void number_fields(const FieldTable<S>& table, S& s, int64_t& next) {
  for (const auto& field : table) {
    std::visit([&](auto m) { s.*m = static_cast<std::decay_t<decltype(s.*m)>>(next++); }, field.member());
  }
}
template <class S>
void expect_metrics(const FieldTable<S>& table, const S& s, const nlohmann::json& j, int& named) {
  for (const auto& field : table) {
    if (field.metric() == nullptr) continue;
    ++named;
    std::visit([&](auto v) { EXPECT_EQ(j.at(field.metric()), v) << field.name(); }, field.value(s));
  }
}

TEST(CounterRecipe, EveryRowThatNamesAMetricReachesTheMetricsJson) {
  Counters c;
  int64_t next = 1;
  number_fields(StoredInputStats::fields(), c.stored, next);
  number_fields(ActivationOffloadStats::fields(), c.offload, next);
  number_fields(parallel::ZeroStats::fields(), c.zero, next);
  const nlohmann::json j = StepMetrics::from_counters(c).to_json();
  int named = 0;
  expect_metrics(StoredInputStats::fields(), c.stored, j, named);
  expect_metrics(ActivationOffloadStats::fields(), c.offload, j, named);
  expect_metrics(parallel::ZeroStats::fields(), c.zero, j, named);
  EXPECT_EQ(named, 11);
}

// The caching allocator's keys are written on a CUDA device only: a CPU run's
// metrics keep exactly the keys above.
TEST(StepMetrics, CudaAllocatorKeysOnlyOnACudaDevice) {
  StepMetrics m;
  m.cuda_allocated_bytes = 1, m.cuda_peak_allocated_bytes = 2;
  m.cuda_reserved_bytes = 3, m.cuda_peak_reserved_bytes = 4;
  const size_t cpu_keys = m.to_json().size();
  EXPECT_EQ(m.to_json().count("cuda_allocated_bytes"), 0u);
  m.cuda_allocator = true;
  const nlohmann::json j = m.to_json();
  EXPECT_EQ(j.size(), cpu_keys + 4);
  EXPECT_EQ(j["cuda_allocated_bytes"], 1);
  EXPECT_EQ(j["cuda_peak_allocated_bytes"], 2);
  EXPECT_EQ(j["cuda_reserved_bytes"], 3);
  EXPECT_EQ(j["cuda_peak_reserved_bytes"], 4);
  for (const char* key : {"cuda_allocated_bytes", "cuda_peak_allocated_bytes", "cuda_reserved_bytes",
                          "cuda_peak_reserved_bytes"}) {
    EXPECT_TRUE(j[key].is_number_integer()) << key;
  }
}

}  // namespace
}  // namespace remat
