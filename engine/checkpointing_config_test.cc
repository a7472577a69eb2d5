// The activation_checkpointing and activation_offloading sections of the JSON
// as the engine reads them into checkpointing's own option structs: the keys,
// the defaults and the errors. What the options then do is checkpointing's
// (checkpointing/offload_activations_test.cc, checkpoint_contract_test.cc) and
// the model-level tests' (tests/policy_test.cc, tests/stored_inputs_test.cc),
// which set these fields directly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpointing/options.h"
#include "checkpointing/policy.h"
#include "engine/config.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

TEST(CheckpointingConfig, ActivationOffloadingKeysAndErrors) {
  Config c = parse_config(R"({"activation_offloading": {"enabled": true, "min_offload_size": 0,
                              "max_fwd_stash_size": 2, "use_streams": false, "head": "head"}})",
                          "test");
  EXPECT_TRUE(c.activation_offloading.enabled);
  EXPECT_EQ(c.activation_offloading.min_offload_size, 0);
  EXPECT_EQ(c.activation_offloading.max_fwd_stash_size, 2);
  EXPECT_FALSE(c.activation_offloading.use_streams);
  EXPECT_TRUE(c.activation_offloading.use_pin_memory);
  EXPECT_THAT(error_of<ConfigError>([] {
                parse_config(R"({"activation_offloading": {"min_offload_bytes": 5}})", "test");
              }),
              HasSubstr("min_offload_bytes"));
  EXPECT_THAT(error_of<ConfigError>([] {
                parse_config(R"({"activation_offloading": {"min_offload_size": -1}})", "test");
              }),
              HasSubstr("'activation_offloading.min_offload_size' = -1 must be >= 0"));
}

TEST(CheckpointingConfig, SelectiveLayerKeysAndEveryKFromIsAnEnum) {
  // every_k_from is an enum: a name that is not one is refused where JSON is read.
  EXPECT_THAT(error_of<Error>([] {
                parse_config(R"({"activation_checkpointing": {"every_k_from": "middle"}})", "test");
              }),
              HasSubstr("'activation_checkpointing.every_k_from' = \"middle\" is not one of first, last"));
  // tests/policy_test.cc applies these fields (EveryKFromTheFirstOrTheLastBlock, FromConfig).
  Config cfg = parse_config(
      R"({"activation_checkpointing": {"variant": "selective_layer", "every_k": 4, "every_k_from": "last"}})", "test");
  EXPECT_EQ(cfg.activation_checkpointing.variant, CheckpointVariant::kSelectiveLayer);
  EXPECT_EQ(cfg.activation_checkpointing.every_k, 4);
  EXPECT_EQ(cfg.activation_checkpointing.every_k_from, EveryKFrom::kLast);
  cfg = parse_config(R"({"activation_checkpointing": {"variant": "selective_layer", "every_k": 4}})", "test");
  EXPECT_EQ(cfg.activation_checkpointing.variant, CheckpointVariant::kSelectiveLayer);
  EXPECT_EQ(cfg.activation_checkpointing.every_k, 4);
  EXPECT_EQ(cfg.activation_checkpointing.every_k_from, EveryKFrom::kFirst);
}

// The policy's settings are the section's (one declaration, one default): a
// PolicyOptions built by hand starts where an empty JSON section does.
TEST(CheckpointingConfig, PolicyOptionsStartFromTheSectionsDefaults) {
  const PolicyOptions by_hand;
  const PolicyOptions from_json(parse_config("{}", "test").activation_checkpointing);
  EXPECT_EQ(by_hand.variant, from_json.variant);
  EXPECT_EQ(by_hand.every_k, from_json.every_k);
  EXPECT_EQ(by_hand.save_ops, from_json.save_ops);
}

TEST(CheckpointingConfig, CpuCheckpointingOffloadsEveryInputByDefault) {
  // DeepSpeed's own checkpointing tests use inputs of a few KiB; turning
  // cpu_checkpointing on must move them to the host
  // (checkpoint_contract_test.cc, CpuCheckpointingOffloadsDeepSpeedSizedInputsByDefault).
  Config config = parse_config(R"({"activation_checkpointing": {"cpu_checkpointing": true}})",
                               "<test>");
  EXPECT_TRUE(config.activation_checkpointing.cpu_checkpointing);
  EXPECT_EQ(config.activation_checkpointing.offload_min_bytes, 0);
}

TEST(CheckpointingConfig, StoredInputErrorsNameTheKeyToChange) {
  auto message = error_of<ConfigError>([] {
    parse_config(R"({"activation_checkpointing": {"partition_activations": true,
                      "contiguous_memory_optimization": true}})", "<test>");
  });
  EXPECT_THAT(message, HasSubstr("'activation_checkpointing.number_checkpoints' is not set"));
  message = error_of<ConfigError>([] {
    parse_config(R"({"activation_checkpointing": {"contiguous_memory_optimization": true,
                      "number_checkpoints": 4}})", "<test>");
  });
  EXPECT_THAT(message, HasSubstr("set 'partition_activations' or 'cpu_checkpointing' to true"));
  message = error_of<ConfigError>([] {
    parse_config(R"({"activation_checkpointing": {"offload_max_in_flight": 0}})", "<test>");
  });
  EXPECT_THAT(message, HasSubstr("'activation_checkpointing.offload_max_in_flight' = 0 must be at least 1"));
}

}  // namespace
}  // namespace remat
