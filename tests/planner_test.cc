// The memory planner: the solver against brute force on synthetic stacks with
// known sizes, and on a real 8-block stack the measured peak of a step under
// each plan against the prediction and the budget, gradients bitwise equal to
// no checkpointing, and profiling that leaves the RNG and gradients as found.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "checkpointing/checkpoint.h"
#include "checkpointing/frontier.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "models/stack.h"
#include "nn/module_call.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/checkpoint_modes.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

// ---- the solver on synthetic costs ----

BlockCosts random_costs(std::mt19937& gen, size_t blocks, size_t columns) {
  std::uniform_int_distribution<int64_t> bytes(0, 1000);
  std::uniform_real_distribution<double> ms(0.0, 50.0);
  BlockCosts c;
  for (size_t k = 0; k < columns; ++k) c.choices.push_back(all_block_choices()[k]);
  c.blocks.assign(blocks, std::vector<ChoiceCost>(columns));
  for (auto& block : c.blocks) {
    for (size_t k = 0; k < columns; ++k) {
      block[k].held_bytes = bytes(gen);
      block[k].forward_peak_bytes = block[k].held_bytes + bytes(gen) / 2;
      block[k].transient_bytes = bytes(gen);
      block[k].extra_cpu_ms = k == 0 ? 0.0 : ms(gen);
      block[k].extra_wall_ms = block[k].extra_cpu_ms * 1.5;
    }
  }
  c.forward_base = bytes(gen);
  c.forward_live_base = bytes(gen) / 4;
  c.backward_base = bytes(gen) / 4;
  c.fixed_peak = bytes(gen) / 2;
  return c;
}

// Every plan, the least time among those within the budget (or -1).
struct Brute {
  double best_time = -1;
  int64_t least_peak = std::numeric_limits<int64_t>::max();
};
Brute brute_force(const BlockCosts& c, int64_t budget) {
  const size_t n = c.blocks.size(), k = c.choices.size();
  size_t plans = 1;
  for (size_t i = 0; i < n; ++i) plans *= k;
  Brute out;
  std::vector<size_t> columns(n);
  for (size_t p = 0; p < plans; ++p) {
    size_t rest = p;
    double time = 0;
    for (size_t i = 0; i < n; ++i) {
      columns[i] = rest % k;
      rest /= k;
      time += c.blocks[i][columns[i]].extra_cpu_ms;
    }
    const int64_t peak = predict_peak(c, columns);
    out.least_peak = std::min(out.least_peak, peak);
    if (peak <= budget && (out.best_time < 0 || time < out.best_time)) out.best_time = time;
  }
  return out;
}

TEST(PlannerSolver, FindsTheKnapsackOptimumOfRandomStacks) {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 40; ++trial) {
    BlockCosts c = random_costs(gen, 6, 4);
    const int64_t least = smallest_feasible_budget(c);
    EXPECT_EQ(least, brute_force(c, 0).least_peak) << "trial " << trial;
    for (double f : {1.0, 1.1, 1.3, 1.6, 2.5}) {
      const auto budget = static_cast<int64_t>(static_cast<double>(least) * f);
      const Brute brute = brute_force(c, budget);
      ASSERT_GE(brute.best_time, 0);
      ActivationPlan plan = solve_activation_plan(c, budget);
      std::vector<size_t> columns;
      for (BlockChoice choice : plan.choices) {
        columns.push_back(static_cast<size_t>(std::find(c.choices.begin(), c.choices.end(), choice) -
                                              c.choices.begin()));
      }
      EXPECT_NEAR(plan.predicted_extra_cpu_ms, brute.best_time, 1e-9) << "trial " << trial << " budget " << budget;
      EXPECT_EQ(plan.predicted_peak, predict_peak(c, columns));
      EXPECT_LE(plan.predicted_peak, budget);
    }
    EXPECT_THAT(error_of<ConfigError>([&] { solve_activation_plan(c, least - 1); }),
                HasSubstr("the smallest peak any plan reaches is " + std::to_string(least) + " bytes"));
  }
}

