// "auto" in a config: which keys take it, what each becomes and why
// (engine/auto_values.h), and that every other key still refuses it.
#include "engine/auto_values.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "optim/lr_schedule.h"
#include "runtime/error.h"
#include "tests/deepspeed_lr.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;

template <typename F>
std::string config_error(F fn) {
  return remat::testing::error_of<ConfigError>(fn);
}

Config parse(const std::string& text, std::vector<std::string> overrides = {}) {
  return parse_config(text, "test.json", overrides);
}

const AutoValue& auto_of(const Config& c, const std::string& key) {
  for (const auto& a : c.auto_values) {
    if (a.key == key) return a;
  }
  throw Error("no auto value " + key);
}

// The keys Hugging Face's Trainer fills (its ds_config templates for ZeRO 2 and 3).
const char* const kTrainerConfig = R"({
  "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto",
                        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto"
})";

TEST(AutoValues, EveryKeyTheTrainerFillsIsTakenInTheOrderGiven) {
  const Config c = parse(kTrainerConfig);
  std::vector<std::string> keys;
  for (const auto& a : c.auto_values) keys.push_back(a.key);
  EXPECT_EQ(keys, (std::vector<std::string>{
                      "bf16.enabled", "fp16.enabled", "gradient_accumulation_steps", "gradient_clipping",
                      "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.lr",
                      "optimizer.params.weight_decay", "scheduler.params.total_num_steps",
                      "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr",
                      "scheduler.params.warmup_num_steps", "train_batch_size", "train_micro_batch_size_per_gpu",
                      "zero_optimization.allgather_bucket_size", "zero_optimization.reduce_bucket_size",
                      "zero_optimization.stage3_param_persistence_threshold",
                      "zero_optimization.stage3_prefetch_bucket_size"}));
  // The device and the memory decide these later; the config alone the rest.
  EXPECT_EQ(undecided_autos(c), (std::vector<std::string>{"bf16.enabled", "fp16.enabled",
                                                          "gradient_accumulation_steps", "train_batch_size",
                                                          "train_micro_batch_size_per_gpu"}));
  EXPECT_TRUE(c.is_auto("bf16.enabled"));
  EXPECT_TRUE(c.is_undecided_auto("bf16.enabled"));
  EXPECT_FALSE(c.is_auto("zero_optimization.stage"));
  EXPECT_EQ(auto_keys().size(), 23u);
}

TEST(AutoValues, TheConfigsOwnKeysBecomeRematsDefaults) {
  const Config c = parse(kTrainerConfig, {"train.steps=50"});
  const Config d;
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_THAT(auto_of(c, "gradient_clipping").why, HasSubstr("no clipping"));
  EXPECT_EQ(c.optimizer.lr, d.optimizer.lr);
  EXPECT_EQ(c.optimizer.betas, d.optimizer.betas);
  EXPECT_EQ(c.optimizer.eps, d.optimizer.eps);
  EXPECT_EQ(c.optimizer.weight_decay, d.optimizer.weight_decay);
  EXPECT_EQ(auto_of(c, "optimizer.params.betas").value, "[0.9,0.999]");
  EXPECT_EQ(auto_of(c, "optimizer.params.lr").why,
            "remat's default for optimizer.type AdamW, as when the key is left out");
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, c.optimizer.lr);
  EXPECT_EQ(c.scheduler.total_num_steps, 50);
  EXPECT_THAT(auto_of(c, "scheduler.params.total_num_steps").why, HasSubstr("train.steps"));
  // The Trainer's warmup_steps (0 unless set), which DeepSpeed raises to 2.
  EXPECT_EQ(c.scheduler.warmup_num_steps, 2);
  EXPECT_THAT(auto_of(c, "scheduler.params.warmup_num_steps").why,
              HasSubstr("fills its warmup_steps, 0 unless set, and DeepSpeed warms up over at least 2 steps"));
  const auto& z = c.zero_optimization;
  EXPECT_EQ(z.reduce_bucket_size, d.zero_optimization.reduce_bucket_size);
  EXPECT_EQ(z.allgather_bucket_size, d.zero_optimization.allgather_bucket_size);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, d.zero_optimization.stage3_prefetch_bucket_size);
  EXPECT_EQ(z.stage3_param_persistence_threshold, d.zero_optimization.stage3_param_persistence_threshold);
  EXPECT_EQ(auto_of(c, "zero_optimization.reduce_bucket_size").value, "500000000");
  // SGD reads no betas or eps: their "auto" is said to be unused.
  const Config sgd = parse(R"({"optimizer": {"type": "SGD", "params": {"lr": "auto", "betas": "auto"}}})");
  EXPECT_EQ(auto_of(sgd, "optimizer.params.betas").why,
            "remat's default, unused: optimizer.type SGD has no betas or eps");
  EXPECT_EQ(auto_of(sgd, "optimizer.params.lr").why,
            "remat's default for optimizer.type SGD, as when the key is left out");
}

