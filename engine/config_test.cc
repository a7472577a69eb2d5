#include "engine/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

template <typename F>
std::string config_error(F fn) {
  return remat::testing::error_of<ConfigError>(fn);
}

Config parse(const std::string& text, std::vector<std::string> overrides = {}) {
  return parse_config(text, "test.json", overrides);
}

TEST(Config, DefaultsAreDeepSpeeds) {
  Config c = parse("{}");
  EXPECT_FALSE(c.train_batch_size.has_value());
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_EQ(c.zero_optimization.stage, 0);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size, 50000000);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 100000);
  EXPECT_FALSE(c.zero_optimization.overlap_comm);
  EXPECT_TRUE(c.zero_optimization.contiguous_gradients);
  const auto& ac = c.activation_checkpointing;
  EXPECT_FALSE(ac.partition_activations);
  EXPECT_FALSE(ac.cpu_checkpointing);
  EXPECT_FALSE(ac.contiguous_memory_optimization);
  EXPECT_FALSE(ac.number_checkpoints.has_value());
  EXPECT_FALSE(ac.synchronize_checkpoint_boundary);
  EXPECT_FALSE(ac.profile);
  EXPECT_EQ(checkpoint_variant_name(ac.variant), "none");
  EXPECT_FALSE(ac.save_ops.has_value()) << "unset: checkpointing's default list";
  EXPECT_EQ(c.tensor_parallel.size, 1);
}

TEST(Config, ReadsEveryKnownSection) {
  Config c = parse(R"({
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.5,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7, "warmup_type": "linear"}},
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "overlap_comm": true},
    "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true,
      "contiguous_memory_optimization": true, "number_checkpoints": 8,
      "synchronize_checkpoint_boundary": true, "profile": true,
      "variant": "selective_op", "every_k": 3, "save_ops": ["aten::mm"]},
    "tensor_parallel": {"size": 2},
    "model": {"n_layer": 8, "n_head": 2, "d_model": 64, "d_ff": 256, "seq_len": 32, "dropout": 0.0},
    "data": {"path": "corpus.txt", "train_fraction": 0.8}
  })");
  EXPECT_EQ(*c.train_batch_size, 32);
  EXPECT_EQ(c.gradient_clipping, 1.5);
  EXPECT_EQ(c.optimizer.type, "SGD");
  EXPECT_EQ(c.optimizer.lr, 0.1);
  EXPECT_EQ(c.optimizer.momentum, 0.9);
  EXPECT_TRUE(c.optimizer.nesterov);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 7);
  EXPECT_EQ(c.scheduler.warmup_type, "linear");
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_EQ(c.zero_optimization.stage, 3);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 500000000);
  EXPECT_TRUE(c.zero_optimization.overlap_comm);
  EXPECT_EQ(*c.activation_checkpointing.number_checkpoints, 8);
  EXPECT_EQ(checkpoint_variant_name(c.activation_checkpointing.variant), "selective_op");
  EXPECT_EQ(c.activation_checkpointing.every_k, 3);
  EXPECT_EQ(c.activation_checkpointing.save_ops, std::optional<std::vector<std::string>>(std::vector<std::string>{"aten::mm"}));
  EXPECT_EQ(c.tensor_parallel.size, 2);
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(c.data.path, "corpus.txt");
}

TEST(Config, EmbeddedDefaultParsesAndRoundTrips) {
  Config c = parse_config(default_config_text(), "<default>");
  Config again = parse_config(c.to_json(), "<dump>");
  EXPECT_EQ(again.to_json(), c.to_json());
  EXPECT_EQ(again.optimizer.betas, c.optimizer.betas);
}

TEST(Config, MalformedJsonGivesLineAndColumn) {
  auto msg = config_error([] { parse("{\n  \"bf16\": {\"enabled\": true,}\n}"); });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: malformed JSON"));
  EXPECT_THAT(msg, HasSubstr("line 2, column"));
}

TEST(Config, DuplicateKeyIsAnError) {
  auto msg = config_error([] { parse(R"({"bf16": {"enabled": true, "enabled": false}})"); });
  EXPECT_THAT(msg, HasSubstr("key 'enabled' appears twice"));
}

TEST(Config, TopLevelMustBeAnObject) {
  EXPECT_THAT(config_error([] { parse("[1, 2]"); }),
              HasSubstr("the top level must be a JSON object, got array"));
}

TEST(Config, UnknownTopLevelKeyNamesClosest) {
  auto msg = config_error([] { parse(R"({"train_batch_sise": 8})"); });
  EXPECT_THAT(msg, HasSubstr("unknown key 'train_batch_sise'; did you mean 'train_batch_size'?"));
}

TEST(Config, UnknownNestedKeyNamesFullPathAndClosest) {
  auto msg = config_error([] {
    parse(R"({"activation_checkpointing": {"partition_activatons": true}})");
  });
  EXPECT_THAT(msg, HasSubstr("unknown key 'activation_checkpointing.partition_activatons'; "
                             "did you mean 'activation_checkpointing.partition_activations'?"));
  msg = config_error([] { parse(R"({"optimizer": {"params": {"weight_decy": 0.1}}})"); });
  EXPECT_THAT(msg, HasSubstr("'optimizer.params.weight_decy'; did you mean "
                             "'optimizer.params.weight_decay'?"));
}

TEST(Config, WrongTypeNamesPathExpectedAndActual) {
  auto msg = config_error([] { parse(R"({"model": {"n_layer": "4"}})"); });
  EXPECT_THAT(msg, HasSubstr("'model.n_layer' must be integer, got string \"4\""));
  msg = config_error([] { parse(R"({"bf16": {"enabled": 1}})"); });
  EXPECT_THAT(msg, HasSubstr("'bf16.enabled' must be boolean, got integer 1"));
  msg = config_error([] { parse(R"({"zero_optimization": {"reduce_bucket_size": 2.5}})"); });
  EXPECT_THAT(msg, HasSubstr("'zero_optimization.reduce_bucket_size' must be integer, got number 2.5"));
  msg = config_error([] { parse(R"({"bf16": true})"); });
  EXPECT_THAT(msg, HasSubstr("'bf16' must be object, got boolean true"));
  msg = config_error([] { parse(R"({"optimizer": {"params": {"betas": [0.9]}}})"); });
  EXPECT_THAT(msg, HasSubstr("'optimizer.params.betas' must be array of 2 numbers"));
}

TEST(Config, ChoicesNameTheClosest) {
  auto msg = config_error([] { parse(R"({"activation_checkpointing": {"variant": "ful"}})"); });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.variant' = \"ful\" is not one of none, "
                             "full, selective_layer, selective_op, auto; did you mean \"full\"?"));
  msg = config_error([] { parse(R"({"optimizer": {"type": "adamw"}})"); });
  EXPECT_THAT(msg, HasSubstr("did you mean \"AdamW\"?"));
}

TEST(Config, AutoTakesExactlyOneBudget) {
  Config c = parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": 0.5}})");
  EXPECT_EQ(c.activation_checkpointing.memory_budget_fraction, 0.5);
  EXPECT_FALSE(c.activation_checkpointing.memory_budget_bytes.has_value());
  c = parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_bytes": 1000000}})");
  EXPECT_EQ(c.activation_checkpointing.memory_budget_bytes, 1000000);
  auto msg = config_error([] { parse(R"({"activation_checkpointing": {"variant": "auto"}})"); });
  EXPECT_THAT(msg, HasSubstr("\"auto\" but no budget is set: set one of 'memory_budget_bytes'"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_bytes": 10,
                                           "memory_budget_fraction": 0.5}})");
  });
  EXPECT_THAT(msg, HasSubstr("sets 'memory_budget_bytes' and 'memory_budget_fraction': the budget is given "
                             "once, keep exactly one of them"));
  // The whole-device budget is the third of the three.
  c = parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": 8000000}})");
  EXPECT_EQ(c.activation_checkpointing.device_memory_budget_bytes, 8000000);
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": 10,
                                           "memory_budget_fraction": 0.5, "memory_budget_bytes": 4}})");
  });
  EXPECT_THAT(msg, HasSubstr("sets 'memory_budget_bytes', 'memory_budget_fraction' and "
                             "'device_memory_budget_bytes': the budget is given once"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": 0}})");
  });
  EXPECT_THAT(msg, HasSubstr("device_memory_budget_bytes' = 0 must be positive"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "none", "device_memory_budget_bytes": 1000}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.device_memory_budget_bytes' is set but 'variant' is "
                             "\"none\""));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "full", "memory_budget_fraction": 0.5}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.memory_budget_fraction' is set but 'variant' is "
                             "\"full\": a budget is planned by variant \"auto\""));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_bytes": -5}})");
  });
  EXPECT_THAT(msg, HasSubstr("memory_budget_bytes' = -5 must be positive"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": 0}})");
  });
  EXPECT_THAT(msg, HasSubstr("memory_budget_fraction' = 0 must be a positive number"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "half"}})");
  });
  EXPECT_THAT(msg, HasSubstr("memory_budget_fraction"));
}

