// The memory estimator's rules on one process: the cold GPT's parameters are
// the built model's, each stage shards what it should, the rows and the
// configured mark, the budgets, the cheapest change, and misuse. Its figures
// against measured steps at 2 ranks: tests/memory_test.sh.
#include "engine/memory_estimate.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "models/gpt.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

Config config_of(const std::vector<std::string>& overrides) {
  return parse_config(default_config_text(), "<default>", overrides);
}

constexpr int64_t kVocab = 118;

models::Gpt build(const Config& c) {
  at::manual_seed(1);
  models::GptOptions o;
  o.shape = c.model;
  o.vocab_size = kVocab;
  return models::Gpt(o);
}

MemoryEstimateInputs live_of(const Config& c, models::Gpt& model, int64_t batch = 2) {
  at::Tensor x = at::randint(kVocab, {batch, c.model.seq_len}, at::kLong);
  at::Tensor y = at::randint(kVocab, {batch, c.model.seq_len}, at::kLong);
  model->train();
  return live_inputs(*model, "blocks", [&] { model->loss(x, y).backward(); });
}

// Sorted parameter sizes per unit.
std::map<int, std::vector<int64_t>> by_unit(const std::vector<ParameterSize>& params) {
  std::map<int, std::vector<int64_t>> out;
  for (const auto& p : params) out[p.unit].push_back(p.numel);
  for (auto& [unit, sizes] : out) std::sort(sizes.begin(), sizes.end());
  return out;
}