// Four equal blocks: keeping costs 100 bytes, a full checkpoint 10 bytes and
// 5 ms, selective 40 bytes and 1 ms; no transients or bases.
BlockCosts equal_blocks() {
  BlockCosts c;
  c.choices = {BlockChoice::kKeep, BlockChoice::kSelectiveOp, BlockChoice::kFull};
  c.blocks.assign(4, {{100, 100, 0, 0.0, 0.0}, {40, 40, 0, 1.0, 1.0}, {10, 10, 0, 5.0, 5.0}});
  return c;
}

TEST(PlannerSolver, KnownSizes) {
  const BlockCosts c = equal_blocks();
  EXPECT_EQ(solve_activation_plan(c, 400).summary(), "keep,keep,keep,keep");
  // 340 bytes: one block must give up 60 bytes; selective does it for 1 ms.
  EXPECT_EQ(solve_activation_plan(c, 340).predicted_extra_cpu_ms, 1.0);
  // 160 bytes = 4 x 40: all selective (4 ms) beats any mix with a full checkpoint.
  ActivationPlan p = solve_activation_plan(c, 160);
  EXPECT_EQ(p.summary(), "selective_op,selective_op,selective_op,selective_op");
  EXPECT_EQ(p.predicted_peak, 160);
  // 40 bytes: everything full.
  EXPECT_EQ(solve_activation_plan(c, 40).summary(), "full,full,full,full");
  EXPECT_EQ(smallest_feasible_budget(c), 40);
  EXPECT_THAT(error_of<ConfigError>([&] { solve_activation_plan(c, 39); }),
              HasSubstr("at least 40"));
}

TEST(PlannerSolver, TheLargestRecomputeCountsWhereItHappens) {
  // A checkpointed block recomputes 200 bytes of intermediates during its
  // backward, while the blocks before it still hold theirs: the last block
  // recomputing costs more peak than the first.
  BlockCosts c;
  c.choices = {BlockChoice::kKeep, BlockChoice::kFull};
  c.blocks.assign(3, {{100, 100, 0, 0.0, 0.0}, {10, 100, 200, 5.0, 5.0}});
  EXPECT_EQ(predict_peak(c, {1, 0, 0}), 10 + 200);        // block 0 recomputes alone
  EXPECT_EQ(predict_peak(c, {0, 0, 1}), 100 + 100 + 10 + 200);
  EXPECT_EQ(predict_peak(c, {0, 0, 0}), 300);
  // Budget 250: checkpointing block 1 or 2 recomputes on top of 100 or 200
  // held bytes and does not fit; checkpointing block 0 does.
  EXPECT_EQ(solve_activation_plan(c, 250).summary(), "full,keep,keep");
}

TEST(PlannerSolver, DecidesOnWallTimeWhenAsked) {
  BlockCosts c;
  c.choices = {BlockChoice::kKeep, BlockChoice::kSelectiveOp, BlockChoice::kFull};
  // Selective is cheaper in CPU time, full in wall time.
  c.blocks.assign(1, {{100, 100, 0, 0.0, 0.0}, {40, 40, 0, 1.0, 9.0}, {10, 10, 0, 5.0, 2.0}});
  EXPECT_EQ(solve_activation_plan(c, 50).summary(), "selective_op");
  c.decide_on_wall_time = true;
  EXPECT_EQ(solve_activation_plan(c, 50).summary(), "full");
}

// ---- the frontier and its knee ----

std::vector<size_t> columns_of(const BlockCosts& c, const ActivationPlan& plan) {
  std::vector<size_t> columns;
  for (BlockChoice choice : plan.choices) {
    columns.push_back(static_cast<size_t>(std::find(c.choices.begin(), c.choices.end(), choice) - c.choices.begin()));
  }
  return columns;
}

// The frontier by brute force: every plan's (peak, time), and in order of
// peak each time below every time of a smaller peak.
std::vector<std::pair<int64_t, double>> brute_frontier(const BlockCosts& c) {
  const size_t n = c.blocks.size(), k = c.choices.size();
  size_t plans = 1;
  for (size_t i = 0; i < n; ++i) plans *= k;
  std::vector<std::pair<int64_t, double>> all;
  std::vector<size_t> columns(n);
  for (size_t p = 0; p < plans; ++p) {
    size_t rest = p;
    double time = 0;
    for (size_t i = 0; i < n; ++i) {
      columns[i] = rest % k;
      rest /= k;
      time += c.blocks[i][columns[i]].extra_cpu_ms;
    }
    all.emplace_back(predict_peak(c, columns), time);
  }
  std::sort(all.begin(), all.end());
  std::vector<std::pair<int64_t, double>> front;
  for (const auto& [peak, time] : all) {
    if (front.empty() || time < front.back().second - 1e-9) front.emplace_back(peak, time);
  }
  return front;
}

