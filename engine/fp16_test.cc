// fp16 compute through the engine (issue 41, item 2): float32 masters and
// optimizer state, fp16 compute copies, the loss scaled by fp16's loss scaler
// (DeepSpeed's dynamic scaling) and the float32 gradients unscaled and
// checked for overflow. Where this LibTorch's CPU kernels compute in fp16
// (LibTorch 2.6: the capability probe, a half-precision matmul and its
// backward, succeeds): stages 1-3 and hybrid sharding against fp16 at stage
// 0 (bf16_test's rules), fp16 against float32 over 30 steps, and an overflow
// forced by a huge first scale that skips steps and halves the scale until
// the run trains. Where they do not (LibTorch 1.13), fp16.enabled is refused
// naming fp16 and the device.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/internal/loss_scaling.h"
#include "models/gpt.h"
#include "parallel/zero.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;
using remat::testing::world;

// What the probe says about this LibTorch's CPU (the empty string: fp16 runs).
const std::string& cpu_fp16_failure() {
  static const std::string failure = internal::fp16_compute_failure(c10::Device(c10::DeviceType::CPU));
  return failure;
}
bool cpu_computes_fp16() { return cpu_fp16_failure().empty(); }

struct Fp16Setup {
  int stage = 0;
  bool fp16 = true;
  int steps = 6;
  int micro_steps = 1;
  double clip = 0;
  int hybrid = 0;
  // 2^8: no overflow in this GPT's gradients (asserted where it matters), so
  // that every step trains; the overflow test starts at 2^30.
  int power = 8;
  parallel::ReduceDtype reduce = parallel::ReduceDtype::kDefault;
  bool offload = false;  // zero_optimization.offload_optimizer.device cpu
};

Config config_of(const Fp16Setup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = s.micro_steps;
  c.gradient_clipping = s.clip;
  c.train.seed = 21;
  c.optimizer.type = "AdamW";
  c.optimizer.lr = 1e-2;
  c.fp16.enabled = s.fp16;
  c.fp16.initial_scale_power = s.power;
  c.bf16.reduce_dtype = s.reduce;
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.reduce_bucket_size = 1000;  // several buckets
  c.zero_optimization.hybrid_shard_size = s.hybrid;
  if (s.offload) c.zero_optimization.offload_optimizer.device = parallel::OffloadDevice::kCpu;
  return c;
}

struct Fp16Run {
  std::vector<StepMetrics> metrics;
  std::vector<double> losses;
  at::ScalarType model_dtype = at::kFloat;  // the model's parameters, as it computes
};

// The GPT of bf16_test trained `s.steps` steps.
Fp16Run train(const Fp16Setup& s) {
  const auto& l = remat::testing::layout(1);
  models::GptOptions o = remat::testing::small_gpt(29, 3, 0.1);
  at::manual_seed(21);
  models::Gpt model(o);
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(1);
  auto engine = initialize(model, config_of(s), options);
  Fp16Run run;
  run.model_dtype = model->parameters().front().scalar_type();
  for (const auto& p : engine->sharding().parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "fp32 masters";
  for (int step = 0; step < s.steps; ++step) {
    const int64_t global = engine->global_steps();
    for (int m = 0; m < s.micro_steps; ++m) {
      at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12})
                           .mul(l.dp_rank() + 1).add(global * 3 + m).remainder(o.vocab_size);
      engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
      engine->step();
    }
    run.metrics.push_back(engine->last_metrics());
    run.losses.push_back(engine->last_metrics().loss);
  }
  return run;
}

std::string describe(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return str("max |difference| ", worst);
}

#define REQUIRE_FP16_CPU()                                                                            \
  if (!cpu_computes_fp16()) {                                                                         \
    GTEST_SKIP() << "this LibTorch's CPU cannot compute in fp16 (" << cpu_fp16_failure()              \
                 << "): Fp16.RefusedOrComputedAsTheProbeSays asserts the refusal";                    \
  }

