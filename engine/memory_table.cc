// The estimator's text (engine/memory_estimate.h): a row by its keys, the
// table like DeepSpeed's estimators print, the one line remat-train prints
// at start, and the JSON remat-estimate writes.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>

#include "engine/memory_estimate.h"
#include "runtime/error.h"

namespace remat {

namespace {

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / 1048576.0);
  return buf;
}

// "device capacity 81092 MiB per rank: the configured peak fits" (the device or host apart).
std::string capacity_text(const MemoryEstimate& e) {
  bool fits = false;
  for (const auto& r : e.rows) {
    if (r.configured) fits = r.feasible && r.peak_bytes <= e.device_capacity_bytes;
  }
  return str(e.host_is_device ? "memory" : "device capacity", " ", mib(e.device_capacity_bytes),
             " MiB per rank: the configured peak ", fits ? "fits" : "does not fit");
}

}  // namespace

const MemoryEstimateRow& MemoryEstimate::configured() const {
  for (const auto& r : rows) {
    if (r.configured) return r;
  }
  throw Error("memory estimate: no row matches the configuration");
}

const MemoryEstimateRow& MemoryEstimate::row(int stage, const std::string& policy, bool offload) const {
  const bool hybrid = shard_group < dp;
  for (const auto& r : rows) {
    if (r.stage == stage && r.policy == policy && r.offload == offload && (stage == 0 || r.hybrid == hybrid)) return r;
  }
  throw Error(str("memory estimate: no row for stage ", stage, " policy ", policy, offload ? " offloaded" : ""));
}

std::string MemoryEstimate::table() const {
  std::ostringstream o;
  o << "Estimated memory per rank (" << mode << (host_is_device ? "" : ", the model on a GPU") << "), " << world_size << " ranks = dp " << dp << " x tp " << tp
    << (shard_group < dp ? str(", hybrid shards of ", shard_group) : std::string()) << ", MiB; * the configuration\n";
  char line[512];
  // offload_param: a column of its own (stage 3's rows), absent otherwise.
  std::snprintf(line, sizeof line, "  %-5s %-13s %-7s %-5s %10s %10s %10s %10s %10s %10s %10s %10s %10s %10s%s  %s\n",
                "stage", "policy", "offload", "optim", "params", "grads", "optimizer", "gathered", "activation",
                "host", "comm", "peak", "host optim", "peak optim", offload_param ? " host param" : "", "plan");
  o << line;
  for (const auto& r : rows) {
    const std::string stage = str(r.configured ? "*" : " ", r.stage, r.hybrid ? "h" : "");
    const bool alt = r.stage > 0;  // stage 0 cannot offload the optimizer
    char host_param[32] = "";
    if (offload_param) {
      std::snprintf(host_param, sizeof host_param, " %10s", r.stage == 3 ? mib(r.host_parameter_bytes).c_str() : "-");
    }
    std::snprintf(line, sizeof line, "  %-5s %-13s %-7s %-5s %10s %10s %10s %10s %10s %10s %10s %10s %10s %10s%s  %s%s\n",
                  stage.c_str(), r.policy.c_str(), r.offload ? "on" : "off", r.offload_optimizer ? "host" : "dev",
                  mib(r.parameter_bytes).c_str(), mib(r.gradient_bytes).c_str(), mib(r.optimizer_bytes).c_str(),
                  mib(r.gathered_bytes).c_str(), mib(r.activation_bytes).c_str(), mib(r.host_bytes).c_str(),
                  mib(r.comm_bytes).c_str(), mib(r.peak_bytes).c_str(), alt ? mib(r.host_optimizer_bytes).c_str() : "-",
                  alt && r.offload_optimizer_peak_bytes > 0 ? mib(r.offload_optimizer_peak_bytes).c_str() : "-",
                  host_param, r.feasible ? "" : "(no plan fits its budget) ", r.plan.c_str());
    o << line;
  }
  if (!rows.empty() && std::count_if(rows.begin(), rows.end(), [](const MemoryEstimateRow& r) {
        return r.policy == "auto";
      }) <= 1) {
    o << "  auto: past " << kMaxPlannedBlocks << " blocks the planner's rows are not solved here (it solves at the run)\n";
  }
  o << "  activation: the step's activation peak above the state (" << (mode == "live" ? "a whole-model backward's "
       "gradients included; grads: the stage's peak" : "gradients apart")
    << "); host: what offloading moves to the host and holds there at the peak (apart from the peak); comm: buffers "
       "inside grads (stages 1-2 bucket) and gathered (stage 3); peak: what one rank holds at once"
    << (host_is_device ? "" : " on its device (host apart: in host memory)")
    << "; optim: where the optimizer's state is (host: zero_optimization.offload_optimizer.device cpu); host optim: "
       "the float32 master shards, their gradients and the optimizer's state on the host when it is there; peak optim: "
       "the peak with the optimizer on the host"
    << (host_is_device ? " (host optim included: the host is the device)" : " (host optim apart)")
    << (offload_param ? str("; host param: zero_optimization.offload_param's float32 parameter shards and their "
                            "gradients on the host (with the optimizer on the device, its state of them too), ",
                            host_is_device ? "in the peaks" : "apart from the peaks",
                            "; params, grads and optimizer then keep the device's: the persistent parameters' and, "
                            "in grads, a unit's gradient shard until it reaches the host")
                      : std::string())
    << "\n";
  for (const MemoryEstimateRow& r : rows) {
    if (!async_save || !r.configured) continue;
    o << "  train.async_save: a background save's snapshot holds " << mib(r.save_snapshot_bytes)
      << " MiB of host memory per rank (the configured row) until its files are written, "
      << (host_is_device ? "in the peaks (the host is the device)" : "apart from the peaks") << "\n";
  }
  if (device_capacity_bytes > 0 && !rows.empty()) o << "  " << capacity_text(*this) << "\n";
  return o.str();
}

