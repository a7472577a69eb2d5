// fp16's loss scaling through the engine, under mpirun at 1 and 2 ranks.
// The loss scaler runs over float32 compute through the test seam
// (EngineOptions::fp16_scaler_at_float32), on any CPU (LibTorch 1.13's cannot
// compute in fp16; fp16 compute itself is engine/fp16_test.cc): the loss is scaled (the gradients carry the scale, bitwise), the
// gradients unscaled (a power-of-two scale gives float32's training bit for
// bit), an overflow injected into one rank's shard of the gradients skips
// the step on every rank and updates the scale, the metrics carry the scale,
// the scaler's state is saved and resumed bitwise. Also: the fp16 section's
// keys and errors, and fp16 refused where the device cannot compute it.
// The scaler's arithmetic alone is optim/loss_scaler_test.cc.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

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

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using remat::testing::error_of;
using remat::testing::world;

struct RunSetup {
  int stage = 0;
  bool fp16 = true;
  bool seam = true;
  int steps = 6;
  int power = 16;
  int64_t window = 1000;
  int hysteresis = 2;
  double min_scale = 1;
  bool schedule = false;  // WarmupDecayLR (linear, warm-up 3, total 8) instead of a constant rate
  // Steps (1-based) whose gradients get an inf, on `inject_rank` only, in
  // the first shard that holds an element there.
  std::set<int> inject;
  int inject_rank = 0;
  // Save after this step into `save_dir` (0: none); resume from `resume_dir` first.
  int save_after = 0;
  std::string save_dir, resume_dir;
};

struct TrainRun {
  std::vector<StepMetrics> metrics;
  std::vector<nlohmann::json> lines;
  std::vector<at::Tensor> final_shards;
  std::vector<bool> shards_unchanged;  // per step: the shards bitwise as before it
  std::vector<at::Tensor> first_grads;  // after the first backward, before step()
};

Config config_of(const RunSetup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_clipping = 1.0;
  c.train.seed = 5;
  c.optimizer.lr = 1e-2;
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  c.zero_optimization.reduce_bucket_size = 1000;
  c.fp16.enabled = s.fp16;
  c.fp16.initial_scale_power = s.power;
  c.fp16.loss_scale_window = s.window;
  c.fp16.hysteresis = s.hysteresis;
  c.fp16.min_loss_scale = s.min_scale;
  if (s.schedule) {
    c.scheduler.type = "WarmupDecayLR";
    c.scheduler.warmup_min_lr = 0;
    c.scheduler.warmup_max_lr = 1e-2;
    c.scheduler.warmup_num_steps = 3;
    c.scheduler.warmup_type = "linear";
    c.scheduler.total_num_steps = 8;
  }
  return c;
}

void inject_inf(parallel::ZeroModel& zero) {
  for (auto& p : zero.parameters()) {
    if (p.grad().defined() && p.grad().numel() > 0) {
      p.mutable_grad().view({-1})[0] = std::numeric_limits<float>::infinity();
      return;
    }
  }
  ADD_FAILURE() << "no gradient to inject into";
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& tensors, bool grads) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(grads ? (t.grad().defined() ? t.grad().clone() : at::Tensor())
                                                    : t.detach().clone());
  return out;
}

bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined() || (a[i].defined() && !at::equal(a[i], b[i]))) return false;
  }
  return true;
}

TrainRun train(const RunSetup& s) {
  models::GptOptions o = remat::testing::small_gpt(29, 2, /*dropout=*/0.0);
  at::manual_seed(5);
  models::Gpt model(o);
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(1);
  options.fp16_scaler_at_float32 = s.seam;
  auto engine = initialize(model, config_of(s), options);
  parallel::ZeroModel& zero = engine->sharding();
  if (!s.resume_dir.empty()) engine->load_checkpoint(s.resume_dir);
  const int dp_rank = remat::testing::layout(1).dp_rank();
  TrainRun run;
  for (int step = static_cast<int>(engine->global_steps()) + 1; step <= s.steps; ++step) {
    const auto before = clones(zero.parameters(), false);
    at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12}).mul(dp_rank + 1).add(step * 3).remainder(29);
    engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
    if (run.first_grads.empty()) run.first_grads = clones(zero.parameters(), true);
    if (s.inject.count(step) && world()->rank() == s.inject_rank) inject_inf(zero);
    engine->step();
    run.metrics.push_back(engine->last_metrics());
    run.lines.push_back(engine->last_metrics().to_json());
    run.shards_unchanged.push_back(all_equal(before, clones(zero.parameters(), false)));
    if (step == s.save_after) engine->save_checkpoint(s.save_dir);
  }
  run.final_shards = clones(zero.parameters(), false);
  return run;
}

