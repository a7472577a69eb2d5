// ZeRO through the engine under mpirun: every stage trained against stage
// 0, with and without tensor parallelism, checkpointing, accumulation, bf16,
// hybrid sharding, frozen parameters, every optimizer and overlapped
// reductions: losses, byte accounting, collective volume and gathers per
// unit. Every case runs at 1 to 4 ranks (one rank's group, even and uneven
// shards, tensor parallelism beside data parallelism at 4; hybrid sharding
// at 4 only). ZeroModel alone is parallel/zero_test.cc.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/step_counters.h"
#include "models/gpt.h"
#include "parallel/zero.h"
#include "parallel/zero_test_models.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using parallel::ZeroModel;
using parallel::ZeroStats;

using remat::testing::BranchyNet;
using remat::testing::layout;
using remat::testing::world;

std::vector<int> tp_sizes() { return remat::testing::tp_sizes(2); }

struct TrainRun {
  std::vector<double> losses;
  std::vector<at::Tensor> loss_tensors;
  ZeroStats stats;            // after the last step
  int64_t optimizer_bytes = 0;
  int64_t step_collective_bytes = 0;  // of the last step
  std::map<std::string, int64_t> gathers_per_step;  // of the last step
  std::map<std::string, int64_t> padded;
  int64_t recomputes_per_step = 0;
  // Of the last step: gradient buckets reduced, and the collective bytes.
  int64_t buckets_per_step = 0;
  // Every parameter after training, whole, by name.
  std::map<std::string, at::Tensor> final_params;
  int64_t params = 0;  // Ψ on this rank's model (tensor-parallel shard)
  // Frozen parameters: bitwise unchanged by training, and given no gradient.
  int frozen = 0;
  bool frozen_unchanged = true, frozen_without_gradient = true;
};

struct TrainSetup {
  int tp = 1;
  int stage = 3;
  std::string variant = "none";
  bool partition = false;
  int steps = 20;
  int micro_steps = 1;
  double clip = 1.0;
  double dropout = 0.1;
  bool bf16 = false;
  // Stages 1-3: shard within groups of this many ranks (0: all).
  int hybrid = 0;
  // Stages 1 and 2.
  bool contiguous_gradients = true, overlap_comm = false, reduce_scatter = true, allgather_partitions = true;
  int64_t allgather_bucket_size = 500000000;
  int64_t reduce_bucket_size = 1000;
  int64_t max_live = 1000000000;  // stage 3: stage3_max_live_parameters
  std::string optimizer = "AdamW";  // AdamW, Adam or SGD
  double lr = 1e-2;
  // Freeze (requires_grad false) the first block and the token embedding, as
  // a fine-tuning job freezes its base weights.
  bool freeze = false;
};

std::unique_ptr<torch::optim::Optimizer> make_test_optimizer(const TrainSetup& s,
                                                             std::vector<at::Tensor> params) {
  if (s.optimizer == "SGD") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(s.lr).momentum(0.9).weight_decay(0.01));
  }
  if (s.optimizer == "Adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(s.lr).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(s.lr).weight_decay(0.01));
}

// The engine's configuration for `s`: several gradient buckets per unit.
Config config_of(const TrainSetup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = s.micro_steps;
  c.gradient_clipping = s.clip;
  c.train.seed = 21;
  c.optimizer.type = s.optimizer;
  c.optimizer.lr = s.lr;
  c.bf16.enabled = s.bf16;
  c.tensor_parallel.size = s.tp;
  c.activation_checkpointing.variant = checkpoint_variant_from_name(s.variant);
  c.activation_checkpointing.partition_activations = s.partition;
  auto& z = c.zero_optimization;
  z.stage = s.stage;
  z.stage3_param_persistence_threshold = 0;
  z.reduce_bucket_size = s.reduce_bucket_size;
  z.hybrid_shard_size = s.hybrid;
  z.contiguous_gradients = s.contiguous_gradients;
  z.overlap_comm = s.overlap_comm;
  z.reduce_scatter = s.reduce_scatter;
  z.allgather_partitions = s.allgather_partitions;
  z.allgather_bucket_size = s.allgather_bucket_size;
  z.stage3_max_live_parameters = s.max_live;
  return c;
}