TEST(MemoryEstimate, ColdGptParametersAreTheBuiltModels) {
  const Config c = config_of({"model.n_layer=3", "model.d_model=32", "model.d_ff=96", "model.n_head=2"});
  models::Gpt model = build(c);
  const MemoryEstimateInputs cold = cold_gpt_inputs(c, kVocab, 2);
  const MemoryEstimateInputs live = live_of(c, model);
  EXPECT_EQ(by_unit(cold.parameters), by_unit(live.parameters));
  int64_t total = 0;
  for (const auto& p : cold.parameters) total += p.numel;
  EXPECT_EQ(total, model->num_parameters());
  EXPECT_EQ(by_unit(live.parameters).size(), 4u);  // three blocks and the root
  // The live profile leaves the model as it found it: no gradients.
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(MemoryEstimate, EachStageShardsWhatItShould) {
  const Config c = config_of({"optimizer.type=\"Adam\""});
  const MemoryEstimateInputs in = cold_gpt_inputs(c, kVocab, 4);
  int64_t params = 0;
  for (const auto& p : in.parameters) params += p.numel * 4;
  for (int ranks : {1, 2, 4}) {
    const MemoryEstimate e = estimate_memory(c, ranks, in);
    const auto& s0 = e.row(0, "none");
    const auto& s1 = e.row(1, "none");
    const auto& s3 = e.row(3, "none");
    EXPECT_EQ(s0.parameter_bytes, params);
    EXPECT_EQ(s0.optimizer_bytes, 2 * params);  // two moments
    EXPECT_EQ(s0.gradient_bytes, params);
    EXPECT_EQ(s1.parameter_bytes, params);
    EXPECT_NEAR(static_cast<double>(s1.optimizer_bytes), 2.0 * params / ranks, 64.0);
    EXPECT_NEAR(static_cast<double>(s1.gradient_bytes), params + 1.0 * params / ranks, 64.0);
    // Stage 3: under the persistence threshold a parameter stays whole.
    EXPECT_LT(s3.parameter_bytes, ranks == 1 ? params + 1 : params);
    EXPECT_GE(s3.parameter_bytes, params / ranks);
    EXPECT_EQ(s3.gathered_bytes > 0, true);
    // The activations do not depend on the stage.
    EXPECT_EQ(s0.activation_bytes, s3.activation_bytes);
    EXPECT_EQ(e.row(0, "full").activation_bytes, e.row(3, "full").activation_bytes);
  }
  // SGD keeps a momentum buffer only with momentum.
  const Config sgd = config_of({"optimizer.type=\"SGD\""});
  EXPECT_EQ(estimate_memory(sgd, 2, in).row(0, "none").optimizer_bytes, 0);
  const Config momentum = config_of({"optimizer.type=\"SGD\"", "optimizer.params.momentum=0.9"});
  EXPECT_EQ(estimate_memory(momentum, 2, in).row(0, "none").optimizer_bytes, params);
}

// train.async_save: a background save's snapshot (the float32 tensors the
// optimizer steps and their state) is a host row, in a CPU model's peak;
// without it nothing changes.
TEST(MemoryEstimate, AsyncSaveCountsTheSnapshotOnTheHost) {
  const Config plain = config_of({"optimizer.type=\"Adam\""});
  const Config async = config_of({"optimizer.type=\"Adam\"", "train.async_save=true"});
  const MemoryEstimateInputs in = cold_gpt_inputs(plain, kVocab, 4);
  int64_t params = 0;
  for (const auto& p : in.parameters) params += p.numel * 4;
  const MemoryEstimate without = estimate_memory(plain, 2, in), with = estimate_memory(async, 2, in);
  EXPECT_EQ(without.row(0, "none").save_snapshot_bytes, 0);
  EXPECT_FALSE(without.to_json()["rows"][0].contains("save_snapshot_bytes"));
  EXPECT_EQ(without.line().find("snapshot"), std::string::npos);
  // Stage 0: every parameter and its two moments; stage 2: this rank's half.
  EXPECT_EQ(with.row(0, "none").save_snapshot_bytes, 3 * params);
  EXPECT_NEAR(static_cast<double>(with.row(2, "none").save_snapshot_bytes), 3.0 * params / 2, 64.0);
  EXPECT_EQ(with.row(0, "none").peak_bytes, without.row(0, "none").peak_bytes + 3 * params);
  EXPECT_TRUE(with.to_json()["rows"][0].contains("save_snapshot_bytes"));
  EXPECT_NE(with.table().find("train.async_save: a background save's snapshot holds"), std::string::npos);
}

TEST(MemoryEstimate, PoliciesOrderTheActivations) {
  const Config c = config_of({});
  for (const MemoryEstimateInputs& in : {cold_gpt_inputs(c, kVocab, 8)}) {
    const MemoryEstimate e = estimate_memory(c, 2, in);
    const int64_t none = e.row(0, "none").activation_bytes, sel = e.row(0, "selective_op").activation_bytes,
                  every = e.row(0, "every_k").activation_bytes, full = e.row(0, "full").activation_bytes;
    EXPECT_GT(none, sel);
    EXPECT_GT(sel, full);
    EXPECT_GT(none, every);
    EXPECT_GT(every, full);
    EXPECT_EQ(e.row(0, "every_k").plan, "fullx1 keepx1 fullx1 keepx1");
    // Offloaded rows move bytes to the host.
    EXPECT_GT(e.row(0, "none", true).host_bytes, 0);
    EXPECT_LT(e.row(0, "none", true).activation_bytes, none);
  }
}

// Sequence parallelism splits what lies between the tensor-parallel layers:
// a full checkpoint's kept input is exactly 1/tp, and a kept block and the
// embeddings and head hold less (the float32 count of docs/parallel.md).
TEST(MemoryEstimate, SequenceParallelismSplitsTheRegionsBetweenTheLayers) {
  for (int tp : {2, 4}) {
    const Config off = config_of({"tensor_parallel.size=" + std::to_string(tp)});
    const Config on = config_of({"tensor_parallel.size=" + std::to_string(tp), "tensor_parallel.sequence_parallel=true"});
    const BlockCosts a = cold_gpt_inputs(off, kVocab, 4).activations, b = cold_gpt_inputs(on, kVocab, 4).activations;
    // Column 2 is full: the block's input alone.
    EXPECT_EQ(b.blocks[0][2].held_bytes * tp, a.blocks[0][2].held_bytes) << "tp " << tp;
    EXPECT_LT(b.blocks[0][0].held_bytes, a.blocks[0][0].held_bytes) << "tp " << tp;
    EXPECT_LT(b.forward_base, a.forward_base) << "tp " << tp;
    // save_collectives: a checkpointed block also holds its collectives'
    // outputs, two whole [4, 64, 64] all-gathers and two reduce-scatters' 1/tp.
    Config kept = on;
    kept.activation_checkpointing.save_collectives = true;
    const int64_t btc = 4 * on.model.seq_len * on.model.d_model;
    EXPECT_EQ(cold_gpt_inputs(kept, kVocab, 4).activations.blocks[0][2].held_bytes - b.blocks[0][2].held_bytes,
              4 * (2 * btc + 2 * btc / tp))
        << "tp " << tp;
    // At tp 1 the key changes nothing.
    const Config one = config_of({"tensor_parallel.sequence_parallel=true"});
    EXPECT_EQ(cold_gpt_inputs(one, kVocab, 4).activations.blocks[0][0].held_bytes,
              cold_gpt_inputs(config_of({}), kVocab, 4).activations.blocks[0][0].held_bytes);
  }
}

TEST(MemoryEstimate, RowsAndTheConfiguredMark) {
  const Config c = config_of({"zero_optimization.stage=2", "activation_checkpointing.variant=\"selective_op\""});
  const MemoryEstimate e = estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, 4));
  EXPECT_EQ(e.rows.size(), 4u * 9u);  // 4 stages x (5 policies + 4 offloaded)
  EXPECT_EQ(std::count_if(e.rows.begin(), e.rows.end(), [](const auto& r) { return r.configured; }), 1);
  EXPECT_EQ(e.configured().stage, 2);
  EXPECT_EQ(e.configured().policy, "selective_op");
  EXPECT_THAT(e.table(), HasSubstr("*2    selective_op"));
  EXPECT_THAT(e.line(), HasSubstr("ZeRO stage 2, selective_op"));
  const auto json = e.to_json();
  EXPECT_EQ(json["rows"].size(), e.rows.size());
  // Hybrid sharding adds stages 1-3 over the shard group.
  const Config hybrid = config_of({"zero_optimization.stage=3", "zero_optimization.hybrid_shard_size=2"});
  const MemoryEstimate h = estimate_memory(hybrid, 4, cold_gpt_inputs(hybrid, kVocab, 4));
  EXPECT_EQ(h.rows.size(), 7u * 9u);
  EXPECT_TRUE(h.configured().hybrid);
  EXPECT_EQ(h.shard_group, 2);
  EXPECT_GT(h.configured().parameter_bytes, estimate_memory(hybrid, 4, cold_gpt_inputs(hybrid, kVocab, 4))
                                                .rows[27].parameter_bytes);  // stage 3 over all 4 ranks
}