// device_memory_budget_bytes: a whole number of bytes, or "auto" (the device's
// capacity less a reserve, resolved by the engine) in place of one.
TEST(Config, DeviceMemoryBudgetTakesAuto) {
  const std::string ac = "activation_checkpointing.";
  Config c = parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": "auto"}})");
  EXPECT_TRUE(c.activation_checkpointing.device_memory_budget_auto);
  EXPECT_FALSE(c.activation_checkpointing.device_memory_budget_bytes.has_value());
  EXPECT_THAT(c.to_json(), HasSubstr("\"device_memory_budget_bytes\": \"auto\""));
  const Config again = parse_config(c.to_json(), "<dump>");
  EXPECT_TRUE(again.activation_checkpointing.device_memory_budget_auto);
  EXPECT_EQ(again.to_json(), c.to_json());
  // From --set, bare or quoted; a later number or null replaces it.
  for (const std::string word : {"auto", "\"auto\""}) {
    c = parse("{}", {ac + "variant=auto", ac + "device_memory_budget_bytes=" + word});
    EXPECT_TRUE(c.activation_checkpointing.device_memory_budget_auto) << word;
  }
  c = parse("{}", {ac + "variant=auto", ac + "device_memory_budget_bytes=auto",
                   ac + "device_memory_budget_bytes=5000000000"});
  EXPECT_FALSE(c.activation_checkpointing.device_memory_budget_auto);
  EXPECT_EQ(c.activation_checkpointing.device_memory_budget_bytes, 5000000000);
  EXPECT_THAT(c.to_json(), HasSubstr("\"device_memory_budget_bytes\": 5000000000"));
  // Bytes stay whole numbers; another word, zero, a negative budget, or "auto"
  // beside another budget or without variant auto are refused naming the key.
  auto msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": 1.5}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.device_memory_budget_bytes' must be integer or \"auto\""));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": "all"}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.device_memory_budget_bytes' must be integer or \"auto\""));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": "Auto"}})");
  });
  EXPECT_THAT(msg, HasSubstr("did you mean \"auto\"?"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": -5}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.device_memory_budget_bytes' = -5 must be positive"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "device_memory_budget_bytes": "auto",
                                           "memory_budget_bytes": 4}})");
  });
  EXPECT_THAT(msg, HasSubstr("sets 'memory_budget_bytes' and 'device_memory_budget_bytes': the budget is given once"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "full", "device_memory_budget_bytes": "auto"}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.device_memory_budget_bytes' is set but 'variant' is "
                             "\"full\""));
}

// memory_budget_fraction: a number, or "knee" (the plan at the knee of the
// planner's frontier) in place of one.
TEST(Config, MemoryBudgetFractionTakesTheKnee) {
  const std::string ac = "activation_checkpointing.";
  Config c = parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "knee"}})");
  EXPECT_TRUE(c.activation_checkpointing.memory_budget_knee);
  EXPECT_FALSE(c.activation_checkpointing.memory_budget_fraction.has_value());
  EXPECT_THAT(c.to_json(), HasSubstr("\"memory_budget_fraction\": \"knee\""));
  EXPECT_TRUE(parse_config(c.to_json(), "<dump>").activation_checkpointing.memory_budget_knee);
  // From --set, as a bare word or quoted; a later number or null replaces it.
  for (const std::string knee : {"knee", "\"knee\""}) {
    c = parse("{}", {ac + "variant=auto", ac + "memory_budget_fraction=" + knee});
    EXPECT_TRUE(c.activation_checkpointing.memory_budget_knee) << knee;
  }
  c = parse("{}", {ac + "variant=auto", ac + "memory_budget_fraction=knee", ac + "memory_budget_fraction=0.4"});
  EXPECT_FALSE(c.activation_checkpointing.memory_budget_knee);
  EXPECT_EQ(c.activation_checkpointing.memory_budget_fraction, 0.4);
  c = parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "knee"}})",
            {ac + "memory_budget_fraction=null", ac + "memory_budget_bytes=1000"});
  EXPECT_FALSE(c.activation_checkpointing.memory_budget_knee);
  EXPECT_EQ(c.activation_checkpointing.memory_budget_bytes, 1000);
  // Other strings: the closest word, or what the key takes.
  auto msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "kne"}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.memory_budget_fraction' = \"kne\" is neither a number "
                             "nor \"knee\"; did you mean \"knee\"?"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "half"}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.memory_budget_fraction' must be number or \"knee\" or "
                             "null, got string \"half\""));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "auto"}})");
  });
  EXPECT_THAT(msg, HasSubstr("got string \"auto\" (\"auto\" is filled in by a launcher"));
  msg = config_error([&] { parse("{}", {ac + "variant=auto", ac + "memory_budget_fraction=Knee"}); });
  EXPECT_THAT(msg, HasSubstr("config error in --set activation_checkpointing.memory_budget_fraction=Knee: "));
  EXPECT_THAT(msg, HasSubstr("did you mean \"knee\"?"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": ["knee"]}})");
  });
  EXPECT_THAT(msg, HasSubstr("must be number or \"knee\" or null, got array"));
  // The knee is a budget like the others: exactly one, and only with auto.
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_fraction": "knee",
                                           "memory_budget_bytes": 10}})");
  });
  EXPECT_THAT(msg, HasSubstr("the budget is given once, keep exactly one of them"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "full", "memory_budget_fraction": "knee"}})");
  });
  EXPECT_THAT(msg, HasSubstr("'activation_checkpointing.memory_budget_fraction' is set but 'variant' is \"full\""));
  msg = config_error([] { parse(R"({"activation_checkpointing": {"variant": "auto"}})"); });
  EXPECT_THAT(msg, HasSubstr("or \"knee\" for the plan at the knee of the planner's frontier"));
}

TEST(Config, OverridesApplyWithValidation) {
  Config c = parse("{}", {"model.n_layer=8", "activation_checkpointing.variant=full",
                          "bf16.enabled=true", "zero_optimization.stage=3", "data.path=123",
                          "optimizer.params.betas=[0.8, 0.9]"});
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(checkpoint_variant_name(c.activation_checkpointing.variant), "full");
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_EQ(c.data.path, "123");  // a string key keeps what was typed
  EXPECT_EQ(c.optimizer.betas[0], 0.8);

  auto msg = config_error([] { parse("{}", {"model.n_layr=8"}); });
  EXPECT_THAT(msg, HasSubstr("--set model.n_layr=8: unknown key 'model.n_layr'; did you mean "
                             "'model.n_layer'?"));
  msg = config_error([] { parse("{}", {"model.n_layer=eight"}); });
  EXPECT_THAT(msg, HasSubstr("'model.n_layer' must be integer, got string \"eight\""));
  msg = config_error([] { parse("{}", {"model.n_layer.x=1"}); });
  EXPECT_THAT(msg, HasSubstr("'model.n_layer' is a integer, not a section"));
  msg = config_error([] { parse("{}", {"model.n_layer"}); });
  EXPECT_THAT(msg, HasSubstr("overrides are written key.path=value"));
}

TEST(Config, CrossFieldChecks) {
  EXPECT_THAT(config_error([] {
                parse(R"({"activation_checkpointing": {"contiguous_memory_optimization": true}})");
              }),
              HasSubstr("'activation_checkpointing.number_checkpoints' is not set"));
  EXPECT_THAT(config_error([] { parse(R"({"activation_checkpointing": {"every_k": 0}})"); }),
              HasSubstr("'activation_checkpointing.every_k' = 0 must be at least 1"));
  EXPECT_THAT(config_error([] { parse(R"({"activation_checkpointing": {"save_ops": ["mm"]}})"); }),
              HasSubstr("entry \"mm\" is not an operator name like \"aten::mm\""));
  EXPECT_THAT(config_error([] { parse(R"({"zero_optimization": {"stage": 4}})"); }),
              HasSubstr("'zero_optimization.stage' = 4 must be 0, 1, 2 or 3"));
  EXPECT_THAT(config_error([] { parse(R"({"tensor_parallel": {"size": 0}})"); }),
              HasSubstr("'tensor_parallel.size' = 0 must be at least 1"));
  EXPECT_THAT(config_error([] { parse(R"({"model": {"d_model": 100, "n_head": 3}})"); }),
              HasSubstr("'model.d_model' (100) must be divisible by 'model.n_head' (3)"));
  EXPECT_THAT(config_error([] { parse(R"({"train_batch_size": 0})"); }),
              HasSubstr("'train_batch_size' = 0 must be at least 1"));
  EXPECT_THAT(config_error([] {
                parse(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})");
              }),
              HasSubstr("scheduler WarmupDecayLR needs 'scheduler.params.total_num_steps' (DeepSpeed's "
                        "constructor requires it): give the run's optimizer steps, or \"auto\" (train.steps)"));
}

