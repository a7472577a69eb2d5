// The rate every step of a 20-step run trains at, for each schedule, against
// DeepSpeed's schedules and engine order written out in tests/deepspeed_lr.h
// (issue 50, item 2). Through the engine: engine_test.cc.
#include "engine/lr_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "engine/config.h"
#include "runtime/error.h"
#include "tests/deepspeed_lr.h"

namespace remat {
namespace {

using nlohmann::json;

constexpr int kSteps = 20;

// A config's optimizer rate and scheduler section, and the section as
// DeepSpeed reads it: its "auto" values filled in as Hugging Face's Trainer
// fills them (warmup_min_lr 0, warmup_max_lr the rate, warmup_num_steps its
// warmup_steps, 0 by default, total_num_steps the run's steps).
struct Case {
  std::string name;
  double lr;
  json scheduler;
  json deepspeed = nullptr;  // null: the same as `scheduler`
};

Config config_of(const Case& c, int steps = kSteps) {
  const json root = {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", c.lr}}}}},
                     {"scheduler", c.scheduler},
                     {"train", {{"steps", steps}}}};
  return parse_config(root.dump(), "<test>");
}

std::vector<double> remat_rates(const Config& c, int n = kSteps) {
  std::vector<double> rates;
  for (int step = 1; step <= n; ++step) rates.push_back(learning_rate(c.optimizer, c.scheduler, step));
  return rates;
}

json section(const std::string& type, json params) { return {{"type", type}, {"params", std::move(params)}}; }

std::vector<Case> cases() {
  const json hf_decay = section("WarmupDecayLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 1e-3},
                                                  {"warmup_num_steps", 0}, {"total_num_steps", kSteps}});
  const json hf_cosine = section("WarmupCosineLR", {{"warmup_num_steps", 0}, {"total_num_steps", kSteps}});
  return {
      {"WarmupLR log", 1e-3, section("WarmupLR", {{"warmup_min_lr", 1e-4}, {"warmup_max_lr", 1e-3},
                                                  {"warmup_num_steps", 5}})},
      {"WarmupLR linear", 1e-3, section("WarmupLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 0.01},
                                                     {"warmup_num_steps", 8}, {"warmup_type", "linear"}})},
      {"WarmupLR warm-up 0, raised to 2", 1e-3,
       section("WarmupLR", {{"warmup_min_lr", 1e-4}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 0}})},
      {"WarmupLR linear warm-up 1, raised to 2", 1e-3,
       section("WarmupLR", {{"warmup_max_lr", 2e-3}, {"warmup_num_steps", 1}, {"warmup_type", "linear"}})},
      {"WarmupLR up to the optimizer's rate", 3e-4, section("WarmupLR", {{"warmup_num_steps", 4}})},
      {"WarmupLR after batch 3", 1e-3, section("WarmupLR", {{"warmup_max_lr", 1e-3}, {"warmup_num_steps", 10},
                                                             {"warmup_type", "linear"}, {"last_batch_iteration", 3}})},
      {"WarmupLR auto", 5e-4,
       section("WarmupLR", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}}),
       section("WarmupLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 5e-4}, {"warmup_num_steps", 0}})},
      {"WarmupDecayLR log, past its end", 1e-3,
       section("WarmupDecayLR", {{"warmup_min_lr", 1e-4}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 2},
                                 {"total_num_steps", 6}})},
      {"WarmupDecayLR linear over the run", 1e-3,
       section("WarmupDecayLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 3e-3}, {"warmup_num_steps", 5},
                                 {"warmup_type", "linear"}, {"total_num_steps", kSteps}})},
      {"WarmupDecayLR after batch 5", 1e-3,
       section("WarmupDecayLR", {{"warmup_min_lr", 1e-5}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 4},
                                 {"total_num_steps", 16}, {"last_batch_iteration", 5}})},
      {"WarmupDecayLR defaults", 5e-2, section("WarmupDecayLR", {{"warmup_num_steps", 10}, {"total_num_steps", 40}})},
      {"WarmupDecayLR auto (a Whisper file)", 1e-3,
       section("WarmupDecayLR", {{"last_batch_iteration", -1}, {"total_num_steps", "auto"}, {"warmup_min_lr", "auto"},
                                 {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}}),
       hf_decay},
      {"WarmupCosineLR log, default ratios", 1e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", 5}, {"total_num_steps", kSteps}})},
      {"WarmupCosineLR linear, past its end", 2e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", 4}, {"total_num_steps", 15}, {"warmup_type", "linear"},
                                  {"warmup_min_ratio", 0.1}, {"cos_min_ratio", 0.05}})},
      {"WarmupCosineLR after batch 6", 1e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", 3}, {"total_num_steps", 30}, {"last_batch_iteration", 6},
                                  {"cos_min_ratio", 0.0}})},
      {"WarmupCosineLR auto", 1e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", "auto"}, {"total_num_steps", "auto"}}), hf_cosine},
  };
}

