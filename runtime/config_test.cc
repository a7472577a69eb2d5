#include "runtime/config.h"

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
  EXPECT_EQ(ac.variant, "none");
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
  EXPECT_EQ(c.activation_checkpointing.variant, "selective_op");
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
  EXPECT_THAT(msg, HasSubstr("\"auto\" but no budget is set: set 'memory_budget_bytes'"));
  msg = config_error([] {
    parse(R"({"activation_checkpointing": {"variant": "auto", "memory_budget_bytes": 10,
                                           "memory_budget_fraction": 0.5}})");
  });
  EXPECT_THAT(msg, HasSubstr("are both set: keep one of them"));
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

TEST(Config, OverridesApplyWithValidation) {
  Config c = parse("{}", {"model.n_layer=8", "activation_checkpointing.variant=full",
                          "bf16.enabled=true", "data.path=123",
                          "optimizer.params.betas=[0.8, 0.9]"});
  EXPECT_EQ(c.model.n_layer, 8);
  EXPECT_EQ(c.activation_checkpointing.variant, "full");
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
              HasSubstr("needs 'scheduler.params.total_num_steps' (0) greater than"));
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
}  // namespace remat
