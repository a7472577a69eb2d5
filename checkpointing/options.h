// Activation checkpointing's own options, each declared once with its default
// and validated here: the policy (which blocks, PolicySettings), the memory
// budget of the planner (MemoryBudget), the defaults of every region
// (RegionSettings, with OffloadSettings for cpu_checkpointing) and activation
// offloading (OffloadActivationsOptions). engine/config.cc binds the JSON
// sections activation_checkpointing and activation_offloading onto these
// structs; the messages name the JSON keys, since that is where users set
// them.
//
//   remat::ActivationCheckpointingOptions ac;
//   ac.variant = remat::CheckpointVariant::kSelectiveLayer;
//   ac.every_k = 2;
//   if (std::string bad = remat::check_activation_checkpointing(ac); !bad.empty()) ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat {

// Which blocks a whole-model policy checkpoints (JSON: "none", "full",
// "selective_layer", "selective_op", "auto").
enum class CheckpointVariant { kNone, kFull, kSelectiveLayer, kSelectiveOp, kAuto };

// The names, in enumerator order.
const std::vector<std::string>& checkpoint_variant_names();
const std::string& checkpoint_variant_name(CheckpointVariant variant);
// The variant named `name`; a ConfigError listing the names otherwise.
CheckpointVariant checkpoint_variant_from_name(const std::string& name);

// selective_layer: which block of each k is checkpointed (JSON: "first", "last").
enum class EveryKFrom { kFirst, kLast };
const std::vector<std::string>& every_k_from_names();
const std::string& every_k_from_name(EveryKFrom from);

// variant "auto": the budget per rank, exactly one of four
// (checkpointing/planner.h): for a step's activation peak (live tensor bytes
// above those at the step's start) in bytes or as a fraction of the peak with
// no checkpointing; the knee of the planner's frontier (JSON:
// memory_budget_fraction "knee"); or everything the rank holds at once
// (device_memory_budget_bytes: the planner subtracts the model state it is
// told of, PlannerOptions::state_bytes, and plans the activations in the rest).
struct MemoryBudget {
  std::optional<int64_t> memory_budget_bytes;
  std::optional<double> memory_budget_fraction;
  // The plan at the knee of the frontier of predicted peak against predicted
  // extra time (checkpointing/frontier.h), whatever its peak.
  bool memory_budget_knee = false;
  std::optional<int64_t> device_memory_budget_bytes;
  // device_memory_budget_bytes "auto": the engine resolves it, before the
  // planner sees it, to the rank's share of its device's capacity less a
  // reserve (runtime/device_memory.h, auto_device_budget).
  bool device_memory_budget_auto = false;
};

// Which blocks a whole-model policy checkpoints (checkpointing/policy.h).
struct PolicySettings : MemoryBudget {
  CheckpointVariant variant = CheckpointVariant::kNone;
  // selective_layer: checkpoint every k-th block.
  int every_k = 1;
  // selective_layer: kFirst: blocks 0, k, 2k, ...; kLast: the last block and
  // every k-th before it (n-1, n-1-k, ...), so the block that runs last is
  // always among them.
  EveryKFrom every_k_from = EveryKFrom::kFirst;
  // selective_op: the ops whose outputs are kept; unset (null): the default
  // list of checkpointing/selective_op.h.
  std::optional<std::vector<std::string>> save_ops;
};

// cpu_checkpointing's settings beyond on/off (checkpointing/stored_inputs.h).
struct OffloadSettings {
  // Offloaded tensors (or shares) smaller than this many bytes stay on the
  // device. 0 moves every input, as DeepSpeed's cpu_checkpointing does; 1024
  // (torchtune's min_offload_size) keeps tiny tensors whose copy costs more
  // latency than the memory is worth.
  int64_t offload_min_bytes = 0;
  // Copies to the host in flight at once.
  int offload_max_in_flight = 2;
  // The last region's inputs stay on the device (backward needs them first).
  bool offload_keep_last = true;
};

// The defaults every checkpoint region starts from (configure_checkpointing,
// checkpointing/checkpoint.h).
struct RegionSettings : OffloadSettings {
  // Each tensor-parallel rank keeps 1/tp of a region's inputs.
  bool partition_activations = false;
  // A region's inputs (or their shares) move to host memory until recompute.
  bool cpu_checkpointing = false;
  // Stored inputs go into preallocated buffers with number_checkpoints slots.
  bool contiguous_memory_optimization = false;
  // Regions alive at once (contiguous_memory_optimization needs it).
  std::optional<int64_t> number_checkpoints;
  // Synchronize the device at region boundaries.
  bool synchronize_checkpoint_boundary = false;
  // Time forward, recompute and backward per region.
  bool profile = false;
  // Regions as one custom autograd Function (true) or through saved-tensor
  // hooks (false); see checkpointing/checkpoint.h.
  bool reentrant = false;
  // Regions keep the outputs of the tensor-parallel collectives they run
  // (all-reduce, all-gather, reduce-scatter) and the recompute reuses them
  // instead of communicating again: no collective in the recompute, their
  // bytes held until the backward.
  bool save_collectives = false;
};

// The activation_checkpointing section: the region defaults and the policy.
struct ActivationCheckpointingOptions : RegionSettings, PolicySettings {};

// torchtune's OffloadActivations options (the names of Axolotl's
// get_lora_act_offloading_ctx_manager), checkpointing/offload_activations.h.
struct OffloadActivationsOptions {
  // remat-train runs each forward inside an offloading scope.
  bool enabled = false;
  // Host copies of GPU tensors in pinned memory.
  bool use_pin_memory = true;
  // Copies on a side stream (GPU), overlapping compute.
  bool use_streams = true;
  // Saved tensors smaller than this many bytes stay on the device.
  int64_t min_offload_size = 1024;
  // Copies to the host in flight at once (with use_streams).
  int max_fwd_stash_size = 5;
  // Warn when no output head is found to keep on the device.
  bool warn_if_no_head = true;
  // The head's dotted module path; empty: found by name or type (find_output_head).
  std::string head;
};

// The rules, each written once: an empty string when the options are valid,
// else every rule broken, one per line, each saying what is wrong and which
// key to change (check_memory_budget: the first, as its rules build on each other).
std::string check_memory_budget(const MemoryBudget& budget);
// every_k, save_ops, and a budget exactly when the variant is auto.
std::string check_policy_settings(const PolicySettings& policy);
std::string check_region_settings(const RegionSettings& region);
// Both of the above.
std::string check_activation_checkpointing(const ActivationCheckpointingOptions& options);
std::string check_offload_activations(const OffloadActivationsOptions& options);

}  // namespace remat
