#include "checkpointing/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "checkpointing/internal/plan_messages.h"
#include "runtime/error.h"

namespace remat {
namespace internal {

std::string mib(int64_t bytes) { return str(std::round(static_cast<double>(bytes) / 1048576.0 * 100) / 100, " MiB"); }

[[noreturn]] void throw_budget_unmet(const BlockCosts& costs, int64_t budget, bool offloading) {
  const int64_t least = smallest_feasible_budget(costs);
  const double fraction = costs.keep_peak > 0 ? std::ceil(1000.0 * static_cast<double>(least) /
                                                          static_cast<double>(costs.keep_peak)) / 1000.0
                                              : 1.0;
  const std::string unmet = str("activation checkpointing: the memory budget of ", budget, " bytes (", mib(budget),
                                ") cannot be met: the smallest peak any plan reaches is ", least, " bytes (",
                                mib(least), "; every block kept: ", costs.keep_peak, " bytes). ");
  const std::string raise = str("activation_checkpointing.memory_budget_bytes to at least ", least,
                                " or memory_budget_fraction to at least ", fraction);
  if (!offloading) throw ConfigError(str(unmet, "Raise ", raise, ", or lower the batch size"));
  throw ConfigError(str(
      unmet, "The cause is activation offloading: activation_offloading.enabled is true, so every step runs "
      "inside an offloading scope that already moves what the blocks save to the host. Keeping a block then "
      "costs the device little and checkpointing it saves little more, so the peak with every block kept is "
      "about the least any plan reaches and a memory_budget_fraction below ", fraction,
      " cannot be met. Set activation_offloading.enabled to false, so that the planner weighs offloading per "
      "block itself (its offload_activations and full_offload choices, on a GPU) against checkpointing; or "
      "raise ", raise, "; or keep offloading with activation_checkpointing.variant \"none\" or \"full\""));
}

}  // namespace internal

namespace {

using internal::mib;
using internal::throw_budget_unmet;

constexpr const char* kChoiceNames[] = {"keep", "selective_op", "selective_op_matmuls", "full",
                                        "full_offload", "offload_activations"};

// The decision time of a cost.
double decision_ms(const BlockCosts& costs, const ChoiceCost& c) {
  return costs.decide_on_wall_time ? c.extra_wall_ms : c.extra_cpu_ms;
}

// A partial plan of blocks 0..i: held bytes so far and time, with the path back.
struct State {
  int64_t held;
  double time;
  int parent;  // index into the previous layer
  int column;
};

// Whether block i under `c` stays within `budget` in its forward and its
// backward, with `held` bytes held by the blocks before it.
bool fits(const BlockCosts& costs, int64_t held, const ChoiceCost& c, int64_t budget) {
  return costs.forward_live_base + held + c.forward_peak_bytes <= budget &&
         costs.backward_base + held + c.held_bytes + c.transient_bytes <= budget;
}

}  // namespace

const char* block_choice_name(BlockChoice choice) { return kChoiceNames[static_cast<int>(choice)]; }

const std::vector<BlockChoice>& all_block_choices() {
  static const std::vector<BlockChoice> all = {BlockChoice::kKeep,        BlockChoice::kSelectiveOp,
                                               BlockChoice::kSelectiveOpMatmuls, BlockChoice::kFull,
                                               BlockChoice::kFullOffload, BlockChoice::kOffloadActivations};
  return all;
}

BlockChoice block_choice_from_name(const std::string& name) {
  for (BlockChoice c : all_block_choices()) {
    if (name == block_choice_name(c)) return c;
  }
  throw ConfigError(str("unknown block choice '", name,
                        "'; use keep, selective_op, selective_op_matmuls, full, full_offload or "
                        "offload_activations"));
}

std::string describe_costs(const BlockCosts& costs) {
  std::string out = str("measured: forward_live_base ", costs.forward_live_base, ", forward_base ",
                        costs.forward_base, ", backward_base ", costs.backward_base, ", fixed_peak ",
                        costs.fixed_peak, ", every block kept ", costs.keep_peak, " bytes\n");
  out += "  block  choice                 held bytes  forward peak  transient bytes  extra ms (CPU)  extra ms (wall)"
         "  of which recompute (CPU)  (wall)\n";
  for (size_t i = 0; i < costs.blocks.size(); ++i) {
    for (size_t c = 0; c < costs.choices.size(); ++c) {
      const ChoiceCost& x = costs.blocks[i][c];
      char line[240];
      std::snprintf(line, sizeof(line), "  %5zu  %-21s %11lld  %12lld  %15lld  %14.2f  %15.2f  %24.2f  %6.2f\n", i,
                    block_choice_name(costs.choices[c]), static_cast<long long>(x.held_bytes),
                    static_cast<long long>(x.forward_peak_bytes), static_cast<long long>(x.transient_bytes),
                    x.extra_cpu_ms, x.extra_wall_ms, x.recompute_cpu_ms, x.recompute_wall_ms);
      out += line;
    }
  }
  return out;
}

std::string ActivationPlan::summary() const {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) out += (i ? "," : "") + std::string(block_choice_name(choices[i]));
  return out;
}