TEST(MemoryEstimate, AutoRowsFollowTheBudgets) {
  const Config none = config_of({"activation_checkpointing.variant=\"none\""});
  const MemoryEstimateInputs in = cold_gpt_inputs(none, kVocab, 8);
  const MemoryEstimate base = estimate_memory(none, 2, in);
  const int64_t keep = base.row(3, "none").peak_bytes, full = base.row(3, "full").peak_bytes;
  // A whole-device budget between full checkpointing and none: the row fits it.
  const int64_t budget = (keep + full) / 2;
  const Config device = config_of({"zero_optimization.stage=3", "activation_checkpointing.variant=\"auto\"",
                                   str("activation_checkpointing.device_memory_budget_bytes=", budget)});
  const MemoryEstimate planned = estimate_memory(device, 2, in);
  const MemoryEstimateRow& row = planned.configured();
  EXPECT_TRUE(row.feasible);
  EXPECT_LE(row.peak_bytes, budget);
  EXPECT_GT(row.peak_bytes, full);
  EXPECT_THAT(row.plan, HasSubstr("keep"));
  // One below what full checkpointing needs: no plan fits.
  const Config tiny = config_of({"zero_optimization.stage=3", "activation_checkpointing.variant=\"auto\"",
                                 str("activation_checkpointing.device_memory_budget_bytes=", full / 2)});
  EXPECT_FALSE(estimate_memory(tiny, 2, in).configured().feasible);
  EXPECT_THAT(estimate_memory(tiny, 2, in).table(), HasSubstr("(no plan fits its budget)"));
}

TEST(MemoryEstimate, ManyBlocksLeaveTheAutoRowsUnsolved) {
  // The planner's solve grows with the square of the blocks: a deep model's
  // estimate stays quick, its configured auto row at full checkpointing's peak.
  const Config c = config_of({"model.n_layer=3000", "activation_checkpointing.variant=\"auto\"",
                              "activation_checkpointing.memory_budget_fraction=0.5"});
  const MemoryEstimate e = estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, 2));
  const MemoryEstimateRow& row = e.configured();
  EXPECT_THAT(row.plan, HasSubstr("not solved (more than 1024 blocks)"));
  EXPECT_EQ(row.activation_bytes, e.row(3, "full").activation_bytes);
  EXPECT_EQ(std::count_if(e.rows.begin(), e.rows.end(), [](const auto& r) { return r.policy == "auto"; }), 1);
  EXPECT_THAT(e.table(), HasSubstr("the planner's rows are not solved here"));
}

TEST(MemoryEstimate, TheCheapestChangeThatFits) {
  const Config c = config_of({"zero_optimization.stage=0", "activation_checkpointing.variant=\"none\""});
  const MemoryEstimate e = estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, 8));
  // Room for selective_op but not for none: the least recompute that fits.
  const int64_t have = e.row(0, "selective_op").peak_bytes + 1;
  const std::string change = cheapest_fitting_change(e, have);
  EXPECT_THAT(change, HasSubstr("activation_checkpointing.variant=selective_op"));
  // Room for full checkpointing alone: the planner's whole-device budget is offered.
  const std::string tight = cheapest_fitting_change(e, e.row(0, "full").peak_bytes + 1);
  EXPECT_THAT(tight, HasSubstr("device_memory_budget_bytes="));
  EXPECT_EQ(cheapest_fitting_change(e, 1000), "");
}

