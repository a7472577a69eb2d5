#include "checkpointing/options.h"

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace remat {

const std::vector<std::string>& checkpoint_variant_names() {
  static const std::vector<std::string> names = {"none", "full", "selective_layer", "selective_op", "auto"};
  return names;
}

const std::string& checkpoint_variant_name(CheckpointVariant variant) {
  return checkpoint_variant_names().at(static_cast<size_t>(variant));
}

CheckpointVariant checkpoint_variant_from_name(const std::string& name) {
  const auto& names = checkpoint_variant_names();
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    throw ConfigError(str("'activation_checkpointing.variant' = \"", name,
                          "\" is not a variant; use none, full, selective_layer, selective_op or auto"));
  }
  return static_cast<CheckpointVariant>(it - names.begin());
}

const std::vector<std::string>& every_k_from_names() {
  static const std::vector<std::string> names = {"first", "last"};
  return names;
}

const std::string& every_k_from_name(EveryKFrom from) {
  return every_k_from_names().at(static_cast<size_t>(from));
}

std::string check_memory_budget(const MemoryBudget& b) {
  std::vector<std::string> set;
  if (b.memory_budget_bytes) set.push_back("'memory_budget_bytes'");
  if (b.memory_budget_fraction) set.push_back("'memory_budget_fraction'");
  // (A fraction and the knee together come from C++ only: the JSON key holds one.)
  if (b.memory_budget_knee) set.push_back("'memory_budget_fraction' \"knee\" (MemoryBudget::memory_budget_knee)");
  if (b.device_memory_budget_bytes || b.device_memory_budget_auto) set.push_back("'device_memory_budget_bytes'");
  if (set.empty()) {
    return "'activation_checkpointing.variant' is \"auto\" but no budget is set: set one of "
           "'memory_budget_bytes' (activations, per rank), 'memory_budget_fraction' (of the activation peak with "
           "no checkpointing, e.g. 0.5, or \"knee\" for the plan at the knee of the planner's frontier) or "
           "'device_memory_budget_bytes' (everything a rank holds at once)";
  }
  if (set.size() > 1) {
    std::string names;
    for (size_t i = 0; i < set.size(); ++i) names += str(i == 0 ? "" : i + 1 == set.size() ? " and " : ", ", set[i]);
    return str("'activation_checkpointing' sets ", names, ": the budget is given once, keep exactly one of them");
  }
  if (b.memory_budget_bytes && *b.memory_budget_bytes <= 0) {
    return str("'activation_checkpointing.memory_budget_bytes' = ", *b.memory_budget_bytes, " must be positive");
  }
  if (b.device_memory_budget_bytes && *b.device_memory_budget_bytes <= 0) {
    return str("'activation_checkpointing.device_memory_budget_bytes' = ", *b.device_memory_budget_bytes,
               " must be positive (the bytes one rank's device may hold at once)");
  }
  if (b.memory_budget_fraction && !(*b.memory_budget_fraction > 0 && std::isfinite(*b.memory_budget_fraction))) {
    return str("'activation_checkpointing.memory_budget_fraction' = ", *b.memory_budget_fraction,
               " must be a positive number (0.5: half the peak with no checkpointing) or \"knee\"");
  }
  return "";
}

namespace {

// Appends one broken rule to `problems` (one per line).
void add_problem(std::string& problems, const std::string& problem) {
  if (!problem.empty()) problems += (problems.empty() ? "" : "\n") + problem;
}

}  // namespace

std::string check_policy_settings(const PolicySettings& p) {
  std::string problems;
  if (p.every_k < 1) {
    add_problem(problems, str("'activation_checkpointing.every_k' = ", p.every_k,
                              " must be at least 1 (1 checkpoints every block)"));
  }
  if (p.variant == CheckpointVariant::kAuto) {
    add_problem(problems, check_memory_budget(p));
  } else if (p.memory_budget_bytes || p.memory_budget_fraction || p.memory_budget_knee ||
             p.device_memory_budget_bytes || p.device_memory_budget_auto) {
    const bool device = p.device_memory_budget_bytes || p.device_memory_budget_auto;
    add_problem(problems, str("'activation_checkpointing.",
                              p.memory_budget_bytes ? "memory_budget_bytes"
                              : device              ? "device_memory_budget_bytes"
                                                    : "memory_budget_fraction",
                              "' is set but 'variant' is \"", checkpoint_variant_name(p.variant),
                              "\": a budget is planned by variant \"auto\" (set it), or remove the budget"));
  }
  for (const auto& op : p.save_ops.value_or(std::vector<std::string>{})) {
    auto sep = op.find("::");
    if (sep == std::string::npos || sep == 0 || sep + 2 >= op.size()) {
      add_problem(problems, str("'activation_checkpointing.save_ops' entry \"", op,
                                "\" is not an operator name like \"aten::mm\""));
      break;
    }
  }
  return problems;
}

std::string check_region_settings(const RegionSettings& r) {
  std::string problems;
  if (r.contiguous_memory_optimization && !r.number_checkpoints) {
    add_problem(problems, "'activation_checkpointing.contiguous_memory_optimization' is true but "
                          "'activation_checkpointing.number_checkpoints' is not set: set it to the "
                          "number of checkpointed regions per forward (e.g. model.n_layer)");
  }
  if (r.number_checkpoints && *r.number_checkpoints < 1) {
    add_problem(problems, str("'activation_checkpointing.number_checkpoints' = ", *r.number_checkpoints,
                              " must be at least 1"));
  }
  if (r.contiguous_memory_optimization && !r.partition_activations && !r.cpu_checkpointing) {
    add_problem(problems, "'activation_checkpointing.contiguous_memory_optimization' lays out the partitioned or "
                          "offloaded copies of checkpoint inputs: set 'partition_activations' or "
                          "'cpu_checkpointing' to true as well, or set it to false");
  }
  if (r.offload_min_bytes < 0) {
    add_problem(problems, str("'activation_checkpointing.offload_min_bytes' = ", r.offload_min_bytes,
                              " must be >= 0"));
  }
  if (r.offload_max_in_flight < 1) {
    add_problem(problems, str("'activation_checkpointing.offload_max_in_flight' = ", r.offload_max_in_flight,
                              " must be at least 1"));
  }
  return problems;
}

std::string check_activation_checkpointing(const ActivationCheckpointingOptions& options) {
  std::string problems = check_policy_settings(options);
  add_problem(problems, check_region_settings(options));
  return problems;
}

std::string check_offload_activations(const OffloadActivationsOptions& o) {
  std::string problems;
  if (o.min_offload_size < 0) {
    add_problem(problems, str("'activation_offloading.min_offload_size' = ", o.min_offload_size,
                              " must be >= 0 (bytes; 0 offloads every saved tensor)"));
  }
  if (o.max_fwd_stash_size < 1) {
    add_problem(problems, str("'activation_offloading.max_fwd_stash_size' = ", o.max_fwd_stash_size,
                              " must be at least 1"));
  }
  return problems;
}

}  // namespace remat
