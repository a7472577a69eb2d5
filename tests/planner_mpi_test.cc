// The memory planner across ranks: every rank measures its own step (its own
// data, its own timings), and every rank gets the same plan, because the
// measurements are all-reduced before solving. Data parallel, and tensor
// parallel at size 2 where the world allows it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "models/gpt.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using remat::testing::layout;
using remat::testing::small_gpt;
using remat::testing::tp_sizes;
using remat::testing::world;

// Every rank's values, gathered (doubles).
std::vector<double> gather(const std::vector<double>& mine) {
  at::Tensor in = at::tensor(mine, at::kDouble);
  at::Tensor out = at::empty({world()->size() * in.numel()}, at::kDouble);
  world()->allGather(out, in)->wait();
  return std::vector<double>(out.data_ptr<double>(), out.data_ptr<double>() + out.numel());
}

TEST(PlannerRanks, EveryRankGetsTheSamePlan) {
  for (int tp : tp_sizes(2)) {
    SCOPED_TRACE(str("tp ", tp));
    const ParallelLayout& l = layout(tp);
    torch::manual_seed(3);
    models::Gpt model(small_gpt(32, 6, 0.1, tp));
    model->train();
    model_parallel_manual_seed(11, l);
    // Each data-parallel rank its own batch.
    at::Generator gen = at::detail::createCPUGenerator(100 + static_cast<uint64_t>(l.dp_rank()));
    at::Tensor idx = at::randint(32, {4, 12}, gen, at::kLong);
    at::Tensor targets = idx.roll(-1, 1);
    for (double fraction : {0.6, 0.8}) {
      PlannerOptions o;
      o.memory_budget_fraction = fraction;
      ActivationPlan plan = plan_activation_checkpointing(
          *model, [&] { model->loss(idx, targets).backward(); }, o, world().get());
      std::vector<double> mine{static_cast<double>(plan.budget_bytes), static_cast<double>(plan.predicted_peak),
                               plan.predicted_extra_cpu_ms};
      for (BlockChoice c : plan.choices) mine.push_back(static_cast<double>(c));
      const std::vector<double> all = gather(mine);
      for (int r = 1; r < world()->size(); ++r) {
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_EQ(all[r * mine.size() + i], all[i]) << "rank " << r << " value " << i << " (plan "
                                                       << plan.summary() << ")";
        }
      }
      EXPECT_NE(plan.summary().find_first_not_of("keep,"), std::string::npos)
          << "a budget below the peak checkpoints something: " << plan.summary();
    }
    // The measurements themselves are the same on every rank (each rank's
    // own timings differ; the planner decides on their maximum).
    PlannerOptions o;
    o.memory_budget_fraction = 0.5;
    BlockCosts costs = profile_activation_choices(
        *model, [&] { model->loss(idx, targets).backward(); }, o, world().get());
    std::vector<double> mine{static_cast<double>(costs.keep_peak), static_cast<double>(costs.backward_base)};
    for (const auto& block : costs.blocks) {
      for (const ChoiceCost& c : block) {
        mine.insert(mine.end(), {static_cast<double>(c.held_bytes), static_cast<double>(c.transient_bytes),
                                 c.extra_cpu_ms, c.extra_wall_ms});
      }
    }
    const std::vector<double> all = gather(mine);
    for (int r = 1; r < world()->size(); ++r) {
      for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(all[r * mine.size() + i], all[i]) << "rank " << r;
    }
    remove_activation_checkpointing(*model);
  }
}

}  // namespace
}  // namespace remat