// bf16 (ZeRO stage 3) computes in bf16 from fp32 master shards: a block's
// saved tensors take half the float32 bytes, while the loss's log-softmax
// stays float32, every parameter is sharded (no persistent ones) with its
// master at 4 bytes an element, and a gathered unit holds 2 (issue 38, item
// 11: the estimate counted float32 activations, 1.8-1.9 x the measured peak;
// tests/memory_test.sh compares a bf16 run).
TEST(MemoryEstimate, Bf16CountsWhatRunsInBf16) {
  const Config fp32 = config_of({"zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=0"});
  const Config bf16 = config_of({"zero_optimization.stage=3", "bf16.enabled=true"});
  const int64_t batch = 4;
  const MemoryEstimateInputs a = cold_gpt_inputs(fp32, kVocab, batch), b = cold_gpt_inputs(bf16, kVocab, batch);
  const int64_t bt = batch * fp32.model.seq_len, btc = bt * fp32.model.d_model;
  // Where LibTorch's attention computes bf16 in float32 (compat.h), a kept
  // block's scores, probabilities, mask and q, k, v stay at 4 bytes.
  const int64_t bhtt = batch * fp32.model.n_head * fp32.model.seq_len * fp32.model.seq_len;
  const int64_t upcast = REMAT_SDPA_MATH_UPCASTS ? 2 * 3 * (bhtt + btc) : 0;
  for (size_t column = 0; column < 3; ++column) {
    EXPECT_EQ((b.activations.blocks[0][column].held_bytes - (column == 0 ? upcast : 0)) * 2,
              a.activations.blocks[0][column].held_bytes)
        << "column " << column;
  }
  // The ends: the ids (int64) and the log-softmax (float32) as they were,
  // the embeddings' dropout mask, the last block's output and ln_f's output
  // and statistics in bf16.
  EXPECT_EQ(a.activations.forward_base - b.activations.forward_base, 2 * (3 * btc + 2 * bt));
  const MemoryEstimate ea = estimate_memory(fp32, 2, a), eb = estimate_memory(bf16, 2, b);
  EXPECT_EQ(eb.row(3, "none").parameter_bytes, ea.row(3, "none").parameter_bytes);
  EXPECT_EQ(eb.row(3, "none").optimizer_bytes, ea.row(3, "none").optimizer_bytes);
  EXPECT_EQ(eb.row(3, "none").gathered_bytes * 2, ea.row(3, "none").gathered_bytes);
  // Live: a model profiled in bf16 still has float32 masters.
  models::Gpt model = build(bf16);
  model->to(at::kBFloat16);
  const MemoryEstimate live = estimate_memory(bf16, 2, live_of(bf16, model));
  EXPECT_EQ(live.row(3, "none").parameter_bytes, ea.row(3, "none").parameter_bytes);
  EXPECT_EQ(live.row(3, "none").gathered_bytes, eb.row(3, "none").gathered_bytes);
}

// bf16 at stages 0-2 (issue 41): float32 masters whole on every rank, each
// with the bf16 copy the model computes with: 6 bytes a parameter element
// where float32 keeps 4; the optimizer's state as in float32.
TEST(MemoryEstimate, Bf16BelowStage3CountsTheComputeCopies) {
  for (int stage : {0, 1, 2}) {
    const std::string z = str("zero_optimization.stage=", stage);
    const Config fp32 = config_of({z}), bf16 = config_of({z, "bf16.enabled=true"});
    const MemoryEstimate ea = estimate_memory(fp32, 2, cold_gpt_inputs(fp32, kVocab, 2));
    const MemoryEstimate eb = estimate_memory(bf16, 2, cold_gpt_inputs(bf16, kVocab, 2));
    EXPECT_EQ(eb.row(stage, "none").parameter_bytes * 2, ea.row(stage, "none").parameter_bytes * 3) << stage;
    EXPECT_EQ(eb.row(stage, "none").optimizer_bytes, ea.row(stage, "none").optimizer_bytes) << stage;
  }
}

// fp16 computes in 16 bits from float32 masters as bf16 does: every row of
// its estimate equals bf16's at every stage, and differs from float32's.
TEST(MemoryEstimate, Fp16IsEstimatedAsBf16) {
  for (int stage : {0, 1, 2, 3}) {
    const std::string z = str("zero_optimization.stage=", stage);
    const Config fp32 = config_of({z}), bf16 = config_of({z, "bf16.enabled=true"}),
                 fp16 = config_of({z, "fp16.enabled=true"});
    const MemoryEstimate ea = estimate_memory(fp32, 2, cold_gpt_inputs(fp32, kVocab, 2));
    const MemoryEstimate eb = estimate_memory(bf16, 2, cold_gpt_inputs(bf16, kVocab, 2));
    const MemoryEstimate eh = estimate_memory(fp16, 2, cold_gpt_inputs(fp16, kVocab, 2));
    for (const char* variant : {"none", "full"}) {
      const auto &b = eb.row(stage, variant), &h = eh.row(stage, variant);
      EXPECT_EQ(h.parameter_bytes, b.parameter_bytes) << stage << variant;
      EXPECT_EQ(h.gradient_bytes, b.gradient_bytes) << stage << variant;
      EXPECT_EQ(h.optimizer_bytes, b.optimizer_bytes) << stage << variant;
      EXPECT_EQ(h.gathered_bytes, b.gathered_bytes) << stage << variant;
      EXPECT_EQ(h.activation_bytes, b.activation_bytes) << stage << variant;
      EXPECT_EQ(h.peak_bytes, b.peak_bytes) << stage << variant;
    }
    EXPECT_LT(eh.row(stage, "none").activation_bytes, ea.row(stage, "none").activation_bytes) << stage;
  }
}