// The GPT trained through the engine with the setting's sharding,
// checkpointing and optimizer; each step's losses, bytes and gathers measured
// around engine.step().
TrainRun train(const TrainSetup& s) {
  const auto& l = layout(s.tp);
  models::GptOptions o = remat::testing::small_gpt(29, 3, s.dropout, s.tp);
  at::manual_seed(21);
  models::Gpt model(o);
  TrainRun run;
  std::map<std::string, at::Tensor> frozen;
  if (s.freeze) {
    for (const auto& item : model->named_parameters()) {
      if (item.key().rfind("blocks.0.", 0) == 0 || item.key().find("tok_emb") != std::string::npos) {
        item.value().requires_grad_(false);
        frozen[item.key()] = item.value().detach().clone();
      }
    }
    run.frozen = static_cast<int>(frozen.size());
  }
  for (const auto& p : model->parameters()) run.params += p.numel();
  const Config config = config_of(s);
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(s.tp);
  options.optimizer = [&](std::vector<at::Tensor> params) { return make_test_optimizer(s, std::move(params)); };
  auto engine = initialize(model, config, options);
  ZeroModel& zero = engine->sharding();
  for (const auto& p : zero.parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "fp32 masters";
  for (int step = 0; step < s.steps; ++step) {
    ContextScope scope(engine->context());  // the counters read below are the engine's
    const Counters before = Counters::read(&zero);
    const auto gathers0 = zero.gather_counts();
    for (int m = 0; m < s.micro_steps; ++m) {
      // Different data on each data-parallel rank, the same within a tensor-parallel group.
      at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12})
                           .mul(l.dp_rank() + 1).add(step * 3 + m).remainder(o.vocab_size);
      engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
      for (const auto& item : model->named_parameters()) {
        if (frozen.count(item.key()) && item.value().grad().defined()) run.frozen_without_gradient = false;
      }
      // With this step's gradients (step() clears them).
      if (m + 1 == s.micro_steps) run.stats = zero.stats();
      engine->step();
    }
    run.losses.push_back(engine->last_metrics().loss);
    run.loss_tensors.push_back(at::full({1}, engine->last_metrics().loss, at::kDouble));
    const Counters this_step = Counters::read(&zero).since(before);
    run.step_collective_bytes = this_step.zero.collective_bytes();
    run.gathers_per_step.clear();
    for (const auto& [name, n] : zero.gather_counts()) run.gathers_per_step[name] = n - gathers0.at(name);
    run.recomputes_per_step = this_step.recomputes;
    run.buckets_per_step = this_step.zero.buckets_reduced;
  }
  for (const auto& [name, value] : zero.full_parameters()) {
    run.final_params[name] = value;
    if (frozen.count(name) && !at::equal(frozen.at(name), value)) run.frozen_unchanged = false;
  }
  int64_t opt = 0;
  for (const auto& [key, state] : engine->optimizer().state()) {
    if (s.optimizer != "AdamW") break;
    auto& st = static_cast<torch::optim::AdamWParamState&>(*state);
    opt += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  run.optimizer_bytes = opt;
  run.padded = zero.unit_padded_numels();
  return run;
}

TEST(ZeroEngine, Stage3MatchesStage0WithinFloatTolerance) {
  for (int tp : tp_sizes()) {
    TrainSetup s;
    s.tp = tp;
    s.stage = 0;
    const TrainRun zero0 = train(s);
    s.stage = 3;
    const TrainRun zero3 = train(s);
    // The same gradients averaged by a reduce-scatter instead of an all-reduce
    // (with 4 ranks the additions may run in another order) and clipped by a
    // global norm summed in another order (per shard, in double): a few
    // float32 ulps of O(1) values per step, carried through AdamW for 20
    // steps. Measured: at most 7.2e-7. 1e-5 is far above that and far below
    // any real difference (a wrong shard moves the loss by > 1e-2).
    double worst = 0;
    for (size_t i = 0; i < zero0.losses.size(); ++i) {
      worst = std::max(worst, std::abs(zero0.losses[i] - zero3.losses[i]));
      EXPECT_NEAR(zero0.losses[i], zero3.losses[i], 1e-5) << "tp " << tp << " step " << i;
    }
    if (world()->rank() == 0) std::printf("tp %d: stage 3 vs stage 0 over 20 steps: max |loss difference| %.3g\n", tp, worst);
    EXPECT_LT(zero3.losses.back(), zero3.losses.front()) << "it learns";
  }
}

