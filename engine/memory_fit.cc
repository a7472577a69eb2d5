// What fits: the cheapest change to a configuration whose estimated row fits
// the memory a rank has, and the largest micro-batch that fits
// (engine/memory_estimate.h), both read off estimate_memory's rows.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/memory_estimate.h"
#include "runtime/error.h"

namespace remat {
namespace {

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / 1048576.0);
  return buf;
}

}  // namespace

namespace {

const std::vector<std::string> kRecomputeOrder = {"none", "selective_op", "every_k", "full"};

int recompute_rank(const std::string& policy) {
  return static_cast<int>(std::find(kRecomputeOrder.begin(), kRecomputeOrder.end(), policy) - kRecomputeOrder.begin());
}

// The keys that turn the configured row into `r`, and its peak.
std::string change_to(const MemoryEstimateRow& now, const MemoryEstimateRow& r) {
  std::vector<std::string> k;
  if (r.stage != now.stage) k.push_back(str("zero_optimization.stage=", r.stage));
  if (r.policy != now.policy) {
    k.push_back(str("activation_checkpointing.variant=", r.policy == "every_k" ? "selective_layer" : r.policy));
  }
  if (r.offload != now.offload) k.push_back(str("activation_offloading.enabled=", r.offload ? "true" : "false"));
  std::string out;
  for (const auto& s : k) out += (out.empty() ? "" : " ") + s;
  return str(out, " (estimated peak ", mib(r.peak_bytes), " MiB)");
}

// The configured offloading off (the optimizer and the parameters back on
// the device), at this stage or the lowest higher one where that fits: on a
// CPU, where the host copies share the memory, it only lowers the peak.
std::string offload_off(const MemoryEstimate& e, const MemoryEstimateRow& now, int64_t have) {
  const MemoryEstimateRow* best = nullptr;
  for (const auto& r : e.rows) {
    if (r.policy != now.policy || r.offload != now.offload || r.stage < now.stage || r.hybrid != now.hybrid) continue;
    const bool fits = r.no_offload_peak_bytes > 0 && r.no_offload_peak_bytes <= have;
    if (fits && (!best || r.stage < best->stage)) best = &r;
  }
  if (!best) return "";
  std::string keys = best->stage != now.stage ? str("zero_optimization.stage=", best->stage, " ") : "";
  if (e.offload_optimizer) keys += "zero_optimization.offload_optimizer.device=none ";
  if (e.offload_param) keys += "zero_optimization.offload_param.device=none ";
  return str(keys, "(estimated peak ", mib(best->no_offload_peak_bytes), " MiB",
             e.host_is_device ? ": on this CPU the host copies are in the same memory" : "", ")");
}

// The optimizer on the host, at this stage or the lowest that allows it (no
// recompute; the optimizer steps on the host), where the device and, when
// known (`host_have` > 0), the host then fit.
const MemoryEstimateRow* host_optimizer_row(const MemoryEstimate& e, const MemoryEstimateRow& now, int64_t have,
                                            int64_t host_have) {
  if (now.offload_optimizer) return nullptr;
  const MemoryEstimateRow* best = nullptr;
  for (const auto& r : e.rows) {
    if (r.policy != now.policy || r.offload != now.offload || r.stage < std::max(now.stage, 1) ||
        r.hybrid != (e.shard_group < e.dp)) {
      continue;
    }
    const int64_t on_host = r.host_optimizer_bytes + r.host_parameter_bytes + r.host_bytes;
    const bool fits = r.offload_optimizer_peak_bytes > 0 && r.offload_optimizer_peak_bytes <= have &&
                      (host_have <= 0 || on_host <= host_have);
    if (fits && (!best || r.stage < best->stage)) best = &r;
  }
  return best;
}

// A whole-device budget for the planner at this stage (or the highest).
std::string device_budget_option(const MemoryEstimate& e, const MemoryEstimateRow& now, int64_t have) {
  for (int stage : {now.stage, 3}) {
    const MemoryEstimateRow& full = e.row(stage, "full", now.offload);
    if (full.peak_bytes <= have) {
      return str(stage != now.stage ? str("zero_optimization.stage=", stage, " ") : std::string(),
                 "activation_checkpointing.variant=auto activation_checkpointing.device_memory_budget_bytes=", have,
                 " (the planner keeps what fits)");
    }
  }
  return "";
}

}  // namespace

std::string cheapest_fitting_change(const MemoryEstimate& e, int64_t have, int64_t host_have) {
  const MemoryEstimateRow& now = e.configured();
  auto fits = [&](const MemoryEstimateRow& r) { return r.feasible && r.peak_bytes <= have; };
  // Another policy at this stage, cheapest recompute first.
  const MemoryEstimateRow* policy_best = nullptr;
  for (const auto& r : e.rows) {
    if (r.stage != now.stage || r.hybrid != now.hybrid || r.offload != now.offload || r.policy == "auto") continue;
    if (fits(r) && recompute_rank(r.policy) > recompute_rank(now.policy) &&
        (!policy_best || recompute_rank(r.policy) < recompute_rank(policy_best->policy))) {
      policy_best = &r;
    }
  }
  // A higher stage with this policy.
  const MemoryEstimateRow* stage_best = nullptr;
  for (const auto& r : e.rows) {
    if (r.policy != now.policy || r.offload != now.offload || r.stage <= now.stage) continue;
    if (fits(r) && (!stage_best || r.stage < stage_best->stage)) stage_best = &r;
  }
  const MemoryEstimateRow* host_best = host_optimizer_row(e, now, have, host_have);
  std::vector<std::string> options = {offload_off(e, now, have)};
  if (stage_best) options.push_back(change_to(now, *stage_best));
  if (host_best && (!stage_best || host_best->stage <= stage_best->stage)) {
    options.push_back(str(host_best->stage != now.stage ? str("zero_optimization.stage=", host_best->stage, " ") : "",
                          "zero_optimization.offload_optimizer.device=cpu (estimated device peak ",
                          mib(host_best->offload_optimizer_peak_bytes), " MiB; the host holds ",
                          mib(host_best->host_optimizer_bytes), " MiB)"));
  }
  if (policy_best) options.push_back(change_to(now, *policy_best));
  options.push_back(device_budget_option(e, now, have));
  std::string out;
  for (const auto& o : options) {
    if (!o.empty()) out += (out.empty() ? "" : "; or ") + o;
  }
  return out;
}

int64_t largest_fitting_micro_batch(const Config& config, int world_size, int64_t have, int64_t limit,
                                    const std::function<MemoryEstimateInputs(int64_t micro)>& inputs) {
  // Memory alone: an auto row whose budget no plan meets is at full
  // checkpointing's peak, the least its plan needs; whether the budget can be
  // met is the planner's to say, at the micro-batch chosen, as for one given.
  auto fits = [&](int64_t micro) {
    const MemoryEstimate estimate = estimate_memory(config, world_size, inputs(micro));
    const MemoryEstimateRow& row = estimate.configured();  // a row of `estimate`, which must outlive it
    return row.peak_bytes <= have;
  };
  int64_t lo = 0, hi = limit;  // lo fits (0: trivially), hi + 1 does not (or is past the limit)
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace remat
