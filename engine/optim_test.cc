#include "engine/optim.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/config.h"

namespace remat {
namespace {

TEST(LearningRate, ConstantWithoutScheduler) {
  OptimizerConfig o;
  o.lr = 0.01;
  SchedulerConfig s;
  EXPECT_EQ(learning_rate(o, s, 1), 0.01);
  EXPECT_EQ(learning_rate(o, s, 1000), 0.01);
}

TEST(LearningRate, WarmupLinearThenDecay) {
  OptimizerConfig o;
  SchedulerConfig s;
  s.type = "WarmupDecayLR";
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1.0;
  s.warmup_num_steps = 10;
  s.warmup_type = "linear";
  s.total_num_steps = 110;
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 5), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 10), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 60), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 110), 0.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 500), 0.0);
}

TEST(LearningRate, WarmupLogThenConstant) {
  OptimizerConfig o;
  SchedulerConfig s;
  s.type = "WarmupLR";
  s.warmup_min_lr = 0.1;
  s.warmup_max_lr = 1.1;
  s.warmup_num_steps = 100;
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 9), 0.1 + std::log(10.0) / std::log(100.0));
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 100), 1.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 10000), 1.1);
}

// scheduler.params.last_batch_iteration k: the schedule shifted by k + 1
// steps; -1 (the default) is the schedule itself; no scheduler, no shift.
TEST(LearningRate, LastBatchIterationShiftsTheSchedule) {
  OptimizerConfig o;
  o.lr = 0.01;
  SchedulerConfig s;
  s.type = "WarmupDecayLR";
  s.warmup_min_lr = 0;
  s.warmup_max_lr = 1;
  s.warmup_num_steps = 10;
  s.warmup_type = "linear";
  s.total_num_steps = 110;
  SchedulerConfig shifted = s;
  EXPECT_EQ(shifted.last_batch_iteration, -1);
  for (int64_t k : {0, 4, 59}) {
    shifted.last_batch_iteration = k;
    for (int64_t step = 1; step <= 60; ++step) {
      EXPECT_EQ(learning_rate(o, shifted, step), learning_rate(o, s, step + k + 1)) << k << " " << step;
    }
  }
  shifted.last_batch_iteration = 4;
  EXPECT_DOUBLE_EQ(learning_rate(o, shifted, 1), 0.6);  // step 6 of the warm-up
  EXPECT_NE(learning_rate(o, shifted, 1), learning_rate(o, s, 1));
  s.type = shifted.type = "none";
  EXPECT_EQ(learning_rate(o, shifted, 1), 0.01);
}

TEST(Optimizer, BuildsEachTypeAndSetsTheRate) {
  torch::nn::Linear lin(2, 2);
  for (const char* type : {"AdamW", "Adam", "SGD"}) {
    OptimizerConfig c;
    c.type = type;
    auto opt = make_optimizer(c, lin->parameters());
    set_learning_rate(*opt, 0.25);
    for (auto& group : opt->param_groups()) EXPECT_EQ(group.options().get_lr(), 0.25) << type;
  }
}

}  // namespace
}  // namespace remat
