// DeepSpeed's keys as copied configs carry them (engine/internal/deepspeed_keys.h):
// a key at the value that asks for nothing is accepted, one that asks for
// what remat does not do is refused with the reason, every problem in one
// error; a key given in two spellings is refused naming both; and what the
// accepted ones change (or do not) is said in one line each.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/config.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

template <typename F>
std::string config_error(F fn) {
  return remat::testing::error_of<ConfigError>(fn);
}

Config parse(const std::string& text, std::vector<std::string> overrides = {}) {
  return parse_config(text, "test.json", overrides);
}

std::string warnings_of(const Config& c) {
  std::string all;
  for (const auto& w : ineffective_settings(c)) all += w + "\n";
  return all;
}

// Issue 49, item 5: stage3_gather_16bit_weights_on_model_save beside its
// deprecated spelling let the deprecated one win (the export's dtype flipped,
// exit 0). Two spellings of one key are refused, naming both and their
// values; each alone is read as before.
TEST(DeepSpeedKeys, TwoSpellingsOfOneKeyAreRefusedNamingBoth) {
  const std::string msg = config_error([] {
    parse(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
              "stage3_gather_16bit_weights_on_model_save": true, "stage3_gather_fp16_weights_on_model_save": false}})");
  });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: 'zero_optimization.stage3_gather_16bit_weights_on_model_save' "
                             "(true) and 'zero_optimization.stage3_gather_fp16_weights_on_model_save' (false) are "
                             "spellings of one key, given together: only one value could be read; keep "
                             "'zero_optimization.stage3_gather_16bit_weights_on_model_save', and remove the other"));
  // Three at once; two without the preferred one.
  EXPECT_THAT(config_error([] {
                parse(R"({"zero_optimization": {"gather_16bit_weights_on_model_save": false,
                          "stage3_gather_16bit_weights_on_model_save": true,
                          "stage3_gather_fp16_weights_on_model_save": true}})");
              }),
              HasSubstr("'zero_optimization.gather_16bit_weights_on_model_save' (false), "
                        "'zero_optimization.stage3_gather_16bit_weights_on_model_save' (true) and "
                        "'zero_optimization.stage3_gather_fp16_weights_on_model_save' (true) are spellings of one "
                        "key, given together"));
  EXPECT_THAT(config_error([] {
                parse(R"({"zero_optimization": {"gather_16bit_weights_on_model_save": true,
                          "stage3_gather_fp16_weights_on_model_save": true}})");
              }),
              HasSubstr("keep one, preferably 'zero_optimization.stage3_gather_16bit_weights_on_model_save', and "
                        "remove the other"));
  // The other keys remat reads in two spellings, even when both say the same.
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"stage3_max_live_parameters", "max_live_parameters"},
           {"stage3_max_reuse_distance", "max_reuse_distance"}}) {
    EXPECT_THAT(config_error([&] { parse(str(R"({"zero_optimization": {")", a, R"(": 5, ")", b, R"(": 5}})")); }),
                HasSubstr(str("'zero_optimization.", b, "' (5) and 'zero_optimization.", a,
                              "' (5) are spellings of one key")))
        << a;
  }
  EXPECT_THAT(config_error([] { parse(R"({"bf16": {"check_overflow": false, "check_grad_overflow": true}})"); }),
              HasSubstr("'bf16.check_grad_overflow' (true) and 'bf16.check_overflow' (false) are spellings of one "
                        "key"));
  // An override in the other spelling than the file's: the pair again.
  EXPECT_THAT(config_error([] {
                parse(R"({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": true}})",
                      {"zero_optimization.stage3_gather_16bit_weights_on_model_save=false"});
              }),
              HasSubstr("config error in test.json with --set overrides: "
                        "'zero_optimization.stage3_gather_16bit_weights_on_model_save' (false) and "
                        "'zero_optimization.stage3_gather_fp16_weights_on_model_save' (true) are spellings"));
  // The effective configuration holds the preferred spelling only, and loads.
  const Config c = parse(R"({"zero_optimization": {"max_live_parameters": 7,
                             "stage3_gather_fp16_weights_on_model_save": true}})");
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, 7);
  const std::string dumped = c.to_json();
  EXPECT_THAT(dumped, Not(HasSubstr("\"max_live_parameters\"")));
  EXPECT_THAT(dumped, Not(HasSubstr("stage3_gather_fp16_weights_on_model_save")));
  const Config again = parse_config(dumped, "<dump>");
  EXPECT_EQ(again.zero_optimization.stage3_max_live_parameters, 7);
  EXPECT_TRUE(again.deepspeed_tuning.gather_16bit_weights_on_model_save);
}