TEST(PlannerFrontier, IsEveryPlanNoOtherBeatsOnBothPeakAndTime) {
  std::mt19937 gen(11);
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE(str("trial ", trial));
    BlockCosts c = random_costs(gen, 5, 4);
    const std::vector<FrontierPoint> frontier = activation_frontier(c);
    const auto brute = brute_frontier(c);
    ASSERT_EQ(frontier.size(), brute.size());
    for (size_t i = 0; i < frontier.size(); ++i) {
      const ActivationPlan& plan = frontier[i].plan;
      EXPECT_EQ(plan.predicted_peak, brute[i].first) << "point " << i;
      EXPECT_NEAR(frontier[i].extra_ms, brute[i].second, 1e-9) << "point " << i;
      EXPECT_EQ(predict_peak(c, columns_of(c, plan)), plan.predicted_peak) << "point " << i;
      EXPECT_EQ(plan.budget_bytes, plan.predicted_peak) << "the least budget that gets it";
      EXPECT_EQ(frontier[i].extra_ms, plan.predicted_extra_cpu_ms);
      if (i > 0) {
        EXPECT_GT(plan.predicted_peak, frontier[i - 1].plan.predicted_peak) << "peaks ascend";
        EXPECT_LT(frontier[i].extra_ms, frontier[i - 1].extra_ms) << "times descend";
      }
      // Each point is what its own budget gets, and the budget just below it gets the point before.
      EXPECT_NEAR(solve_activation_plan(c, plan.predicted_peak).predicted_extra_cpu_ms, frontier[i].extra_ms, 1e-9);
      if (i > 0) {
        EXPECT_NEAR(solve_activation_plan(c, plan.predicted_peak - 1).predicted_extra_cpu_ms,
                    frontier[i - 1].extra_ms, 1e-9);
      }
    }
    EXPECT_EQ(frontier.front().plan.predicted_peak, smallest_feasible_budget(c)) << "first: the smallest feasible";
    EXPECT_EQ(frontier.back().extra_ms, 0.0) << "last: no extra time";
  }
}

TEST(PlannerFrontier, KnownSizesAndTheirKnee) {
  // equal_blocks: all full (40 bytes, 20 ms); each full -> selective adds 30
  // bytes and saves 4 ms; each selective -> keep adds 60 bytes and saves 1 ms.
  const BlockCosts c = equal_blocks();
  const std::vector<FrontierPoint> frontier = activation_frontier(c);
  std::vector<std::pair<int64_t, double>> points;
  for (const auto& p : frontier) points.emplace_back(p.plan.predicted_peak, p.extra_ms);
  EXPECT_EQ(points, (std::vector<std::pair<int64_t, double>>{
                        {40, 20}, {70, 16}, {100, 12}, {130, 8}, {160, 4}, {220, 3}, {280, 2}, {340, 1}, {400, 0}}));
  // Scaled: (160, 4) is 1/3 along the peaks and 1/5 along the times, the least
  // sum: the knee, where memory stops buying much time.
  const size_t knee = frontier_knee(frontier);
  EXPECT_EQ(knee, 4u);
  EXPECT_EQ(frontier[knee].plan.summary(), "selective_op,selective_op,selective_op,selective_op");
  EXPECT_EQ(frontier_point_for_budget(frontier, 39), frontier.size());
  EXPECT_EQ(frontier_point_for_budget(frontier, 40), 0u);
  EXPECT_EQ(frontier_point_for_budget(frontier, 219), 4u);
  EXPECT_EQ(frontier_point_for_budget(frontier, 1000), 8u);
}

