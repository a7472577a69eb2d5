// Sequence parallelism (tensor_parallel.sequence_parallel) on the GPT through
// the engine, the whole world one tensor-parallel group (tp = 2 at np 2, 4 at
// np 4), against the same GPT without it and against tp 1 (every rank alone on
// the same batch): losses over 10 steps with dropout 0.1, every checkpointing
// variant, offloading and each ZeRO stage, the saved bytes of a checkpoint
// region, the replicated parameters' gradients and the errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "models/gpt.h"
#include "parallel/mappings.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

constexpr int64_t kVocab = 13, kSeq = 12, kBatch = 2, kSteps = 10;

// Each rank alone: the tp 1 reference on the batch every rank draws alike.
std::shared_ptr<ParallelLayout> alone() {
  static std::shared_ptr<ParallelLayout> l = [] {
    auto self = testing::world()->split(testing::world()->rank(), 0);
    return std::make_shared<ParallelLayout>(self, ParallelDims::from_world(1, 1));
  }();
  return l;
}

int world_tp() { return testing::world()->size(); }

struct SpSetup {
  int tp = 1;
  bool sp = false;
  std::string dropout_rng = "replicated";
  int stage = 0;
  std::string checkpointing = R"("variant": "none")";
  bool offload = false;
  std::string optimizer = "SGD";
  double dropout = 0.1;
};

std::string config_json(const SpSetup& s) {
  return str(R"({"train_micro_batch_size_per_gpu": )", kBatch, R"(,
    "optimizer": {"type": ")", s.optimizer, R"(", "params": {"lr": 0.05}},
    "zero_optimization": {"stage": )", s.stage, R"(, "stage3_param_persistence_threshold": 0},
    "activation_checkpointing": {)", s.checkpointing, R"(},
    "activation_offloading": {"enabled": )", s.offload ? "true" : "false", R"(, "min_offload_size": 1},
    "tensor_parallel": {"size": )", s.tp, R"(, "sequence_parallel": )", s.sp ? "true" : "false",
             R"(, "sequence_parallel_dropout": ")", s.dropout_rng, R"("},
    "model": {"n_layer": 3, "n_head": 4, "d_model": 16, "d_ff": 32, "seq_len": )", kSeq, R"(, "dropout": )", s.dropout, R"(},
    "train": {"seed": 5}})");
}

struct SpRun {
  std::vector<double> losses;
  std::vector<StepMetrics> metrics;
  std::map<std::string, at::Tensor> grads;  // after the last backward, before its step
};

SpRun train(const SpSetup& s, int64_t steps = kSteps) {
  Config config = parse_config(config_json(s), "<test>");
  EngineOptions options;
  options.layout = s.tp == 1 ? alone() : testing::layout_ptr(s.tp);
  options.blocks = "blocks";
  at::manual_seed(static_cast<uint64_t>(config.train.seed));
  models::GptOptions o;
  o.shape = config.model;
  o.vocab_size = kVocab;
  if (s.tp > 1) o.tensor_parallel = options.layout->tp_group();
  o.sequence_parallel = config.tensor_parallel.sequence_parallel;
  o.sequence_parallel_dropout = config.tensor_parallel.sequence_parallel_dropout;
  models::Gpt model(o);
  auto engine = initialize(model, config, options);
  SpRun run;
  for (int64_t step = 1; step <= steps; ++step) {
    // The same batch on every rank (one data-parallel replica at every tp
    // here) and at every step, so that the loss falls as the model learns it.
    at::Generator gen = at::detail::createCPUGenerator(100);
    at::Tensor x = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong);
    at::Tensor y = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong);
    engine->backward(engine->forward([&] { return model->loss(x, y); }));
    if (step == steps && s.stage == 0) {
      for (const auto& p : model->named_parameters()) {
        if (p.value().grad().defined()) run.grads[p.key()] = p.value().grad().clone();
      }
    }
    engine->step();
    run.losses.push_back(engine->last_metrics().loss);
    run.metrics.push_back(engine->last_metrics());
  }
  return run;
}