TEST(ZeroEngine, CheckpointingOnAndOffIsBitwiseAtStage3) {
  for (int tp : tp_sizes()) {
    TrainSetup s;
    s.tp = tp;
    s.steps = 6;
    const TrainRun off = train(s);
    for (std::string variant : {"full", "selective_op"}) {
      s.variant = variant;
      for (bool partition : {false, true}) {
        s.partition = partition;
        const TrainRun on = train(s);
        for (size_t i = 0; i < off.losses.size(); ++i) {
          EXPECT_TRUE(at::equal(off.loss_tensors[i], on.loss_tensors[i]))
              << "tp " << tp << " " << variant << (partition ? " partitioned" : "") << " step " << i;
        }
      }
    }
  }
}

TEST(ZeroEngine, ModelStateBytesAreSixteenPsiOverN) {
  TrainSetup s;
  s.steps = 1;
  const TrainRun r = train(s);
  const int n = layout(1).dp_group()->size();
  const double psi = static_cast<double>(r.params);
  const double expected = 16.0 * psi / n;
  const double measured = static_cast<double>(r.stats.param_bytes + r.stats.grad_bytes + r.optimizer_bytes);
  EXPECT_NEAR(measured / expected, 1.0, 0.05) << measured << " vs " << expected;
  // Padding only: at most n - 1 elements per flat buffer (two per unit at most).
  EXPECT_GE(measured, expected);
  int64_t largest_block = 0;
  for (const auto& [name, padded] : r.padded) {
    if (name != "root") largest_block = std::max(largest_block, padded * 4);
  }
  const int64_t root = r.padded.at("root") * 4;
  // The unit running and the one fetched ahead, never more.
  EXPECT_EQ(r.stats.peak_gathered_units, 2);
  EXPECT_LE(r.stats.peak_gathered_bytes, std::max(root, largest_block) + largest_block);
  EXPECT_GE(r.stats.peak_gathered_bytes, root + largest_block) << "the last block with the head";
  if (world()->rank() == 0) std::printf("world %d: params %lld, model state %.0f B (16 psi / N = %.0f), peak gathered %lld B\n",
              n, static_cast<long long>(r.params), measured, expected,
              static_cast<long long>(r.stats.peak_gathered_bytes));
}

// stage3_max_live_parameters caps what a prefetch may gather: below two
// blocks no block is fetched ahead (only the head's root unit, during the last
// block), so the peak is the last block with the root; the losses are the same
// bits, since only when parameters arrive changes.
TEST(ZeroEngine, MaxLiveParametersCapsThePrefetch) {
  TrainSetup s;
  s.steps = 3;
  const TrainRun free_run = train(s);
  int64_t block = 0;
  for (const auto& [name, padded] : free_run.padded) {
    if (name != "root") block = std::max(block, padded);
  }
  const int64_t root = free_run.padded.at("root");
  ASSERT_GT(block, root) << "the test model's blocks must outweigh its root for the peaks to differ";
  EXPECT_EQ(free_run.stats.peak_gathered_bytes, 2 * block * 4) << "two blocks: one running, one fetched ahead";
  s.max_live = 2 * block;  // room for two blocks: as without a cap
  EXPECT_EQ(train(s).stats.peak_gathered_bytes, 2 * block * 4);
  s.max_live = 2 * block - 1;
  const TrainRun capped = train(s);
  EXPECT_EQ(capped.stats.peak_gathered_bytes, (block + root) * 4);
  EXPECT_EQ(capped.stats.peak_gathered_units, 2);
  ASSERT_EQ(capped.loss_tensors.size(), free_run.loss_tensors.size());
  for (size_t i = 0; i < capped.loss_tensors.size(); ++i) {
    EXPECT_TRUE(at::equal(capped.loss_tensors[i], free_run.loss_tensors[i])) << "step " << i;
  }
  EXPECT_EQ(capped.gathers_per_step, free_run.gathers_per_step) << "each unit gathered as often";
}

