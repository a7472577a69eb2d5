// The rate every step of a 20-step run trains at, for each schedule, against
// DeepSpeed's schedules and engine order written out in tests/deepspeed_lr.h
// (issue 50, item 2). A section given "auto" (the engine decides it):
// engine/auto_values_test.cc; through the engine: engine/engine_test.cc.
#include "optim/lr_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "tests/deepspeed_lr.h"

namespace remat::optim {
namespace {

using nlohmann::json;

constexpr int kSteps = 20;

// An optimizer rate and a scheduler section, as DeepSpeed's JSON gives them.
struct Case {
  std::string name;
  double lr;
  json scheduler;
};

struct Schedule {
  OptimizerOptions optimizer;
  SchedulerOptions scheduler;
};

// The section's keys into the options (the engine's schema binds them; here
// each key the cases give).
Schedule schedule_of(const Case& c) {
  Schedule s;
  s.optimizer.lr = c.lr;
  SchedulerOptions& o = s.scheduler;
  o.type = c.scheduler.at("type").get<std::string>();
  const json params = c.scheduler.value("params", json::object());
  auto real = [&](const char* key, std::optional<double>& to) {
    if (params.contains(key)) to = params.at(key).get<double>();
  };
  real("warmup_min_lr", o.warmup_min_lr);
  real("warmup_max_lr", o.warmup_max_lr);
  real("warmup_min_ratio", o.warmup_min_ratio);
  real("cos_min_ratio", o.cos_min_ratio);
  if (params.contains("total_num_steps")) o.total_num_steps = params.at("total_num_steps").get<int64_t>();
  o.warmup_num_steps = params.value("warmup_num_steps", o.warmup_num_steps);
  o.warmup_type = params.value("warmup_type", o.warmup_type);
  o.last_batch_iteration = params.value("last_batch_iteration", o.last_batch_iteration);
  return s;
}

std::vector<double> remat_rates(const Schedule& s, int n = kSteps) {
  std::vector<double> rates;
  for (int step = 1; step <= n; ++step) rates.push_back(learning_rate(s.optimizer, s.scheduler, step));
  return rates;
}

json section(const std::string& type, json params) { return {{"type", type}, {"params", std::move(params)}}; }

std::vector<Case> cases() {
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
      {"WarmupCosineLR log, default ratios", 1e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", 5}, {"total_num_steps", kSteps}})},
      {"WarmupCosineLR linear, past its end", 2e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", 4}, {"total_num_steps", 15}, {"warmup_type", "linear"},
                                  {"warmup_min_ratio", 0.1}, {"cos_min_ratio", 0.05}})},
      {"WarmupCosineLR after batch 6", 1e-3,
       section("WarmupCosineLR", {{"warmup_num_steps", 3}, {"total_num_steps", 30}, {"last_batch_iteration", 6},
                                  {"cos_min_ratio", 0.0}})},
  };
}

TEST(LearningRate, EveryStepOfA20StepRunIsDeepSpeeds) {
  for (const Case& c : cases()) {
    const std::vector<double> expected = testing::deepspeed_rates(c.lr, c.scheduler, kSteps);
    const std::vector<double> got = remat_rates(schedule_of(c));
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
  const std::vector<double> got = remat_rates(schedule_of(c), static_cast<int>(expected.size()));
  for (size_t s = 0; s < expected.size(); ++s) EXPECT_DOUBLE_EQ(got[s], expected[s]) << "step " << s + 1;
  // WarmupCosineLR's constructor sets 0, then the ratio of position 0.
  const Case cosine{"", 2e-3, section("WarmupCosineLR", {{"warmup_num_steps", 4}, {"total_num_steps", 10},
                                                         {"warmup_min_ratio", 0.25}, {"warmup_type", "linear"}})};
  const std::vector<double> cosine_rates = remat_rates(schedule_of(cosine), 7);
  EXPECT_EQ(cosine_rates[0], 0.0);
  EXPECT_DOUBLE_EQ(cosine_rates[1], 2e-3 * 0.25);                 // position 0
  EXPECT_DOUBLE_EQ(cosine_rates[4], 2e-3 * (0.25 + 0.75 * 3 / 4));  // position 3, the warm-up's last
  for (int s : {6, 7}) {                                             // positions 4 and 5: the cosine
    EXPECT_DOUBLE_EQ(cosine_rates[s - 1], 2e-3 * (0.0001 + 0.9999 * (1 + std::cos(M_PI * (s - 5) / 6)) / 2));
  }
}

// last_batch_iteration k >= 0: step 1 trains at the optimizer's own rate (the
// constructor sets none), step s at position k + s - 1. The last k the rules
// take, total_num_steps - 2, leaves step 2 above warmup_min_lr.
TEST(LearningRate, AfterBatchKStep2TrainsAtPositionKPlus1) {
  const Case c{"", 5e-3, section("WarmupDecayLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 1e-3},
                                                   {"warmup_num_steps", 2}, {"total_num_steps", 10},
                                                   {"last_batch_iteration", 8}})};
  EXPECT_EQ(remat_rates(schedule_of(c), 4), (std::vector<double>{5e-3, 1e-3 * 1 / 8, 0, 0}));
}