// remat-estimate refuses what remat-train refuses, in the same words (issue
// 38, item 13): the configuration's rules (bf16 reductions without bf16) are
// config rules both parse, and the rules that need the number of ranks are
// the ones ZeroModel runs.
TEST(MemoryEstimate, RefusesWhatTheTrainerRefuses) {
  EXPECT_THAT(error_of<ConfigError>([] { config_of({"communication_data_type=\"bf16\""}); }),
              HasSubstr("communication_data_type \"bf16\" reduces gradients in bf16, but bf16.enabled is false"));
  const Config hybrid = config_of({"zero_optimization.stage=3", "zero_optimization.hybrid_shard_size=3"});
  EXPECT_THAT(error_of<ConfigError>([&] { estimate_memory(hybrid, 4, cold_gpt_inputs(hybrid, kVocab, 2)); }),
              HasSubstr("zero_optimization.hybrid_shard_size 3 must divide the data-parallel size 4 (world size / "
                        "tensor_parallel.size) into equal groups: use one of 1, 2, 4"));
}

// Host bytes, one definition in both modes (issue 38, item 12): what the
// offloaded rows move to the host and hold there at the step's peak, cold
// derived, live read from the offloading counters during the profile (live
// read 0 before). They are apart from the peak: activation offloading's host
// arena is outside the memory tracker, and a CPU model's cpu_checkpointing
// copies are in the blocks' held bytes (cold added every host byte to the
// peak). The two modes then plan the same offloaded auto row (cold found
// none fitting and fell back to full_offload).
TEST(MemoryEstimate, HostBytesAreOneThingColdAndLive) {
  const Config c = config_of({"model.n_layer=2", "zero_optimization.stage=0", "activation_offloading.enabled=true",
                              "activation_checkpointing.variant=\"none\""});
  const int64_t batch = 4;
  models::Gpt model = build(c);
  const MemoryEstimateInputs cold_in = cold_gpt_inputs(c, kVocab, batch), live_in = live_of(c, model, batch);
  const MemoryEstimate cold = estimate_memory(c, 2, cold_in), live = estimate_memory(c, 2, live_in);
  const int64_t boundary = cold_in.activations.blocks[0][2].held_bytes;  // a full checkpoint's input
  for (const char* policy : {"none", "full"}) {
    const MemoryEstimateRow& r = cold.row(0, policy, true);
    EXPECT_EQ(r.peak_bytes, std::max(r.parameter_bytes + r.optimizer_bytes + r.other_bytes + r.activation_bytes +
                                         r.gradient_bytes,
                                     r.parameter_bytes + r.optimizer_bytes + r.gradient_bytes))
        << policy;
    const double ratio = static_cast<double>(live.row(0, policy, true).host_bytes) / static_cast<double>(r.host_bytes);
    EXPECT_NEAR(ratio, 1.0, 0.10) << policy << ": live " << live.row(0, policy, true).host_bytes << ", cold "
                                  << r.host_bytes;
  }
  EXPECT_EQ(cold.row(0, "full", true).host_bytes, 2 * boundary);
  // A CPU model's cpu_checkpointing copy stays in the tracked memory: a
  // full_offload block holds its input's bytes as a full one does.
  EXPECT_EQ(cold_in.activations.blocks[0][3].held_bytes, boundary);
  EXPECT_EQ(cold.row(0, "auto", true).plan, live.row(0, "auto", true).plan);
}

// On a GPU every host copy is host memory: cpu_checkpointing's inputs leave
// the device's peak and count in the host column alone; without offloading
// the rows are the CPU's.
TEST(MemoryEstimate, OnAGpuOffloadedBytesAreHostRowsApartFromTheDevicePeak) {
  const Config c = config_of({"zero_optimization.stage=0", "activation_checkpointing.variant=\"full\"",
                              "activation_checkpointing.cpu_checkpointing=true"});
  std::vector<ParameterSize> params = {{1000, true, -1}, {2000, true, 0}, {2000, true, 1}, {2000, true, 2}};
  BlockActivationBytes bytes;
  bytes.boundary = 4096, bytes.saved = 40960, bytes.selective_op = 8192, bytes.embedding = 1024, bytes.ends = 2048;
  const MemoryEstimateInputs cpu_in = cold_inputs(params, 3, bytes);
  MemoryEstimateInputs gpu_in = cold_inputs(params, 3, bytes, c10::DeviceType::CUDA);
  EXPECT_TRUE(cpu_in.host_is_device);
  EXPECT_FALSE(gpu_in.host_is_device);
  EXPECT_EQ(cpu_in.activations.blocks[0][3].held_bytes, 4096);  // the host copy, counted where it was
  EXPECT_EQ(gpu_in.activations.blocks[0][3].held_bytes, 0);     // on the host, not the device
  const MemoryEstimate cpu = estimate_memory(c, 1, cpu_in), gpu = estimate_memory(c, 1, gpu_in);
  const MemoryEstimateRow &cr = cpu.row(0, "full", true), &gr = gpu.row(0, "full", true);
  EXPECT_TRUE(gr.configured);
  EXPECT_EQ(cr.host_bytes, 3 * 4096);
  EXPECT_EQ(gr.host_bytes, 3 * 4096);
  // At the peak (the head's backward) every block's input is held: the CPU's
  // three host copies count there, the GPU holds none of them.
  EXPECT_EQ(cr.activation_bytes - gr.activation_bytes, 3 * 4096);
  EXPECT_EQ(cr.peak_bytes - gr.peak_bytes, 3 * 4096);
  for (const auto& r : cpu.rows) {
    if (!r.offload) {
      EXPECT_EQ(gpu.row(r.stage, r.policy, false).peak_bytes, r.peak_bytes) << r.policy;
    }
  }
  EXPECT_THAT(gpu.table(), HasSubstr("the model on a GPU"));
  EXPECT_THAT(gpu.table(), HasSubstr("on its device (host apart: in host memory)"));
  EXPECT_EQ(cpu.table().find("GPU"), std::string::npos);
  // The capacity beside the peak, when known.
  EXPECT_EQ(gpu.line().find("capacity"), std::string::npos);
  gpu_in.device_capacity_bytes = gr.peak_bytes;
  EXPECT_THAT(estimate_memory(c, 1, gpu_in).line(), HasSubstr("MiB per rank: the configured peak fits"));
  EXPECT_EQ(estimate_memory(c, 1, gpu_in).to_json()["device_capacity_bytes"], gr.peak_bytes);
  EXPECT_EQ(estimate_memory(c, 1, gpu_in).to_json()["host_is_device"], false);
  EXPECT_EQ(cpu.to_json().count("host_is_device"), 0u);
  gpu_in.device_capacity_bytes = gr.peak_bytes - 1;
  EXPECT_THAT(estimate_memory(c, 1, gpu_in).table(), HasSubstr("device capacity"));
  EXPECT_THAT(estimate_memory(c, 1, gpu_in).table(), HasSubstr("the configured peak does not fit"));
}

