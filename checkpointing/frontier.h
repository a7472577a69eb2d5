// The planner's frontier: every plan some budget gets, from the smallest
// feasible budget to the one that keeps every block, as (predicted peak,
// predicted extra time) points, and its knee, the plan that
// memory_budget_fraction "knee" chooses.
//
//   remat::BlockCosts costs = ...;   // profile_activation_choices (planner.h), or given
//   std::vector<remat::FrontierPoint> frontier = remat::activation_frontier(costs);
//   const remat::ActivationPlan& knee = frontier[remat::frontier_knee(frontier)].plan;
//   remat::write_frontier_csv("report/frontier.csv", costs, frontier, knee);
//
// The knee (docs/memory.md, "The planner's frontier"): with the peaks scaled
// to [0, 1] between the first point and the last and the extra times between
// the last (0) and the first, it is the point farthest below the straight
// line joining the two ends, i.e. the least sum of the two scaled values:
// the point where giving up more memory stops buying much time and
// where saving more memory starts costing much. Ties go to the smaller
// peak; a frontier with no point below the line (two points, or a straight
// one) has no knee and gives its last point, keeping as much as helps.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "checkpointing/plan.h"

namespace remat {

// One plan on the frontier. plan.budget_bytes is plan.predicted_peak: the
// least budget that gets this plan.
struct FrontierPoint {
  ActivationPlan plan;
  double extra_ms = 0;  // the decision time (CPU, or wall with decide_on_wall_time)
};

// Every distinct plan on the Pareto frontier of (predicted peak, predicted
// extra time): peaks strictly ascending, extra times strictly descending.
// The first is the plan of smallest_feasible_budget(costs); the last has no
// extra time. Each point is solve_activation_plan at its own peak, found by
// bisecting the budget between one point's peak and the peak of keeping
// every block for the least budget that buys less time.
std::vector<FrontierPoint> activation_frontier(const BlockCosts& costs);

// The index of the knee of `frontier` (the rule above). An empty frontier is
// an Error.
size_t frontier_knee(const std::vector<FrontierPoint>& frontier);

// The budget `budget_bytes` gets the frontier's point with the largest peak
// within it: its index (the same predicted time as solve_activation_plan at
// that budget), or frontier.size() when the budget is below the first.
size_t frontier_point_for_budget(const std::vector<FrontierPoint>& frontier, int64_t budget_bytes);

// Writes the frontier as CSV, one row per point in order:
//   point,budget_bytes,budget_fraction,predicted_peak_bytes,predicted_peak_mib,
//   extra_ms,extra_cpu_ms,extra_wall_ms,knee,chosen,plan
// budget_fraction is of costs.keep_peak; extra_ms is the time decided on;
// knee is 1 on the knee's row; chosen is 1 on the row of the plan in effect
// (`chosen`'s point: frontier_point_for_budget of its budget); plan is
// ActivationPlan::summary(), quoted. An Error naming the path and the
// reason when it cannot be written.
void write_frontier_csv(const std::string& path, const BlockCosts& costs, const std::vector<FrontierPoint>& frontier,
                        const ActivationPlan& chosen);

}  // namespace remat