// A shared folder for this job (rank 0 names it).
std::string job_dir(const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir = (fs::temp_directory_path() / str("remat_fp16_", stamp.item<int64_t>(), "_", name)).string();
  world()->barrier()->wait();
  return dir;
}

// Scaled by a power of two and unscaled before clipping, float32 compute
// trains bit for bit as without the scaler, at every stage; the gradients
// the backward leaves carry the scale exactly.
TEST(LossScaling, ScaledAndUnscaledTrainsAsFloat32BitForBit) {
  for (int stage : {0, 1, 2, 3}) {
    RunSetup s;
    s.stage = stage;
    s.fp16 = false;
    const TrainRun plain = train(s);
    s.fp16 = true;
    const TrainRun scaled = train(s);
    ASSERT_EQ(plain.metrics.size(), scaled.metrics.size());
    for (size_t i = 0; i < plain.metrics.size(); ++i) {
      EXPECT_EQ(plain.metrics[i].loss, scaled.metrics[i].loss) << "stage " << stage << " step " << i + 1;
      EXPECT_EQ(scaled.metrics[i].loss_scale, 65536) << "stage " << stage;
      EXPECT_FALSE(scaled.metrics[i].skipped);
      EXPECT_EQ(scaled.lines[i]["loss_scale"], 65536.0);
      EXPECT_EQ(scaled.lines[i]["overflows"], 0);
      EXPECT_EQ(scaled.lines[i]["skipped"], false);
      // Without fp16 the metrics' keys are as they were.
      EXPECT_FALSE(plain.lines[i].contains("loss_scale") || plain.lines[i].contains("overflows") ||
                   plain.lines[i].contains("skipped"))
          << plain.lines[i].dump();
    }
    EXPECT_TRUE(all_equal(plain.final_shards, scaled.final_shards)) << "stage " << stage;
    ASSERT_EQ(plain.first_grads.size(), scaled.first_grads.size());
    for (size_t i = 0; i < plain.first_grads.size(); ++i) {
      if (!plain.first_grads[i].defined()) continue;
      EXPECT_TRUE(at::equal(plain.first_grads[i] * 65536, scaled.first_grads[i])) << "stage " << stage;
      if (plain.first_grads[i].numel() > 0 && plain.first_grads[i].abs().max().item<float>() > 0) {
        EXPECT_FALSE(at::equal(plain.first_grads[i], scaled.first_grads[i])) << "the scale is applied";
      }
    }
  }
}

// An inf in one rank's shard of the gradients (the last rank's): every rank
// skips the step and leaves its shards as they were; the first overflow is
// tolerated (hysteresis 2), the second halves the scale; train.on_nonfinite
// (stop, its default) does not apply with fp16.
// The rates DeepSpeed's engine trains `skipped` (per step) at under the
// schedule of RunSetup::schedule: its WarmupDecayLR (linear) sets
// warmup_min_lr when built (position -1) and advances one position after each
// step that is not an overflow.
std::vector<double> deepspeed_rates(const std::vector<bool>& skipped) {
  const double lo = 0, hi = 1e-2, warmup = 3, total = 8;
  std::vector<double> out;
  int position = -1;
  for (bool skip : skipped) {
    const double i = position;
    out.push_back(i < 0         ? lo
                  : i < warmup ? lo + (hi - lo) * i / warmup
                               : lo + (hi - lo) * std::max(0.0, (total - i) / std::max(1.0, total - warmup)));
    if (!skip) ++position;
  }
  return out;
}

