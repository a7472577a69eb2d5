// The planner's pure core without autograd: synthetic per-block costs in,
// plans out. The costs are chosen so that the predicted peak is the sum of
// the held bytes (every forward peak is what the block holds, nothing is
// transient, the bases are 0): the budget is then a plain knapsack whose
// answers can be written down by hand.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpointing/frontier.h"
#include "checkpointing/plan.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

ChoiceCost cost(int64_t held, double ms) {
  ChoiceCost c;
  c.held_bytes = held;
  c.forward_peak_bytes = held;
  c.extra_cpu_ms = ms;
  c.extra_wall_ms = ms;
  return c;
}

// Blocks of two choices: keep (100 bytes, no time) or full (20 bytes,
// `full_ms[i]`).
BlockCosts keep_or_full(const std::vector<double>& full_ms, std::vector<int64_t> full_held = {}) {
  BlockCosts costs;
  costs.choices = {BlockChoice::kKeep, BlockChoice::kFull};
  for (size_t i = 0; i < full_ms.size(); ++i) {
    costs.blocks.push_back({cost(100, 0.0), cost(full_held.empty() ? 20 : full_held[i], full_ms[i])});
  }
  costs.keep_peak = 100 * static_cast<int64_t>(full_ms.size());
  return costs;
}

TEST(PlanSolver, EachBudgetGetsTheLeastExtraTimeThatFits) {
  const BlockCosts costs = keep_or_full({5.0, 1.0, 2.0});
  struct Case {
    int64_t budget;
    const char* plan;
    int64_t peak;
    double ms;
  };
  for (const Case& c : {Case{300, "keep,keep,keep", 300, 0.0}, Case{1000, "keep,keep,keep", 300, 0.0},
                        Case{299, "keep,full,keep", 220, 1.0}, Case{220, "keep,full,keep", 220, 1.0},
                        Case{219, "keep,full,full", 140, 3.0}, Case{139, "full,full,full", 60, 8.0},
                        Case{60, "full,full,full", 60, 8.0}}) {
    SCOPED_TRACE(c.budget);
    const ActivationPlan plan = solve_activation_plan(costs, c.budget);
    EXPECT_EQ(plan.summary(), c.plan);
    EXPECT_EQ(plan.budget_bytes, c.budget);
    EXPECT_EQ(plan.predicted_peak, c.peak);
    EXPECT_DOUBLE_EQ(plan.predicted_extra_cpu_ms, c.ms);
    EXPECT_DOUBLE_EQ(plan.predicted_extra_wall_ms, c.ms);
  }
}

TEST(PlanSolver, TheBasesAndTheTransientCountInThePeak) {
  BlockCosts costs = keep_or_full({2.0, 1.0});
  costs.blocks[1][0].transient_bytes = 50;  // keeping block 1 costs 50 more while its backward runs
  costs.backward_base = 10;
  costs.fixed_peak = 30;
  // Keeping both: max(30, 100, 200, 10 + 100, 10 + 200 + 50) = 260.
  EXPECT_EQ(predict_peak(costs, {0, 0}), 260);
  EXPECT_EQ(predict_peak(costs, {1, 1}), 50);  // block 1's backward: 10 + 40
  EXPECT_EQ(solve_activation_plan(costs, 260).summary(), "keep,keep");
  // One below: block 1's backward no longer fits kept after block 0 kept;
  // full there (1 ms) beats full in block 0 (2 ms) and peaks at 10 + 120.
  const ActivationPlan plan = solve_activation_plan(costs, 259);
  EXPECT_EQ(plan.summary(), "keep,full");
  EXPECT_EQ(plan.predicted_peak, 130);
  costs.fixed_peak = 150;  // what runs outside the blocks is a floor no plan lowers
  EXPECT_EQ(smallest_feasible_budget(costs), 150);
}

TEST(PlanSolver, AnInfeasibleBudgetNamesTheSmallestFeasibleOne) {
  const BlockCosts costs = keep_or_full({5.0, 1.0, 2.0});
  EXPECT_EQ(smallest_feasible_budget(costs), 60);
  const std::string message = error_of<ConfigError>([&] { solve_activation_plan(costs, 59); });
  EXPECT_THAT(message, HasSubstr("the memory budget of 59 bytes"));
  EXPECT_THAT(message, HasSubstr("cannot be met: the smallest peak any plan reaches is 60 bytes"));
  EXPECT_THAT(message, HasSubstr("every block kept: 300 bytes"));
  EXPECT_THAT(message, HasSubstr("memory_budget_bytes to at least 60 or memory_budget_fraction to at least 0.2"));
  EXPECT_THAT(message, HasSubstr("or lower the batch size"));
}