TEST(ZeroEngine, CollectiveBytesFollowFromUnitSizes) {
  TrainSetup s;
  s.steps = 2;
  s.clip = 0;
  const int n = layout(1).dp_group()->size();
  const TrainRun r3 = train(s);
  int64_t expected = 0;
  for (const auto& [name, padded] : r3.padded) expected += 3 * padded * 4;  // 2 gathers + 1 reduce-scatter
  EXPECT_EQ(r3.step_collective_bytes, expected);
  s.stage = 0;
  const TrainRun r0 = train(s);
  EXPECT_EQ(r0.step_collective_bytes, n > 1 ? 2 * r0.params * 4 : 0);  // an all-reduce counts twice
  if (n > 1) {
    const double ratio = static_cast<double>(r3.step_collective_bytes) / r0.step_collective_bytes;
    EXPECT_NEAR(ratio, 1.5, 0.01);
    if (world()->rank() == 0) std::printf("world %d: stage 3 moves %lld B per step, stage 0 %lld B: %.4f x\n", n,
                static_cast<long long>(r3.step_collective_bytes),
                static_cast<long long>(r0.step_collective_bytes), ratio);
  }
}

TEST(ZeroEngine, ACheckpointedUnitGathersOnceInForwardAndOnceInRecompute) {
  for (std::string variant : {"none", "full"}) {
    TrainSetup s;
    s.steps = 2;
    s.variant = variant;
    const TrainRun r = train(s);
    for (const auto& [name, n] : r.gathers_per_step) EXPECT_EQ(n, 2) << variant << " " << name;
    EXPECT_EQ(r.recomputes_per_step, variant == "full" ? 3 : 0);
  }
}

TEST(ZeroEngine, GradientAccumulationMatchesStage0) {
  TrainSetup s;
  s.steps = 5;
  s.micro_steps = 2;
  s.stage = 0;
  const TrainRun a = train(s);
  s.stage = 3;
  const TrainRun b = train(s);
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5) << i;
}

TEST(ZeroEngine, Bf16ComputesFromFp32MasterShards) {
  TrainSetup s;
  s.steps = 8;
  s.dropout = 0.0;
  const TrainRun fp32 = train(s);
  s.bf16 = true;
  const TrainRun bf16 = train(s);
  // bf16 keeps 8 bits of mantissa: the forward's relative error is ~1e-2 at
  // worst; the loss (about 3.4) stays within 0.05 of the float32 one while
  // the masters and optimizer stay float32.
  for (size_t i = 0; i < fp32.losses.size(); ++i) {
    EXPECT_NEAR(bf16.losses[i], fp32.losses[i], 0.05) << "step " << i;
    EXPECT_NE(bf16.losses[i], fp32.losses[i]) << "step " << i << " ran in float32";
  }
  EXPECT_LT(bf16.losses.back(), bf16.losses.front());
  // Gathered parameters are bf16: half the bytes of the float32 units.
  EXPECT_EQ(bf16.stats.peak_gathered_bytes * 2, fp32.stats.peak_gathered_bytes);
  EXPECT_EQ(bf16.stats.param_bytes, fp32.stats.param_bytes) << "fp32 shards either way";
}

// --- Stages 1 and 2, hybrid sharding ----------------------------------------

// The ZeRO paper's model-state bytes per rank for fp32 AdamW (4 bytes of
// parameters, 4 of gradients, 8 of moments per parameter), over n sharding ranks.
double paper_bytes(int stage, double psi, int n) {
  switch (stage) {
    case 0: return 16 * psi;
    case 1: return 8 * psi + 8 * psi / n;
    case 2: return 4 * psi + 12 * psi / n;
    default: return 16 * psi / n;
  }
}

double model_state_bytes(const TrainRun& r) {
  return static_cast<double>(r.stats.param_bytes + r.stats.peak_grad_bytes + r.optimizer_bytes);
}

