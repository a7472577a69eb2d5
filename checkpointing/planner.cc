#include "checkpointing/planner.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "checkpointing/frontier.h"
#include "checkpointing/internal/plan_messages.h"
#include "checkpointing/internal/profiling.h"
#include "checkpointing/policy.h"
#include "rng/rng_tracker.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace {

using internal::mib;
using internal::throw_budget_unmet;

std::vector<std::shared_ptr<torch::nn::Module>> block_modules(torch::nn::Module& model,
                                                              const std::string& path) {
  auto list = find_block_list(model, path);
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (size_t i = 0; i < list->size(); ++i) out.push_back(list->ptr(i));
  if (out.empty()) {
    throw ConfigError(str("activation checkpointing planner: the ModuleList '", path,
                          "' has no blocks to plan for"));
  }
  return out;
}

c10::Device model_device(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) return p.device();
  return c10::Device(c10::DeviceType::CPU);
}

// The choices to profile: keep, then options.choices as given, or every
// choice less those that make no sense here (see PlannerOptions::choices).
std::vector<BlockChoice> candidate_choices(const PlannerOptions& options, c10::DeviceType device) {
  std::vector<BlockChoice> choices = {BlockChoice::kKeep};
  const CheckpointOptions& base = options.checkpoint ? *options.checkpoint : default_checkpoint_options();
  for (BlockChoice c : options.choices.empty() ? all_block_choices() : options.choices) {
    if (std::find(choices.begin(), choices.end(), c) != choices.end()) continue;
    if (options.choices.empty()) {
      const bool offloads = c == BlockChoice::kFullOffload || c == BlockChoice::kOffloadActivations;
      if (offloads && device == c10::DeviceType::CPU) continue;
      // A full checkpoint whose inputs the defaults offload already is the same choice twice.
      if (c == BlockChoice::kFullOffload && base.storage.offload) continue;
    }
    choices.push_back(c);
  }
  return choices;
}

// Block i's hook for `choice`, its regions named like a policy's ("blocks.3").
std::shared_ptr<internal::ChoiceHook> choice_hook(BlockChoice choice, size_t i, const PlannerOptions& options,
                                                  const std::shared_ptr<torch::nn::Module>& block) {
  return std::make_shared<internal::ChoiceHook>(choice, str(options.blocks, ".", i), options.checkpoint,
                                                options.offload, block);
}

// The parameters' gradients as the step found them: restore() puts back
// undefined ones and defined ones (their values too with `values`).
class GradSnapshot {
 public:
  explicit GradSnapshot(torch::nn::Module& model) {
    for (auto& p : model.parameters()) {
      grads_.emplace_back(p, p.grad().defined() ? p.grad().clone() : at::Tensor());
    }
  }
  void restore(bool values) {
    at::NoGradGuard no_grad;
    for (auto& [p, g] : grads_) {
      if (!g.defined()) {
        if (p.grad().defined()) p.mutable_grad() = at::Tensor();
      } else if (!p.grad().defined()) {
        p.mutable_grad() = g.clone();
      } else if (values) {
        p.mutable_grad().copy_(g);
      }
    }
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> grads_;  // parameter, its gradient's values (or undefined)
};

// Hooks on the caller's leaf tensors go with the run, whatever happens.
struct LeafHooks {
  internal::RunRecord& record;
  ~LeafHooks() {
    for (auto& [tensor, handle] : record.leaf_hooks) {
      try {
        tensor.remove_hook(handle);
      } catch (...) {  // the tensor's hooks are gone already
      }
    }
  }
};

// The profiling of one model: runs its step with every block under one
// choice, measured or not, and leaves the RNG and gradients as found when a
// step throws.
struct Profiling {
  torch::nn::Module& model;
  const std::vector<std::shared_ptr<torch::nn::Module>>& blocks;
  const std::function<void()>& step;
  const PlannerOptions& options;
  const std::vector<BlockChoice>& choices;
  c10::DeviceType device;
  RngSnapshot rng = capture_rng();  // what the step changes besides activations: the RNG...
  GradSnapshot grads{model};        // ...and the gradients