// Item 5, the old offload switches: beside their current key's section
// switched on, refused naming both (DeepSpeed refuses the pair); beside it
// switched off, false still asks for nothing.
TEST(DeepSpeedKeys, OldOffloadSwitchesBesideTheCurrentKeyAreRefusedNamingBoth) {
  const std::string msg = config_error([] {
    parse(R"({"zero_optimization": {"stage": 3, "cpu_offload": false, "offload_optimizer": {"device": "cpu"},
              "cpu_offload_param": true, "offload_param": {"device": "cpu"}}})");
  });
  EXPECT_THAT(msg, HasSubstr("2 problems"));
  EXPECT_THAT(msg, HasSubstr("'zero_optimization.cpu_offload' (false) and 'zero_optimization.offload_optimizer' "
                             "(device \"cpu\") are both given: cpu_offload is DeepSpeed's old spelling of "
                             "zero_optimization.offload_optimizer, and only one of them can say whether to offload "
                             "(DeepSpeed refuses the two together too): remove 'zero_optimization.cpu_offload'"));
  EXPECT_THAT(msg, HasSubstr("'zero_optimization.cpu_offload_param' (true) and 'zero_optimization.offload_param' "
                             "(device \"cpu\") are both given"));
  const Config off = parse(R"({"zero_optimization": {"cpu_offload": false, "offload_optimizer": {"device": "none"}}})");
  EXPECT_THAT(warnings_of(off), HasSubstr("zero_optimization.cpu_offload = false has no effect"));
}

// Issue 49, item 12: DeepSpeed's "off" values, its defaults and sections
// switched off ask for nothing: accepted, with no line (nothing to say).
TEST(DeepSpeedKeys, ValuesThatAskForNothingAreAccepted) {
  const Config c = parse(R"({
    "bf16": {"enabled": true, "immediate_grad_update": false, "check_overflow": false,
             "bf16_master_weights_and_grads": false, "bf16_optimizer_states": false},
    "fp16": {"enabled": false, "fp16_master_weights_and_grads": true, "loss_scale_window": 0, "hysteresis": 0},
    "zero_force_ds_cpu_optimizer": false,
    "sparse_gradients": false, "disable_allgather": false, "memory_breakdown": false, "dump_state": false,
    "graph_harvesting": false, "sequence_parallel_size": 1,
    "aio": {"block_size": 1048576, "queue_depth": 8},
    "zero_optimization": {
      "stage": 2, "round_robin_gradients": false, "zero_quantized_weights": false,
      "zero_quantized_nontrainable_weights": false, "zero_quantized_gradients": false, "zero_hpz_partition_size": 1,
      "mics_shard_size": -1, "mics_hierarchical_params_gather": false, "zeropp_loco_param": null,
      "stage3_use_all_reduce_for_fetch_params": false, "stage3_module_granularity_threshold": 0,
      "elastic_checkpoint": false, "load_from_fp32_weights": true, "ignore_unused_parameters": true,
      "legacy_stage1": false, "pipeline_loading_checkpoint": false, "log_trace_cache_warnings": false,
      "offload_optimizer": {"device": "cpu", "nvme_path": null, "pipeline_read": false, "pipeline_write": false,
                            "buffer_count": 0, "ratio": 0},
      "offload_param": {"device": "none", "nvme_path": "/local_nvme", "buffer_count": 0, "buffer_size": 0}}
  })");
  EXPECT_TRUE(c.bf16.enabled);
  EXPECT_FALSE(*c.deepspeed_tuning.round_robin_gradients);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.buffer_count, 0);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.ratio, 0.0);
  EXPECT_EQ(warnings_of(c), "");
  // As --set gives them.
  EXPECT_EQ(parse("{}", {"zero_optimization.zero_quantized_weights=false", "zero_optimization.zero_hpz_partition_size=1",
                         "zero_force_ds_cpu_optimizer=false"})
                .zero_optimization.stage,
            0);
  // A section switched off asks for nothing whatever its keys say.
  parse(R"({"bf16": {"enabled": false, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}})");
  // NVMe's keys ask for nothing while no device is "nvme", as in DeepSpeed.
  parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme",
                                   "pipeline_read": true}}, "aio": {"block_size": 1048576}})");
}