void expect_close_losses(const TrainRun& a, const TrainRun& b, const std::string& what) {
  double worst = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    worst = std::max(worst, std::abs(a.losses[i] - b.losses[i]));
    EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5) << what << " step " << i;
  }
  if (world()->rank() == 0) std::printf("%s vs stage 0 over %zu steps: max |loss difference| %.3g\n", what.c_str(), a.losses.size(), worst);
}

// Each way of moving the gradients and parameters (reduce-scatter or
// all-reduce, contiguous buffers or not, overlapped or not, all-gather in one
// piece, in pieces, or by broadcasts) trains as stage 0 does, within float
// tolerance (the same bound and reasoning as stage 3's).
TEST(ZeroEngine, Stages1And2MatchStage0WithinFloatTolerance) {
  for (int tp : tp_sizes()) {
    TrainSetup s;
    s.tp = tp;
    s.stage = 0;
    const TrainRun zero0 = train(s);
    struct Variant {
      const char* name;
      int stage;
      bool contiguous, overlap, reduce_scatter, allgather_partitions;
      int64_t allgather_bucket;
    };
    for (const Variant& v : {Variant{"stage 1", 1, true, false, true, true, 500000000},
                             Variant{"stage 1 all-reduce, gradients on parameters", 1, false, false, false, true, 500000000},
                             Variant{"stage 2 overlapped", 2, true, true, true, true, 500000000},
                             Variant{"stage 2 gradients on parameters, broadcasts", 2, false, false, true, false, 500000000},
                             Variant{"stage 2 all-gather in 64-element pieces", 2, true, true, true, true, 64}}) {
      TrainSetup t = s;
      t.stage = v.stage;
      t.contiguous_gradients = v.contiguous;
      t.overlap_comm = v.overlap;
      t.reduce_scatter = v.reduce_scatter;
      t.allgather_partitions = v.allgather_partitions;
      t.allgather_bucket_size = v.allgather_bucket;
      const TrainRun r = train(t);
      expect_close_losses(zero0, r, str("tp ", tp, " ", v.name));
      EXPECT_LT(r.losses.back(), r.losses.front()) << v.name << ": it learns";
    }
  }
}

TEST(ZeroEngine, Stages1And2WithCheckpointingAndAccumulationMatchStage0) {
  TrainSetup s;
  s.steps = 6;
  s.micro_steps = 2;
  s.variant = "full";
  s.stage = 0;
  const TrainRun a = train(s);
  for (int stage : {1, 2}) {
    s.stage = stage;
    expect_close_losses(a, train(s), str("stage ", stage, ", full checkpointing, 2 micro-steps"));
  }
}

// Per-rank model state: parameters, the most gradient bytes held at once and
// AdamW's moments, against 8 psi + 8 psi / N (stage 1) and 4 psi + 12 psi / N
// (stage 2). What is above the formula: padding (fewer than N elements per
// bucket) and the gradient buckets being reduced (each at most
// reduce_bucket_size elements).
TEST(ZeroEngine, Stages1And2ModelStateBytesFollowThePaper) {
  const int n = layout(1).dp_group()->size();
  for (int stage : {0, 1, 2, 3}) {
    TrainSetup s;
    s.steps = 2;
    s.stage = stage;
    // Overlapped reductions must not hold every bucket's gradients to the end.
    s.overlap_comm = true;
    const TrainRun r = train(s);
    const double psi = static_cast<double>(r.params);
    const double expected = paper_bytes(stage, psi, n);
    const double measured = model_state_bytes(r);
    // Stage 1 overlapped in a one-micro-step window frees each bucket's full
    // gradients once reduced, as stage 2 does: it may hold as little as
    // stage 2's formula.
    EXPECT_GE(measured, stage == 1 ? paper_bytes(2, psi, n) : expected) << "stage " << stage;
    // Slack: three buckets of 1000 float32 elements in flight and padding.
    EXPECT_LE(measured, expected + (stage == 1 || stage == 2 ? 3 * 1000 * 4 : 0) + 64 * n * 16) << "stage " << stage;
    if (world()->rank() == 0) {
      std::printf("world %d stage %d: psi %.0f, model state %.0f B (params %lld, peak grads %lld, optimizer %lld), "
                  "paper %.0f B: %.4f x\n", n, stage, psi, measured, static_cast<long long>(r.stats.param_bytes),
                  static_cast<long long>(r.stats.peak_grad_bytes), static_cast<long long>(r.optimizer_bytes),
                  expected, measured / expected);
    }
  }
}