TEST(PlannerFrontier, KneeOfHandMadeCurves) {
  auto curve = [](std::vector<std::pair<int64_t, double>> points) {
    std::vector<FrontierPoint> out;
    for (const auto& [peak, ms] : points) {
      FrontierPoint p;
      p.plan.predicted_peak = peak;
      p.extra_ms = ms;
      out.push_back(p);
    }
    return out;
  };
  // A sharp bend at the second point.
  EXPECT_EQ(frontier_knee(curve({{0, 100}, {10, 20}, {20, 10}, {30, 5}, {40, 0}})), 1u);
  // The same bend later: peaks are scaled, not taken as they are.
  EXPECT_EQ(frontier_knee(curve({{1000, 100}, {1030, 80}, {1035, 10}, {1040, 0}})), 2u);
  // No point below the line joining the ends: no knee, the last point (keep what helps).
  EXPECT_EQ(frontier_knee(curve({{0, 30}, {10, 20}, {20, 10}, {30, 0}})), 3u);
  EXPECT_EQ(frontier_knee(curve({{0, 30}, {10, 0}})), 1u);
  EXPECT_EQ(frontier_knee(curve({{0, 0}})), 0u);
  // Equally far below the line: the smaller peak.
  EXPECT_EQ(frontier_knee(curve({{0, 10}, {2, 4}, {4, 2}, {10, 0}})), 1u);
  EXPECT_THAT(error_of<Error>([&] { frontier_knee({}); }), HasSubstr("no points"));
}

TEST(PlannerFrontier, CsvMarksTheKneeAndThePlanInEffect) {
  const BlockCosts c = equal_blocks();
  const std::vector<FrontierPoint> frontier = activation_frontier(c);
  const std::string path = ::testing::TempDir() + "/frontier_test.csv";
  write_frontier_csv(path, c, frontier, solve_activation_plan(c, 300));  // the point of 280 bytes
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), frontier.size() + 1);
  EXPECT_EQ(lines[0], "point,budget_bytes,budget_fraction,predicted_peak_bytes,predicted_peak_mib,extra_ms,"
                      "extra_cpu_ms,extra_wall_ms,knee,chosen,plan");
  EXPECT_EQ(lines[1], "0,40,0.0000,40,0.000,20.000,20.000,20.000,0,0,\"full,full,full,full\"");
  EXPECT_THAT(lines[5], ::testing::StartsWith("4,160,"));
  EXPECT_THAT(lines[5], HasSubstr(",1,0,\"selective_op,selective_op,selective_op,selective_op\""));
  EXPECT_THAT(lines[7], ::testing::StartsWith("6,280,"));
  EXPECT_THAT(lines[7], HasSubstr(",0,1,\""));
  EXPECT_THAT(error_of<Error>([&] { write_frontier_csv("/nonexistent-dir/f.csv", c, frontier, frontier[0].plan); }),
              HasSubstr("cannot write the frontier to '/nonexistent-dir/f.csv'"));
}

TEST(PlannerSolver, ChoiceNames) {
  for (BlockChoice c : all_block_choices()) EXPECT_EQ(block_choice_from_name(block_choice_name(c)), c);
  EXPECT_THAT(error_of<ConfigError>([] { block_choice_from_name("partial"); }), HasSubstr("full_offload"));
}

// ---- a real stack ----

constexpr int64_t kBatch = 4, kSeq = 32, kLayers = 8;

models::Stack make_stack() {
  torch::manual_seed(0);
  models::StackOptions o;
  o.shape.n_layer = kLayers;
  o.shape.d_model = 64;
  o.shape.n_head = 4;
  o.shape.d_ff = 256;
  o.shape.dropout = 0.1;
  return models::Stack(o);
}

class Planner : public CheckpointModes {
 protected:
  void SetUp() override {
    CheckpointModes::SetUp();
    torch::manual_seed(1);
    x = torch::randn({kBatch, kSeq, 64}, torch::requires_grad());
    // Gradients allocated, as from the second training step on.
    model_parallel_manual_seed(5, 0);
    train_step();
    zero_grads();
  }
  void TearDown() override {
    remove_activation_checkpointing(*model);
    CheckpointModes::TearDown();
  }
  void train_step() { model->forward(x).pow(2).mean().backward(); }
  void zero_grads() {
    for (auto& p : model->parameters()) p.mutable_grad().zero_();
    x.mutable_grad().zero_();
  }
  // A step from a fixed RNG state: its peak above the start, and the gradients.
  std::pair<int64_t, std::vector<at::Tensor>> measured_step() {
    zero_grads();
    model_parallel_manual_seed(123, 0);
    int64_t peak = 0;
    {
      MemoryTracker memory;
      train_step();
      peak = memory.peak();
    }
    std::vector<at::Tensor> grads{x.grad().clone()};
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    return {peak, grads};
  }
  PlannerOptions budget(double fraction) {
    PlannerOptions o;
    o.memory_budget_fraction = fraction;
    return o;
  }