TEST(AutoValues, TheSchedulerFollowsTheOptimizerAndTheRun) {
  Config c = parse(R"({"optimizer": {"params": {"lr": 3e-4}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                                        "total_num_steps": "auto"}}})",
                   {"train.steps=5000"});
  EXPECT_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_THAT(auto_of(c, "scheduler.params.warmup_max_lr").why, HasSubstr("optimizer.params.lr"));
  EXPECT_EQ(c.scheduler.total_num_steps, 5000);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 2);  // as for a short run: the Trainer's warmup_steps, raised to 2
  EXPECT_EQ(auto_of(c, "scheduler.params.warmup_num_steps").value, "2");
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);  // left out: DeepSpeed's default, written in
  // WarmupCosineLR takes the warm-up and the total the same way.
  c = parse(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto",
                                                                    "total_num_steps": "auto"}}})",
            {"train.steps=300"});
  EXPECT_EQ(c.scheduler.warmup_num_steps, 2);
  EXPECT_EQ(c.scheduler.total_num_steps, 300);
  // An override may say "auto" too.
  c = parse("{}", {"gradient_clipping=auto", "train_micro_batch_size_per_gpu=\"auto\""});
  EXPECT_TRUE(c.is_auto("gradient_clipping"));
  EXPECT_TRUE(c.is_undecided_auto("train_micro_batch_size_per_gpu"));
}

TEST(AutoValues, EveryOtherKeyStillRefusesAuto) {
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {R"({"train": {"steps": "auto"}})", "train.steps"},
           {R"({"steps_per_print": "auto"})", "steps_per_print"},
           {R"({"zero_optimization": {"stage": "auto"}})", "zero_optimization.stage"},
           {R"({"fp16": {"loss_scale": "auto"}})", "fp16.loss_scale"},
           {R"({"optimizer": {"params": {"momentum": "auto"}}})", "optimizer.params.momentum"},
           {R"({"model": {"n_layer": "auto"}})", "model.n_layer"}}) {
    const std::string msg = config_error([&] { parse(text); });
    EXPECT_THAT(msg, HasSubstr("'" + key + "' must be ")) << msg;
    EXPECT_THAT(msg, HasSubstr("remat decides \"auto\" only for the keys docs/config.md lists")) << msg;
  }
  EXPECT_THAT(config_error([] { parse("{}", {"train.steps=auto"}); }),
              HasSubstr("config error in --set train.steps=auto: 'train.steps' must be integer, got string \"auto\""));
  // "Auto" is not "auto".
  EXPECT_THAT(config_error([] { parse(R"({"gradient_clipping": "Auto"})"); }),
              HasSubstr("'gradient_clipping' must be number, got string \"Auto\""));
}