// Stages 1 and 2 move what stage 0 moves (a reduce-scatter and an all-gather
// are one all-reduce), up to padding.
TEST(ZeroEngine, Stages1And2MoveWhatStage0Moves) {
  const int n = layout(1).dp_group()->size();
  if (n == 1) GTEST_SKIP() << "nothing moves at one rank";
  TrainSetup s;
  s.steps = 2;
  s.clip = 0;
  s.stage = 0;
  const TrainRun r0 = train(s);
  for (int stage : {1, 2}) {
    s.stage = stage;
    const TrainRun r = train(s);
    const double ratio = static_cast<double>(r.step_collective_bytes) / r0.step_collective_bytes;
    EXPECT_GE(ratio, 1.0);
    EXPECT_LT(ratio, 1.01) << "stage " << stage;
    if (world()->rank() == 0) std::printf("world %d: stage %d moves %lld B per step, stage 0 %lld B: %.4f x\n", n, stage,
                                          static_cast<long long>(r.step_collective_bytes),
                                          static_cast<long long>(r0.step_collective_bytes), ratio);
  }
}

// Hybrid sharding at 4 ranks (shard 2 x replicate 2): stages 1-3 train as
// stage 0 does, with the model state of 2-way sharding.
TEST(ZeroEngine, HybridShardingMatchesStage0) {
  const int n = layout(1).dp_group()->size();
  if (n != 4) GTEST_SKIP() << "shard 2 x replicate 2 needs 4 ranks";
  TrainSetup s;
  s.stage = 0;
  const TrainRun zero0 = train(s);
  for (int stage : {1, 2, 3}) {
    TrainSetup t = s;
    t.stage = stage;
    t.hybrid = 2;
    const TrainRun r = train(t);
    expect_close_losses(zero0, r, str("hybrid 2 x 2 stage ", stage));
    const double psi = static_cast<double>(r.params);
    const double expected = paper_bytes(stage, psi, 2);
    // One step's peak: measured after 20 steps the peak is the same.
    EXPECT_GE(model_state_bytes(r), expected) << "stage " << stage;
    EXPECT_LE(model_state_bytes(r), expected + (stage == 1 || stage == 2 ? 3 * 1000 * 4 : 0) + 64 * 2 * 16) << "stage " << stage;
    if (world()->rank() == 0) std::printf("hybrid 2 x 2 stage %d: model state %.0f B, paper (N = 2) %.0f B\n", stage,
                                          model_state_bytes(r), expected);
  }
}

// Every optimizer remat offers at every stage, with and without frozen
// parameters: the same training as stage 0. An optimizer may update its
// parameters without bumping their version counters (LibTorch 1.13's SGD):
// stages 1 and 2 must gather the stepped shards all the same. Frozen
// parameters get no gradient (weight decay and momentum would move zeros) and
// are bitwise unchanged, whole in the export.
TEST(ZeroEngine, EveryOptimizerAtEveryStageWithAndWithoutFrozenParametersMatchesStage0) {
  for (std::string optimizer : {"SGD", "Adam", "AdamW"}) {
    for (bool freeze : {false, true}) {
      TrainSetup s;
      s.steps = 4;
      s.optimizer = optimizer;
      s.lr = optimizer == "SGD" ? 0.5 : 1e-2;
      s.freeze = freeze;
      s.stage = 0;
      const TrainRun zero0 = train(s);
      const std::string what = str(optimizer, freeze ? " with frozen parameters" : "");
      if (freeze) {
        EXPECT_GT(zero0.frozen, 0);
        EXPECT_TRUE(zero0.frozen_unchanged) << what << " stage 0";
        EXPECT_TRUE(zero0.frozen_without_gradient) << what << " stage 0";
      }
      for (int stage : {1, 2, 3}) {
        s.stage = stage;
        const TrainRun run = train(s);
        expect_close_losses(zero0, run, str(what, ", stage ", stage));
        EXPECT_TRUE(run.frozen_unchanged) << what << " stage " << stage;
        EXPECT_TRUE(run.frozen_without_gradient) << what << " stage " << stage;
      }
    }
  }
  // Frozen tensor-parallel shards (stage 3 keeps them in flat groups of their own).
  for (int tp : tp_sizes()) {
    if (tp == 1) continue;
    TrainSetup s;
    s.tp = tp;
    s.steps = 4;
    s.freeze = true;
    s.stage = 0;
    const TrainRun zero0 = train(s);
    for (int stage : {1, 3}) {
      s.stage = stage;
      const TrainRun run = train(s);
      expect_close_losses(zero0, run, str("tp ", tp, " with frozen parameters, stage ", stage));
      EXPECT_TRUE(run.frozen_unchanged) << "tp " << tp << " stage " << stage;
      EXPECT_TRUE(run.frozen_without_gradient) << "tp " << tp << " stage " << stage;
    }
  }
}

