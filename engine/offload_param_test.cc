// zero_optimization.offload_param at stage 3 through the engine (issue 42,
// item 3), under mpirun at 1 and 2 ranks. On this CPU the host and the device
// are one memory, so a run with the parameter shards on the host computes the
// same bits as the run without it: alone and with offload_optimizer (whose
// masters are then the host shards themselves), in float32 and bf16, with
// accumulation and clipping. The shards are host tensors of their own (no
// alias of the model's device-side parameters), the metrics count their bytes
// (a run without offload_param has no such key), saves resume across
// offload_param on and off, and the keys are checked (stage 3 only).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <set>

#include "engine/config.h"
#include "engine/engine.h"
#include "models/gpt.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/error_of.h"
#include "tests/offload_runs.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using remat::testing::expect_same;
using remat::testing::world;
using ParamRun = remat::testing::TrainedRun;

// Whether `zero` holds a part of the model state at `place` (ZeroModel::holding).
bool holds_at(const parallel::ZeroModel& zero, parallel::Place place) {
  for (const auto& part : zero.holding()) {
    if (part.place == place) return true;
  }
  return false;
}

struct ParamSetup {
  bool offload_param = false;
  bool offload_optimizer = false;
  bool bf16 = false;
  bool fp16 = false;  // the loss scaler over float32 compute
  int hybrid = 0;
  int steps = 5;
  int micro_steps = 1;
};

Config config_of(const ParamSetup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = s.micro_steps;
  c.gradient_clipping = 1.0;
  c.train.seed = 9;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.bf16.enabled = s.bf16;
  c.fp16.enabled = s.fp16;
  c.zero_optimization.hybrid_shard_size = s.hybrid;
  c.zero_optimization.stage = 3;
  c.zero_optimization.reduce_bucket_size = 900;
  c.zero_optimization.stage3_param_persistence_threshold = 40;  // some whole parameters (on the device)
  using parallel::OffloadDevice;
  c.zero_optimization.offload_param.device = s.offload_param ? OffloadDevice::kCpu : OffloadDevice::kNone;
  c.zero_optimization.offload_param.pin_memory = true;
  c.zero_optimization.offload_optimizer.device = s.offload_optimizer ? OffloadDevice::kCpu : OffloadDevice::kNone;
  return c;
}

// The GPT trained to step `s.steps` (a resume from `from` counts its steps);
// saved into `save_to` after step `save_at`.
ParamRun train(const ParamSetup& s, const std::string& from = "", const std::string& save_to = "", int save_at = -1) {
  const auto layout = remat::testing::layout_ptr(1);
  models::GptOptions o = remat::testing::small_gpt(29, 3, /*dropout=*/0.1);
  at::manual_seed(9);
  models::Gpt model(o);
  EngineOptions options;
  options.layout = layout;
  options.fp16_scaler_at_float32 = s.fp16;
  auto engine = initialize(model, config_of(s), options);
  if (!from.empty()) engine->load_checkpoint(from);
  EXPECT_EQ(holds_at(engine->sharding(), parallel::Place::kHostParameters), s.offload_param);
  return remat::testing::train_to(*engine, model, *layout, o.vocab_size, s.steps, s.micro_steps, {save_to, save_at});
}

// The same losses and final weights, bit for bit, with the shards on the
// host: alone and with offload_optimizer, float32 and bf16, accumulation,
// fp16's loss scaler, hybrid sharding.
TEST(OffloadParam, TrainsBitwiseAsWithoutAloneAndWithOffloadOptimizer) {
  for (bool bf16 : {false, true}) {
    for (int micro : {1, 2}) {
      ParamSetup s;
      s.bf16 = bf16;
      s.micro_steps = micro;
      const ParamRun device = train(s);
      const std::string what = str(bf16 ? "bf16" : "float32", ", micro-steps ", micro);
      s.offload_param = true;
      const ParamRun host = train(s);
      expect_same(device, host, "offload_param, " + what);
      EXPECT_LT(host.losses.back(), host.losses.front()) << "trains";
      s.offload_optimizer = true;
      expect_same(device, train(s), "offload_param + offload_optimizer, " + what);
      s.offload_param = false;
      expect_same(device, train(s), "offload_optimizer alone, " + what);
    }
  }
  // fp16's loss scaler unscales the host gradients; hybrid sharding (2 ranks) replicates the host shards.
  for (int variant : {0, 1}) {
    if (variant == 1 && world()->size() < 2) continue;
    ParamSetup s;
    s.fp16 = variant == 0;
    s.hybrid = variant == 1 ? 1 : 0;
    const ParamRun device = train(s);
    s.offload_param = s.offload_optimizer = true;
    expect_same(device, train(s), variant == 0 ? "fp16" : "hybrid");
  }
}