TEST(AutoValues, PrecisionIsTheFastestTheDeviceComputesWell) {
  const std::string both = R"({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}})";
  Config c = parse(both);
  decide_precision_autos(c, "cpu", false, false);
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_THAT(auto_of(c, "bf16.enabled").why, HasSubstr("the training device, cpu, is a CPU: float32"));
  c = parse(both);
  decide_precision_autos(c, "cuda:0", true, true);
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(auto_of(c, "bf16.enabled").value, "true");
  EXPECT_EQ(auto_of(c, "fp16.enabled").why, "bf16.enabled is true: one compute dtype");
  c = parse(both);
  decide_precision_autos(c, "cuda:1", true, false);  // a GPU without bf16 (compute capability 7.x)
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_THAT(auto_of(c, "fp16.enabled").why, HasSubstr("fp16 with the dynamic loss scaler"));
  // One given true: the other "auto" is false.
  c = parse(R"({"bf16": {"enabled": "auto"}, "fp16": {"enabled": true}})");
  decide_precision_autos(c, "cuda:0", true, true);
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_TRUE(c.fp16.enabled);
  c = parse(R"({"bf16": {"enabled": true}, "fp16": {"enabled": "auto"}})");
  decide_precision_autos(c, "cuda:0", true, false);
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_FALSE(c.fp16.enabled);
  // communication_data_type "bf16" waits for bf16's decision: refused where it is false.
  c = parse(R"({"bf16": {"enabled": "auto"}, "communication_data_type": "bf16"})");
  EXPECT_THAT(config_error([&] { decide_precision_autos(c, "cpu", false, false); }),
              HasSubstr("config error in the config with bf16/fp16 \"auto\" decided for cpu: communication_data_type "
                        "\"bf16\" reduces gradients in bf16, but bf16.enabled is false"));
  c = parse(R"({"bf16": {"enabled": "auto"}, "communication_data_type": "bf16"})");
  decide_precision_autos(c, "cuda:0", true, true);
  EXPECT_TRUE(c.bf16.enabled);
  // Both given true is still refused.
  EXPECT_THAT(config_error([] { parse(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})"); }),
              HasSubstr("'fp16.enabled' and 'bf16.enabled' are both true"));
}

TEST(AutoValues, BatchSizesFollowDeepSpeedsRule) {
  // micro given: accumulation 1, train_batch_size micro x 1 x dp.
  Config c = parse(R"({"train_micro_batch_size_per_gpu": 4, "train_batch_size": "auto",
                       "gradient_accumulation_steps": "auto"})");
  decide_batch_autos(c, 2);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(auto_of(c, "train_batch_size").why,
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size = 4 x 1 x 2");
  EXPECT_EQ(c.resolve_batch(2).train_batch_size, 8);
  // train_batch_size given: accumulation derived.
  c = parse(R"({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 32, "gradient_accumulation_steps": "auto"})");
  decide_batch_autos(c, 2);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_EQ(auto_of(c, "gradient_accumulation_steps").why,
            "train_batch_size / (train_micro_batch_size_per_gpu x data-parallel size) = 32 / (4 x 2)");
  // micro "auto" with both others given: derived, no memory asked.
  c = parse(R"({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 32, "gradient_accumulation_steps": 2})");
  decide_batch_autos(c, 2);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(auto_of(c, "train_micro_batch_size_per_gpu").value, "8");
  EXPECT_TRUE(undecided_autos(c).empty());
  // The arithmetic's errors stay resolve_batch's.
  c = parse(R"({"train_micro_batch_size_per_gpu": 3, "train_batch_size": 32, "gradient_accumulation_steps": "auto"})");
  EXPECT_THAT(config_error([&] { decide_batch_autos(c, 2); }),
              HasSubstr("train_batch_size (32) is not divisible by train_micro_batch_size_per_gpu (3)"));
}

TEST(AutoValues, AnAutoMicroBatchIsTheChoosersWithinTheBatch) {
  // Both others auto: the chooser's micro-batch, accumulation 1.
  Config c = parse(kTrainerConfig);
  int64_t asked = -1;
  decide_batch_autos(c, 2, [&](int64_t limit) {
    asked = limit;
    return MicroBatchChoice{6, "six fit"};
  });
  EXPECT_EQ(asked, kMaxAutoMicroBatch);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 6);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 12);
  EXPECT_EQ(auto_of(c, "train_micro_batch_size_per_gpu").why, "six fit");
  // train_batch_size given: at most train_batch_size / dp, a divisor of it.
  c = parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
               "gradient_accumulation_steps": "auto"})");
  decide_batch_autos(c, 2, [&](int64_t limit) {
    asked = limit;
    return MicroBatchChoice{6, "six fit"};
  });
  EXPECT_EQ(asked, 16);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_THAT(auto_of(c, "train_micro_batch_size_per_gpu").why,
              HasSubstr("4, the largest micro-batch up to 6 that divides train_batch_size / data-parallel size = 16"));
  // Nothing fits: the chooser's reason.
  c = parse(kTrainerConfig);
  EXPECT_THAT(config_error([&] { decide_batch_autos(c, 1, [](int64_t) { return MicroBatchChoice{0, "too big"}; }); }),
              HasSubstr("not even a micro-batch of 1 fits: too big"));
  // resolve_batch before the decision says what is missing.
  c = parse(kTrainerConfig);
  EXPECT_THAT(config_error([&] { c.resolve_batch(1); }),
              HasSubstr("train_micro_batch_size_per_gpu is \"auto\" and not decided yet"));
  // No chooser (a model remat cannot estimate): a number is asked for.
  c = parse(kTrainerConfig);
  EXPECT_THAT(config_error([&] { decide_batch_autos(c, 1); }),
              HasSubstr("a model given to remat::initialize cannot be estimated before it runs: give "
                        "train_micro_batch_size_per_gpu a number"));
}