// --- Overlapped gradient reduction (overlap_comm at stages 0 and 1) ----------

bool same_params(const TrainRun& a, const TrainRun& b) {
  if (a.final_params.size() != b.final_params.size()) return false;
  for (const auto& [name, value] : a.final_params) {
    if (!b.final_params.count(name) || !at::equal(value, b.final_params.at(name))) return false;
  }
  return true;
}

// The buckets reduced while the backward runs are the ones reduced after it,
// in the same order, with the same sums: losses and parameters bitwise equal,
// under gradient accumulation (nothing reduced before the window's last
// micro-step: as many buckets per step as without it), checkpointing, frozen
// parameters and every optimizer.
TEST(ZeroEngine, OverlappedReductionIsBitwiseTheReductionAfterTheBackward) {
  struct Case {
    std::string optimizer;
    bool freeze;
    int micro_steps;
    const char* variant;
  };
  for (int stage : {0, 1}) {
    int64_t buckets_one_micro_step = -1;
    for (const Case& c : {Case{"AdamW", false, 1, "none"}, Case{"AdamW", false, 3, "full"},
                          Case{"SGD", true, 2, "none"}, Case{"Adam", true, 1, "full"}}) {
      TrainSetup s;
      s.stage = stage;
      s.steps = 3;
      s.optimizer = c.optimizer;
      s.lr = c.optimizer == "SGD" ? 0.5 : 1e-2;
      s.freeze = c.freeze;
      s.micro_steps = c.micro_steps;
      s.variant = c.variant;
      const std::string what = str("stage ", stage, " ", c.optimizer, c.freeze ? " frozen" : "", ", ",
                                   c.micro_steps, " micro-steps, checkpointing ", c.variant);
      const TrainRun after = train(s);
      s.overlap_comm = true;
      const TrainRun during = train(s);
      ASSERT_EQ(after.losses.size(), during.losses.size());
      for (size_t i = 0; i < after.losses.size(); ++i) EXPECT_EQ(after.losses[i], during.losses[i]) << what << " step " << i;
      EXPECT_TRUE(same_params(after, during)) << what << ": parameters differ";
      EXPECT_EQ(during.step_collective_bytes, after.step_collective_bytes) << what;
      EXPECT_EQ(during.buckets_per_step, after.buckets_per_step) << what;
      if (!c.freeze) {
        if (buckets_one_micro_step < 0) buckets_one_micro_step = during.buckets_per_step;
        EXPECT_EQ(during.buckets_per_step, buckets_one_micro_step) << what << ": reduced before the window's end";
      }
      EXPECT_TRUE(during.frozen_unchanged && during.frozen_without_gradient) << what;
      EXPECT_LT(during.losses.back(), during.losses.front()) << what << ": it learns";
    }
    EXPECT_GT(buckets_one_micro_step, 1) << "several buckets";
  }
}