// Item 12: a value that asks for what remat does not do is refused with the
// reason and the value that asks for nothing, all of them in one error.
TEST(DeepSpeedKeys, ValuesThatAskForSomethingAreRefusedInOneError) {
  const std::string msg = config_error([] {
    parse(R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true},
              "sparse_gradients": true,
              "zero_optimization": {"stage": 3, "zero_quantized_weights": true, "zero_hpz_partition_size": 8,
                                    "mics_shard_size": 4, "ignore_unused_parameters": false}})");
  });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: 7 problems (nothing was applied):"));
  for (const char* want : {
           "'bf16.bf16_master_weights_and_grads' = true, because remat keeps float32 master weights and gradients; "
           "remove it or set it to false, which asks for nothing",
           "'bf16.bf16_optimizer_states' = true, because remat keeps the optimizer state in float32",
           "'sparse_gradients' = true, because remat reduces dense gradients only",
           "'zero_optimization.zero_quantized_weights' = true, because remat's collectives carry unquantized values",
           "'zero_optimization.zero_hpz_partition_size' = 8, because remat has no secondary parameter partition "
           "(ZeRO++ hpZ); remove it or set it to 1, which asks for nothing (or set "
           "zero_optimization.hybrid_shard_size",
           "'zero_optimization.mics_shard_size' = 4, because remat has no MiCS; remove it or set it to -1",
           "'zero_optimization.ignore_unused_parameters' = false, because remat has no check of unused parameters",
       }) {
    EXPECT_THAT(msg, HasSubstr(want)) << msg;
  }
  EXPECT_THAT(config_error([] { parse("{}", {"zero_optimization.zero_quantized_gradients=true"}); }),
              HasSubstr("config error in --set zero_optimization.zero_quantized_gradients=true: recognised DeepSpeed "
                        "key, not supported by remat: 'zero_optimization.zero_quantized_gradients' = true, because"));
  // Issue 49, item 15: dump_state's refusal pointed at an effective
  // configuration remat-train did not print; it names --print-config, which does.
  EXPECT_THAT(config_error([] { parse(R"({"dump_state": true})"); }),
              HasSubstr("'dump_state' = true, because remat does not print its engine's state; remove it or set it "
                        "to false, which asks for nothing (or remat-train --print-config prints the configuration a "
                        "run trains with, every \"auto\" decided)"));
}