TEST(Config, BatchSizesAnyTwoDetermineTheThird) {
  auto batch = [](const std::string& text, int dp) { return parse(text).resolve_batch(dp); };
  BatchSizes b = batch(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 2);
  EXPECT_EQ(b.gradient_accumulation_steps, 4);
  b = batch(R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})", 4);
  EXPECT_EQ(b.micro_batch_per_gpu, 4);
  b = batch(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})", 3);
  EXPECT_EQ(b.train_batch_size, 18);
  b = batch(R"({"train_batch_size": 8})", 2);
  EXPECT_EQ(b.micro_batch_per_gpu, 4);
  EXPECT_EQ(b.gradient_accumulation_steps, 1);
  b = batch(R"({"train_micro_batch_size_per_gpu": 5})", 3);
  EXPECT_EQ(b.train_batch_size, 15);
  b = batch(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2})", 2);
  EXPECT_EQ(b.train_batch_size, 16);
}

TEST(Config, InconsistentBatchSizesShowTheArithmetic) {
  auto msg = config_error([] {
    parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2})").resolve_batch(2);
  });
  EXPECT_THAT(msg, HasSubstr("train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) "
                             "x gradient_accumulation_steps (2) x data-parallel size (2) = 16"));
  msg = config_error([] {
    parse(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})").resolve_batch(2);
  });
  EXPECT_THAT(msg, HasSubstr("train_batch_size (30) is not divisible by "
                             "train_micro_batch_size_per_gpu (4) x data-parallel size (2) = 8"));
  msg = config_error([] { parse(R"({"gradient_accumulation_steps": 2})").resolve_batch(1); });
  EXPECT_THAT(msg, HasSubstr("set train_batch_size or train_micro_batch_size_per_gpu"));
}

TEST(Config, UnreadableFileIsAnError) {
  EXPECT_THAT(config_error([] { load_config("/nonexistent/remat.json"); }),
              HasSubstr("cannot read '/nonexistent/remat.json'"));
}

TEST(Config, LoadsAFileAndNamesItInErrors) {
  std::string path = ::testing::TempDir() + "/remat_config_test.json";
  {
    std::ofstream out(path);
    out << R"({"model": {"n_layer": 2}})";
  }
  EXPECT_EQ(load_config(path).model.n_layer, 2);
  {
    std::ofstream out(path);
    out << R"({"modle": {}})";
  }
  EXPECT_THAT(config_error([&] { load_config(path); }),
              HasSubstr("config error in " + path + ": unknown key 'modle'; did you mean 'model'?"));
  std::remove(path.c_str());
}


// A DeepSpeed config as launchers write it: every problem in one error, each
// DeepSpeed key remat does not implement named with its reason, and no
// far-fetched suggestion (fp16 is not offered bf16).
TEST(Config, ARealDeepSpeedConfigListsEveryProblemInOneError) {
  const std::string ds = R"({
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "min_loss_scale": "auto"},
    "bf16": {"enabled": false},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "adam_w_mode": true}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "overlap_comm": true, "round_robin_gradients": true, "stage3_max_live_parameters": 1e9,
                          "zero_quantized_weights": true},
    "zero_allow_untested_optimizer": true,
    "zero_force_ds_cpu_optimizer": true,
    "gradient_clipping": 1.0,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": "auto",
    "wall_clock_breakdown": false,
    "flops_profiler": {"enabled": false, "profile_step": 1},
    "tensorboard": {"enabled": true},
    "my_own_key": 1
  })";
  const std::string msg = config_error([&] { parse(ds); });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: 6 problems (nothing was applied):"));
  for (const std::string& want : {
           // "auto" where remat cannot decide (it decides fp16.enabled and train_batch_size).
           std::string("'fp16.min_loss_scale' must be number, got string \"auto\""),
           std::string("recognised DeepSpeed key, not supported by remat: 'optimizer.params.adam_w_mode', because"),
           std::string("'zero_optimization.zero_quantized_weights' = true, because remat's collectives carry "
                       "unquantized values; remove it or set it to false, which asks for nothing"),
           std::string("'steps_per_print' must be integer, got string \"auto\" (\"auto\" is filled in by "
                       "a launcher"),
           std::string("recognised DeepSpeed key, not supported by remat: 'tensorboard'"),
           std::string("unknown key 'my_own_key'\n"),
           std::string("Valid keys at the top level: train_batch_size, "),
       }) {
    EXPECT_THAT(msg, HasSubstr(want)) << msg;
  }
  // wall_clock_breakdown is accepted, and so is a section switched off: not among the problems.
  EXPECT_EQ(msg.find("'wall_clock_breakdown'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'train_batch_size'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'fp16.enabled'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'flops_profiler'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("offload_optimizer"), std::string::npos) << "implemented (offload_test): " << msg;
  // Tuning keys remat honours or accepts (without effect) are not problems either.
  EXPECT_EQ(msg.find("stage3_max_live_parameters'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'zero_allow_untested_optimizer'"), std::string::npos) << msg;
  // Issue 49, item 12: round_robin_gradients (HF's ZeRO-2 file) and
  // zero_force_ds_cpu_optimizer (remat's offload steps its host Adam) are accepted.
  EXPECT_EQ(msg.find("round_robin_gradients"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'zero_force_ds_cpu_optimizer'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("overlap_comm'?"), std::string::npos) << msg;
}

TEST(Config, ASuggestionIsMadeOnlyWhenReallyClose) {
  // Close: a typo, a swapped pair, a different case, a prefix.
  EXPECT_THAT(config_error([] { parse(R"({"wall_clock_breakdwn": true})"); }),
              HasSubstr("unknown key 'wall_clock_breakdwn'; did you mean 'wall_clock_breakdown'?"));
  EXPECT_THAT(config_error([] { parse(R"({"zero_optimisation": {}})"); }),
              HasSubstr("did you mean 'zero_optimization'?"));
  EXPECT_THAT(config_error([] { parse(R"({"optimizer": {"type": "sgd"}})"); }),
              HasSubstr("did you mean \"SGD\"?"));
  EXPECT_THAT(config_error([] { parse(R"({"zero_optimization": {"stag": 1}})"); }),
              HasSubstr("unknown key 'zero_optimization.stag'; did you mean 'zero_optimization.stage'?"));
  // Far: no suggestion, the valid keys instead.
  for (const char* text : {R"({"fp32": {}})", R"({"wallclock": true})", R"({"zero_optimization": {"shards": 1}})",
                           R"({"lr": 0.1})", R"({"optimizer": {"type": "Lamb"}})"}) {
    const std::string msg = config_error([&] { parse(text); });
    EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
    EXPECT_THAT(msg, ::testing::AnyOf(HasSubstr("Valid keys"), HasSubstr("is not one of AdamW, Adam, SGD"))) << msg;
  }
  EXPECT_THAT(config_error([] { parse(R"({"fp32": {}})"); }),
              HasSubstr("unknown key 'fp32'. Valid keys at the top level: "));
  // Recognised keys that remat refuses are neither suggested nor listed as valid.
  const std::string msg = config_error([] { parse(R"({"zero_optimization": {"offload": 1}})"); });
  EXPECT_THAT(msg, HasSubstr("Valid keys in 'zero_optimization': stage, "));
  EXPECT_THAT(msg, HasSubstr("did you mean 'zero_optimization.offload_"));
  EXPECT_EQ(msg.find("zero_quantized_weights"), std::string::npos) << msg;
}

TEST(Config, DeepSpeedKeysAreRecognisedInEverySectionAndThroughSet) {
  for (const char* key : {"amp", "torch_autocast", "flops_profiler", "tensorboard", "wandb",
                          "csv_monitor", "comms_logger", "autotuning", "elasticity", "data_efficiency",
                          "compression_training", "sparse_attention", "curriculum_learning", "pipeline",
                          "sparse_gradients", "dump_state", "memory_breakdown", "checkpoint"}) {
    const std::string msg = config_error([&] { parse(str("{\"", key, "\": {}}")); });
    EXPECT_THAT(msg, HasSubstr(str("recognised DeepSpeed key, not supported by remat: '", key, "'"))) << key;
    EXPECT_THAT(msg, HasSubstr(", because ")) << key;
  }
  for (const char* key : {"zero_hpz_partition_size", "zero_quantized_weights",
                          "zero_quantized_gradients", "elastic_checkpoint", "ignore_unused_parameters",
                          "load_from_fp32_weights", "mics_shard_size"}) {
    const std::string msg = config_error([&] { parse(str(R"({"zero_optimization": {")", key, "\": 2}}")); });
    EXPECT_THAT(msg, HasSubstr(str("recognised DeepSpeed key, not supported by remat: 'zero_optimization.", key,
                                   "' = 2, because ")))
        << key;
    EXPECT_THAT(msg, HasSubstr("; remove it")) << key;
  }
  EXPECT_THAT(config_error([] { parse("{}", {"amp.enabled=true"}); }),
              HasSubstr("config error in --set amp.enabled=true: recognised DeepSpeed key, not supported by "
                        "remat: 'amp', because"));
  EXPECT_THAT(config_error([] { parse("{}", {"zero_optimization.zero_quantized_weights={\"x\": 1}"}); }),
              HasSubstr("'zero_optimization.zero_quantized_weights' = {\"x\":1}, because remat's collectives carry "
                        "unquantized"));
  // The dump holds remat's keys only.
  EXPECT_EQ(parse("{}").to_json().find("\"amp\""), std::string::npos);
}

TEST(Config, WallClockBreakdownIsAccepted) {
  EXPECT_FALSE(parse("{}").wall_clock_breakdown);
  Config c = parse(R"({"wall_clock_breakdown": true})");
  EXPECT_TRUE(c.wall_clock_breakdown);
  EXPECT_TRUE(parse_config(c.to_json(), "<dump>").wall_clock_breakdown);
  EXPECT_TRUE(parse("{}", {"wall_clock_breakdown=true"}).wall_clock_breakdown);
  EXPECT_THAT(config_error([] { parse(R"({"wall_clock_breakdown": 1})"); }),
              HasSubstr("'wall_clock_breakdown' must be boolean, got integer 1"));
}

// remat-train passes --steps and --seed as the overrides train.steps=... and
// train.seed=...: an error in such a value names the override, not the file
// (or "<embedded default>") the rest came from.
TEST(Config, AnErrorInAnOverriddenValueNamesTheOverride) {
  auto embedded = [](std::vector<std::string> overrides) {
    return config_error([&] { parse_config(default_config_text(), "<embedded default>", overrides); });
  };
  std::string msg = embedded({"train.steps=abc"});
  EXPECT_THAT(msg, HasSubstr("config error in --set train.steps=abc: 'train.steps' must be integer"));
  msg = embedded({"train.steps=-5"});
  EXPECT_THAT(msg, HasSubstr("config error in --set train.steps=-5: 'train.steps' = -5 must be >= 0"));
  EXPECT_EQ(msg.find("<embedded default>"), std::string::npos) << msg;
  msg = embedded({"model.n_layer=8", "train.seed=-1"});
  EXPECT_THAT(msg, HasSubstr("config error in --set train.seed=-1: 'train.seed' = -1 must be >= 0"));
  msg = embedded({"optimizer.params.lr=0"});
  EXPECT_THAT(msg, HasSubstr("config error in --set optimizer.params.lr=0: 'optimizer.params.lr' = 0"));
  // A rule over several keys names the overrides among them.
  msg = config_error([] { parse(R"({"model": {"d_model": 100, "n_head": 4}})", {"model.n_head=3"}); });
  EXPECT_THAT(msg, HasSubstr("config error in --set model.n_head=3: 'model.d_model' (100) must be divisible"));
  msg = config_error([] { parse("{}", {"model.n_head=3", "model.d_model=100"}); });
  EXPECT_THAT(msg, HasSubstr("config error in --set model.n_head=3 and --set model.d_model=100: "));
  // A section given whole, and a rule on a section.
  msg = config_error([] { parse("{}", {R"(model={"n_layr": 2})"}); });
  EXPECT_THAT(msg, HasSubstr(R"(config error in --set model={"n_layr": 2}: unknown key 'model.n_layr')"));
  msg = config_error([] { parse("{}", {R"(model={"n_layer": 0})"}); });
  EXPECT_THAT(msg, HasSubstr(R"(config error in --set model={"n_layer": 0}: 'model.n_layer' = 0)"));
  msg = config_error([] { parse("{}", {"activation_checkpointing.variant=auto"}); });
  EXPECT_THAT(msg, HasSubstr("config error in --set activation_checkpointing.variant=auto: "));
  // What the file broke still names the file, overrides or not.
  msg = config_error([] { parse(R"({"train": {"steps": -1}})", {"model.n_layer=2"}); });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: 'train.steps' = -1 must be >= 0"));
}

// Deep nesting is refused before anything recurses over it (a 100 000-deep
// value in a file or a 60 000-deep one through --set crashed the parser's
// callers), and messages quote a short prefix of long values.
TEST(ConfigHardening, DeepNestingIsAnErrorNotACrash) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_THAT(config_error([&] { parse(R"({"model": {"n_layer": )" + deep + "}}"); }),
              HasSubstr("nested deeper than 16 levels"));
  const std::string set_deep = std::string(60000, '[') + std::string(60000, ']');
  EXPECT_THAT(config_error([&] { parse("{}", {"model.n_layer=" + set_deep}); }),
              HasSubstr("nested deeper than 16 levels"));
  // Sixteen levels are fine where the schema allows a value (here a wrong type).
  EXPECT_THAT(config_error([&] { parse(R"({"model": {"n_layer": [[[1]]]}})"); }),
              HasSubstr("'model.n_layer' must be integer, got array [[[1]]]"));
}