void expect_bitwise(const SpRun& a, const SpRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << ", step " << i + 1;
  }
}

double max_relative(const SpRun& a, const SpRun& b) {
  double worst = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    worst = std::max(worst, std::abs(a.losses[i] - b.losses[i]) / std::abs(b.losses[i]));
  }
  return worst;
}

// The forward is the same arithmetic on each token with or without the
// split, so the first loss is bitwise equal; from the second step on the
// parameters differ by the order in which gradients were summed (a LayerNorm
// weight's over this rank's tokens, then over the group).
TEST(SequenceParallel, LossesEqualWithoutItWithReplicatedDropout) {
  const int tp = world_tp();
  const SpRun with = train({tp, true}), without = train({tp, false});
  EXPECT_EQ(with.losses[0], without.losses[0]) << "the first step's forward";
  const double worst = max_relative(with, without);
  std::printf("tp %d, dropout 0.1, %lld steps: sequence parallel vs not: max relative difference %.3g\n", tp,
              static_cast<long long>(kSteps), worst);
  EXPECT_LE(worst, 1e-6);
  // Not vacuous: the model trained.
  EXPECT_LT(with.losses.back(), with.losses.front());
}

// At tp > 1 the attention probabilities' dropout draws from each rank's
// model-parallel stream (each rank its own heads), so no tp > 1 run repeats
// tp 1's masks: against tp 1 the dropout is 0. The row-parallel partial
// products sum in another order than tp 1's matmul: float rounding apart.
TEST(SequenceParallel, LossesEqualTp1WithoutDropout) {
  const int tp = world_tp();
  SpSetup on{tp, true}, one{1, false};
  on.dropout = one.dropout = 0.0;
  const SpRun with = train(on), reference = train(one);
  const double worst = max_relative(with, reference);
  std::printf("tp %d, dropout 0, %lld steps: sequence parallel vs tp 1: max relative difference %.3g\n", tp,
              static_cast<long long>(kSteps), worst);
  EXPECT_LE(worst, 1e-6);
  EXPECT_LT(with.losses.back(), with.losses.front());
}