// Issue 53: DeepSpeed's aio section is read into Config::aio with DeepSpeed's
// defaults, checked as runtime's AsyncIoOptions, its unknown keys refused;
// away from the defaults it is said to have no effect while no device is "nvme".
TEST(DeepSpeedKeys, AioSectionIsReadAndChecked) {
  const Config defaults = parse("{}");
  EXPECT_EQ(defaults.aio.block_size, 1048576);
  EXPECT_EQ(defaults.aio.queue_depth, 8);
  EXPECT_EQ(defaults.aio.thread_count, 1);
  EXPECT_FALSE(defaults.aio.single_submit);
  EXPECT_TRUE(defaults.aio.overlap_events);
  const Config given = parse(R"({"aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 4,
                                         "single_submit": true, "overlap_events": false, "use_gds": false}})");
  const AsyncIoOptions o = given.aio.options();
  EXPECT_EQ(o.block_size, 262144u);
  EXPECT_EQ(o.queue_depth, 32);
  EXPECT_EQ(o.thread_count, 4);
  EXPECT_TRUE(o.single_submit);
  EXPECT_FALSE(o.overlap_events);
  EXPECT_EQ(check_async_io_options(o), "");
  EXPECT_THAT(warnings_of(given), HasSubstr("aio (block_size 262144, queue_depth 32, thread_count 4, single_submit "
                                            "true, overlap_events false) has no effect in this run: it tunes the I/O "
                                            "of offload to NVMe, and no offload device is \"nvme\""));
  EXPECT_THAT(warnings_of(parse(R"({"aio": {"block_size": 1048576, "queue_depth": 8}})")), Not(HasSubstr("aio")));
  // DeepSpeed's later spelling of thread_count; both together name both.
  EXPECT_EQ(parse(R"({"aio": {"intra_op_parallelism": 3}})").aio.thread_count, 3);
  EXPECT_THAT(config_error([] { parse(R"({"aio": {"intra_op_parallelism": 3, "thread_count": 2}})"); }),
              AllOf(HasSubstr("thread_count"), HasSubstr("intra_op_parallelism")));
  // Round trip through the dump, as initialize's overrides do.
  EXPECT_EQ(parse(given.to_json()).aio.queue_depth, 32);
  // Checked: every problem in one error; unknown keys and use_gds refused.
  const std::string bad = config_error([] {
    parse(R"({"aio": {"block_size": 1000, "queue_depth": 0, "thread_count": 0}})");
  });
  EXPECT_THAT(bad, HasSubstr("3 problems"));
  EXPECT_THAT(bad, HasSubstr("aio.block_size 1000 is not a multiple of the alignment 4096 that direct I/O needs: "
                             "round it to 4096"));
  EXPECT_THAT(bad, HasSubstr("aio.queue_depth 0 is not in [1, 4096]"));
  EXPECT_THAT(bad, HasSubstr("aio.thread_count 0 is not in [1, 256]"));
  EXPECT_THAT(config_error([] { parse(R"({"aio": {"block_size": -4096}})"); }),
              HasSubstr("'aio.block_size' = -4096 must be at least 1"));
  EXPECT_THAT(config_error([] { parse(R"({"aio": {"blocksize": 4096}})"); }), HasSubstr("blocksize"));
  EXPECT_THAT(config_error([] { parse(R"({"aio": {"use_gds": true}})"); }),
              HasSubstr("'aio.use_gds' = true, because remat reads and writes NVMe through host memory"));
  EXPECT_THAT(config_error([] { parse("{}", {"aio.queue_depth=0"}); }),
              HasSubstr("config error in --set aio.queue_depth=0: aio.queue_depth 0 is not in [1, 4096]"));
}

// Item 12 and issue 53: both offloads to NVMe are read with their folders,
// max_in_cpu and the pipeline switches; every NVMe problem (a device without
// its nvme_path, too few buffers, a stage that cannot take it) is in one
// error, not one a run.
TEST(DeepSpeedKeys, EveryNvmeProblemIsInOneError) {
  const std::string msg = config_error([] {
    parse(R"({"aio": {"block_size": 1048576},
              "zero_optimization": {"stage": 3,
                "offload_optimizer": {"device": "nvme", "buffer_count": 1, "pipeline_read": true},
                "offload_param": {"device": "nvme"}}})");
  });
  EXPECT_THAT(msg, HasSubstr("config error in test.json: 3 problems (nothing was applied):"));
  for (const char* want : {
           "'zero_optimization.offload_optimizer.device' = \"nvme\" needs 'zero_optimization.offload_optimizer."
           "nvme_path'",
           "'zero_optimization.offload_optimizer.buffer_count' = 1 with device \"nvme\"",
           "'zero_optimization.offload_param.device' = \"nvme\" needs 'zero_optimization.offload_param.nvme_path': "
           "a folder on a fast local disk where each rank keeps its parameter shards",
       }) {
    EXPECT_THAT(msg, HasSubstr(want)) << msg;
  }
  // The aio section is read whatever the devices say: not among the problems.
  EXPECT_THAT(msg, Not(HasSubstr("'aio")));
  const Config c = parse(R"({"aio": {"queue_depth": 16}, "zero_optimization": {"stage": 3, "sub_group_size": 4096,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pipeline_read": true},
      "offload_param": {"device": "nvme", "nvme_path": "/other_nvme", "max_in_cpu": 1e6}}})");
  EXPECT_EQ(*c.zero_optimization.offload_optimizer.nvme_path, "/local_nvme");
  EXPECT_EQ(*c.zero_optimization.offload_param.nvme_path, "/other_nvme");
  EXPECT_EQ(c.zero_optimization.offload_param.max_in_cpu, 1000000);
  EXPECT_TRUE(c.zero_optimization.offload_param.on_nvme());
  // With device "nvme" the aio section and sub_group_size take effect: not said to have none.
  EXPECT_THAT(warnings_of(c), Not(HasSubstr("aio (")));
  EXPECT_THAT(warnings_of(c), Not(HasSubstr("sub_group_size = 4096 has no effect")));
  // offload_param's "nvme" at stage 2 is named with the override that set it.
  EXPECT_THAT(config_error([] {
                parse(R"({"zero_optimization": {"stage": 2}})",
                      {"zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=/x"});
              }),
              HasSubstr("'zero_optimization.offload_param.device' = \"nvme\" needs stage 3"));
  // nvme_path beside device "cpu" or "none" asks for nothing (DeepSpeed reads it only with "nvme").
  EXPECT_NO_THROW(parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
      "nvme_path": "/local_nvme"}}})"));
}

