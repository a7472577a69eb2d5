// A memory budget instead of a policy: remat measures what each block keeps
// and costs under every choice, then picks per block what to keep, recompute
// or offload so that a training step's activation peak fits the budget at the
// least extra time.
//
//   remat::PlannerOptions options;
//   options.memory_budget_fraction = 0.5;   // of the peak with every block kept
//   auto step = [&] { model->loss(x, y).backward(); };   // the real batch shape
//   remat::ActivationPlan plan =
//       remat::plan_activation_checkpointing(*model, step, options, world.get());
//   // the model now runs under the plan; plan again when the batch shape changes
//
// How it works (docs/checkpointing.md, "The memory planner"):
// - Profiling: the step runs once to warm up, then `rounds` times under each
//   candidate choice applied to every block. A hook on each block's call
//   route records, per block: the bytes its forward leaves live (held), the
//   peak above the live bytes while its backward runs (transient: the
//   recomputed intermediates and gradient buffers), and the thread CPU time
//   and wall time of its forward call, its backward and its recompute alone.
//   The RNG states are restored before every run and after the last, the
//   parameters' gradients (values, and undefined ones left undefined) after
//   the last, so the profiled steps leave training as they found it. With a
//   communicator, every measurement is all-reduced (max), so every rank
//   solves the same problem and gets the same plan.
//   The peak model's bases are the largest values the profiling runs saw.
// - The time model: a checkpointed choice costs its recompute (the median
//   over rounds); an offloading one also what the rest of its forward and
//   backward takes over keeping's.
// - The peak model and the solver: checkpointing/plan.h (the pure core); the
//   measuring hooks and the time model: checkpointing/internal/profiling.h.
//   Every plan a budget can get, from the smallest feasible one up, is the
//   frontier (checkpointing/frontier.h); memory_budget_knee plans at its knee.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpointing/checkpoint.h"
#include "checkpointing/options.h"
#include "checkpointing/plan.h"

namespace remat {

class Communicator;

// The budget (MemoryBudget, checkpointing/options.h): absolute bytes, a
// fraction of the measured peak with every block kept, or the whole device's
// bytes less `state_bytes` (exactly one is set).
struct PlannerOptions : MemoryBudget {
  // device_memory_budget_bytes: what the rank holds besides the step's
  // activation peak as profiled (parameters, optimizer state, whatever is
  // live at the step's start: the engine measures it), and a description of
  // it for the message when the budget cannot be met.
  int64_t state_bytes = 0;
  std::string state_description;
  // Dotted path of the ModuleList of blocks.
  std::string blocks = "blocks";
  // Candidate choices (keep is always one). Empty: every choice, except that
  // the two offloading ones are left out for a model on the CPU (there is no
  // separate host memory to move to) and full_offload when the region
  // defaults offload already. A list given here is used as it is.
  std::vector<BlockChoice> choices;
  // Profiling runs per choice; the median time of the runs is used.
  int rounds = 2;
  // Decide on wall time instead of thread CPU time (CPU time is steadier on a
  // shared machine; wall time also sees waiting and other threads' work).
  bool decide_on_wall_time = false;
  // The options of the offload_activations choice (torchtune's defaults;
  // remat-train passes its activation_offloading section).
  OffloadActivationsOptions offload;
  // Region options for the checkpointed choices; unset: the defaults in
  // effect when each region runs (configure_checkpointing), as policies do.
  std::optional<CheckpointOptions> checkpoint;
  // Each plan also writes the frontier here as frontier.csv, the plan in
  // effect marked (write_frontier_csv; rank 0 of the communicator). Empty:
  // none. remat-train's --plan-report.
  std::string report_dir;
};

// The rules plan_activation_checkpointing checks before profiling, for a
// caller to check earlier: exactly one budget (check_memory_budget), rounds
// >= 1, a block list at options.blocks, and for the knee at least two blocks.
// A ConfigError saying what to change otherwise.
void check_planner_options(torch::nn::Module& model, const PlannerOptions& options);

// Runs `step` (one forward and backward on the real batch) under every
// candidate choice and returns the measurements. Leaves the model unmarked.
BlockCosts profile_activation_choices(torch::nn::Module& model, const std::function<void()>& step,
                                      const PlannerOptions& options, Communicator* comm = nullptr);

// Marks the blocks with the plan's choices (replacing earlier marks).
void apply_activation_plan(torch::nn::Module& model, const ActivationPlan& plan,
                           const PlannerOptions& options);

// Profiles, solves for the budget, applies the plan and logs its table.
ActivationPlan plan_activation_checkpointing(torch::nn::Module& model, const std::function<void()>& step,
                                             const PlannerOptions& options, Communicator* comm = nullptr);

// Plans once per batch shape: ensure() profiles, solves and applies when the
// shape differs from the one the current plan was made for (or there is none).
//
//   remat::ActivationPlanner planner(*model, options, world.get());
//   for (...) {
//     planner.ensure(x.sizes().vec(), [&] { model->loss(x, y).backward(); });
//     ...  // the step itself
//   }
class ActivationPlanner {
 public:
  ActivationPlanner(torch::nn::Module& model, PlannerOptions options, Communicator* comm = nullptr)
      : model_(model), options_(std::move(options)), comm_(comm) {}
  // True when it planned now.
  bool ensure(const std::vector<int64_t>& batch_shape, const std::function<void()>& step);
  // The plan in effect (none before the first ensure).
  const std::optional<ActivationPlan>& plan() const { return plan_; }
  // device_memory_budget_bytes: the state the next plan subtracts.
  void set_state_bytes(int64_t bytes, std::string description) {
    options_.state_bytes = bytes;
    options_.state_description = std::move(description);
  }
  int plans_made() const { return plans_made_; }

 private:
  torch::nn::Module& model_;
  PlannerOptions options_;
  Communicator* comm_;
  std::optional<ActivationPlan> plan_;
  int plans_made_ = 0;
};

}  // namespace remat