std::string ActivationPlan::table(const BlockCosts& costs) const {
  std::string out = str("activation plan for a budget of ", budget_bytes, " bytes (", mib(budget_bytes),
                        "; every block kept: ", mib(costs.keep_peak), "), predicted peak ",
                        predicted_peak, " bytes (", mib(predicted_peak), "), predicted extra ",
                        std::round(predicted_extra_cpu_ms * 10) / 10, " ms CPU / ",
                        std::round(predicted_extra_wall_ms * 10) / 10, " ms wall per step\n");
  out += "  block  choice                 kept bytes   extra ms (CPU)  extra ms (wall)\n";
  for (size_t i = 0; i < choices.size(); ++i) {
    const auto col = static_cast<size_t>(std::find(costs.choices.begin(), costs.choices.end(), choices[i]) -
                                         costs.choices.begin());
    const ChoiceCost& c = costs.blocks[i][col];
    char line[160];
    std::snprintf(line, sizeof(line), "  %5zu  %-21s %11lld  %14.2f  %15.2f\n", i, block_choice_name(choices[i]),
                  static_cast<long long>(c.held_bytes), c.extra_cpu_ms, c.extra_wall_ms);
    out += line;
  }
  return out;
}

int64_t predict_peak(const BlockCosts& costs, const std::vector<size_t>& columns) {
  REMAT_CHECK_EQ(columns.size(), costs.blocks.size(), "one column per block");
  int64_t held = 0, peak = costs.fixed_peak;
  for (size_t i = 0; i < columns.size(); ++i) {
    const ChoiceCost& c = costs.blocks[i].at(columns[i]);
    peak = std::max(peak, costs.forward_live_base + held + c.forward_peak_bytes);
    held += c.held_bytes;
    peak = std::max(peak, costs.backward_base + held + c.transient_bytes);
  }
  return std::max(peak, costs.forward_base + held);
}