// device_memory_budget_bytes "auto" plans against the capacity less the
// reserve (1 GiB below 10 GiB); with the capacity unknown, as half the peak.
TEST(MemoryEstimate, AutoDeviceBudgetPlansAgainstTheCapacity) {
  const Config none = config_of({"activation_checkpointing.variant=\"none\""});
  MemoryEstimateInputs in = cold_gpt_inputs(none, kVocab, 8, c10::DeviceType::CUDA);
  const MemoryEstimate base = estimate_memory(none, 2, in);
  const int64_t keep = base.row(3, "none").peak_bytes, full = base.row(3, "full").peak_bytes;
  const int64_t budget = (keep + full) / 2;
  const Config c = config_of({"zero_optimization.stage=3", "activation_checkpointing.variant=\"auto\"",
                              "activation_checkpointing.device_memory_budget_bytes=\"auto\""});
  in.device_capacity_bytes = (int64_t{1} << 30) + budget;
  const MemoryEstimateRow row = estimate_memory(c, 2, in).configured();
  EXPECT_TRUE(row.feasible);
  EXPECT_LE(row.peak_bytes, budget);
  EXPECT_GT(row.peak_bytes, full);
  // The same as the budget given in bytes.
  const Config bytes = config_of({"zero_optimization.stage=3", "activation_checkpointing.variant=\"auto\"",
                                  str("activation_checkpointing.device_memory_budget_bytes=", budget)});
  EXPECT_EQ(estimate_memory(bytes, 2, in).configured().plan, row.plan);
  in.device_capacity_bytes = (int64_t{1} << 30) + full / 2;
  EXPECT_FALSE(estimate_memory(c, 2, in).configured().feasible);
}

TEST(MemoryEstimate, Misuse) {
  const Config tp = config_of({"tensor_parallel.size=2"});
  EXPECT_THAT(error_of<ConfigError>([&] { estimate_memory(tp, 3, cold_gpt_inputs(tp, kVocab, 2)); }),
              HasSubstr("3 ranks do not divide into tensor_parallel.size 2"));
  const Config c = config_of({"model.n_layer=2"});
  models::Gpt model = build(c);
  EXPECT_THAT(error_of<ConfigError>([&] { live_inputs(*model, "layers", [] {}); }),
              HasSubstr("the model has no module 'layers'"));
}