// Stage 0's buckets now go in reverse registration order, many per step.
// One rank's sum of two values does not depend on how the buffer is cut, so
// at 2 ranks the result is bitwise that of one bucket for everything; at 3
// and 4 ranks MPI may sum in another order for another message size: within
// 1e-6 relative there.
TEST(ZeroEngine, OverlappedBucketsMatchOneBucketForTheWholeModel) {
  const int n = layout(1).dp_group()->size();
  TrainSetup s;
  s.stage = 0;
  s.steps = 4;
  s.reduce_bucket_size = 1000000000;
  const TrainRun one = train(s);
  s.reduce_bucket_size = 1000;
  s.overlap_comm = true;
  const TrainRun many = train(s);
  EXPECT_EQ(one.buckets_per_step, n > 1 ? 1 : one.buckets_per_step);
  EXPECT_GT(many.buckets_per_step, 1);
  double worst = 0;
  for (size_t i = 0; i < one.losses.size(); ++i) {
    const double rel = std::abs(one.losses[i] - many.losses[i]) / std::abs(one.losses[i]);
    worst = std::max(worst, rel);
    if (n <= 2) {
      EXPECT_EQ(one.losses[i], many.losses[i]) << "step " << i;
    } else {
      EXPECT_LE(rel, 1e-6) << "step " << i;
    }
  }
  if (n <= 2) {
    EXPECT_TRUE(same_params(one, many));
  }
  if (world()->rank() == 0) {
    std::printf("world %d: %lld buckets overlapped vs one after the backward: max relative loss difference %.3g\n", n,
                static_cast<long long>(many.buckets_per_step), worst);
  }
}

std::pair<std::vector<double>, std::map<std::string, at::Tensor>> train_branchy(int stage, bool overlap,
                                                                                 int micro_steps) {
  const auto& l = layout(1);
  at::manual_seed(8);
  BranchyNet net;
  Config config;
  config.train_micro_batch_size_per_gpu = 2;
  config.gradient_accumulation_steps = micro_steps;
  config.train.seed = 8;
  config.optimizer.type = "AdamW";
  config.optimizer.lr = 0.01;
  config.zero_optimization.stage = stage;
  config.zero_optimization.reduce_bucket_size = 40;
  config.zero_optimization.overlap_comm = overlap;
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(1);
  auto engine = initialize(net, config, options);
  std::vector<double> losses;
  for (int step = 0; step < 4; ++step) {
    for (int m = 0; m < micro_steps; ++m) {
      at::Tensor idx = at::arange(12, at::kLong).view({2, 6}).mul(l.dp_rank() + 2).add(step + m).remainder(13);
      // Rank 0 uses the side branch on even steps, the others on odd ones.
      const bool use_side = (step + l.dp_rank() + m) % 2 == 0;
      engine->backward(engine->forward([&] { return net->loss(idx, use_side, step % 2 == 1); }));
      engine->step();
    }
    losses.push_back(engine->last_metrics().loss);
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& [name, value] : engine->sharding().full_parameters()) params[name] = value;
  return {losses, params};
}

// Parameters unused in a step (on some ranks, or always) do not stall the
// overlapped reduction: their buckets, and the ones after them, are reduced
// after the backward with zeros for the missing gradients, so every rank
// reduces the same buffers; the result is bitwise that of reducing after the
// backward, with and without accumulation.
TEST(ZeroEngine, UnusedParametersAndAutogradGradDoNotStallOverlappedReduction) {
  for (int stage : {0, 1}) {
    for (int micro_steps : {1, 2}) {
      const auto after = train_branchy(stage, false, micro_steps);
      const auto during = train_branchy(stage, true, micro_steps);
      const std::string what = str("stage ", stage, ", ", micro_steps, " micro-steps");
      ASSERT_EQ(after.first.size(), during.first.size());
      for (size_t i = 0; i < after.first.size(); ++i) EXPECT_EQ(after.first[i], during.first[i]) << what << " step " << i;
      for (const auto& [name, value] : after.second) {
        EXPECT_TRUE(at::equal(value, during.second.at(name))) << what << ": " << name;
      }
      // Replicas agree: every rank's parameters equal rank 0's.
      for (const auto& [name, value] : during.second) {
        at::Tensor mine = value.clone(), first = value.clone();
        layout(1).dp_group()->broadcast(first, {0})->wait();
        EXPECT_TRUE(at::equal(mine, first)) << what << ": " << name << " differs from rank 0's";
      }
    }
  }
}

}  // namespace
}  // namespace remat