TEST(AutoValues, EachDecisionIsOneLine) {
  Config c = parse(R"({"train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto", "gradient_clipping": "auto"})");
  EXPECT_EQ(auto_lines(c), (std::vector<std::string>{"gradient_clipping \"auto\" -> 0.0: remat's default, no clipping "
                                                     "(give a number, such as 1.0, to clip the gradients' norm)"}));
  decide_batch_autos(c, 3);
  ASSERT_EQ(auto_lines(c).size(), 2u);
  EXPECT_EQ(auto_lines(c)[1], "train_batch_size \"auto\" -> 6: train_micro_batch_size_per_gpu x "
                              "gradient_accumulation_steps x data-parallel size = 2 x 1 x 3");
  // The dump shows what was decided.
  EXPECT_THAT(c.to_json(), HasSubstr("\"train_batch_size\": 6"));
}

// Issue 49, item 6: under bf16 or fp16 at stage 3 the persistence threshold
// "auto" said "-> 100000" while stage 3 used 0. Its one line now says what
// stage 3 uses and why, however the precision is decided.
TEST(AutoValues, APersistenceThresholdIsTheOneStage3Uses) {
  const std::string key = "zero_optimization.stage3_param_persistence_threshold";
  Config c = parse(R"({"bf16": {"enabled": true},
                       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}})");
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 0);
  EXPECT_EQ(auto_of(c, key).value, "0");
  EXPECT_EQ(auto_of(c, key).why, "under bf16 stage 3 shards every parameter, since the float32 masters live in the "
                                 "shards and a parameter kept whole would have none beside its bf16 copy (remat's "
                                 "default, 100000, keeps smaller parameters whole in float32 runs)");
  // One line says it; no other line repeats or contradicts it.
  int lines = 0;
  for (const auto& line : auto_lines(c)) lines += line.find("persistence_threshold") != std::string::npos;
  EXPECT_EQ(lines, 1);
  for (const auto& line : ineffective_settings(c)) EXPECT_EQ(line.find("persistence"), std::string::npos) << line;
  // bf16 and fp16 "auto": decided with the device.
  const std::string both = R"({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}})";
  c = parse(both);
  decide_precision_autos(c, "cpu", false, false);  // float32: remat's default stands
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 100000);
  EXPECT_EQ(auto_of(c, key).why, "remat's default, as when the key is left out");
  c = parse(both);
  decide_precision_autos(c, "cuda:1", true, false);  // fp16
  EXPECT_EQ(auto_of(c, key).value, "0");
  EXPECT_THAT(auto_of(c, key).why, HasSubstr("under fp16 stage 3 shards every parameter"));
  // Below stage 3 the threshold is not read: remat's default, as before.
  c = parse(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 2,
                "stage3_param_persistence_threshold": "auto"}})");
  EXPECT_EQ(auto_of(c, key).value, "100000");
}

// Issue 49, item 12: DeepSpeed reads "auto" on these as the key left out
// (its default); remat did not take it. Their lines say what it means here.
TEST(AutoValues, DeepSpeedsDefaultsForItsTilingAndPrefetchKeys) {
  const Config c = parse(R"({"zero_optimization": {"stage": 3, "sub_group_size": "auto",
      "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto"}})");
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(auto_of(c, "zero_optimization.stage3_max_live_parameters").why,
            "remat's default (DeepSpeed's), as when the key is left out");
  EXPECT_EQ(auto_of(c, "zero_optimization.sub_group_size").value, "1000000000");
  EXPECT_THAT(auto_of(c, "zero_optimization.sub_group_size").why,
              HasSubstr("DeepSpeed's default, as when the key is left out; it has no effect in remat: remat steps each "
                        "optimizer shard in one piece"));
  EXPECT_THAT(auto_of(c, "zero_optimization.stage3_max_reuse_distance").why,
              HasSubstr("it has no effect in remat: remat's stage 3 frees a unit's parameters"));
  // Said once: by the "auto" line, not again as a value without effect.
  EXPECT_FALSE(c.deepspeed_tuning.sub_group_size.has_value());
  EXPECT_TRUE(ineffective_settings(c).empty());
  EXPECT_EQ(parse(R"({"zero_optimization": {"max_live_parameters": "auto"}})")
                .zero_optimization.stage3_max_live_parameters, 1000000000);
}