// The probe decides: where the CPU cannot compute in fp16, fp16.enabled is a
// ConfigError at initialize naming fp16, the device and bf16 instead; where
// it can, the model holds fp16 copies of float32 masters and the metrics
// carry the scale.
TEST(Fp16, RefusedOrComputedAsTheProbeSays) {
  Fp16Setup s;
  s.steps = 2;
  if (!cpu_computes_fp16()) {
    const std::string msg = error_of<ConfigError>([&] { train(s); });
    EXPECT_THAT(msg, HasSubstr("fp16.enabled is true, but the cpu device cannot compute in fp16"));
    EXPECT_THAT(msg, HasSubstr(cpu_fp16_failure()));
    EXPECT_THAT(msg, HasSubstr("Set bf16.enabled instead"));
    return;
  }
  const Fp16Run r = train(s);
  EXPECT_EQ(r.model_dtype, at::kHalf);
  ASSERT_EQ(r.metrics.size(), 2u);
  EXPECT_EQ(r.metrics[0].loss_scale, 256);
  EXPECT_EQ(r.metrics[1].overflows, 0);
  for (double loss : r.losses) EXPECT_TRUE(std::isfinite(loss));
  // The float32 run computes in float32: the cast and the copies are fp16's.
  s.fp16 = false;
  EXPECT_EQ(train(s).model_dtype, at::kFloat);
}

// bf16_test's stage rules hold in fp16: with one micro-step and no clipping
// every stage reduces the same fp16 gradients in the same fp16 sums (the
// default communication_data_type under fp16), so the losses are bitwise
// those of stage 0; with accumulation, stages 2 and 3 reduce each
// micro-step's gradients where 0 and 1 reduce their float32 sum once (fp16
// roundings apart, bound 5e-3; measured with LibTorch 2.6 at 2 ranks
// 2.9e-5). No step overflows at a scale of 2^8.
TEST(Fp16, EveryStageAndHybridShardingMatchStage0) {
  REQUIRE_FP16_CPU();
  const int n = world()->size();
  for (int micro : {1, 2}) {
    Fp16Setup base;
    base.micro_steps = micro;
    const Fp16Run zero0 = train(base);
    EXPECT_EQ(zero0.metrics.back().overflows, 0) << "micro-steps " << micro;
    for (int stage : {1, 2, 3}) {
      for (int hybrid : {0, 1}) {
        if (hybrid == 1 && n == 1) continue;  // hybrid needs replicas
        Fp16Setup s = base;
        s.stage = stage;
        s.hybrid = hybrid;
        const Fp16Run r = train(s);
        EXPECT_EQ(r.model_dtype, at::kHalf) << "stage " << stage;
        const std::string what = str("stage ", stage, " micro-steps ", micro, " hybrid ", hybrid, ": ",
                                     describe(zero0.losses, r.losses));
        for (size_t i = 0; i < r.losses.size(); ++i) {
          if (micro == 1 || stage == 1) {
            EXPECT_EQ(zero0.losses[i], r.losses[i]) << what << " step " << i;
          } else {
            EXPECT_NEAR(zero0.losses[i], r.losses[i], 5e-3) << what << " step " << i;
          }
        }
        if (world()->rank() == 0) std::printf("fp16 %s\n", what.c_str());
      }
    }
  }
  if (n == 1) return;  // nothing is reduced
  // communication_data_type fp32: bitwise across stages too, and not the fp16 reduce.
  Fp16Setup fp32_reduce, fp16_reduce;
  fp32_reduce.reduce = parallel::ReduceDtype::kFp32;
  const Fp16Run a = train(fp32_reduce), halves = train(fp16_reduce);
  fp32_reduce.stage = 2;
  const Fp16Run b = train(fp32_reduce);
  int differ = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "float32 reductions, stage 2 against 0, step " << i;
    if (a.losses[i] != halves.losses[i]) ++differ;
  }
  EXPECT_GT(differ, 0) << "communication_data_type fp32 reduced in fp16";
}