  models::Stack model = make_stack();
  at::Tensor x;
};
INSTANTIATE_CHECKPOINT_MODES(Planner);

TEST_P(Planner, StepsFitTheBudgetAsPredictedWithThePlainGradients) {
  auto [plain_peak, plain] = measured_step();
  std::set<std::string> plans;
  for (double fraction : {0.25, 0.35, 0.5, 0.7}) {
    SCOPED_TRACE(str("budget ", fraction));
    ActivationPlan plan = plan_activation_checkpointing(*model, [&] { train_step(); }, budget(fraction));
    plans.insert(plan.summary());
    EXPECT_LE(plan.predicted_peak, plan.budget_bytes);
    EXPECT_NEAR(static_cast<double>(plan.budget_bytes), fraction * static_cast<double>(plain_peak),
                0.02 * static_cast<double>(plain_peak))
        << "the budget is a fraction of the measured peak with every block kept";
    auto [peak, grads] = measured_step();
    std::printf("budget %.2f: %s predicted %lld measured %lld bytes (%.3f)\n", fraction, plan.summary().c_str(),
                static_cast<long long>(plan.predicted_peak), static_cast<long long>(peak),
                static_cast<double>(peak) / static_cast<double>(plan.predicted_peak));
    EXPECT_LE(peak, plan.budget_bytes * 1.05) << plan.summary();
    EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(plan.predicted_peak),
                0.10 * static_cast<double>(plan.predicted_peak))
        << plan.summary();
    ASSERT_EQ(grads.size(), plain.size());
    for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(grads[i].equal(plain[i])) << "gradient " << i;
  }
  // Tighter budgets checkpoint more: the four budgets give different plans.
  EXPECT_GE(plans.size(), 3u);
}

TEST_P(Planner, ProfilingLeavesRngGradientsAndHooksAsFound) {
  for (auto& p : model->parameters()) p.mutable_grad().fill_(0.25);
  model->parameters()[3].mutable_grad() = at::Tensor();  // one undefined
  model_parallel_manual_seed(9, 0);
  const at::Tensor expected = at::rand({4});
  model_parallel_manual_seed(9, 0);
  BlockCosts costs = profile_activation_choices(*model, [&] { train_step(); }, budget(0.5));
  EXPECT_TRUE(at::rand({4}).equal(expected)) << "the RNG moved";
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == 3) {
      EXPECT_FALSE(params[i].grad().defined());
    } else {
      EXPECT_TRUE(params[i].grad().equal(at::full_like(params[i], 0.25))) << "parameter " << i;
    }
  }
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    EXPECT_EQ(module_hook(*model->blocks->ptr(i), HookSlot::kCheckpoint), nullptr);
  }
  // Measured: a full checkpoint holds far less than keeping, and keeping costs no extra time.
  ASSERT_EQ(costs.blocks.size(), static_cast<size_t>(kLayers));
  auto col = [&](BlockChoice c) {
    return static_cast<size_t>(std::find(costs.choices.begin(), costs.choices.end(), c) - costs.choices.begin());
  };
  for (const auto& block : costs.blocks) {
    EXPECT_LT(block[col(BlockChoice::kFull)].held_bytes * 4, block[col(BlockChoice::kKeep)].held_bytes);
    EXPECT_LT(block[col(BlockChoice::kSelectiveOp)].held_bytes, block[col(BlockChoice::kKeep)].held_bytes);
    EXPECT_LT(block[col(BlockChoice::kSelectiveOp)].held_bytes, block[col(BlockChoice::kSelectiveOpMatmuls)].held_bytes)
        << "the matmul list also keeps the attention scores";
    EXPECT_GT(block[col(BlockChoice::kFull)].transient_bytes, block[col(BlockChoice::kKeep)].transient_bytes)
        << "a full checkpoint recomputes in its backward";
  }
  EXPECT_GT(costs.keep_peak, 0);
  // On a CPU model the offloading choices are not candidates unless asked for.
  EXPECT_EQ(costs.choices, (std::vector<BlockChoice>{BlockChoice::kKeep, BlockChoice::kSelectiveOp,
                                                     BlockChoice::kSelectiveOpMatmuls, BlockChoice::kFull}));
}