// Each rank's 1/tp of the sequence: a replicated parameter's gradient is
// computed from its own tokens and summed over the group, so it is the same
// on every rank and equals the one computed from the whole sequence.
TEST(SequenceParallel, ReplicatedParametersGetTheWholeSequencesGradientOnEveryRank) {
  const int tp = world_tp();
  const SpRun with = train({tp, true}, 2), without = train({tp, false}, 2);
  int checked = 0;
  for (const std::string name : {"blocks.0.ln1.weight", "blocks.0.ln2.bias", "blocks.2.fc2.bias", "ln_f.weight",
                                 "pos_emb.weight", "blocks.1.proj.bias"}) {
    ASSERT_TRUE(with.grads.count(name)) << name;
    const at::Tensor& g = with.grads.at(name);
    at::Tensor all = at::empty({tp * g.numel()});
    testing::world()->allGather(all, g.contiguous().view({-1}))->wait();
    for (int r = 1; r < tp; ++r) {
      EXPECT_TRUE(at::equal(all.narrow(0, r * g.numel(), g.numel()), all.narrow(0, 0, g.numel())))
          << name << " differs between rank 0 and rank " << r;
    }
    EXPECT_TRUE(at::allclose(g, without.grads.at(name), 1e-5, 1e-6)) << name;
    EXPECT_GT(g.abs().max().item<double>(), 0.0) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

// The recompute replays each region's dropout draws and collectives: every
// checkpointing variant, offloading, and the planner's plans give the losses
// of no checkpointing bit for bit, with either dropout stream.
TEST(SequenceParallel, EveryCheckpointingVariantMatchesNoCheckpointingBitwise) {
  const int tp = world_tp();
  for (const char* rng : {"replicated", "per_rank"}) {
    SpSetup base{tp, true, rng};
    const SpRun none = train(base);
    const std::vector<std::pair<std::string, std::string>> variants{
        {"full", R"("variant": "full")"},
        {"full, reentrant", R"("variant": "full", "reentrant": true)"},
        {"every 2nd block", R"("variant": "selective_layer", "every_k": 2)"},
        {"selective_op", R"("variant": "selective_op")"},
        {"auto at the knee", R"("variant": "auto", "memory_budget_fraction": "knee")"},
        {"full, host copies, contiguous, partition asked for",
         R"("variant": "full", "cpu_checkpointing": true, "contiguous_memory_optimization": true,
            "number_checkpoints": 3, "partition_activations": true)"}};
    for (const auto& [name, section] : variants) {
      SpSetup s = base;
      s.checkpointing = section;
      expect_bitwise(train(s), none, str(rng, ", ", name));
    }
    SpSetup offload = base;
    offload.offload = true;
    expect_bitwise(train(offload), none, str(rng, ", activation offloading"));
  }
}

// Without accumulation every ZeRO stage reduces the same per-rank gradients
// once: the losses of stage 0 bitwise (here over the one data-parallel
// replica that each tensor-parallel rank is), with full checkpointing too.
TEST(SequenceParallel, EveryZeroStageMatchesStage0) {
  const int tp = world_tp();
  SpSetup base{tp, true, "per_rank"};
  base.optimizer = "AdamW";
  const SpRun stage0 = train(base, 4);
  for (int stage : {1, 2, 3}) {
    for (const char* variant : {R"("variant": "none")", R"("variant": "full")"}) {
      SpSetup s = base;
      s.stage = stage;
      s.checkpointing = variant;
      expect_bitwise(train(s, 4), stage0, str("stage ", stage, ", ", variant));
    }
  }
}

// The per-rank stream draws each rank's own mask: another model than the
// replicated one (which is tp 1's), and still trained.
TEST(SequenceParallel, PerRankDropoutDrawsOtherMasksThanTheReplicatedOne) {
  const int tp = world_tp();
  const SpRun per_rank = train({tp, true, "per_rank"}, 3), replicated = train({tp, true, "replicated"}, 3);
  EXPECT_NE(per_rank.losses[0], replicated.losses[0]);
  EXPECT_LT(std::abs(per_rank.losses[0] - replicated.losses[0]), 0.5);
}

// With full checkpointing a region keeps its input only: 1/tp of the
// sequence, exactly, with sequence parallelism (and partition_activations,
// asked for, splits nothing more).
TEST(SequenceParallel, CheckpointRegionsKeepExactlyOneTpthOfTheirInputs) {
  const int tp = world_tp();
  for (const char* section : {R"("variant": "full")", R"("variant": "full", "partition_activations": true)"}) {
    SpSetup on{tp, true}, off{tp, false};
    on.checkpointing = off.checkpointing = section;
    off.checkpointing = R"("variant": "full")";
    const SpRun with = train(on, 1), without = train(off, 1);
    const int64_t whole = 3 * kBatch * kSeq * 16 * 4;  // 3 blocks of [batch, seq, d_model] floats
    EXPECT_EQ(without.metrics[0].ckpt_saved_bytes, whole) << section;
    EXPECT_EQ(with.metrics[0].ckpt_saved_bytes * tp, whole) << section;
    EXPECT_EQ(with.metrics[0].counter("ckpt_gathered_bytes"), 0) << section << ": nothing gathered in the recompute";
  }
}

// A recompute runs the block's forward again, collectives included, unless
// the region keeps their outputs (save_collectives): then a step moves the
// tensor-parallel bytes of no checkpointing, exactly, and the region holds
// the collectives' outputs instead. Closed forms per block of [2, 12, 16]
// floats (1536 bytes): without sequence parallelism two all-reduces (1536
// each); with it two all-gathers (this rank's 1536 / tp sent each, the whole
// 1536 kept) and two reduce-scatters (1536 in, 1536 / tp kept).
TEST(TensorParallelCollectives, SavedCollectivesAreNotRunAgainInTheRecompute) {
  const int tp = world_tp();
  const int64_t whole = kBatch * kSeq * 16 * 4, blocks = 3;
  for (bool sp : {false, true}) {
    SpSetup base{tp, sp, "per_rank"};
    const SpRun none = train(base, 2);
    SpSetup full = base, saved = base, selective = base;
    full.checkpointing = R"("variant": "full")";
    saved.checkpointing = R"("variant": "full", "save_collectives": true)";
    selective.checkpointing = R"("variant": "selective_op", "save_collectives": true)";
    const SpRun recomputed = train(full, 2), kept = train(saved, 2), selective_kept = train(selective, 2);
    const int64_t forward_bytes = blocks * (sp ? 2 * whole / tp + 2 * whole : 2 * whole);
    const int64_t held = blocks * (sp ? 2 * whole + 2 * whole / tp : 2 * whole);
    const std::string what = sp ? "sequence parallel" : "tensor parallel";
    for (size_t step = 0; step < 2; ++step) {
      const int64_t none_bytes = none.metrics[step].counter("tp_comm_bytes");
      EXPECT_EQ(recomputed.metrics[step].counter("tp_comm_bytes"), none_bytes + forward_bytes) << what;
      EXPECT_EQ(kept.metrics[step].counter("tp_comm_bytes"), none_bytes) << what;
      EXPECT_EQ(selective_kept.metrics[step].counter("tp_comm_bytes"), none_bytes) << what;
      EXPECT_EQ(kept.metrics[step].ckpt_saved_bytes, recomputed.metrics[step].ckpt_saved_bytes + held) << what;
    }
    expect_bitwise(kept, none, what + ", full, collectives kept");
    expect_bitwise(selective_kept, none, what + ", selective_op, collectives kept");
    expect_bitwise(recomputed, none, what + ", full");
    std::printf("%s, tp %d: a step moves %lld tensor-parallel bytes without checkpointing, %lld with full "
                "checkpointing, %lld with its collectives kept, which hold %lld bytes more\n",
                what.c_str(), tp, static_cast<long long>(none.metrics[1].counter("tp_comm_bytes")),
                static_cast<long long>(recomputed.metrics[1].counter("tp_comm_bytes")),
                static_cast<long long>(kept.metrics[1].counter("tp_comm_bytes")), static_cast<long long>(held));
  }
}

TEST(SequenceParallel, ASequenceThatDoesNotSplitEvenlyIsRefusedNamingTheLengthsThatDo) {
  const int tp = world_tp();
  // The configuration: model.seq_len.
  SpSetup s{tp, true};
  std::string text = config_json(s);
  const std::string seq = str(R"("seq_len": )", kSeq);
  text.replace(text.find(seq), seq.size(), str(R"("seq_len": )", kSeq + 1));
  const std::string message = error_of<ConfigError>([&] { parse_config(text, "<test>"); });
  EXPECT_THAT(message, HasSubstr(str("model.seq_len=", kSeq + 1, " is not a multiple of ", tp)));
  EXPECT_THAT(message, HasSubstr(str("set model.seq_len to ", (kSeq + 1) / tp * tp)));
  // A batch whose sequence does not split.
  models::GptOptions o = testing::small_gpt(kVocab, 1, 0.0, tp);
  o.sequence_parallel = true;
  models::Gpt model(o);
  model_parallel_manual_seed(3, testing::layout(tp).tp_rank());
  at::Tensor x = at::zeros({1, kSeq - 1}, at::kLong);
  EXPECT_THAT(error_of<ConfigError>([&] { model->loss(x, x); }),
              HasSubstr(str("a sequence of ", kSeq - 1, " tokens evenly across the ", tp, " tensor-parallel ranks")));
  // Generation pads the context instead: every length works.
  model->eval();
  at::Generator gen = at::detail::createCPUGenerator(3);
  EXPECT_EQ(model->generate(at::zeros({1, 1}, at::kLong), 5, 1.0, gen).size(1), 6);
  // The model itself, built with a seq_len that does not split.
  o.shape.seq_len = kSeq + 1;
  EXPECT_THAT(error_of<ConfigError>([&] { models::Gpt bad(o); }), HasSubstr("model.seq_len=13"));
}

}  // namespace
}  // namespace remat