// offload_optimizer under fp16 compute: the float32 masters on the host
// alone, copied back into the fp16 parameters (rounded as the device copy
// would be): the same losses bit for bit as without offload at stages 1-3,
// with a third (stages 1-2) or half (stage 3) of the device's parameter bytes.
TEST(Fp16, OffloadedOptimizerTrainsBitwiseAsWithout) {
  REQUIRE_FP16_CPU();
  for (int stage : {1, 2, 3}) {
    for (int micro : {1, 2}) {
      Fp16Setup s;
      s.stage = stage;
      s.micro_steps = micro;
      const Fp16Run device = train(s);
      s.offload = true;
      const Fp16Run host = train(s);
      const std::string what = str("stage ", stage, " micro-steps ", micro);
      EXPECT_EQ(host.model_dtype, at::kHalf) << what;
      EXPECT_EQ(device.losses, host.losses) << what << ": " << describe(device.losses, host.losses);
      EXPECT_EQ(host.metrics.back().counter("param_bytes") * (stage < 3 ? 3 : 2),
                device.metrics.back().counter("param_bytes"))
          << what;
      EXPECT_GT(host.metrics.back().host_optimizer_bytes, 0) << what;
    }
  }
}

// fp16 keeps 11 bits of mantissa (bf16 8): its trajectory drifts from
// float32's more slowly. The bound is bf16_test's, 4 % of the float32 loss at
// every step over 30 steps; the measured largest gap is printed (LibTorch
// 2.6: 0.026 at 1 rank, about 1.8 % of a loss near 1.48; 0.0044 at 2). No
// step overflows at 2^8 (a skipped step would shift the trajectory).
TEST(Fp16, TracksFloat32Over30Steps) {
  REQUIRE_FP16_CPU();
  for (int stage : {0, 2}) {
    Fp16Setup fp32;
    fp32.stage = stage;
    fp32.fp16 = false;
    fp32.clip = 1.0;
    fp32.steps = 30;
    Fp16Setup fp16 = fp32;
    fp16.fp16 = true;
    const Fp16Run a = train(fp32), b = train(fp16);
    EXPECT_EQ(b.metrics.back().overflows, 0) << "stage " << stage;
    int differ = 0;
    for (size_t i = 0; i < a.losses.size(); ++i) {
      EXPECT_NEAR(a.losses[i], b.losses[i], 0.04 * std::abs(a.losses[i])) << "stage " << stage << " step " << i;
      if (a.losses[i] != b.losses[i]) ++differ;
    }
    EXPECT_GT(differ, 20) << "fp16 ran in float32";
    EXPECT_LT(b.losses.back(), b.losses.front() - 0.5) << "fp16 trains";
    if (world()->rank() == 0) {
      std::printf("fp16 vs float32, stage %d, 30 steps: %s (first loss %.4f, last %.4f vs %.4f)\n", stage,
                  describe(a.losses, b.losses).c_str(), a.losses.front(), b.losses.back(), a.losses.back());
    }
  }
}