TEST(LossScaling, AnOverflowInOneRanksShardSkipsOnEveryRankAndHalves) {
  // Steps 2 and 3 overflow: the schedule stands still over them.
  const std::vector<double> rates = deepspeed_rates({false, true, true, false, false, false});
  const std::vector<double> expected = {0, 0, 0, 0, 1e-2 / 3, 2e-2 / 3};
  for (size_t i = 0; i < rates.size(); ++i) EXPECT_DOUBLE_EQ(rates[i], expected[i]) << "step " << i + 1;
  for (int stage : {0, 1, 2, 3}) {
    RunSetup s;
    s.stage = stage;
    s.schedule = true;
    s.inject = {2, 3};
    s.inject_rank = world()->size() - 1;
    const TrainRun run = train(s);
    const std::vector<double> scales = {65536, 65536, 65536, 32768, 32768, 32768};
    const std::vector<int64_t> overflows = {0, 1, 2, 2, 2, 2};
    for (size_t i = 0; i < run.metrics.size(); ++i) {
      const bool skip = i == 1 || i == 2;
      EXPECT_EQ(run.metrics[i].skipped, skip) << "stage " << stage << " step " << i + 1;
      // (Steps 1 and 4 train at rate 0: their shards stay too.)
      EXPECT_EQ(run.shards_unchanged[i], skip || rates[i] == 0) << "stage " << stage << " step " << i + 1;
      EXPECT_EQ(run.metrics[i].loss_scale, scales[i]) << "stage " << stage << " step " << i + 1;
      EXPECT_EQ(run.metrics[i].overflows, overflows[i]) << "stage " << stage << " step " << i + 1;
      EXPECT_EQ(run.lines[i]["skipped"], skip);
      EXPECT_DOUBLE_EQ(run.metrics[i].lr, rates[i]) << "stage " << stage << " step " << i + 1;
      if (skip) {
        EXPECT_EQ(run.metrics[i].grad_norm, -1);
      }
    }
  }
}

// An overflow at fp16.min_loss_scale stops every rank with the same error.
TEST(LossScaling, AnOverflowAtTheFloorStopsEveryRank) {
  RunSetup s;
  s.stage = 2;
  s.power = 3;
  s.min_scale = 8;
  s.hysteresis = 1;
  s.inject = {2};
  s.inject_rank = world()->size() - 1;
  EXPECT_THAT(error_of<Error>([&] { train(s); }),
              HasSubstr("step 2: fp16: the gradients overflowed at the loss scale's floor (fp16.min_loss_scale = 8)"));
}

// The scaler's state is saved with the step and resumed bitwise: a run
// resumed from step 3 goes on as the uninterrupted one (scale, overflow
// count, losses, shards). A save made without fp16 holds none and starts
// an fp16 run at the first scale.
TEST(LossScaling, StateIsSavedAndResumedBitwise) {
  const std::string dir = job_dir("resume");
  RunSetup s;
  s.stage = 2;
  s.window = 2;
  s.schedule = true;
  s.inject = {2, 3};
  s.inject_rank = world()->size() - 1;
  s.steps = 7;
  s.save_after = 4;
  s.save_dir = dir;
  const TrainRun whole = train(s);
  std::ifstream manifest(fs::path(dir) / "step_00000004" / "manifest.json");
  const nlohmann::json m = nlohmann::json::parse(manifest);
  ASSERT_TRUE(m.contains("loss_scaler")) << m.dump();
  EXPECT_EQ(m["loss_scaler"]["overflows"], 2);
  EXPECT_EQ(m["skipped_steps"], 2) << "the schedule's position is step - skipped_steps";
  EXPECT_EQ(m["loss_scaler"]["scale"], 32768.0);

  RunSetup r = s;
  r.save_after = 0;
  r.resume_dir = dir;
  const TrainRun resumed = train(r);
  ASSERT_EQ(resumed.metrics.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const StepMetrics &a = whole.metrics[4 + i], &b = resumed.metrics[i];
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.loss, b.loss) << "step " << a.step;
    EXPECT_EQ(a.loss_scale, b.loss_scale) << "step " << a.step;
    EXPECT_EQ(a.overflows, b.overflows) << "step " << a.step;
    EXPECT_EQ(a.lr, b.lr) << "step " << a.step;
  }
  EXPECT_DOUBLE_EQ(whole.metrics[4].lr, deepspeed_rates({false, true, true, false, false})[4]);
  // Step 6 follows two clean steps since the overflow: it doubles the scale
  // for step 7, having used the halved one.
  EXPECT_EQ(whole.metrics[5].loss_scale, 32768);
  EXPECT_EQ(whole.metrics[6].loss_scale, 65536);
  EXPECT_TRUE(all_equal(whole.final_shards, resumed.final_shards));

  // A float32 save: no scaler state in it; fp16 resumes it at the first scale.
  const std::string plain_dir = job_dir("plain");
  RunSetup p;
  p.fp16 = false;
  p.steps = 2;
  p.save_after = 2;
  p.save_dir = plain_dir;
  train(p);
  std::ifstream plain_manifest(fs::path(plain_dir) / "step_00000002" / "manifest.json");
  EXPECT_FALSE(nlohmann::json::parse(plain_manifest).contains("loss_scaler"));
  RunSetup q;
  q.steps = 3;
  q.resume_dir = plain_dir;
  const TrainRun from_plain = train(q);
  ASSERT_EQ(from_plain.metrics.size(), 1u);
  EXPECT_EQ(from_plain.metrics[0].loss_scale, 65536);
  world()->barrier()->wait();
  if (world()->rank() == 0) {
    fs::remove_all(dir);
    fs::remove_all(plain_dir);
  }
}

