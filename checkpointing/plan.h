// The planner's pure core: the choices a block can take, what each costs (as
// measured by profile_activation_choices, checkpointing/planner.h, or given
// by a test), the plan, and the solver that picks the plan of least predicted
// extra time whose predicted peak fits a budget. No autograd, no modules: the
// numbers in, the plan out.
//
//   remat::BlockCosts costs;   // costs.choices, costs.blocks[block][column], the bases
//   remat::ActivationPlan plan = remat::solve_activation_plan(costs, budget_bytes);
//
// - The peak model: with S_i the held bytes of blocks 0..i under the plan,
//   peak = max(fixed_peak, max_i(forward_live_base + S_(i-1) + forward_peak_i),
//   forward_base + S_last, max_i(backward_base + S_i + transient_i)): a
//   block's forward (a checkpointed one frees its intermediates only at its
//   end), the head and loss, and a block's backward (a checkpointed one
//   recomputes first).
// - Solving: a multiple-choice knapsack over blocks in order (exact dynamic
//   programming over the Pareto frontier of held bytes and time) minimising
//   the predicted extra time (CPU time unless decide_on_wall_time) subject to
//   the predicted peak <= budget. Every plan a budget can get is the frontier
//   (checkpointing/frontier.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

// What one block does with its activations.
enum class BlockChoice : int {
  kKeep = 0,            // no checkpoint: autograd keeps what it saves
  kSelectiveOp,         // selective_op with the default list (the projections)
  kSelectiveOpMatmuls,  // selective_op with matmul_save_ops() (scores kept too)
  kFull,                // full checkpoint: only the inputs are kept
  kFullOffload,         // full checkpoint with the inputs offloaded to the host
  kOffloadActivations,  // no checkpoint; what it saves goes to the host (offload_activations.h)
};
// "keep", "selective_op", "selective_op_matmuls", "full", "full_offload",
// "offload_activations".
const char* block_choice_name(BlockChoice choice);
// Every choice, in the order above.
const std::vector<BlockChoice>& all_block_choices();
// The choice named `name`; an Error listing the names otherwise.
BlockChoice block_choice_from_name(const std::string& name);

// One block under one choice, as measured.
struct ChoiceCost {
  int64_t held_bytes = 0;       // live after its forward (its output included)
  int64_t forward_peak_bytes = 0;  // peak above the live bytes at its call, during the call
  int64_t transient_bytes = 0;  // peak above the live bytes while its backward runs
  double extra_cpu_ms = 0;      // thread CPU time over keeping, forward + backward (the model's)
  double extra_wall_ms = 0;     // wall time over keeping
  double recompute_cpu_ms = 0;  // the part of extra_cpu_ms its recompute takes, as measured
  double recompute_wall_ms = 0;
  // Moved to the host by its forward and held there until its backward
  // (offloaded activations, offloaded checkpoint inputs), as the offloading
  // counters count them. Where the host is the device (a CPU model) bytes the
  // memory tracker sees are in held_bytes too: activation offloading's host
  // arena is outside it, cpu_checkpointing's copies are not.
  int64_t host_bytes = 0;
};

// The planner's input: measured (profile_activation_choices) or given (tests).
struct BlockCosts {
  std::vector<BlockChoice> choices;              // the columns
  std::vector<std::vector<ChoiceCost>> blocks;   // [block][column]
  int64_t forward_base = 0;       // peak from the last block's call to the blocks' backward, minus S_last
  int64_t forward_live_base = 0;  // live at block i's call, minus S_(i-1)
  int64_t backward_base = 0;      // live at block i's backward start, minus S_i
  int64_t fixed_peak = 0;         // peak before the first block's call and after the blocks' backward
  int64_t keep_peak = 0;      // measured peak with every block kept
  bool decide_on_wall_time = false;
};

// The measurements as a table (logged at debug level by the planner).
std::string describe_costs(const BlockCosts& costs);

// A per-block choice with what the model predicts for it.
struct ActivationPlan {
  std::vector<BlockChoice> choices;  // one per block
  int64_t budget_bytes = 0;
  int64_t predicted_peak = 0;
  // device_memory_budget_bytes: the whole budget, and predicted_peak plus
  // the state the planner was told of (PlannerOptions::state_bytes); else 0.
  int64_t device_budget_bytes = 0;
  int64_t predicted_total_peak = 0;
  double predicted_extra_cpu_ms = 0;
  double predicted_extra_wall_ms = 0;
  std::vector<int64_t> batch_shape;  // what it was planned for (remat-train)

  // "keep,full,..." one name per block.
  std::string summary() const;
  // One line per block: choice, held bytes, predicted extra ms (CPU, wall).
  std::string table(const BlockCosts& costs) const;
};

// The predicted peak of `columns` (one column index per block).
int64_t predict_peak(const BlockCosts& costs, const std::vector<size_t>& columns);

// The least predicted extra time with a predicted peak <= budget_bytes (ties:
// fewer held bytes, then lower columns). A budget no plan fits is an Error
// giving the smallest feasible budget.
ActivationPlan solve_activation_plan(const BlockCosts& costs, int64_t budget_bytes);

// The lowest predicted peak any plan reaches.
int64_t smallest_feasible_budget(const BlockCosts& costs);

}  // namespace remat