TEST(ConfigHardening, LongValuesAreQuotedShort) {
  const std::string huge(5 << 20, 'x');
  for (const std::string& message :
       {config_error([&] { parse(R"({"model": {"n_layer": ")" + huge + R"("}})"); }),
        config_error([&] { parse(R"({"activation_checkpointing": {"variant": ")" + huge + R"("}})"); }),
        config_error([&] { parse("{\"" + huge + "\": 1}"); }),
        config_error([&] { parse("{}", {"model." + huge + "=1"}); })}) {
    EXPECT_LT(message.size(), 1000u) << message.substr(0, 200);
    EXPECT_THAT(message, HasSubstr("(5242880 characters)"));
  }
}

TEST(ConfigHardening, OutOfRangeNumbersAreNamedBeforeAnyConversion) {
  // int fields: the range of int, whatever the spelling.
  EXPECT_THAT(config_error([] { parse(R"({"model": {"n_layer": 5e9}})"); }),
              HasSubstr("'model.n_layer' = 5000000000.0 is out of range: it must be an integer from "
                        "-2147483648 to 2147483647"));
  EXPECT_THAT(config_error([] { parse("{}", {"model.n_layer=5000000000"}); }),
              HasSubstr("'model.n_layer' = 5000000000 is out of range"));
  EXPECT_THAT(config_error([] { parse("{}", {"train.steps=99999999999999999999"}); }),
              HasSubstr("'train.steps' = 99999999999999999999 is out of range"));
  EXPECT_THAT(config_error([] { parse("{}", {"train.seed=-1e300"}); }),
              HasSubstr("'train.seed' = -1e300 is out of range"));
  // 1e999 is beyond a double: named with its key, in a file and through --set.
  EXPECT_THAT(config_error([] { parse(R"({"optimizer": {"params": {"lr": 1e999}}})"); }),
              HasSubstr("config error in test.json: 'optimizer.params.lr' holds a number beyond what a "
                        "double holds (about 1.8e308): '1e999'"));
  EXPECT_THAT(config_error([] { parse("{}", {"model.dropout=-1e999"}); }),
              HasSubstr("'model.dropout' holds a number beyond what a double holds"));
  EXPECT_THAT(config_error([] { parse("{}", {"optimizer.params.betas=[0.9, 1e999]"}); }),
              HasSubstr("'optimizer.params.betas' holds a number beyond"));
  // Integral doubles still count (DeepSpeed writes 5e8).
  EXPECT_EQ(parse(R"({"zero_optimization": {"reduce_bucket_size": 5e8}})").zero_optimization.reduce_bucket_size,
            500000000);
}

TEST(ConfigHardening, NulBytesAreAnError) {
  const std::string text = std::string("{\"model\": {\"n_layer\": 2}}\n") + '\0' + "{\"junk\": 1}";
  EXPECT_THAT(config_error([&] { parse(text); }), HasSubstr("a NUL byte at line 2 (byte 26)"));
}

// DeepSpeed's stage 1 and 2 keys, and hybrid sharding.
TEST(Config, ReadsZeroStage12AndHybridKeys) {
  Config c = parse(R"({"zero_optimization": {"stage": 2, "reduce_scatter": false, "overlap_comm": true,
    "contiguous_gradients": false, "reduce_bucket_size": 2e5, "allgather_bucket_size": 3e5,
    "allgather_partitions": false, "hybrid_shard_size": 4}})");
  const auto& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 2);
  EXPECT_FALSE(z.reduce_scatter);
  EXPECT_TRUE(z.overlap_comm);
  EXPECT_FALSE(z.contiguous_gradients);
  EXPECT_EQ(z.reduce_bucket_size, 200000);
  EXPECT_EQ(z.allgather_bucket_size, 300000);
  EXPECT_FALSE(z.allgather_partitions);
  EXPECT_EQ(z.hybrid_shard_size, 4);
  const Config d = parse("{}");
  EXPECT_TRUE(d.zero_optimization.reduce_scatter);
  EXPECT_TRUE(d.zero_optimization.allgather_partitions);
  EXPECT_EQ(d.zero_optimization.hybrid_shard_size, 0);
}