// Without the seam, fp16 on a CPU that cannot compute it (LibTorch 1.13) is
// refused at initialize, naming fp16, the device and what to do instead.
// Where it can (LibTorch 2.6), engine/fp16_test.cc trains in fp16.
TEST(LossScaling, Fp16IsRefusedWhereTheDeviceCannotComputeIt) {
  if (internal::fp16_compute_failure(c10::Device(c10::DeviceType::CPU)).empty()) {
    GTEST_SKIP() << "this LibTorch computes fp16 on the CPU: engine/fp16_test.cc trains in it";
  }
  RunSetup s;
  s.seam = false;
  const std::string msg = error_of<ConfigError>([&] { train(s); });
  EXPECT_THAT(msg, HasSubstr("fp16.enabled is true"));
  EXPECT_THAT(msg, HasSubstr("the cpu device"));
  EXPECT_THAT(msg, HasSubstr("Set bf16.enabled instead"));
}

Config parse(const std::string& text) { return parse_config(text, "test.json"); }

std::string config_error(const std::string& text) {
  return error_of<ConfigError>([&] { parse(text); });
}

// The fp16 section of the ds_configs users have: every key bound, with
// DeepSpeed's defaults; each broken rule named by its key.
TEST(LossScalingConfig, TheFp16SectionBindsEveryKey) {
  const Config d = parse("{}");
  EXPECT_FALSE(d.fp16.enabled);
  EXPECT_FALSE(d.fp16.auto_cast);
  EXPECT_EQ(d.fp16.loss_scale, 0);
  EXPECT_EQ(d.fp16.initial_scale_power, 16);
  EXPECT_EQ(d.fp16.loss_scale_window, 1000);
  EXPECT_EQ(d.fp16.hysteresis, 2);
  EXPECT_FALSE(d.fp16.consecutive_hysteresis);
  EXPECT_EQ(d.fp16.min_loss_scale, 1);
  const Config c = parse(R"({"fp16": {"enabled": true, "auto_cast": false, "loss_scale": 0,
      "initial_scale_power": 32, "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": true,
      "min_loss_scale": 0.5, "fp16_master_weights_and_grads": false}})");
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 32);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_EQ(parse(R"({"fp16": {"loss_scale": 128}})").fp16.loss_scale, 128);
  EXPECT_EQ(nlohmann::json::parse(c.to_json())["fp16"]["hysteresis"], 3);

  const std::string broken = R"("loss_scale": -2, "loss_scale_window": 0, "hysteresis": 0,
      "min_loss_scale": 0, "initial_scale_power": 300)";
  const std::string msg = config_error(R"({"fp16": {"enabled": true, )" + broken + "}}");
  EXPECT_THAT(msg, HasSubstr("5 problems"));
  for (const char* key : {"'fp16.loss_scale' = -2", "'fp16.loss_scale_window' = 0", "'fp16.hysteresis' = 0",
                          "'fp16.min_loss_scale' = 0", "'fp16.initial_scale_power' = 300"}) {
    EXPECT_THAT(msg, HasSubstr(key));
  }
  EXPECT_THAT(config_error(R"({"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}})"),
              HasSubstr("'fp16.fp16_master_weights_and_grads' is true, which keeps master weights and gradients "
                        "in fp16"));
  // fp16 off (enabled false, or left out as DeepSpeed's default): the section
  // asks for nothing, and its other keys are not checked (issue 49, item 12).
  EXPECT_FALSE(parse(R"({"fp16": {"enabled": false, "fp16_master_weights_and_grads": true, )" + broken + "}}")
                   .fp16.enabled);
  EXPECT_FALSE(parse(R"({"fp16": {"fp16_master_weights_and_grads": true}})").fp16.enabled);
  EXPECT_THAT(config_error(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
              HasSubstr("'fp16.enabled' and 'bf16.enabled' are both true"));
  EXPECT_THAT(config_error(R"({"fp16": {"hysterisis": 2}})"), HasSubstr("did you mean 'fp16.hysteresis'?"));
  EXPECT_THAT(error_of<ConfigError>([] { parse_config("{}", "test.json", {"fp16.enabled=true", "fp16.hysteresis=0"}); }),
              HasSubstr("config error in --set fp16.hysteresis=0: 'fp16.hysteresis' = 0 must be at least 1"));
}

}  // namespace
}  // namespace remat
