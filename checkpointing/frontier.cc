#include "checkpointing/frontier.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "runtime/error.h"

namespace remat {
namespace {

double decision_ms(const BlockCosts& costs, const ActivationPlan& plan) {
  return costs.decide_on_wall_time ? plan.predicted_extra_wall_ms : plan.predicted_extra_cpu_ms;
}

// Less time, beyond the rounding of sums taken in another order.
bool faster(double a, double than) { return a < than - 1e-9 * std::max(1.0, std::fabs(than)); }

}  // namespace

std::vector<FrontierPoint> activation_frontier(const BlockCosts& costs) {
  REMAT_CHECK(!costs.blocks.empty(), "activation frontier: no blocks");
  // Every budget from the peak of keeping every block up gets a plan with no extra time.
  const int64_t keep_all = predict_peak(costs, std::vector<size_t>(costs.blocks.size(), 0));
  std::vector<FrontierPoint> points;
  int64_t budget = smallest_feasible_budget(costs);
  for (;;) {
    ActivationPlan plan = solve_activation_plan(costs, budget);
    // Its own peak gets it as well (no smaller budget gets its time).
    plan.budget_bytes = plan.predicted_peak;
    const double time = decision_ms(costs, plan);
    points.push_back({plan, time});
    if (time <= 0 || plan.predicted_peak >= keep_all) break;
    // The least budget above this peak that buys less time: solve's time
    // never rises with the budget, so bisect. A budget that buys less gets
    // a plan whose own peak buys the same: the bound drops to that peak.
    int64_t lo = plan.predicted_peak, hi = keep_all;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      const ActivationPlan probe = solve_activation_plan(costs, mid);
      if (faster(decision_ms(costs, probe), time)) {
        hi = probe.predicted_peak;
      } else {
        lo = mid;
      }
    }
    budget = hi;
  }
  return points;
}

size_t frontier_knee(const std::vector<FrontierPoint>& frontier) {
  REMAT_CHECK(!frontier.empty(), "activation frontier: no points, so no knee");
  const size_t last = frontier.size() - 1;
  const double peak0 = static_cast<double>(frontier.front().plan.predicted_peak);
  const double peak_span = static_cast<double>(frontier.back().plan.predicted_peak) - peak0;
  const double time_span = frontier.front().extra_ms - frontier.back().extra_ms;
  if (last < 2 || peak_span <= 0 || time_span <= 0) return last;
  size_t knee = last;
  double best = 0;  // how far below the line joining the ends (scaled): 1 - x - y
  for (size_t i = 1; i < last; ++i) {
    const double x = (static_cast<double>(frontier[i].plan.predicted_peak) - peak0) / peak_span;
    const double y = (frontier[i].extra_ms - frontier.back().extra_ms) / time_span;
    const double below = 1.0 - x - y;
    if (below > best + 1e-12) {
      best = below;
      knee = i;
    }
  }
  return knee;
}

size_t frontier_point_for_budget(const std::vector<FrontierPoint>& frontier, int64_t budget_bytes) {
  size_t found = frontier.size();
  for (size_t i = 0; i < frontier.size() && frontier[i].plan.predicted_peak <= budget_bytes; ++i) found = i;
  return found;
}

void write_frontier_csv(const std::string& path, const BlockCosts& costs, const std::vector<FrontierPoint>& frontier,
                        const ActivationPlan& chosen) {
  const size_t knee = frontier.empty() ? 0 : frontier_knee(frontier);
  const size_t in_effect = frontier_point_for_budget(frontier, chosen.budget_bytes);
  std::ofstream out(path, std::ios::trunc);
  if (!out) {
    throw Error(str("activation planner: cannot write the frontier to '", path, "' (", std::strerror(errno),
                    "): give --plan-report (PlannerOptions::report_dir) a writable folder"));
  }
  out << "point,budget_bytes,budget_fraction,predicted_peak_bytes,predicted_peak_mib,extra_ms,extra_cpu_ms,"
         "extra_wall_ms,knee,chosen,plan\n";
  for (size_t i = 0; i < frontier.size(); ++i) {
    const ActivationPlan& p = frontier[i].plan;
    char line[256];
    std::snprintf(line, sizeof(line), "%zu,%lld,%.4f,%lld,%.3f,%.3f,%.3f,%.3f,%d,%d,", i,
                  static_cast<long long>(p.budget_bytes),
                  costs.keep_peak > 0 ? static_cast<double>(p.budget_bytes) / static_cast<double>(costs.keep_peak) : 0.0,
                  static_cast<long long>(p.predicted_peak), static_cast<double>(p.predicted_peak) / 1048576.0,
                  frontier[i].extra_ms, p.predicted_extra_cpu_ms, p.predicted_extra_wall_ms, i == knee ? 1 : 0,
                  i == in_effect ? 1 : 0);
    out << line << '"' << p.summary() << "\"\n";
  }
  out.flush();
  if (!out) {
    throw Error(str("activation planner: writing the frontier to '", path, "' failed (", std::strerror(errno),
                    "; disk full?)"));
  }
}

}  // namespace remat