TEST(LearningRate, EveryStepOfA20StepRunIsDeepSpeeds) {
  for (const Case& c : cases()) {
    const std::vector<double> expected =
        testing::deepspeed_rates(c.lr, c.deepspeed.is_null() ? c.scheduler : c.deepspeed, kSteps);
    const std::vector<double> got = remat_rates(config_of(c));
    ASSERT_EQ(got.size(), expected.size());
    for (int s = 0; s < kSteps; ++s) EXPECT_DOUBLE_EQ(got[s], expected[s]) << c.name << ", step " << s + 1;
  }
}

// The figures: DeepSpeed trains steps 1-6 at these (its log warm-up,
// then the linear decay), remat did at 5.5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4.
TEST(LearningRate, TheFirstTwoStepsTrainAtTheStartOfTheWarmup) {
  const Case c{"", 1e-3, section("WarmupDecayLR", {{"warmup_min_lr", 1e-4}, {"warmup_max_lr", 1e-3},
                                                   {"warmup_num_steps", 2}, {"total_num_steps", 6}})};
  const std::vector<double> expected = {1e-4, 1e-4, 1e-3, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4};
  const std::vector<double> got = remat_rates(config_of(c), static_cast<int>(expected.size()));
  for (size_t s = 0; s < expected.size(); ++s) EXPECT_DOUBLE_EQ(got[s], expected[s]) << "step " << s + 1;
  // WarmupCosineLR's constructor sets 0, then the ratio of position 0.
  const Case cosine{"", 2e-3, section("WarmupCosineLR", {{"warmup_num_steps", 4}, {"total_num_steps", 10},
                                                         {"warmup_min_ratio", 0.25}, {"warmup_type", "linear"}})};
  const std::vector<double> cosine_rates = remat_rates(config_of(cosine), 7);
  EXPECT_EQ(cosine_rates[0], 0.0);
  EXPECT_DOUBLE_EQ(cosine_rates[1], 2e-3 * 0.25);                 // position 0
  EXPECT_DOUBLE_EQ(cosine_rates[4], 2e-3 * (0.25 + 0.75 * 3 / 4));  // position 3, the warm-up's last
  for (int s : {6, 7}) {                                             // positions 4 and 5: the cosine
    EXPECT_DOUBLE_EQ(cosine_rates[s - 1], 2e-3 * (0.0001 + 0.9999 * (1 + std::cos(M_PI * (s - 5) / 6)) / 2));
  }
}

// With total_num_steps "auto" (the run's steps), the last step trains above
// warmup_min_lr, as in DeepSpeed: at position steps - 2 of steps.
TEST(LearningRate, TheLastStepOfAnAutoDecayTrainsAboveZero) {
  const Case whisper{"", 1e-3, section("WarmupDecayLR", {{"total_num_steps", "auto"}, {"warmup_min_lr", "auto"},
                                                         {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}})};
  EXPECT_EQ(remat_rates(config_of(whisper, 3), 3), (std::vector<double>{0.0, 0.0, 1e-3}));
  for (int steps : {3, 4, 5, 10, 20, 120, 1000}) {
    const Config c = config_of(whisper, steps);
    EXPECT_EQ(c.scheduler.total_num_steps, steps);
    EXPECT_EQ(c.scheduler.warmup_num_steps, 2);
    EXPECT_DOUBLE_EQ(learning_rate(c.optimizer, c.scheduler, steps), steps == 3 ? 1e-3 : 1e-3 * 2 / (steps - 2))
        << steps << " steps";
  }
  const Case cosine{"", 1e-3, section("WarmupCosineLR", {{"total_num_steps", "auto"}, {"warmup_num_steps", "auto"}})};
  for (int steps : {3, 4, 10, 120}) {
    const Config c = config_of(cosine, steps);
    EXPECT_GT(learning_rate(c.optimizer, c.scheduler, steps), 1e-3 * 1e-4) << steps << " steps";
  }
}

// last_batch_iteration k >= 0: step 1 trains at the optimizer's own rate (the
// constructor sets none), step s at position k + s - 1. The last k the rules
// take, total_num_steps - 2, leaves step 2 above warmup_min_lr.
TEST(LearningRate, AfterBatchKStep2TrainsAtPositionKPlus1) {
  const Case c{"", 5e-3, section("WarmupDecayLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 1e-3},
                                                   {"warmup_num_steps", 2}, {"total_num_steps", 10},
                                                   {"last_batch_iteration", 8}})};
  EXPECT_EQ(remat_rates(config_of(c), 4), (std::vector<double>{5e-3, 1e-3 * 1 / 8, 0, 0}));
}

// Without a scheduler every step trains at optimizer.params.lr, whatever the
// other keys of the section say.
TEST(LearningRate, NoneIsTheOptimizersRate) {
  const Config c = config_of({"", 0.01, section("none", {{"warmup_num_steps", 5}, {"last_batch_iteration", 7}})});
  EXPECT_EQ(remat_rates(c), std::vector<double>(kSteps, 0.01));
}

TEST(LearningRate, StepsCountFromOne) {
  const Config c = config_of({"", 0.01, section("WarmupLR", {{"warmup_num_steps", 5}})});
  EXPECT_THROW(learning_rate(c.optimizer, c.scheduler, 0), Error);
}

}  // namespace
}  // namespace remat