namespace remat {
namespace {

// train_micro_batch_size_per_gpu "auto": the largest micro-batch whose
// configured row fits, one more does not, and more memory never picks less.
TEST(MemoryEstimate, TheLargestFittingMicroBatchFitsAndOneMoreDoesNot) {
  for (const char* variant : {"none", "full"}) {
    const Config c = config_of({std::string("activation_checkpointing.variant=") + variant});
    auto inputs = [&](int64_t micro) { return cold_gpt_inputs(c, kVocab, micro); };
    auto peak = [&](int64_t micro) { return estimate_memory(c, 2, inputs(micro)).configured().peak_bytes; };
    const int64_t at5 = peak(5);
    EXPECT_EQ(largest_fitting_micro_batch(c, 2, at5, 64, inputs), 5) << variant;
    EXPECT_EQ(largest_fitting_micro_batch(c, 2, at5 - 1, 64, inputs), 4) << variant;
    EXPECT_EQ(largest_fitting_micro_batch(c, 2, peak(1) - 1, 64, inputs), 0) << variant;  // not even 1
    EXPECT_EQ(largest_fitting_micro_batch(c, 2, peak(100), 64, inputs), 64) << variant;    // the limit
    int64_t last = 0;
    for (int64_t have = peak(1) / 2; have <= peak(40); have += (peak(40) - peak(1)) / 37) {
      const int64_t micro = largest_fitting_micro_batch(c, 2, have, 64, inputs);
      EXPECT_GE(micro, last) << variant << " at " << have << " bytes";
      if (micro > 0) {
        EXPECT_LE(peak(micro), have) << variant;
      }
      EXPECT_GT(peak(micro + 1), have) << variant;
      last = micro;
    }
    EXPECT_GE(last, 30) << variant;  // the sweep went up the sizes
    EXPECT_EQ(largest_fitting_micro_batch(c, 2, peak(40), 64, inputs), 40) << variant;
  }
}

// zero_optimization.offload_optimizer on a GPU: the configured row keeps no
// optimizer state on the device and the host holds 16 bytes per element the
// rank's AdamW steps (masters, their gradients, two moments); every row at
// stages 1-3 shows its peak with the optimizer on the host, and where that is
// the change that fits, the cheapest change names it. On a CPU the host is
// the device: offloading saves nothing there.
TEST(MemoryEstimate, TheOptimizerOnTheHost) {
  const Config plain = config_of({"zero_optimization.stage=2", "activation_checkpointing.variant=\"none\""});
  const Config host = config_of({"zero_optimization.stage=2", "activation_checkpointing.variant=\"none\"",
                                 "zero_optimization.offload_optimizer.device=\"cpu\""});
  const MemoryEstimate p = estimate_memory(plain, 2, cold_gpt_inputs(plain, kVocab, 1, c10::DeviceType::CUDA));
  const MemoryEstimate h = estimate_memory(host, 2, cold_gpt_inputs(host, kVocab, 1, c10::DeviceType::CUDA));
  const MemoryEstimateRow &pr = p.configured(), &hr = h.configured();
  EXPECT_FALSE(pr.offload_optimizer);
  EXPECT_TRUE(hr.offload_optimizer);
  EXPECT_EQ(hr.optimizer_bytes, 0);
  EXPECT_EQ(hr.parameter_bytes, pr.parameter_bytes) << "the device keeps what the stage gathers from";
  EXPECT_EQ(hr.host_optimizer_bytes, 2 * pr.optimizer_bytes) << "masters and gradients (8) beside AdamW's 8";
  EXPECT_EQ(pr.host_optimizer_bytes, hr.host_optimizer_bytes);
  EXPECT_EQ(pr.offload_optimizer_peak_bytes, hr.peak_bytes);
  EXPECT_EQ(pr.peak_bytes - hr.peak_bytes, pr.optimizer_bytes + pr.gradient_bytes - hr.gradient_bytes);
  EXPECT_EQ(p.row(0, "none").offload_optimizer_peak_bytes, 0) << "stage 0 cannot offload it";
  EXPECT_THAT(h.table(), HasSubstr("host optim"));
  EXPECT_THAT(h.line(), HasSubstr("the optimizer on the host"));
  EXPECT_EQ(h.to_json()["rows"][0].count("host_optimizer_bytes"), 1u);
  // Room for the offloaded row alone at this stage: the cheapest change names it.
  const std::string change = cheapest_fitting_change(p, hr.peak_bytes);
  EXPECT_THAT(change, HasSubstr("zero_optimization.offload_optimizer.device=cpu"));
  EXPECT_EQ(change.find("zero_optimization.stage="), std::string::npos) << change;
  EXPECT_EQ(cheapest_fitting_change(h, hr.peak_bytes - 1).find("offload_optimizer"), std::string::npos);
  // ... but not where the host cannot hold what it would keep.
  EXPECT_THAT(cheapest_fitting_change(p, hr.peak_bytes, hr.host_optimizer_bytes), HasSubstr("offload_optimizer"));
  EXPECT_EQ(cheapest_fitting_change(p, hr.peak_bytes, hr.host_optimizer_bytes - 1).find("offload_optimizer"),
            std::string::npos);
  // On a CPU the offloaded bytes are in the same memory: the peak grows.
  const MemoryEstimate cpu = estimate_memory(host, 2, cold_gpt_inputs(host, kVocab, 1));
  const MemoryEstimate cpu_plain = estimate_memory(plain, 2, cold_gpt_inputs(plain, kVocab, 1));
  EXPECT_GT(cpu.configured().peak_bytes, cpu_plain.configured().peak_bytes);
}

}  // namespace
}  // namespace remat