// The scheduler's "auto" keys, decided as Hugging Face's Trainer fills them
// (warmup_min_lr 0, warmup_max_lr the rate, warmup_num_steps its warmup_steps,
// 0 by default, total_num_steps the run's steps): every step of a 20-step run
// trains at DeepSpeed's rate for the section so filled (optim/lr_schedule_test.cc
// compares the schedules given numbers).
nlohmann::json scheduler_section(const std::string& type, nlohmann::json params) {
  return {{"type", type}, {"params", std::move(params)}};
}

Config scheduled(double lr, const nlohmann::json& scheduler, int steps) {
  const nlohmann::json root = {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", lr}}}}},
                               {"scheduler", scheduler},
                               {"train", {{"steps", steps}}}};
  return parse(root.dump());
}

std::vector<double> rates_of(const Config& c, int n) {
  std::vector<double> rates;
  for (int step = 1; step <= n; ++step) rates.push_back(optim::learning_rate(c.optimizer, c.scheduler, step));
  return rates;
}

TEST(AutoValues, SchedulerAutosTrainAtTheRatesOfHuggingFacesValues) {
  constexpr int kSteps = 20;
  struct Case {
    std::string name;
    double lr;
    nlohmann::json given, filled;
  };
  const std::vector<Case> cases = {
      {"WarmupLR", 5e-4,
       scheduler_section("WarmupLR", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"},
                                      {"warmup_num_steps", "auto"}}),
       scheduler_section("WarmupLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 5e-4}, {"warmup_num_steps", 0}})},
      {"WarmupDecayLR (a Whisper file)", 1e-3,
       scheduler_section("WarmupDecayLR", {{"last_batch_iteration", -1}, {"total_num_steps", "auto"},
                                           {"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"},
                                           {"warmup_num_steps", "auto"}}),
       scheduler_section("WarmupDecayLR", {{"warmup_min_lr", 0}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 0},
                                           {"total_num_steps", kSteps}})},
      {"WarmupCosineLR", 1e-3,
       scheduler_section("WarmupCosineLR", {{"warmup_num_steps", "auto"}, {"total_num_steps", "auto"}}),
       scheduler_section("WarmupCosineLR", {{"warmup_num_steps", 0}, {"total_num_steps", kSteps}})},
  };
  for (const Case& c : cases) {
    const std::vector<double> expected = testing::deepspeed_rates(c.lr, c.filled, kSteps);
    const std::vector<double> got = rates_of(scheduled(c.lr, c.given, kSteps), kSteps);
    ASSERT_EQ(got.size(), expected.size());
    for (int s = 0; s < kSteps; ++s) EXPECT_DOUBLE_EQ(got[s], expected[s]) << c.name << ", step " << s + 1;
  }
}

// With total_num_steps "auto" (the run's steps), the last step trains above
// warmup_min_lr, as in DeepSpeed: at position steps - 2 of steps.
TEST(AutoValues, TheLastStepOfAnAutoDecayTrainsAboveZero) {
  const auto whisper = scheduler_section("WarmupDecayLR", {{"total_num_steps", "auto"}, {"warmup_min_lr", "auto"},
                                                           {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"}});
  EXPECT_EQ(rates_of(scheduled(1e-3, whisper, 3), 3), (std::vector<double>{0.0, 0.0, 1e-3}));
  for (int steps : {3, 4, 5, 10, 20, 120, 1000}) {
    const Config c = scheduled(1e-3, whisper, steps);
    EXPECT_EQ(c.scheduler.total_num_steps, steps);
    EXPECT_EQ(c.scheduler.warmup_num_steps, 2);
    EXPECT_DOUBLE_EQ(optim::learning_rate(c.optimizer, c.scheduler, steps),
                     steps == 3 ? 1e-3 : 1e-3 * 2 / (steps - 2))
        << steps << " steps";
  }
  const auto cosine = scheduler_section("WarmupCosineLR", {{"total_num_steps", "auto"}, {"warmup_num_steps", "auto"}});
  for (int steps : {3, 4, 10, 120}) {
    const Config c = scheduled(1e-3, cosine, steps);
    EXPECT_GT(optim::learning_rate(c.optimizer, c.scheduler, steps), 1e-3 * 1e-4) << steps << " steps";
  }
}

}  // namespace
}  // namespace remat