// bf16 at every stage (issue 41): DeepSpeed's communication_data_type and
// data_types.grad_accum_dtype go with the bf16 options; bf16 reduces in bf16
// by default, as DeepSpeed; gradients accumulate in fp32 only.
TEST(Config, ReadsBf16AtEveryStageWithItsGradientDtypes) {
  for (int stage : {0, 1, 2, 3}) {
    const Config c = parse(str(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": )", stage, "}}"));
    EXPECT_TRUE(c.bf16.enabled);
    EXPECT_TRUE(c.bf16.reduces_in_bf16()) << "DeepSpeed's default under bf16";
  }
  const Config fp32_reduce = parse(R"({"bf16": {"enabled": true}, "communication_data_type": "fp32",
    "data_types": {"grad_accum_dtype": "fp32"}})");
  EXPECT_EQ(fp32_reduce.bf16.reduce_dtype, parallel::ReduceDtype::kFp32);
  EXPECT_FALSE(fp32_reduce.bf16.reduces_in_bf16());
  EXPECT_FALSE(parse("{}").bf16.reduces_in_bf16());
  EXPECT_THAT(config_error([] { parse(R"({"communication_data_type": "bf16"})"); }),
              HasSubstr("communication_data_type \"bf16\" reduces gradients in bf16, but bf16.enabled is false"));
  EXPECT_THAT(config_error([] { parse(R"({"communication_data_type": "fp16"})"); }),
              HasSubstr("communication_data_type"));
  EXPECT_THAT(config_error([] { parse(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}})"); }),
              HasSubstr("data_types.grad_accum_dtype"));
  // The effective configuration shows them.
  EXPECT_THAT(fp32_reduce.to_json(), HasSubstr("\"communication_data_type\": \"fp32\""));
}

TEST(ConfigHardening, RangesOfOptimizerSchedulerAndZeroKeys) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"scheduler.type=WarmupLR", ""},  // valid alone
      {"optimizer.params.betas=[0.9, 1.0]", "'optimizer.params.betas' [0.9, 1]: beta2 must be in [0, 1)"},
      {"optimizer.params.betas=[-0.1, 0.9]", "beta1 must be in [0, 1)"},
      {"optimizer.params.eps=0", "'optimizer.params.eps' = 0 must be > 0"},
      {"optimizer.params.weight_decay=-0.1", "'optimizer.params.weight_decay' = -0.1 must be >= 0"},
      {"optimizer.params.momentum=-1", "'optimizer.params.momentum' = -1 must be >= 0"},
      {"optimizer.params.nesterov=true", "'optimizer.params.nesterov' applies to SGD only"},
      {"zero_optimization.reduce_bucket_size=0", "'zero_optimization.reduce_bucket_size' = 0 must be at least 1"},
      {"zero_optimization.stage3_prefetch_bucket_size=-1", "must be >= 0 (0 turns prefetching off)"},
      {"zero_optimization.stage3_param_persistence_threshold=-5",
       "'zero_optimization.stage3_param_persistence_threshold' = -5 must be >= 0"},
      {"zero_optimization.allgather_bucket_size=0", "'zero_optimization.allgather_bucket_size' = 0 must be at least 1"},
      {"zero_optimization.hybrid_shard_size=-2", "'zero_optimization.hybrid_shard_size' = -2 must be >= 0"},
      {"zero_optimization.hybrid_shard_size=2",
       "shards within groups, but stage 0 shards nothing: set zero_optimization.stage to 1, 2 or 3"},
      {"zero_optimization.reduce_scatter=1", "'zero_optimization.reduce_scatter'"},
  };
  for (const auto& [set, want] : cases) {
    if (want.empty()) {
      EXPECT_NO_THROW(parse("{}", {set})) << set;
    } else {
      EXPECT_THAT(config_error([&] { parse("{}", {set}); }), HasSubstr(want)) << set;
    }
  }
  EXPECT_THAT(config_error([] { parse("{}", {"optimizer.type=SGD", "optimizer.params.nesterov=true"}); }),
              HasSubstr("'optimizer.params.nesterov' needs 'optimizer.params.momentum' > 0"));
  EXPECT_NO_THROW(parse("{}", {"optimizer.type=SGD", "optimizer.params.nesterov=true", "optimizer.params.momentum=0.9"}));
  EXPECT_THAT(config_error([] { parse("{}", {"scheduler.type=WarmupLR", "scheduler.params.warmup_max_lr=-0.01"}); }),
              HasSubstr("'scheduler.params.warmup_max_lr' = -0.01 must be > 0"));
  EXPECT_THAT(config_error([] { parse("{}", {"scheduler.type=WarmupLR", "scheduler.params.warmup_min_lr=-1"}); }),
              HasSubstr("'scheduler.params.warmup_min_lr' = -1 must be >= 0"));
  EXPECT_THAT(config_error([] { parse("{}", {"train.on_nonfinite=ignore"}); }),
              HasSubstr("'train.on_nonfinite' = \"ignore\" is not one of stop, skip"));
}

TEST(ConfigHardening, ADirectoryAsConfigIsNamed) {
  EXPECT_THAT(config_error([] { load_config(::testing::TempDir()); }),
              HasSubstr("is a directory; give --config a JSON file"));
}

// Mutated configs and overrides through the parser: each ends in a Config
// or a ConfigError, never a crash or another exception. A fixed seed, so a
// failure names an input that reproduces; bounded by count and by time.
TEST(ConfigFuzz, EveryMutationEndsInAConfigOrAConfigError) {
  std::mt19937 rng(20261123);
  const std::string base = default_config_text();
  const std::vector<std::string> tokens = {"{", "}", "[", "]", ",", ":", "\"", "null", "true", "-",
                                           "1e999", "5e9", "-0", "0.5", "\"x\"", "\\u0000", "1",
                                           "{\"a\":1}", "[1,2]", "\"model\"", "\"n_layer\"", "\n"};
  const std::vector<std::string> keys = {
      "model.n_layer", "model.dropout", "train.steps", "train.seed", "optimizer.betas",
      "optimizer.type", "optimizer.lr", "activation_checkpointing.variant",
      "activation_checkpointing.every_k", "activation_checkpointing.save_ops",
      "activation_checkpointing.number_checkpoints", "zero_optimization.stage", "data.path",
      "train_batch_size", "scheduler.params", "model", "nope.key", "model.n_layer.x", ""};
  const std::vector<std::string> values = {
      "1", "-1", "0", "1e999", "-1e999", "5e9", "1.5", "\"s\"", "null", "[]", "[1, 2]", "[\"aten::mm\"]",
      "{}", "{\"a\": 1}", "true", "99999999999999999999", "-9223372036854775809", "[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]",
      "SGD", "full", "", "=", "0x10", "NaN"};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int outcomes[2] = {0, 0};
  int n = 0;
  for (; n < 20000 && std::chrono::steady_clock::now() < deadline; ++n) {
    std::string text = base;
    std::vector<std::string> overrides;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % (text.size() + 1);
      switch (rng() % 4) {
        case 0: if (at < text.size()) text.erase(at, 1 + rng() % 8); break;
        case 1: text.insert(at, tokens[rng() % tokens.size()]); break;
        case 2: if (at < text.size()) text[at] = static_cast<char>(rng() % 256); break;
        default: overrides.push_back(keys[rng() % keys.size()] + "=" + values[rng() % values.size()]);
      }
    }
    try {
      parse_config(text, "fuzz", overrides);
      outcomes[0]++;
    } catch (const ConfigError&) {
      outcomes[1]++;
    } catch (const std::exception& e) {
      std::string sets;
      for (const auto& o : overrides) sets += " --set " + o;
      ADD_FAILURE() << "case " << n << " threw " << typeid(e).name() << ": " << e.what()
                    << "\noverrides:" << sets << "\ntext:\n" << text;
      break;
    }
  }
  std::printf("config fuzz: %d cases, %d parsed, %d ConfigError\n", n, outcomes[0], outcomes[1]);
  EXPECT_GE(n, 1000) << "too few cases ran in the time allowed";
  EXPECT_GT(outcomes[0], 0);
  EXPECT_GT(outcomes[1], 0);
}

}  // namespace

// A copied ds_config writes features off with {"enabled": false} (and
// offloads with {"device": "none"}): those sections ask for nothing and load;
// switched on, or left to a launcher ("auto"), they are refused.
TEST(Config, DeepSpeedSectionsSwitchedOffAreAccepted) {
  const Config c = parse(R"({
    "amp": {"enabled": false, "opt_level": "O1"},
    "wandb": {"enabled": false, "project": "x"},
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"},
                          "offload_param": {"device": "none", "pin_memory": true}},
    "train_micro_batch_size_per_gpu": 4
  })");
  EXPECT_EQ(c.zero_optimization.stage, 1);
  EXPECT_EQ(*c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.to_json().find("\"amp\""), std::string::npos) << "ignored, not dumped";
  for (const char* on : {R"({"amp": {"enabled": true}})", R"({"amp": {"enabled": "auto"}})",
                                R"({"amp": {"opt_level": "O1"}})"}) {
    EXPECT_THAT(config_error([&] { parse(on); }), HasSubstr("recognised DeepSpeed key, not supported by remat"))
        << on;
  }
}