  // One step with every block under choices[column]; with `into`, what it
  // measured is added there.
  void run(size_t column, internal::Measurements* into) {
    grads.restore(false);
    restore_rng(rng);
    const size_t n = blocks.size();
    auto record = std::make_shared<internal::RunRecord>(n);
    record->device = device;
    for (size_t i = 0; i < n; ++i) {
      set_module_hook(*blocks[i], HookSlot::kCheckpoint,
                      std::make_shared<internal::MeasuringHook>(choice_hook(choices[column], i, options, blocks[i]),
                                                                static_cast<int>(i), record));
    }
    LeafHooks leaf_hooks{*record};
    int64_t step_tail = 0;
    try {
      step();
      // After block 0's backward: the peak of what follows (embedding backward).
      step_tail = record->open >= 0 ? 0 : record->memory.peak(device);
      record->boundary(-1);
      if (into != nullptr) check_every_backward_ran(*record);
    } catch (...) {
      finish();
      throw;
    }
    if (into == nullptr) return;
    record->settle_held();
    into->add(column, *record, step_tail);
  }

  void check_every_backward_ran(const internal::RunRecord& record) const {
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!record.seen[i]) {
        throw Error(str("activation planner: the profiling step ran no backward through ", options.blocks, ".", i,
                        " (its output does not require grad, or the step does not call backward): the step "
                        "must run one forward and one backward on the real batch in training mode"));
      }
    }
  }

  // The model unmarked, its gradients and the RNG as found.
  void finish() {
    remove_activation_checkpointing(model);
    grads.restore(true);
    restore_rng(rng);
  }
};

}  // namespace

void apply_activation_plan(torch::nn::Module& model, const ActivationPlan& plan, const PlannerOptions& options) {
  auto blocks = block_modules(model, options.blocks);
  if (plan.choices.size() != blocks.size()) {
    throw Error(str("activation plan: the plan has ", plan.choices.size(), " choices but '", options.blocks,
                    "' has ", blocks.size(), " blocks: plan again for this model"));
  }
  remove_activation_checkpointing(model);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (plan.choices[i] == BlockChoice::kKeep) continue;
    set_module_hook(*blocks[i], HookSlot::kCheckpoint, choice_hook(plan.choices[i], i, options, blocks[i]));
  }
}

BlockCosts profile_activation_choices(torch::nn::Module& model, const std::function<void()>& step,
                                      const PlannerOptions& options, Communicator* comm) {
  auto blocks = block_modules(model, options.blocks);
  if (options.rounds < 1) throw ConfigError(str("activation planner: rounds = ", options.rounds, " must be at least 1"));
  BlockCosts costs;
  const c10::Device model_at = model_device(model);
  // On a GPU the host thread's CPU time is launch time, not the kernels':
  // the measurements synchronize the device and the decision uses wall time.
  costs.decide_on_wall_time = options.decide_on_wall_time || model_at.type() != c10::DeviceType::CPU;
  costs.choices = candidate_choices(options, model_at.type());
  Profiling profiling{model, blocks, step, options, costs.choices, model_at.type()};
  internal::Measurements measured(costs.choices.size(), blocks.size());
  profiling.run(0, nullptr);  // first-call allocations, caches
  for (int r = 0; r < options.rounds; ++r) {
    for (size_t column = 0; column < costs.choices.size(); ++column) profiling.run(column, &measured);
  }
  profiling.finish();
  measured.finish(costs, comm, model_at);
  return costs;
}

void check_planner_options(torch::nn::Module& model, const PlannerOptions& options) {
  const std::string invalid = check_memory_budget(options);
  if (!invalid.empty()) throw ConfigError("activation checkpointing planner: " + invalid);
  if (options.rounds < 1) throw ConfigError(str("activation planner: rounds = ", options.rounds, " must be at least 1"));
  if (options.device_memory_budget_auto) {
    throw ConfigError("activation checkpointing planner: device_memory_budget_bytes is \"auto\", which the engine "
                      "resolves against the device: a direct caller sets the bytes (runtime/device_memory.h, "
                      "auto_device_budget)");
  }
  const size_t n = block_modules(model, options.blocks).size();
  if (options.memory_budget_knee && n < 2) {
    throw ConfigError(str(
        "activation_checkpointing.memory_budget_fraction is \"knee\", the plan where the planner's frontier of "
        "predicted peak against extra time bends, but the model has ", n, " block in '", options.blocks,
        "': one block has one plan per choice and no frontier across blocks to find a knee on. Set "
        "memory_budget_fraction to a number (e.g. 0.5) or memory_budget_bytes, or give the model more blocks"));
  }
}