int64_t smallest_feasible_budget(const BlockCosts& costs) {
  // For feasibility only the least held bytes so far matters (every later
  // bound is easier with less), so a budget is feasible when the greedy walk
  // keeping the least held bytes that respects each block's bound finishes.
  auto feasible = [&](int64_t budget) {
    if (costs.fixed_peak > budget) return false;
    int64_t held = 0;
    for (const auto& block : costs.blocks) {
      int64_t best = std::numeric_limits<int64_t>::max();
      for (const ChoiceCost& c : block) {
        if (fits(costs, held, c, budget)) {
          best = std::min(best, c.held_bytes);
        }
      }
      if (best == std::numeric_limits<int64_t>::max()) return false;
      held += best;
    }
    return costs.forward_base + held <= budget;
  };
  int64_t hi = std::max<int64_t>(costs.fixed_peak, 0) + std::max<int64_t>(costs.forward_base, 0) +
               std::max<int64_t>(costs.forward_live_base, 0) + std::max<int64_t>(costs.backward_base, 0);
  for (const auto& block : costs.blocks) {
    int64_t m = 0;
    for (const ChoiceCost& c : block) {
      m = std::max(m, std::max<int64_t>(c.held_bytes, 0) + std::max<int64_t>(c.transient_bytes, 0) +
                          std::max<int64_t>(c.forward_peak_bytes, 0));
    }
    hi += m;
  }
  int64_t lo = std::numeric_limits<int64_t>::min() / 4;
  if (!feasible(hi)) throw Error("activation planner: no budget is feasible (inconsistent costs)");
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (feasible(mid) ? hi : lo) = mid;
  }
  return hi;
}

ActivationPlan solve_activation_plan(const BlockCosts& costs, int64_t budget) {
  const size_t n = costs.blocks.size();
  REMAT_CHECK(n > 0, "activation planner: no blocks");
  REMAT_CHECK(!costs.choices.empty(), "activation planner: no choices");
  // Layered dynamic programming over the Pareto frontier of (held bytes, time):
  // a state with no more held bytes and no more time than another dominates it
  // (every later bound is easier with fewer held bytes).
  std::vector<std::vector<State>> layers;
  std::vector<State> frontier = {{0, 0.0, -1, -1}};
  for (size_t i = 0; i < n && !frontier.empty(); ++i) {
    std::vector<State> next;
    for (size_t p = 0; p < frontier.size(); ++p) {
      for (size_t col = 0; col < costs.blocks[i].size(); ++col) {
        const ChoiceCost& c = costs.blocks[i][col];
        if (!fits(costs, frontier[p].held, c, budget)) continue;
        const int64_t held = frontier[p].held + c.held_bytes;
        next.push_back({held, frontier[p].time + decision_ms(costs, c), static_cast<int>(p),
                        static_cast<int>(col)});
      }
    }
    // Deterministic order: held, then time, then the earliest path.
    std::stable_sort(next.begin(), next.end(), [](const State& a, const State& b) {
      return a.held != b.held ? a.held < b.held : a.time < b.time;
    });
    std::vector<State> kept;
    double best_time = std::numeric_limits<double>::infinity();
    for (const State& s : next) {
      if (s.time < best_time) {
        kept.push_back(s);
        best_time = s.time;
      }
    }
    layers.push_back(frontier);
    frontier = std::move(kept);
  }
  // The last layer: states whose forward bound holds; least time, then least held.
  int best = -1;
  if (layers.size() == n && costs.fixed_peak <= budget) {
    for (size_t s = 0; s < frontier.size(); ++s) {
      if (costs.forward_base + frontier[s].held > budget) continue;
      if (best < 0 || frontier[s].time < frontier[best].time) best = static_cast<int>(s);
    }
  }
  if (best < 0) throw_budget_unmet(costs, budget, /*offloading=*/false);
  std::vector<size_t> columns(n);
  const State* s = &frontier[best];
  for (size_t i = n; i-- > 0;) {
    columns[i] = static_cast<size_t>(s->column);
    if (i > 0) s = &layers[i][s->parent];
  }
  ActivationPlan plan;
  plan.budget_bytes = budget;
  for (size_t i = 0; i < n; ++i) {
    const ChoiceCost& c = costs.blocks[i][columns[i]];
    plan.choices.push_back(costs.choices[columns[i]]);
    plan.predicted_extra_cpu_ms += c.extra_cpu_ms;
    plan.predicted_extra_wall_ms += c.extra_wall_ms;
  }
  plan.predicted_peak = predict_peak(costs, columns);
  return plan;
}

}  // namespace remat