// On a CPU the host copies of the offloaded optimizer and parameters are in
// the same memory: a configuration that offloads may fit only without it,
// and the fit search tries that first (issue 49, item 10: at 12 MiB per rank
// the default config with the optimizer offloaded was told that nothing fits,
// though stage 3 without offload, 11.57 MiB, does).
TEST(MemoryEstimate, OnACpuTheFitSearchTurnsOffloadingOff) {
  const int64_t have = int64_t{12} << 20;
  for (const std::vector<std::string>& keys :
       {std::vector<std::string>{"zero_optimization.offload_optimizer.device=\"cpu\""},
        {"zero_optimization.offload_param.device=\"cpu\"", "zero_optimization.offload_optimizer.device=\"cpu\"",
         "train_micro_batch_size_per_gpu=17"}}) {
    const Config c = config_of(keys);
    std::vector<std::string> plain_keys(keys.begin() + (keys.size() > 1 ? 2 : 1), keys.end());
    const Config plain = config_of(plain_keys);
    const MemoryEstimate e = estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, c.resolve_batch(2).micro_batch_per_gpu));
    const MemoryEstimate p =
        estimate_memory(plain, 2, cold_gpt_inputs(plain, kVocab, plain.resolve_batch(2).micro_batch_per_gpu));
    const MemoryEstimateRow &row = e.configured(), &off = p.configured();
    EXPECT_EQ(row.no_offload_peak_bytes, off.peak_bytes) << keys[0];
    EXPECT_GT(row.peak_bytes, off.peak_bytes) << keys[0];
    const int64_t between = (row.peak_bytes + off.peak_bytes) / 2;
    const std::string change = cheapest_fitting_change(e, keys.size() > 1 ? between : have);
    EXPECT_THAT(change, HasSubstr("zero_optimization.offload_optimizer.device=none"));
    EXPECT_THAT(change, HasSubstr(str("(estimated peak ", off.peak_bytes / 1048576 , ".")));
    EXPECT_EQ(change.find("offload_param.device=none") != std::string::npos, keys.size() > 1) << change;
    EXPECT_EQ(e.to_json()["rows"][0].count("no_offload_peak_bytes"), 1u);
    EXPECT_EQ(p.to_json()["rows"][0].count("no_offload_peak_bytes"), 0u) << "other estimates' keys as they were";
  }
  const Config c = config_of({"zero_optimization.offload_optimizer.device=\"cpu\""});
  EXPECT_THAT(cheapest_fitting_change(estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, 16)), have),
              HasSubstr("zero_optimization.offload_optimizer.device=none (estimated peak 11.57 MiB: on this CPU the "
                        "host copies are in the same memory)"));
}

// A whole-device budget on a CPU bounds the host copies too (they share the
// memory the budget is of): the offloaded auto row's peak, host bytes
// included, stays within it (issue 49, item 10: they were left out, and a
// run went over its budget by about the host optimizer's bytes).
TEST(MemoryEstimate, OnACpuTheDeviceBudgetCountsTheHostCopies) {
  const Config base = config_of({"zero_optimization.offload_optimizer.device=\"cpu\"",
                                 "activation_checkpointing.variant=\"none\""});
  const MemoryEstimate e = estimate_memory(base, 2, cold_gpt_inputs(base, kVocab, 4));
  const int64_t budget = (e.row(3, "none").peak_bytes + e.row(3, "full").peak_bytes) / 2;
  const Config c = config_of({"zero_optimization.offload_optimizer.device=\"cpu\"",
                              "activation_checkpointing.variant=\"auto\"",
                              str("activation_checkpointing.device_memory_budget_bytes=", budget)});
  const MemoryEstimateRow row = estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, 4)).configured();
  ASSERT_TRUE(row.feasible);
  EXPECT_GT(row.host_optimizer_bytes, 0);
  EXPECT_LE(row.peak_bytes, budget) << "host optimizer " << row.host_optimizer_bytes;
  // On a GPU they are apart: the device's peak alone is within the budget.
  const MemoryEstimateRow gpu =
      estimate_memory(c, 2, cold_gpt_inputs(c, kVocab, 4, c10::DeviceType::CUDA)).configured();
  EXPECT_LE(gpu.peak_bytes, budget);
  EXPECT_GT(gpu.peak_bytes + gpu.host_optimizer_bytes, budget) << "the host copies are not the device's";
}

// REMAT_MEMORY_PER_RANK_BYTES gives what a rank may use: "auto" keeps a tenth
// of it, where a measured device keeps at least 1 GiB (issue 49, item 11:
// "auto" on the CPU planned against the host's whole memory instead).
TEST(MemoryEstimate, AGivenCapacityReservesATenth) {
  const Config c = config_of({"activation_checkpointing.variant=\"auto\"",
                              "activation_checkpointing.device_memory_budget_bytes=\"auto\""});
  MemoryEstimateInputs in = cold_gpt_inputs(c, kVocab, 16);
  in.device_capacity_bytes = int64_t{16} << 20;
  EXPECT_THAT(error_of<ConfigError>([&] { estimate_memory(c, 2, in); }), HasSubstr("leaves nothing above the reserve"));
  in.device_capacity_given = true;
  const MemoryEstimate e = estimate_memory(c, 2, in);
  EXPECT_TRUE(e.configured().feasible);
  EXPECT_LE(e.configured().peak_bytes, in.device_capacity_bytes - in.device_capacity_bytes / 10);
  EXPECT_GT(e.configured().peak_bytes, e.row(3, "full").peak_bytes) << "the planner keeps what fits";
  EXPECT_THAT(e.line(), HasSubstr("memory 16.00 MiB per rank: the configured peak fits"));
}

}  // namespace
}  // namespace remat