// Issue 38, item 15: out-of-range values were reported one per run. Every
// broken rule is now listed in one error, each with its source.
TEST(ConfigMessages, EveryOutOfRangeValueIsListedInOneError) {
  const std::string msg = config_error([] {
    parse(R"({"gradient_clipping": -1, "optimizer": {"params": {"lr": 0}}, "model": {"n_layer": 0},
              "train": {"steps": -1}, "data": {"train_fraction": 2},
              "zero_optimization": {"stage": 4, "reduce_bucket_size": 0}})");
  });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: 7 problems (nothing was applied):"));
  for (const char* problem :
       {"\n  - 'gradient_clipping' = -1 must be >= 0", "\n  - 'optimizer.params.lr' = 0 must be > 0",
        "\n  - 'model.n_layer' = 0 must be at least 1", "\n  - 'train.steps' = -1 must be >= 0",
        "\n  - 'data.train_fraction' = 2 must be in (0, 1)", "\n  - 'zero_optimization.stage' = 4 must be 0, 1, 2 or 3",
        "\n  - 'zero_optimization.reduce_bucket_size' = 0 must be at least 1"}) {
    EXPECT_THAT(msg, HasSubstr(problem));
  }
  // From the file and from overrides: each names its source.
  const std::string mixed = config_error([] { parse(R"({"train": {"steps": -1}})", {"model.dropout=1.5"}); });
  EXPECT_THAT(mixed, HasSubstr("config error: 2 problems (nothing was applied):\n  - in --set model.dropout=1.5: "
                               "'model.dropout' = 1.5 must be in [0, 1)"));
  EXPECT_THAT(mixed, HasSubstr("\n  - in test.json: 'train.steps' = -1 must be >= 0"));
  // Two rules of one library's section: each names the override that broke it.
  const std::string section = config_error([] { parse("{}", {"model.n_head=0", "model.dropout=-1"}); });
  EXPECT_THAT(section, HasSubstr("\n  - in --set model.n_head=0: 'model.n_head' = 0 must be at least 1"));
  EXPECT_THAT(section, HasSubstr("\n  - in --set model.dropout=-1: 'model.dropout' = -1 must be in [0, 1)"));
  // Overrides of the wrong type: every one is named.
  const std::string typed = config_error([] { parse("{}", {"model.n_layer=x", "train.steps=y"}); });
  EXPECT_THAT(typed, HasSubstr("config error: 2 problems (nothing was applied):\n  - in --set model.n_layer=x: "
                               "'model.n_layer' must be integer, got string \"x\""));
  EXPECT_THAT(typed, HasSubstr("\n  - in --set train.steps=y: 'train.steps' must be integer"));
  // A zero head count is named once, with no division by it.
  EXPECT_THAT(config_error([] { parse(R"({"model": {"n_head": 0}})"); }),
              ::testing::AllOf(HasSubstr("config error in test.json: 'model.n_head' = 0 must be at least 1"),
                               ::testing::Not(HasSubstr("divisible"))));
}

// Item 16: an override is quoted whole (it was cut at 60 characters,
// 100000000 reading as "10000000..."), and null is named once.
TEST(ConfigMessages, AnOverrideIsQuotedWholeAndNullOnce) {
  const std::string set = "activation_checkpointing.device_memory_budget_bytes=100000000";
  const std::string msg = config_error([&] { parse("{}", {set}); });
  EXPECT_THAT(msg, HasSubstr("config error in --set " + set + ": 'activation_checkpointing."
                             "device_memory_budget_bytes' is set but 'variant' is \"none\""));
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("...")));
  const std::string null = config_error([] { parse("{}", {"model.n_layer=null"}); });
  EXPECT_THAT(null, HasSubstr("'model.n_layer' must be integer, got null (leave the key out to keep its default)"));
  EXPECT_THAT(null, ::testing::Not(HasSubstr("null null")));
  EXPECT_THAT(config_error([] { parse(R"({"optimizer": {"params": {"lr": null}}})"); }),
              HasSubstr("'optimizer.params.lr' must be number, got null (leave the key out"));
}

// Item 16: DeepSpeed-Ulysses' long-sequence keys, as each DeepSpeed version
// spells them, are recognised and point to remat's sequence parallelism.
TEST(ConfigMessages, LongSequenceKeysOfEveryDeepSpeedVersionGetAHint) {
  for (const char* key : {"sequence_parallel_size", "seq_parallel_communication_data_type",
                          "seq_parallel_comm_data_type"}) {
    const std::string msg = config_error([&] { parse(str("{\"", key, "\": 2}")); });
    EXPECT_THAT(msg, HasSubstr(str("recognised DeepSpeed key, not supported by remat: '", key, "'"))) << key;
    EXPECT_THAT(msg, HasSubstr(", because it ")) << key;
    EXPECT_THAT(msg, HasSubstr("remat's sequence parallelism")) << key;
    EXPECT_THAT(msg, HasSubstr("(or set tensor_parallel.size to the ranks that split a sequence and "
                               "tensor_parallel.sequence_parallel to true)")) << key;
  }
  EXPECT_THAT(config_error([] { parse(R"({"sequence_parallel_size": 2, "data_parallel_size": 2})"); }),
              HasSubstr("'data_parallel_size', because remat derives the data-parallel size: the world size / "
                        "tensor_parallel.size"));
}

// Item 17: a key path with an empty part was read without it
// (model.n_layer.=2 set model.n_layer).
TEST(ConfigMessages, AKeyPathWithAnEmptyPartIsRefused) {
  for (const char* set : {"model.n_layer.=2", ".model.n_layer=2", "model..n_layer=2"}) {
    EXPECT_THAT(config_error([&] { parse("{}", {set}); }),
                HasSubstr("has an empty key part (a leading, trailing or doubled '.')")) << set;
  }
  EXPECT_THAT(config_error([] { parse("{}", {"model.n_layer.=2"}); }),
              HasSubstr("config error in --set model.n_layer.=2: 'model.n_layer.' has an empty key part"));
}

// Item 17: a section given whole through --set was put in place of the
// file's (model={"n_layer": 2} reset d_model to 128); it is merged into it.
TEST(ConfigMessages, ASectionGivenWholeIsMergedIntoTheFilesSection) {
  const Config c = parse(R"({"model": {"d_model": 64, "n_head": 4, "n_layer": 6},
                             "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "weight_decay": 0.1}}})",
                         {R"(model={"n_layer": 2})", R"(optimizer={"type": "SGD", "params": {"momentum": 0.9}})"});
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.model.n_head, 4);
  EXPECT_EQ(c.optimizer.type, "SGD");
  EXPECT_EQ(c.optimizer.lr, 0.5);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.optimizer.momentum, 0.9);
  // A section the file leaves out starts from the defaults, as before.
  EXPECT_EQ(parse("{}", {R"(model={"n_layer": 3})"}).model.d_model, models::ModelShape{}.d_model);
  // Its keys are checked as before.
  EXPECT_THAT(config_error([] { parse(R"({"model": {"d_model": 64}})", {R"(model={"n_layr": 2})"}); }),
              HasSubstr("unknown key 'model.n_layr'"));
}

// Item 17: sequence_parallel_dropout where it has no effect is pointed out.
TEST(ConfigMessages, SequenceParallelDropoutWithoutEffectIsWarned) {
  auto warnings = [](std::vector<std::string> overrides) {
    std::string all;
    for (const auto& w : ineffective_settings(parse_config("{}", "test.json", overrides))) all += w + "\n";
    return all;
  };
  const std::string replicated = "tensor_parallel.sequence_parallel_dropout=replicated";
  const std::string sp = "tensor_parallel.sequence_parallel=true";
  EXPECT_THAT(warnings({replicated}),
              HasSubstr("tensor_parallel.sequence_parallel_dropout is \"replicated\" but sequence parallelism is "
                        "off: it only chooses where the dropouts of a split sequence draw"));
  EXPECT_THAT(warnings({replicated, sp}), HasSubstr("sequence parallelism is over one rank (tensor_parallel.size 1)"));
  EXPECT_THAT(warnings({replicated, sp, "tensor_parallel.size=2", "model.dropout=0"}),
              HasSubstr("tensor_parallel.sequence_parallel_dropout is \"replicated\" but model.dropout is 0"));
  EXPECT_EQ(warnings({replicated, sp, "tensor_parallel.size=2", "model.dropout=0.1"}), "");
  EXPECT_EQ(warnings({}), "");
}

}  // namespace remat