TEST_P(Planner, ChoicesGivenAreUsedAsTheyAreActivationOffloadingIncluded) {
  // Here the host copies of activation offloading go to an arena outside
  // c10's allocator, as they leave the device on a GPU.
  auto [plain_peak, plain] = measured_step();
  PlannerOptions o = budget(0.35);
  o.choices = {BlockChoice::kFull, BlockChoice::kOffloadActivations};
  BlockCosts costs = profile_activation_choices(*model, [&] { train_step(); }, o);
  EXPECT_EQ(costs.choices, (std::vector<BlockChoice>{BlockChoice::kKeep, BlockChoice::kFull,
                                                     BlockChoice::kOffloadActivations}));
  ActivationPlan plan = plan_activation_checkpointing(*model, [&] { train_step(); }, o);
  EXPECT_NE(plan.summary().find("offload_activations"), std::string::npos) << plan.summary();
  auto [peak, grads] = measured_step();
  EXPECT_LE(peak, plan.budget_bytes * 1.05) << plan.summary();
  // Within 10 % above the prediction, as before; below it the band is wider,
  // the safe side: with offloading the peak depends on timing, and once, on a
  // loaded machine, the measured step ran 13 % below the profiled one.
  EXPECT_LE(static_cast<double>(peak), 1.10 * static_cast<double>(plan.predicted_peak)) << plan.summary();
  EXPECT_GE(static_cast<double>(peak), 0.75 * static_cast<double>(plan.predicted_peak)) << plan.summary();
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(grads[i].equal(plain[i])) << "gradient " << i;
}

TEST_P(Planner, TheKneePlansAtTheFrontiersKneeAndTheReportMarksIt) {
  auto [plain_peak, plain] = measured_step();
  PlannerOptions o;
  o.memory_budget_knee = true;
  o.report_dir = ::testing::TempDir() + "/planner_knee_report";
  std::filesystem::create_directories(o.report_dir);
  std::filesystem::remove(o.report_dir + "/frontier.csv");
  ActivationPlan plan = plan_activation_checkpointing(*model, [&] { train_step(); }, o);
  // The CSV: one row per frontier point, the knee's row is the plan in effect.
  std::ifstream in(o.report_dir + "/frontier.csv");
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(line);
  ASSERT_GE(rows.size(), 4u) << "a header and at least three plans";
  int knees = 0, chosen = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const bool knee = rows[i].find(",1,1,\"") != std::string::npos;
    knees += knee || rows[i].find(",1,0,\"") != std::string::npos;
    chosen += knee || rows[i].find(",0,1,\"") != std::string::npos;
    if (knee) {
      EXPECT_THAT(rows[i], HasSubstr("\"" + plan.summary() + "\""));
      EXPECT_THAT(rows[i], ::testing::StartsWith(str(i - 1, ",", plan.budget_bytes, ",")));
    }
  }
  EXPECT_EQ(knees, 1);
  EXPECT_EQ(chosen, 1);
  // Neither end: some blocks checkpointed, some time saved against the smallest peak.
  EXPECT_NE(plan.summary().find("keep"), std::string::npos) << plan.summary();
  EXPECT_EQ(plan.budget_bytes, plan.predicted_peak);
  EXPECT_LT(plan.predicted_peak, plain_peak);
  // The plan runs as predicted, with the plain gradients.
  auto [peak, grads] = measured_step();
  EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(plan.predicted_peak),
              0.10 * static_cast<double>(plan.predicted_peak));
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(grads[i].equal(plain[i])) << "gradient " << i;
}