ActivationPlan plan_activation_checkpointing(torch::nn::Module& model, const std::function<void()>& step,
                                             const PlannerOptions& options, Communicator* comm) {
  check_planner_options(model, options);
  BlockCosts costs = profile_activation_choices(model, step, options, comm);
  log_rank0().debug("{}", describe_costs(costs));
  std::vector<FrontierPoint> frontier;
  if (options.memory_budget_knee || !options.report_dir.empty()) frontier = activation_frontier(costs);
  ActivationPlan plan;
  if (options.memory_budget_knee) {
    const size_t knee = frontier_knee(frontier);
    plan = frontier[knee].plan;
    log_rank0().info("activation planner: the knee is point {} of the {} on the frontier (peak {} of every block "
                     "kept), the budget memory_budget_fraction \"knee\" plans for",
                     knee, frontier.size(),
                     std::round(1000.0 * static_cast<double>(plan.predicted_peak) /
                                static_cast<double>(std::max<int64_t>(costs.keep_peak, 1))) / 1000.0);
  } else if (options.device_memory_budget_bytes) {
    // The whole device: what the state takes is not the activations' to use.
    const int64_t device = *options.device_memory_budget_bytes;
    const int64_t least = smallest_feasible_budget(costs);
    if (device - options.state_bytes < least) {
      const std::string state = str(mib(options.state_bytes), options.state_description.empty() ? "" : ": ",
                                    options.state_description);
      throw ConfigError(str(
          "activation checkpointing: device_memory_budget_bytes = ", device, " (", mib(device), ") cannot be met",
          device <= options.state_bytes ? ", it is below the model state alone" : "", ": the model state takes ",
          state, " and the smallest activation peak any plan reaches is ", mib(least), " (every block kept: ",
          mib(costs.keep_peak), "). The smallest feasible budget is ", options.state_bytes + least,
          " bytes: raise activation_checkpointing.device_memory_budget_bytes to at least that, shard more (a "
          "higher zero_optimization.stage, more data-parallel ranks) or lower the batch size"));
    }
    plan = solve_activation_plan(costs, device - options.state_bytes);
    plan.device_budget_bytes = device;
    plan.predicted_total_peak = options.state_bytes + plan.predicted_peak;
    log_rank0().info("activation planner: whole device: budget {}, state {} + predicted activation peak {} = {}",
                     mib(device), mib(options.state_bytes), mib(plan.predicted_peak), mib(plan.predicted_total_peak));
  } else {
    const int64_t budget =
        options.memory_budget_bytes
            ? *options.memory_budget_bytes
            : static_cast<int64_t>(std::min(1e18, std::floor(*options.memory_budget_fraction *
                                                             static_cast<double>(costs.keep_peak))));
    // With every step offloaded, a budget no plan meets is offloading's doing: said so.
    if (options.offload.enabled && smallest_feasible_budget(costs) > budget) {
      throw_budget_unmet(costs, budget, /*offloading=*/true);
    }
    plan = solve_activation_plan(costs, budget);
  }
  if (!options.report_dir.empty() && (comm == nullptr || comm->rank() == 0)) {
    const std::string path = (std::filesystem::path(options.report_dir) / "frontier.csv").string();
    write_frontier_csv(path, costs, frontier, plan);
    log_rank0().info("activation planner: wrote the frontier ({} plans) to {}", frontier.size(), path);
  }
  apply_activation_plan(model, plan, options);
  log_rank0().info("{}", plan.table(costs));
  return plan;
}

bool ActivationPlanner::ensure(const std::vector<int64_t>& batch_shape, const std::function<void()>& step) {
  if (plan_ && plan_->batch_shape == batch_shape) return false;
  ActivationPlan plan = plan_activation_checkpointing(model_, step, options_, comm_);
  plan.batch_shape = batch_shape;
  plan_ = std::move(plan);
  ++plans_made_;
  return true;
}

}  // namespace remat