namespace remat {
namespace {

std::string warnings_of(const std::string& text) {
  std::string all;
  for (const auto& w : ineffective_settings(parse(text))) all += w + "\n";
  return all;
}

// Issue 41, item 4: DeepSpeed's tuning keys. Those that cannot change what
// remat computes are accepted, each with one line saying why it has no effect.
TEST(ConfigTuningKeys, KeysWithoutEffectAreAcceptedAndSaidToBe) {
  EXPECT_EQ(warnings_of("{}"), "");
  const Config c = parse(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e9,
                                                   "stage3_max_reuse_distance": 1e9},
                             "zero_allow_untested_optimizer": true})");
  EXPECT_EQ(*c.deepspeed_tuning.sub_group_size, 1000000000);
  EXPECT_EQ(*c.deepspeed_tuning.max_reuse_distance, 1000000000);
  EXPECT_TRUE(*c.deepspeed_tuning.allow_untested_optimizer);
  const std::vector<std::string> lines = ineffective_settings(c);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_THAT(lines[0], HasSubstr("zero_optimization.sub_group_size = 1000000000 has no effect in remat: remat "
                                  "steps each optimizer shard in one piece"));
  EXPECT_THAT(lines[1], HasSubstr("zero_optimization.stage3_max_reuse_distance = 1000000000 has no effect in "
                                  "remat"));
  EXPECT_THAT(lines[2], HasSubstr("zero_allow_untested_optimizer = true has no effect in remat: remat's ZeRO "
                                  "runs remat's own optimizers"));
  EXPECT_THAT(warnings_of(R"({"zero_allow_untested_optimizer": false})"),
              HasSubstr("zero_allow_untested_optimizer = false has no effect"));
  EXPECT_THAT(warnings_of(R"({"zero_optimization": {"max_reuse_distance": 7}})"),
              HasSubstr("stage3_max_reuse_distance = 7 has no effect"));
  // They survive the dump (the effective configuration) and --set.
  const Config again = parse_config(c.to_json(), "<dump>");
  EXPECT_EQ(*again.deepspeed_tuning.sub_group_size, 1000000000);
  EXPECT_TRUE(*again.deepspeed_tuning.allow_untested_optimizer);
  EXPECT_EQ(*parse("{}", {"zero_optimization.sub_group_size=5"}).deepspeed_tuning.sub_group_size, 5);
  EXPECT_THAT(config_error([] { parse(R"({"zero_optimization": {"sub_group_size": "big"}})"); }),
              HasSubstr("'zero_optimization.sub_group_size' must be integer or null, got string"));
}

// "auto" misspelt where remat decides the key: named with the right spelling;
// on a key remat does not decide, no such hint.
TEST(Config, AMisspeltAutoIsNamed) {
  for (const char* text : {R"({"train_micro_batch_size_per_gpu": "Auto"})", R"({"gradient_clipping": " AUTO"})"}) {
    EXPECT_THAT(config_error([&] { parse(text); }), HasSubstr("; did you mean \"auto\" (remat decides it)?"))
        << text;
  }
  EXPECT_THAT(config_error([] { parse("{}", {"train_micro_batch_size_per_gpu=Auto"}); }),
              HasSubstr("did you mean \"auto\""));
  EXPECT_EQ(config_error([] { parse(R"({"steps_per_print": "Auto"})"); }).find("did you mean"), std::string::npos);
}

// train_batch_size "auto" with no micro-batch: named as what is missing.
TEST(Config, AnAutoTrainBatchSizeWithoutAMicroBatchNamesIt) {
  const Config c = parse(R"({"train_batch_size": "auto"})");
  EXPECT_THAT(config_error([&] { c.resolve_batch(2); }),
              HasSubstr("train_batch_size is \"auto\", which remat derives from train_micro_batch_size_per_gpu, "
                        "and that is not set"));
  EXPECT_THAT(config_error([] { parse("{}").resolve_batch(2); }),
              HasSubstr("set train_batch_size or train_micro_batch_size_per_gpu (or both)"));
}

// Keys set to what remat always does (DeepSpeed-Chat's configs write them) are
// accepted, each said to have no effect; a value that would change how
// gradients are averaged is refused, naming the value to write.
TEST(ConfigTuningKeys, KeysAskingForWhatRematDoesAreAccepted) {
  const std::string chat = R"({"prescale_gradients": false, "gradient_predivide_factor": 1.0,
                               "zero_optimization": {"stage": 3, "memory_efficient_linear": false}})";
  const std::vector<std::string> lines = ineffective_settings(parse(chat));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_THAT(lines[0], HasSubstr("prescale_gradients = false has no effect in remat"));
  EXPECT_THAT(lines[1], HasSubstr("gradient_predivide_factor = 1.0 has no effect in remat"));
  EXPECT_THAT(lines[2], HasSubstr("zero_optimization.memory_efficient_linear = false has no effect in remat"));
  EXPECT_THAT(warnings_of(R"({"zero_optimization": {"memory_efficient_linear": true}})"),
              HasSubstr("memory_efficient_linear = true has no effect"));
  EXPECT_THAT(config_error([] { parse(R"({"prescale_gradients": true})"); }),
              HasSubstr("'prescale_gradients' is true, which divides gradients before their sum"));
  EXPECT_THAT(config_error([] { parse(R"({"gradient_predivide_factor": 2.0})"); }),
              HasSubstr("'gradient_predivide_factor' = 2 divides gradients by it before their sum"));
  // The old pinning switch, false, asks for no pinning (not for no offload).
  EXPECT_THAT(warnings_of(R"({"zero_optimization": {"cpu_offload_use_pin_memory": false}})"),
              HasSubstr("asks for no pinned host memory; write pin_memory in"));
  EXPECT_THAT(warnings_of(R"({"zero_optimization": {"cpu_offload": false}})"),
              HasSubstr("asks for no offload; write zero_optimization.offload_optimizer to ask for an offload"));
}


// stage3_max_live_parameters (and max_live_parameters) is ZeRO's cap on what
// a prefetch may gather (parallel/zero_options.h).
TEST(ConfigTuningKeys, MaxLiveParametersReachesZerosOptions) {
  EXPECT_EQ(parse("{}").zero_optimization.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(parse(R"({"zero_optimization": {"stage3_max_live_parameters": 3e6}})")
                .zero_optimization.stage3_max_live_parameters, 3000000);
  EXPECT_EQ(parse(R"({"zero_optimization": {"max_live_parameters": 12}})").zero_optimization.stage3_max_live_parameters,
            12);
  EXPECT_EQ(parse("{}", {"zero_optimization.stage3_max_live_parameters=0"}).zero_optimization.stage3_max_live_parameters,
            0);
  EXPECT_EQ(warnings_of(R"({"zero_optimization": {"stage3_max_live_parameters": 5}})"), "");
  EXPECT_THAT(config_error([] { parse(R"({"zero_optimization": {"stage3_max_live_parameters": -1}})"); }),
              HasSubstr("'zero_optimization.stage3_max_live_parameters' = -1 must be >= 0"));
}

// The old offload switches: false asks for nothing; true names the current key.
TEST(ConfigTuningKeys, OldOffloadSwitchesFalseAreAcceptedTrueRefused) {
  const Config c = parse(R"({"zero_optimization": {"cpu_offload": false, "cpu_offload_param": false,
                                                   "cpu_offload_use_pin_memory": false}})");
  EXPECT_FALSE(*c.deepspeed_tuning.cpu_offload);
  const std::string lines = warnings_of(R"({"zero_optimization": {"cpu_offload": false, "cpu_offload_param": false}})");
  EXPECT_THAT(lines, HasSubstr("zero_optimization.cpu_offload = false has no effect: it is DeepSpeed's old spelling "
                               "of zero_optimization.offload_optimizer and asks for no offload"));
  EXPECT_THAT(lines, HasSubstr("zero_optimization.cpu_offload_param = false has no effect: it is DeepSpeed's old "
                               "spelling of zero_optimization.offload_param"));
  EXPECT_THAT(config_error([] { parse(R"({"zero_optimization": {"cpu_offload": true}})"); }),
              HasSubstr("'zero_optimization.cpu_offload' is true: it is DeepSpeed's old spelling of "
                        "zero_optimization.offload_optimizer, and remat reads only the current key: write "
                        "zero_optimization.offload_optimizer instead"));
  EXPECT_THAT(config_error([] { parse("{}", {"zero_optimization.cpu_offload_param=true"}); }),
              HasSubstr("config error in --set zero_optimization.cpu_offload_param=true: "
                        "'zero_optimization.cpu_offload_param' is true: it is DeepSpeed's old spelling of "
                        "zero_optimization.offload_param"));
}

// stage3_gather_16bit_weights_on_model_save, in each spelling: the export in
// the training dtype; at float32 it changes nothing, and says so.
TEST(ConfigTuningKeys, Gather16BitWeightsOnSaveIsReadInEverySpelling) {
  EXPECT_FALSE(parse("{}").deepspeed_tuning.gather_16bit_weights_on_model_save);
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "gather_16bit_weights_on_model_save"}) {
    const std::string text = str(R"({"zero_optimization": {")", key, R"(": true}})");
    EXPECT_TRUE(parse(text).deepspeed_tuning.gather_16bit_weights_on_model_save) << key;
    EXPECT_THAT(warnings_of(text), HasSubstr("but the training dtype is float32 (bf16 and fp16 are off), so the "
                                             "export is float32 as without it"))
        << key;
  }
  EXPECT_EQ(warnings_of(R"({"bf16": {"enabled": true},
                            "zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true}})"),
            "");
}