TEST_P(Planner, TheKneeOfOneBlockIsRefusedBeforeProfiling) {
  torch::manual_seed(0);
  models::StackOptions so;
  so.shape.n_layer = 1;
  so.shape.d_model = 64;
  so.shape.n_head = 4;
  so.shape.d_ff = 256;
  models::Stack one(so);
  PlannerOptions o;
  o.memory_budget_knee = true;
  int steps = 0;
  const std::string msg = error_of<ConfigError>([&] {
    plan_activation_checkpointing(*one, [&] { ++steps; }, o);
  });
  EXPECT_THAT(msg, HasSubstr("memory_budget_fraction is \"knee\""));
  EXPECT_THAT(msg, HasSubstr("the model has 1 block in 'blocks'"));
  EXPECT_THAT(msg, HasSubstr("Set memory_budget_fraction to a number (e.g. 0.5) or memory_budget_bytes"));
  EXPECT_EQ(steps, 0) << "refused before any profiling step";
  EXPECT_THAT(error_of<ConfigError>([&] { check_planner_options(*one, o); }), HasSubstr("1 block"));
  // Two blocks and more have a frontier; one block with a number is planned as before.
  EXPECT_NO_THROW(check_planner_options(*model, o));
  o.memory_budget_knee = false;
  o.memory_budget_fraction = 0.5;
  EXPECT_NO_THROW(check_planner_options(*one, o));
  // The knee counts as a budget: with a fraction too it is one too many.
  o.memory_budget_knee = true;
  EXPECT_THAT(error_of<ConfigError>([&] { check_planner_options(*model, o); }), HasSubstr("keep exactly one of them"));
}

TEST_P(Planner, PlansAgainOnlyWhenTheBatchShapeChanges) {
  ActivationPlanner planner(*model, budget(0.5));
  int steps = 0;
  auto step_on = [&](const at::Tensor& input) {
    return [&, input] {
      ++steps;
      model->forward(input).pow(2).mean().backward();
    };
  };
  EXPECT_TRUE(planner.ensure(x.sizes().vec(), step_on(x)));
  ASSERT_TRUE(planner.plan().has_value());
  EXPECT_EQ(planner.plan()->batch_shape, x.sizes().vec());
  const int profiling_steps = steps;
  EXPECT_GE(profiling_steps, 1 + 2 * 4) << "warm-up plus two rounds of four choices";
  // The same shape: the plan stays, nothing runs.
  EXPECT_FALSE(planner.ensure(x.sizes().vec(), step_on(x)));
  EXPECT_EQ(steps, profiling_steps);
  EXPECT_EQ(planner.plans_made(), 1);
  // A shorter batch: planned again for it, with its own (smaller) budget.
  const int64_t budget_before = planner.plan()->budget_bytes;
  torch::manual_seed(2);
  at::Tensor half = torch::randn({kBatch / 2, kSeq, 64}, torch::requires_grad());
  EXPECT_TRUE(planner.ensure(half.sizes().vec(), step_on(half)));
  EXPECT_EQ(planner.plans_made(), 2);
  EXPECT_EQ(steps, 2 * profiling_steps);
  EXPECT_EQ(planner.plan()->batch_shape, half.sizes().vec());
  EXPECT_LT(planner.plan()->budget_bytes, budget_before);
}

TEST_P(Planner, AnImpossibleBudgetNamesTheSmallestFeasibleOne) {
  PlannerOptions o;
  o.memory_budget_bytes = 1000;
  auto msg = error_of<ConfigError>([&] { plan_activation_checkpointing(*model, [&] { train_step(); }, o); });
  EXPECT_THAT(msg, HasSubstr("the memory budget of 1000 bytes"));
  EXPECT_THAT(msg, HasSubstr("Raise activation_checkpointing.memory_budget_bytes to at least"));
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    EXPECT_EQ(module_hook(*model->blocks->ptr(i), HookSlot::kCheckpoint), nullptr) << "nothing applied";
  }
}