TEST(PlanSolver, TiesGoToFewerHeldBytesThenToTheEarlierBlock) {
  // Equal times, different held bytes: the plan that holds less.
  const ActivationPlan fewer = solve_activation_plan(keep_or_full({2.0, 2.0}, {20, 10}), 199);
  EXPECT_EQ(fewer.summary(), "keep,full");
  EXPECT_EQ(fewer.predicted_peak, 110);
  // Equal in both: the earlier block is checkpointed, every time.
  for (int i = 0; i < 3; ++i) {
    const ActivationPlan same = solve_activation_plan(keep_or_full({2.0, 2.0}), 199);
    EXPECT_EQ(same.summary(), "full,keep");
    EXPECT_EQ(same.predicted_peak, 120);
  }
}

TEST(PlanSolver, DecidesOnTheTimeItIsTold) {
  BlockCosts costs = keep_or_full({1.0, 1.0});
  costs.blocks[0][1].extra_wall_ms = 9.0;  // block 0's recompute is cheap in CPU time, dear in wall time
  costs.blocks[1][1].extra_cpu_ms = 3.0;
  EXPECT_EQ(solve_activation_plan(costs, 150).summary(), "full,keep");
  costs.decide_on_wall_time = true;
  const ActivationPlan plan = solve_activation_plan(costs, 150);
  EXPECT_EQ(plan.summary(), "keep,full");
  EXPECT_DOUBLE_EQ(plan.predicted_extra_cpu_ms, 3.0);
  EXPECT_DOUBLE_EQ(plan.predicted_extra_wall_ms, 1.0);
}

TEST(PlanSolver, ChoicesByNameAndTheTable) {
  for (BlockChoice c : all_block_choices()) EXPECT_EQ(block_choice_from_name(block_choice_name(c)), c);
  EXPECT_THAT(error_of<ConfigError>([] { block_choice_from_name("half"); }),
              HasSubstr("unknown block choice 'half'; use keep, selective_op"));
  const BlockCosts costs = keep_or_full({5.0, 1.0, 2.0});
  const std::string table = solve_activation_plan(costs, 219).table(costs);
  EXPECT_THAT(table, HasSubstr("activation plan for a budget of 219 bytes"));
  EXPECT_THAT(table, HasSubstr("predicted peak 140 bytes"));
  EXPECT_THAT(table, HasSubstr("      1  full                           20            1.00             1.00\n"));
  EXPECT_THAT(describe_costs(costs), HasSubstr("every block kept 300 bytes"));
}

TEST(PlanFrontier, EveryBudgetsPlanWithItsKneeAndCsv) {
  const BlockCosts costs = keep_or_full({5.0, 1.0, 2.0});
  const std::vector<FrontierPoint> frontier = activation_frontier(costs);
  std::vector<std::string> plans;
  std::vector<int64_t> peaks;
  std::vector<double> times;
  for (const FrontierPoint& p : frontier) {
    plans.push_back(p.plan.summary());
    peaks.push_back(p.plan.predicted_peak);
    times.push_back(p.extra_ms);
    EXPECT_EQ(p.plan.budget_bytes, p.plan.predicted_peak);
  }
  EXPECT_EQ(plans, (std::vector<std::string>{"full,full,full", "keep,full,full", "keep,full,keep", "keep,keep,keep"}));
  EXPECT_EQ(peaks, (std::vector<int64_t>{60, 140, 220, 300}));
  EXPECT_EQ(times, (std::vector<double>{8.0, 3.0, 1.0, 0.0}));
  // Scaled: (1/3, 3/8) lies furthest below the line from (0, 1) to (1, 0).
  EXPECT_EQ(frontier_knee(frontier), 1u);
  EXPECT_EQ(frontier_point_for_budget(frontier, 219), 1u);
  EXPECT_EQ(frontier_point_for_budget(frontier, 220), 2u);
  EXPECT_EQ(frontier_point_for_budget(frontier, 59), frontier.size());

  const std::string path = ::testing::TempDir() + "plan_test_frontier.csv";
  write_frontier_csv(path, costs, frontier, solve_activation_plan(costs, 219));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(path.c_str());
  EXPECT_EQ(text.str(),
            "point,budget_bytes,budget_fraction,predicted_peak_bytes,predicted_peak_mib,extra_ms,extra_cpu_ms,"
            "extra_wall_ms,knee,chosen,plan\n"
            "0,60,0.2000,60,0.000,8.000,8.000,8.000,0,0,\"full,full,full\"\n"
            "1,140,0.4667,140,0.000,3.000,3.000,3.000,1,1,\"keep,full,full\"\n"
            "2,220,0.7333,220,0.000,1.000,1.000,1.000,0,0,\"keep,full,keep\"\n"
            "3,300,1.0000,300,0.000,0.000,0.000,0.000,0,0,\"keep,keep,keep\"\n");
}

}  // namespace
}  // namespace remat