// Without a scheduler every step trains at optimizer.params.lr, whatever the
// other keys of the section say.
TEST(LearningRate, NoneIsTheOptimizersRate) {
  const Schedule c = schedule_of({"", 0.01, section("none", {{"warmup_num_steps", 5}, {"last_batch_iteration", 7}})});
  EXPECT_EQ(remat_rates(c), std::vector<double>(kSteps, 0.01));
}

TEST(LearningRate, StepsCountFromOne) {
  const Schedule c = schedule_of({"", 0.01, section("WarmupLR", {{"warmup_num_steps", 5}})});
  EXPECT_THROW(learning_rate(c.optimizer, c.scheduler, 0), Error);
}

// The rules, one problem a line naming its key; "none" reads no other key.
TEST(SchedulerOptions, EveryBrokenRuleOnALineNamingItsKey) {
  SchedulerOptions s;
  s.warmup_num_steps = -1;
  EXPECT_EQ(check_scheduler_options(s), "");
  s.type = "WarmupCosineLR";
  s.warmup_min_lr = 0.1;
  EXPECT_EQ(check_scheduler_options(s),
            "'scheduler.params.warmup_min_lr' is not a parameter of WarmupCosineLR (DeepSpeed's constructor "
            "refuses it): WarmupCosineLR's rates are optimizer.params.lr times a ratio: remove it, and give "
            "warmup_min_ratio and cos_min_ratio (optimizer.params.lr is the peak)\n"
            "'scheduler.params.warmup_num_steps' = -1 must be >= 0 (DeepSpeed warms up over at least 2 steps: 0 "
            "and 1 give 2)\n"
            "scheduler WarmupCosineLR needs 'scheduler.params.total_num_steps' (DeepSpeed's constructor requires "
            "it): give the run's optimizer steps, or \"auto\" (train.steps)");
  SchedulerOptions decay;
  decay.type = "WarmupDecayLR";
  decay.warmup_num_steps = 2;
  decay.total_num_steps = 10;
  decay.last_batch_iteration = 9;
  EXPECT_THAT(check_scheduler_options(decay, " (a note)"),
              ::testing::HasSubstr("('scheduler.params.total_num_steps' = 10 (a note)): from step 2 on"));
  decay.last_batch_iteration = -1;
  decay.total_num_steps = 2;
  EXPECT_EQ(check_scheduler_options(decay), "");
  ASSERT_EQ(scheduler_settings_without_effect(decay).size(), 1u);
  EXPECT_THAT(scheduler_settings_without_effect(decay)[0], ::testing::HasSubstr("is not above the warm-up"));
}

// The keys the type takes get DeepSpeed's defaults; another type's stay unset.
TEST(SchedulerOptions, WithDefaultsWritesTheTypesKeys) {
  SchedulerOptions s;
  s.type = "WarmupLR";
  const SchedulerOptions w = with_defaults(s, 0.02);
  EXPECT_EQ(w.warmup_min_lr, 0.0);
  EXPECT_EQ(w.warmup_max_lr, 0.02);
  EXPECT_FALSE(w.cos_min_ratio.has_value());
  s.type = "WarmupCosineLR";
  const SchedulerOptions c = with_defaults(s, 0.02);
  EXPECT_EQ(c.cos_min_ratio, 1e-4);
  EXPECT_EQ(c.warmup_min_ratio, 0.0);
  EXPECT_FALSE(c.warmup_max_lr.has_value());
}

}  // namespace
}  // namespace remat::optim