// With activation_offloading.enabled every step runs in an offloading scope:
// the blocks' saved tensors are on the host whatever the plan, so no plan
// lowers the peak below about what keeping every block gives, and the error
// says offloading is why (the same budget without offloading is met).
TEST_P(Planner, ABudgetUnmetUnderActivationOffloadingNamesOffloadingAsTheCause) {
  PlannerOptions o = budget(0.5);
  o.offload.enabled = true;
  auto offloaded_step = [&] {
    at::Tensor loss;
    {
      OffloadActivations scope(o.offload, model.ptr().get());
      loss = model->forward(x).pow(2).mean();
    }
    loss.backward();
  };
  const std::string msg =
      error_of<ConfigError>([&] { plan_activation_checkpointing(*model, offloaded_step, o); });
  EXPECT_THAT(msg, HasSubstr("cannot be met: the smallest peak any plan reaches is"));
  EXPECT_THAT(msg, HasSubstr("The cause is activation offloading: activation_offloading.enabled is true"));
  EXPECT_THAT(msg, HasSubstr("Set activation_offloading.enabled to false, so that the planner weighs offloading "
                             "per block itself"));
  EXPECT_THAT(msg, HasSubstr("or raise activation_checkpointing.memory_budget_bytes to at least"));
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    EXPECT_EQ(module_hook(*model->blocks->ptr(i), HookSlot::kCheckpoint), nullptr) << "nothing applied";
  }
  // Offloading off: the same fraction is met, and an unmet budget does not blame offloading.
  EXPECT_NO_THROW(plan_activation_checkpointing(*model, [&] { train_step(); }, budget(0.5)));
  PlannerOptions tiny;
  tiny.memory_budget_bytes = 1000;
  EXPECT_THAT(error_of<ConfigError>([&] { plan_activation_checkpointing(*model, [&] { train_step(); }, tiny); }),
              ::testing::Not(HasSubstr("activation offloading")));
}

TEST_P(Planner, Misuse) {
  auto step = [&] { train_step(); };
  // Exactly one budget (the rule of checkpointing/options.h, the config's too).
  PlannerOptions neither;
  EXPECT_THAT(error_of<ConfigError>([&] { plan_activation_checkpointing(*model, step, neither); }),
              HasSubstr("no budget is set"));
  PlannerOptions both = budget(0.5);
  both.memory_budget_bytes = 100;
  EXPECT_THAT(error_of<ConfigError>([&] { plan_activation_checkpointing(*model, step, both); }),
              HasSubstr("the budget is given once, keep exactly one of them"));
  EXPECT_THAT(error_of<ConfigError>([&] { plan_activation_checkpointing(*model, step, budget(0)); }),
              HasSubstr("positive"));
  PlannerOptions path = budget(0.5);
  path.blocks = "layers";
  EXPECT_THAT(error_of<Error>([&] { plan_activation_checkpointing(*model, step, path); }),
              HasSubstr("blocks (torch::nn::ModuleList)"));
  // A step without backward cannot be profiled; the model, its gradients and
  // the RNG are left as they were.
  for (auto& p : model->parameters()) p.mutable_grad().fill_(0.5);
  model_parallel_manual_seed(9, 0);
  const at::Tensor expected = at::rand({4});
  model_parallel_manual_seed(9, 0);
  EXPECT_THAT(error_of<Error>([&] {
                plan_activation_checkpointing(*model, [&] { model->forward(x); }, budget(0.5));
              }),
              HasSubstr("ran no backward through blocks.0"));
  EXPECT_TRUE(at::rand({4}).equal(expected)) << "the RNG moved";
  for (auto& p : model->parameters()) EXPECT_TRUE(p.grad().equal(at::full_like(p, 0.5)));
  for (size_t i = 0; i < model->blocks->size(); ++i) {
    EXPECT_EQ(module_hook(*model->blocks->ptr(i), HookSlot::kCheckpoint), nullptr);
  }
  // A step that throws: the error comes through, the model is left unmarked.
  EXPECT_THAT(error_of<std::runtime_error>([&] {
                plan_activation_checkpointing(*model, [] { throw std::runtime_error("data ran out"); },
                                              budget(0.5));
              }),
              HasSubstr("data ran out"));
  EXPECT_EQ(module_hook(*model->blocks->ptr(0), HookSlot::kCheckpoint), nullptr);
  // The policy entry point refuses auto and points to the planner.
  PolicyOptions p;
  p.variant = CheckpointVariant::kAuto;
  EXPECT_THAT(error_of<ConfigError>([&] { apply_activation_checkpointing(*model, p); }),
              HasSubstr("plan_activation_checkpointing"));
  // A plan for another depth.
  ActivationPlan wrong;
  wrong.choices = {BlockChoice::kFull};
  EXPECT_THAT(error_of<Error>([&] { apply_activation_plan(*model, wrong, budget(0.5)); }),
              HasSubstr("has 8 blocks"));
}

}  // namespace
}  // namespace remat