std::string MemoryEstimate::line() const {
  const MemoryEstimateRow& r = configured();
  return str("memory estimate (", mode, "): peak ", mib(r.peak_bytes), " MiB per rank = parameters ",
             mib(r.parameter_bytes), " + gradients ", mib(r.gradient_bytes), " + optimizer state ",
             mib(r.optimizer_bytes), " + gathered units ", mib(r.gathered_bytes), " + activations ",
             mib(r.activation_bytes), r.host_bytes > 0 ? str(" (host ", mib(r.host_bytes), ")") : std::string(),
             r.offload_optimizer ? str("; the optimizer on the host: ", mib(r.host_optimizer_bytes), " MiB")
                                 : std::string(),
             r.disk_bytes > 0 ? str("; its Adam moments on disk (nvme_path): ", mib(r.disk_bytes), " MiB")
                              : std::string(),
             r.disk_master_bytes > 0 ? str("; its float32 masters on disk: ", mib(r.disk_master_bytes), " MiB")
                                     : std::string(),
             r.host_parameter_bytes > 0 ? str("; the parameter shards on the host: ", mib(r.host_parameter_bytes), " MiB")
                                        : std::string(),
             r.disk_parameter_bytes > 0
                 ? str("; the parameter shards on disk (offload_param.nvme_path): ", mib(r.disk_parameter_bytes), " MiB")
                 : std::string(),
             async_save ? str("; a background save's snapshot on the host: ", mib(r.save_snapshot_bytes), " MiB")
                        : std::string(),
             " (ZeRO stage ", r.stage, r.hybrid ? " hybrid" : "", ", ", r.policy, r.plan.empty() ? "" : " ", r.plan,
             ")", device_capacity_bytes > 0 ? "; " + capacity_text(*this) : std::string());
}

nlohmann::json MemoryEstimate::to_json() const {
  nlohmann::json rows_json = nlohmann::json::array();
  for (const auto& r : rows) {
    rows_json.push_back({{"stage", r.stage}, {"hybrid", r.hybrid}, {"policy", r.policy}, {"offload", r.offload},
                         {"configured", r.configured}, {"feasible", r.feasible}, {"plan", r.plan},
                         {"parameter_bytes", r.parameter_bytes}, {"gradient_bytes", r.gradient_bytes},
                         {"optimizer_bytes", r.optimizer_bytes}, {"gathered_bytes", r.gathered_bytes},
                         {"activation_bytes", r.activation_bytes}, {"host_bytes", r.host_bytes},
                         {"comm_bytes", r.comm_bytes}, {"other_bytes", r.other_bytes},
                         {"peak_bytes", r.peak_bytes}, {"offload_optimizer", r.offload_optimizer},
                         {"host_optimizer_bytes", r.host_optimizer_bytes},
                         {"offload_optimizer_peak_bytes", r.offload_optimizer_peak_bytes}});
    if (r.disk_bytes > 0) rows_json.back()["disk_bytes"] = r.disk_bytes;
    if (r.disk_master_bytes > 0) rows_json.back()["disk_master_bytes"] = r.disk_master_bytes;
    if (r.disk_parameter_bytes > 0) rows_json.back()["disk_parameter_bytes"] = r.disk_parameter_bytes;
    // Written only when the config offloads: other estimates' keys stay as they are.
    if (offload_param) rows_json.back()["host_parameter_bytes"] = r.host_parameter_bytes;
    if (offload_param || offload_optimizer) rows_json.back()["no_offload_peak_bytes"] = r.no_offload_peak_bytes;
    if (async_save) rows_json.back()["save_snapshot_bytes"] = r.save_snapshot_bytes;
  }
  nlohmann::json out = {{"mode", mode}, {"world_size", world_size}, {"dp", dp}, {"tp", tp},
                        {"shard_group", shard_group}, {"rows", rows_json}};
  if (!host_is_device) out["host_is_device"] = false;
  if (offload_param) out["offload_param"] = true;
  if (device_capacity_bytes > 0) out["device_capacity_bytes"] = device_capacity_bytes;
  return out;
}

}  // namespace remat