// A first scale of 2^30 overflows fp16 (the scaled gradients pass 65504):
// those steps are skipped on every rank, the first overflow is tolerated
// (fp16.hysteresis 2) and each further one halves the scale, until the
// gradients fit and the run trains. At stages 0 and 3 alike (LibTorch 2.6:
// 15 steps skipped at 1 rank, the first clean step 13 at 2^18; 16 at 2
// ranks, two of them after the first clean step, which the bound of 3 allows).
TEST(Fp16, AnOverflowSkipsStepsAndHalvesTheScaleUntilItTrains) {
  REQUIRE_FP16_CPU();
  for (int stage : {0, 3}) {
    Fp16Setup s;
    s.stage = stage;
    s.power = 30;
    s.steps = 40;
    s.clip = 1.0;
    const Fp16Run r = train(s);
    ASSERT_EQ(r.metrics.size(), 40u);
    EXPECT_EQ(r.metrics[0].loss_scale, std::ldexp(1.0, 30));
    EXPECT_TRUE(r.metrics[0].skipped) << "stage " << stage;
    EXPECT_EQ(r.metrics[1].loss_scale, std::ldexp(1.0, 30)) << "the first overflow is tolerated (hysteresis 2)";
    int skipped = 0, first_clean = -1;
    for (size_t i = 0; i < r.metrics.size(); ++i) {
      const StepMetrics& m = r.metrics[i];
      EXPECT_TRUE(std::isfinite(m.loss)) << "step " << i;
      if (m.skipped) ++skipped;
      if (!m.skipped && first_clean < 0) first_clean = static_cast<int>(i);
      EXPECT_EQ(m.overflows, skipped) << "stage " << stage << " step " << i;
      if (i > 0) {
        const double before = r.metrics[i - 1].loss_scale;
        EXPECT_TRUE(m.loss_scale == before || m.loss_scale == before / 2)
            << "stage " << stage << " step " << i << ": scale " << m.loss_scale << " after " << before;
      }
    }
    ASSERT_GE(first_clean, 2) << "stage " << stage;
    ASSERT_LT(first_clean, 30) << "stage " << stage << ": the scale never came down to what fp16 holds";
    EXPECT_LT(r.metrics[first_clean].loss_scale, std::ldexp(1.0, 30)) << "stage " << stage;
    EXPECT_LE(skipped - first_clean, 3) << "stage " << stage << ": overflows after the scale came down";
    EXPECT_LT(r.losses.back(), r.losses[first_clean] - 0.1) << "stage " << stage << ": trains after the overflows";
    if (world()->rank() == 0) {
      std::printf("fp16 stage %d from 2^30: %d steps skipped, first clean step %d at scale %g, loss %.4f -> %.4f\n",
                  stage, skipped, first_clean, r.metrics[first_clean].loss_scale, r.losses[first_clean],
                  r.losses.back());
    }
  }
}

// communication_data_type under fp16: fp16 by default (DeepSpeed's: the
// compute dtype), "fp32" or "fp16" when named; an fp16 reduce needs
// fp16.enabled, whose loss scaler catches an fp16 sum that overflows.
TEST(Fp16Config, TheReduceDtypeFollowsTheComputeDtype) {
  auto parse = [](const std::string& text) {
    const Config c = parse_config(text, "test.json");
    return parallel::mixed_precision(c.bf16, c.fp16.enabled);
  };
  const parallel::MixedPrecision fp16 = parse(R"({"fp16": {"enabled": true}})");
  EXPECT_EQ(fp16.compute_dtype, at::kHalf);
  EXPECT_EQ(fp16.reduce_dtype, at::kHalf);
  EXPECT_EQ(parse(R"({"fp16": {"enabled": true}, "communication_data_type": "fp32"})").reduce_dtype, at::kFloat);
  EXPECT_EQ(parse(R"({"fp16": {"enabled": true}, "communication_data_type": "fp16"})").reduce_dtype, at::kHalf);
  const parallel::MixedPrecision bf16 = parse(R"({"bf16": {"enabled": true}})");
  EXPECT_EQ(bf16.compute_dtype, at::kBFloat16);
  EXPECT_EQ(bf16.reduce_dtype, at::kBFloat16);
  EXPECT_FALSE(parse("{}").enabled());
  EXPECT_THAT(error_of<ConfigError>([&] { parse(R"({"communication_data_type": "fp16"})"); }),
              HasSubstr("communication_data_type \"fp16\" reduces gradients in fp16, but fp16.enabled is false (the "
                        "gradients are float32; an fp16 sum needs fp16's loss scaler"));
  EXPECT_THAT(error_of<ConfigError>([&] {
                parse(R"({"bf16": {"enabled": true}, "communication_data_type": "fp16"})");
              }),
              HasSubstr("but fp16.enabled is false (the model computes in bf16"));
  EXPECT_THAT(error_of<ConfigError>([&] {
                parse(R"({"fp16": {"enabled": true}, "communication_data_type": "bf16"})");
              }),
              HasSubstr("communication_data_type \"bf16\" reduces gradients in bf16, but bf16.enabled is false"));
  // ZeroModel checks the same rule for a caller that builds its own.
  parallel::MixedPrecision bad;
  bad.reduce_dtype = at::kHalf;
  EXPECT_THAT(parallel::check_mixed_precision(bad), HasSubstr("set fp16.enabled true, or communication_data_type"));
}

}  // namespace
}  // namespace remat