// scheduler.params.last_batch_iteration reaches the scheduler (optim/lr_schedule.h starts the schedule
// after it).
TEST(ConfigTuningKeys, LastBatchIterationReachesTheScheduler) {
  EXPECT_EQ(parse("{}").scheduler.last_batch_iteration, -1);
  EXPECT_EQ(parse(R"({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 99}}})")
                .scheduler.last_batch_iteration, 99);
  EXPECT_THAT(config_error([] {
                parse(R"({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -2}}})");
              }),
              HasSubstr("'scheduler.params.last_batch_iteration' = -2 must be -1 (a fresh run) or the index of the "
                        "last batch trained on (>= 0)"));
  // Past the end of WarmupDecayLR's schedule from the first step (with
  // total_num_steps given or decided from "auto" = train.steps): refused.
  for (const char* total : {"10", "\"auto\""}) {
    EXPECT_THAT(config_error([&] {
                  parse(str(R"({"train": {"steps": 10}, "scheduler": {"type": "WarmupDecayLR", "params": )",
                            R"({"warmup_num_steps": 2, "last_batch_iteration": 9, "total_num_steps": )", total, "}}}"));
                }),
                HasSubstr("'scheduler.params.last_batch_iteration' = 9 starts the run past the end of WarmupDecayLR's "
                          "schedule ('scheduler.params.total_num_steps' = 10"))
        << total;
  }
  // A total decided from "auto" (train.steps) at or below the warm-up: the
  // warning says where it came from, and what to change.
  const std::string short_auto = R"({"train": {"steps": 3}, "scheduler": {"type": "WarmupDecayLR",
                                      "params": {"total_num_steps": "auto", "warmup_num_steps": 5}}})";
  EXPECT_EQ(parse(short_auto).scheduler.total_num_steps, 3);
  EXPECT_THAT(warnings_of(short_auto),
              HasSubstr("'scheduler.params.total_num_steps' (3 (\"auto\": train.steps, 3; raise the steps, or give "
                        "total_num_steps a number)) is not above the warm-up (5 steps)"));
  EXPECT_EQ(parse(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2,
                      "last_batch_iteration": 8, "total_num_steps": 10}}})").scheduler.last_batch_iteration, 8);
  // WarmupCosineLR reaches cos_min_ratio one position earlier, at total_num_steps - 1.
  auto cosine = [](int k) {
    return parse(str(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, )",
                     R"("total_num_steps": 10, "last_batch_iteration": )", k, "}}}"));
  };
  EXPECT_THAT(config_error([&] { cosine(8); }),
              HasSubstr("'scheduler.params.last_batch_iteration' = 8 starts the run past the end of WarmupCosineLR's "
                        "schedule ('scheduler.params.total_num_steps' = 10): from step 2 on every step would train at "
                        "cos_min_ratio x optimizer.params.lr; raise total_num_steps above 10 plus the steps to train, "
                        "or set last_batch_iteration to -1"));
  EXPECT_EQ(cosine(7).scheduler.last_batch_iteration, 7);
}

// Each scheduler type takes its DeepSpeed constructor's keys: another type's
// key is refused (DeepSpeed's constructor would), naming what to write; the
// defaults of the keys left out are written in. "none" reads no key.
TEST(ConfigScheduler, EachTypeTakesItsConstructorsKeys) {
  auto refused = [](const std::string& type, const std::string& params) {
    return config_error([&] { parse(str(R"({"scheduler": {"type": ")", type, R"(", "params": )", params, "}}")); });
  };
  EXPECT_THAT(refused("WarmupCosineLR", R"({"total_num_steps": 10, "warmup_num_steps": 2, "warmup_max_lr": 0.1})"),
              HasSubstr("'scheduler.params.warmup_max_lr' is not a parameter of WarmupCosineLR (DeepSpeed's "
                        "constructor refuses it): WarmupCosineLR's rates are optimizer.params.lr times a ratio: "
                        "remove it, and give warmup_min_ratio and cos_min_ratio (optimizer.params.lr is the peak)"));
  EXPECT_THAT(refused("WarmupCosineLR", R"({"total_num_steps": 10, "warmup_num_steps": 2, "warmup_min_lr": "auto"})"),
              HasSubstr("'scheduler.params.warmup_min_lr' is not a parameter of WarmupCosineLR"));
  EXPECT_THAT(refused("WarmupLR", R"({"total_num_steps": 100})"),
              HasSubstr("'scheduler.params.total_num_steps' is not a parameter of WarmupLR (DeepSpeed's constructor "
                        "refuses it): WarmupLR keeps warmup_max_lr after the warm-up; remove it, or set "
                        "scheduler.type to WarmupDecayLR or WarmupCosineLR to decay over total_num_steps"));
  EXPECT_THAT(refused("WarmupDecayLR", R"({"total_num_steps": 100, "cos_min_ratio": 0.1})"),
              HasSubstr("'scheduler.params.cos_min_ratio' is not a parameter of WarmupDecayLR (DeepSpeed's "
                        "constructor refuses it): it is WarmupCosineLR's; remove it, or set scheduler.type to "
                        "WarmupCosineLR"));
  EXPECT_THAT(refused("WarmupLR", R"({"warmup_min_ratio": 0.1})"),
              HasSubstr("'scheduler.params.warmup_min_ratio' is not a parameter of WarmupLR"));
  EXPECT_EQ(parse(R"({"scheduler": {"type": "none", "params": {"total_num_steps": 5, "cos_min_ratio": 0.5,
                      "warmup_max_lr": 0.1}}})").scheduler.type, "none");

  // Left out: DeepSpeed's defaults, WarmupLR's peak the optimizer's rate.
  const Config warmup = parse(R"({"optimizer": {"params": {"lr": 3e-4}}, "scheduler": {"type": "WarmupLR"}})");
  EXPECT_EQ(warmup.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(warmup.scheduler.warmup_max_lr, 3e-4);
  EXPECT_FALSE(warmup.scheduler.total_num_steps.has_value());
  EXPECT_FALSE(warmup.scheduler.cos_min_ratio.has_value());
  const Config decay = parse(R"({"optimizer": {"params": {"lr": 3e-4}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}}})");
  EXPECT_EQ(decay.scheduler.warmup_max_lr, 1e-3);
  const Config cosine = parse(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}})");
  EXPECT_EQ(cosine.scheduler.warmup_min_ratio, 0.0);
  EXPECT_EQ(cosine.scheduler.cos_min_ratio, 1e-4);
  EXPECT_FALSE(cosine.scheduler.warmup_max_lr.has_value());
  // The dump holds them and reads back to the same schedule.
  const Config again = parse(warmup.to_json());
  EXPECT_EQ(again.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(parse(cosine.to_json()).scheduler.cos_min_ratio, 1e-4);
}

// warmup_num_steps below 2 warms up over 2 (DeepSpeed's max(2, ...)), said
// once; the rules compare the total with that warm-up; the ratios' ranges.
TEST(ConfigScheduler, RangesAndTheWarmUpOfAtLeastTwoSteps) {
  EXPECT_THAT(config_error([] {
                parse(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}})");
              }),
              HasSubstr("'scheduler.params.warmup_num_steps' = -1 must be >= 0 (DeepSpeed warms up over at least 2 "
                        "steps: 0 and 1 give 2)"));
  // A total at or below the warm-up: DeepSpeed's constructor warns and goes on
  // (the rate warms up, then sits at its minimum).
  const std::string short_total = R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1,
                                       "total_num_steps": 2}}})";
  EXPECT_EQ(parse(short_total).scheduler.total_num_steps, 2);
  EXPECT_THAT(warnings_of(short_total),
              HasSubstr("scheduler WarmupDecayLR: 'scheduler.params.total_num_steps' (2) is not above the warm-up (2 "
                        "steps), so the rate warms up and then ends at its minimum without decaying (DeepSpeed warns "
                        "likewise); raise total_num_steps or lower warmup_num_steps"));
  const std::string zero = R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0,
                                "total_num_steps": 3}}})";
  EXPECT_EQ(parse(zero).scheduler.warmup_num_steps, 0);
  EXPECT_THAT(warnings_of(zero), HasSubstr("scheduler.params.warmup_num_steps = 0: the warm-up lasts 2 steps, as "
                                           "DeepSpeed raises it to at least 2 (and from 0.19.3 refuses 0); give 2 "
                                           "to say so"));
  EXPECT_EQ(warnings_of(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}})"), "");
  EXPECT_EQ(warnings_of(R"({"scheduler": {"type": "none", "params": {"warmup_num_steps": 0}}})"), "");
  EXPECT_THAT(config_error([] {
                parse(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                          "warmup_num_steps": 10, "warmup_min_ratio": -0.5, "cos_min_ratio": -0.1}}})");
              }),
              AllOf(HasSubstr("'scheduler.params.warmup_min_ratio' = -0.5 must be >= 0 (the warm-up starts at that "
                              "share of optimizer.params.lr)"),
                    HasSubstr("'scheduler.params.cos_min_ratio' = -0.1 must be >= 0 (DeepSpeed stops the rate at "
                              "0, before total_num_steps): give 0 to decay to 0")));
  EXPECT_THAT(config_error([] {
                parse(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}})");
              }),
              HasSubstr("scheduler WarmupCosineLR needs 'scheduler.params.total_num_steps' (DeepSpeed's constructor "
                        "requires it)"));
}

}  // namespace
}  // namespace remat