// Item 12: keys whose "true" asks for nothing remat's results depend on are
// accepted, one line each saying what remat does instead; no line calls remat
// without a CPU optimizer.
TEST(DeepSpeedKeys, TuningThatChangesNothingIsSaidOnce) {
  const Config c = parse(R"({"bf16": {"enabled": true, "immediate_grad_update": true, "check_overflow": true},
      "zero_force_ds_cpu_optimizer": true, "optimizer": {"type": "AdamW"},
      "zero_optimization": {"stage": 2, "round_robin_gradients": true, "offload_optimizer": {"device": "cpu"}}})");
  const std::vector<std::string> lines = ineffective_settings(c);
  ASSERT_EQ(lines.size(), 4u) << warnings_of(c);
  EXPECT_THAT(lines[0], HasSubstr("zero_optimization.round_robin_gradients = true has no effect in remat: it "
                                  "reorders which rank's partition each gradient falls in"));
  EXPECT_THAT(lines[1], HasSubstr("zero_force_ds_cpu_optimizer = true: offload_optimizer steps optimizer.type AdamW "
                                  "with remat's host Adam (optim/host_adam.h"));
  EXPECT_THAT(lines[2], HasSubstr("bf16.immediate_grad_update = true has no effect in remat"));
  EXPECT_THAT(lines[3], HasSubstr("bf16.check_overflow = true: remat checks every step's loss and gradients for inf "
                                  "and nan whatever it says, and train.on_nonfinite decides what follows: it is "
                                  "\"stop\", which stops the run naming the step"));
  EXPECT_THAT(warnings_of(c), Not(HasSubstr("no CPU optimizer")));
  // Without offload, zero_force_ds_cpu_optimizer has nothing to say.
  EXPECT_EQ(warnings_of(parse(R"({"zero_force_ds_cpu_optimizer": true})")), "");
  EXPECT_THAT(warnings_of(parse(R"({"bf16": {"enabled": true, "check_grad_overflow": true}})",
                                {"train.on_nonfinite=skip"})),
              HasSubstr("it is \"skip\", which skips the step, as DeepSpeed does"));
}

// Issue 49, item 6: a persistence threshold given under bf16 or fp16 at
// stage 3, where stage 3 shards every parameter, was set to 0 without a word.
// One line names the value given, the one used and why.
TEST(DeepSpeedKeys, APersistenceThresholdStage3DoesNotUseIsSaidOnce) {
  const Config c = parse(R"({"bf16": {"enabled": true},
                             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 5000}})");
  const std::vector<std::string> lines = ineffective_settings(c);
  ASSERT_EQ(lines.size(), 1u) << warnings_of(c);
  EXPECT_EQ(lines[0], "zero_optimization.stage3_param_persistence_threshold = 5000 is not used: the threshold is 0, "
                      "because under bf16 stage 3 shards every parameter, since the float32 masters live in the "
                      "shards and a parameter kept whole would have none beside its bf16 copy (the threshold keeps "
                      "small parameters whole in float32 runs)");
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 5000) << "the value given stays what it was";
  EXPECT_THAT(warnings_of(parse(R"({"fp16": {"enabled": true},
                                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5}})")),
              HasSubstr("= 100000 is not used: the threshold is 0, because under fp16 stage 3 shards every parameter"));
  // Through --set as from the file.
  EXPECT_THAT(warnings_of(parse(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3}})",
                                {"zero_optimization.stage3_param_persistence_threshold=7"})),
              HasSubstr("= 7 is not used: the threshold is 0"));
  // Used as given: 0 under bf16, any value in float32, any value below stage
  // 3; and nothing to say when the key is left out.
  for (const char* text : {R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3}})",
                           R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3,
                                "stage3_param_persistence_threshold": 0}})",
                           R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 5000}})",
                           R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}})"}) {
    EXPECT_EQ(warnings_of(parse(text)), "") << text;
  }
}

}  // namespace
}  // namespace remat