// The shards are float32 host tensors of their own: none shares memory with
// a model parameter (the device-side views of the gathered units) or with
// another shard, pinning is asked for and (without CUDA) not possible. With
// offload_optimizer too, the optimizer steps those very shards (no third
// copy): its host masters are the persistent parameters' only. The metrics
// count the host bytes, present only with offload_param.
TEST(OffloadParam, ShardsAreSeparateHostTensorsAndCounted) {
  for (bool with_optimizer : {false, true}) {
    ParamSetup s;
    s.offload_param = true;
    s.offload_optimizer = with_optimizer;
    const auto layout = remat::testing::layout_ptr(1);
    at::manual_seed(9);
    models::Gpt model(remat::testing::small_gpt(29, 3, 0.1));
    EngineOptions options;
    options.layout = layout;
    auto engine = initialize(model, config_of(s), options);
    parallel::ZeroModel& zero = engine->sharding();
    ASSERT_TRUE(holds_at(zero, parallel::Place::kHostParameters));
    EXPECT_EQ(holds_at(zero, parallel::Place::kHostOptimizer), with_optimizer);
    at::Tensor idx = at::arange(24, at::kLong).view({2, 12}).remainder(29);
    engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
    // Persistent: below the threshold (40), whole on the device (their
    // host masters with offload_optimizer); every shard holds more.
    int64_t persistent_bytes = 0;
    for (const auto& q : model->parameters()) {
      if (q.numel() < 40) persistent_bytes += static_cast<int64_t>(q.nbytes());
    }
    EXPECT_GT(persistent_bytes, 0) << "the config keeps some parameters whole";
    std::set<const void*> storages;
    int64_t shard_bytes = 0, shards = 0;
    for (const auto& p : zero.parameters()) {
      if (p.numel() < 40) continue;
      ++shards;
      EXPECT_TRUE(p.device().is_cpu());
      EXPECT_EQ(p.scalar_type(), at::kFloat);
      EXPECT_EQ(p.is_pinned(), at::globalContext().hasCUDA()) << "pinned where this LibTorch can pin";
      EXPECT_TRUE(storages.insert(p.storage().data()).second) << "a shard of its own";
      for (const auto& q : model->parameters()) EXPECT_FALSE(p.is_alias_of(q)) << "a shard aliases a parameter";
      shard_bytes += static_cast<int64_t>(p.nbytes());
      ASSERT_TRUE(p.grad().defined()) << "the reduced gradient reached the host shard";
      EXPECT_TRUE(p.grad().device().is_cpu());
      for (const auto& q : model->parameters()) EXPECT_FALSE(p.grad().is_alias_of(q));
      shard_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    EXPECT_GT(shards, 0);
    // What stays on the device for parameters(): the persistent parameters, the model's own.
    int64_t device_bytes = 0;
    for (const auto& t : zero.device_parameters()) {
      EXPECT_LT(t.numel(), 40) << "a host shard among the device's tensors";
      device_bytes += static_cast<int64_t>(t.nbytes());
    }
    EXPECT_EQ(device_bytes, persistent_bytes);
    const parallel::ZeroStats st = zero.stats();
    EXPECT_EQ(st.host_param_bytes, shard_bytes);
    if (with_optimizer) {
      // offload_optimizer's host masters and their gradients: the persistent parameters', not the shards again.
      EXPECT_EQ(st.host_bytes, 2 * persistent_bytes);
    } else {
      EXPECT_EQ(st.param_bytes, persistent_bytes) << "the device holds the persistent parameters only";
      EXPECT_EQ(st.grad_bytes, persistent_bytes);
    }
    engine->step();
    const nlohmann::json m = engine->last_metrics().to_json();
    ASSERT_TRUE(m.count("host_parameter_bytes"));
    EXPECT_GT(m.at("host_parameter_bytes").get<int64_t>(), 0);
    EXPECT_EQ(m.at("host_parameter_bytes").get<int64_t>(), st.host_param_bytes) << "shards and gradients at the step";
    EXPECT_EQ(m.count("host_optimizer_bytes"), with_optimizer ? 1u : 0u);
  }
  ParamSetup plain;
  plain.steps = 1;
  EXPECT_EQ(train(plain).metrics[0].count("host_parameter_bytes"), 0u) << "a run without offload_param keeps its keys";
  plain.offload_optimizer = true;
  EXPECT_EQ(train(plain).metrics[0].count("host_parameter_bytes"), 0u);
}

// A save with the shards on the host resumes with them on the device, and
// back, bit for bit as the run that never stopped (with offload_optimizer on
// either side too).
TEST(OffloadParam, SavesResumeAcrossOffloadParamOnAndOff) {
  ParamSetup s;
  s.steps = 6;
  const ParamRun straight = train(s);
  const std::string on = remat::testing::job_dir("remat_offload_param_", "on");
  const std::string off = remat::testing::job_dir("remat_offload_param_", "off");
  ParamSetup saving = s;
  saving.steps = 3;
  saving.offload_param = true;
  saving.offload_optimizer = true;
  train(saving, "", on, 3);
  saving.offload_param = saving.offload_optimizer = false;
  train(saving, "", off, 3);
  for (int variant = 0; variant < 3; ++variant) {
    ParamSetup rest = s;
    rest.offload_param = variant > 0;
    rest.offload_optimizer = variant == 2;
    for (const std::string& from : {on, off}) {
      const ParamRun tail = train(rest, from);
      ASSERT_EQ(tail.losses.size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(tail.losses[i], straight.losses[3 + i])
            << "variant " << variant << " from " << (from == on ? "an offloaded save" : "a device save") << ", step "
            << 4 + i;
      }
    }
  }
}

// GatheredParameters(modify) writes an edit into the host shards and the
// model reads it at the next gather: trained on bitwise as without offload_param.
TEST(OffloadParam, AModifyingScopeReachesTheHostShards) {
  std::vector<double> losses[2];
  for (bool offload : {false, true}) {
    at::manual_seed(9);
    models::Gpt model(remat::testing::small_gpt(29, 2, 0.0));
    ParamSetup s;
    s.offload_param = offload;
    EngineOptions options;
    options.layout = remat::testing::layout_ptr(1);
    auto engine = initialize(model, config_of(s), options);
    {
      GatheredParameters scope(*engine, /*modify=*/true);
      at::NoGradGuard no_grad;
      model->named_parameters()["pos_emb.weight"].fill_(0.5);
    }
    at::Tensor idx = at::arange(24, at::kLong).view({2, 12}).remainder(29);
    for (int step = 0; step < 2; ++step) {
      engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
      engine->step();
      losses[offload].push_back(engine->last_metrics().loss);
    }
    for (const auto& [name, value] : engine->sharding().full_parameters()) {
      if (name != "pos_emb.weight") continue;
      EXPECT_FALSE(at::equal(value, at::full_like(value, 0.5))) << "stepped since";
    }
  }
  EXPECT_EQ(losses[0], losses[1]);
}

// The keys: device "cpu" at stage 3 with DeepSpeed's buffer tuning accepted;
// another stage, "nvme" and nvme_path beside it refused saying what to change; "none"
// accepted at any stage (a copied config switching it off).
TEST(OffloadParam, ConfigKeys) {
  const Config c = parse_config(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true,
          "buffer_count": 4, "buffer_size": 100000000, "max_in_cpu": 1000000000},
          "offload_optimizer": {"device": "cpu", "pin_memory": true}}})", "<offload_param_test>");
  EXPECT_TRUE(c.zero_optimization.offload_param.enabled());
  EXPECT_TRUE(c.zero_optimization.offload_param.pin_memory);
  EXPECT_EQ(c.zero_optimization.offload_param.buffer_count, 4);
  const Config set = parse_config("{}", "<offload_param_test>",
                                  {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu"});
  EXPECT_TRUE(set.zero_optimization.offload_param.enabled());
  const Config none = parse_config(R"({"zero_optimization": {"stage": 1, "offload_param": {"device": "none"}}})",
                                   "<offload_param_test>");
  EXPECT_FALSE(none.zero_optimization.offload_param.enabled());
  for (int stage : {0, 1, 2}) {
    const std::string msg = remat::testing::error_of<ConfigError>([&] {
      parse_config(str(R"({"zero_optimization": {"stage": )", stage, R"(, "offload_param": {"device": "cpu"}}})"),
                   "<offload_param_test>");
    });
    EXPECT_NE(msg.find("offload_param.device' = \"cpu\" needs stage 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("set the stage to 3"), std::string::npos) << msg;
  }
  // "nvme" needs its folder (engine/nvme_offload_test.cc trains with it); with
  // "cpu" nvme_path asks for nothing (DeepSpeed reads it only for NVMe).
  const std::string nvme = remat::testing::error_of<ConfigError>([] {
    parse_config(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})", "<offload_param_test>");
  });
  EXPECT_NE(nvme.find("offload_param.device' = \"nvme\" needs 'zero_optimization.offload_param.nvme_path'"),
            std::string::npos) << nvme;
  EXPECT_EQ(*parse_config(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})",
                          "<offload_param_test>").zero_optimization.offload_param.nvme_path, "/x");
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/x"}}})",
                         "<offload_param_test>").zero_optimization.offload_param.device,
            parallel::OffloadDevice::kCpu);
}

}  // namespace
}  // namespace remat
