// Policies on an 8-block transformer-like stack written with plain LibTorch
// modules: bitwise parity with the plain run, recompute counts, saved-op reuse
// below autograd, and peak activation memory.
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpointing/checkpoint.h"
#include "checkpointing/op_recorder.h"
#include "checkpointing/options.h"
#include "checkpointing/policy.h"
#include "checkpointing/selective_op.h"
#include "models/stack.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/checkpoint_modes.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;
using models::Stack;
using models::StackOptions;

constexpr int64_t kBatch = 4, kSeq = 32, kLayers = 8;

// The 8-block stack of d_model 64, 4 heads, d_ff 256.
StackOptions stack_options(int layers, double dropout) {
  StackOptions o;
  o.shape.n_layer = layers;
  o.shape.d_model = 64;
  o.shape.n_head = 4;
  o.shape.d_ff = 256;
  o.shape.dropout = dropout;
  return o;
}

Stack make_stack(double dropout = 0.1) {
  torch::manual_seed(0);
  return Stack(stack_options(kLayers, dropout));
}

at::Tensor make_input() {
  torch::manual_seed(1);
  return torch::randn({kBatch, kSeq, 64}, torch::requires_grad());
}

// One training step from a fixed RNG state: output, input grad, parameter grads.
std::vector<at::Tensor> step(Stack& model, const at::Tensor& x) {
  model_parallel_manual_seed(123, 0);
  model->zero_grad(/*set_to_none=*/true);
  if (x.grad().defined()) x.mutable_grad().reset();
  at::Tensor y = model->forward(x);
  y.pow(2).mean().backward();
  std::vector<at::Tensor> out{y.detach(), x.grad().clone()};
  for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

PolicyOptions variant(const std::string& name, int k = 1) {
  PolicyOptions o;
  o.variant = checkpoint_variant_from_name(name);
  o.every_k = k;
  return o;
}

class Policies : public CheckpointModes {
 protected:
  void TearDown() override {
    remove_activation_checkpointing(*model);
    CheckpointModes::TearDown();
  }
  Stack model = make_stack();
  at::Tensor x = make_input();
};
INSTANTIATE_CHECKPOINT_MODES(Policies);

TEST_P(Policies, EveryVariantMatchesThePlainRunBitwise) {
  auto plain = step(model, x);
  for (auto [name, k, marked] : {std::tuple{"full", 1, 8}, {"selective_layer", 2, 4},
                                 {"selective_layer", 3, 3}, {"selective_op", 1, 8}}) {
    EXPECT_EQ(apply_activation_checkpointing(*model, variant(name, k)), marked) << name;
    auto ckpt = step(model, x);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << name << " k=" << k << " tensor " << i;
    }
  }
}

// every_k_from chooses which block of each k is marked: the first (0, k, ...)
// or the last (n-1, n-1-k, ...); both keep the plain run's gradients.
TEST_P(Policies, EveryKFromTheFirstOrTheLastBlock) {
  auto plain = step(model, x);
  for (auto [from, k, want] : {std::tuple{"first", 3, "blocks.0 blocks.3 blocks.6"},
                               {"last", 3, "blocks.1 blocks.4 blocks.7"},
                               {"last", 2, "blocks.1 blocks.3 blocks.5 blocks.7"},
                               {"last", 8, "blocks.7"}}) {
    PolicyOptions o = variant("selective_layer", k);
    o.every_k_from = std::string(from) == "last" ? EveryKFrom::kLast : EveryKFrom::kFirst;
    std::string marked;
    apply_activation_checkpointing(*model, o);
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      if (module_hook(*item.value(), HookSlot::kCheckpoint)) marked += (marked.empty() ? "" : " ") + item.key();
    }
    EXPECT_EQ(marked, want) << from << " k=" << k;
    auto ckpt = step(model, x);
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << from << " " << i;
  }
  // every_k_from is an enum: a name that is not one is refused where JSON is
  // read (engine/checkpointing_config_test.cc, which also reads this section).
  ActivationCheckpointingOptions section;
  section.variant = CheckpointVariant::kSelectiveLayer;
  section.every_k = 4;
  section.every_k_from = EveryKFrom::kLast;
  EXPECT_EQ(apply_activation_checkpointing(*model, section), 2);
}

TEST_P(Policies, RecomputeCounts) {
  for (auto [name, k, expected] : {std::tuple{"none", 1, 0}, {"full", 1, 8},
                                   {"selective_layer", 2, 4}, {"selective_op", 1, 8}}) {
    apply_activation_checkpointing(*model, variant(name, k));
    at::Tensor loss = model->forward(x).pow(2).mean();
    int64_t before = checkpoint_recompute_count();
    loss.backward();
    EXPECT_EQ(checkpoint_recompute_count() - before, expected) << name;
  }
}

// Counts aten ops during backward: every dispatcher entry, and entries that ran
// the real kernel under a selective_op region.
struct KernelCounter {
  static thread_local std::map<std::string, int>* calls;
  static thread_local std::map<std::string, int>* kernels;
  std::map<std::string, int> call_counts, kernel_counts;
  at::CallbackHandle handle;
  KernelCounter() {
    calls = &call_counts;
    kernels = &kernel_counts;
    handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          (*calls)[fn.name()]++;
          if (selective_op_kernel_running()) (*kernels)[fn.name()]++;
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
  }
  ~KernelCounter() { at::removeCallback(handle); }
};
thread_local std::map<std::string, int>* KernelCounter::calls = nullptr;
thread_local std::map<std::string, int>* KernelCounter::kernels = nullptr;

TEST_P(Policies, SelectiveOpRunsNoSavedOpDuringBackwardButRecomputesTheRest) {
  // The default list keeps the projections (the C++ Linear on 3-d input runs
  // aten::mm) and recomputes the attention core.
  apply_activation_checkpointing(*model, variant("selective_op"));
  at::Tensor loss = model->forward(x).pow(2).mean();
  KernelCounter counter;
  loss.backward();
  // The recompute asked for the matmuls (the dispatcher saw them)...
  EXPECT_GT(counter.call_counts["aten::mm"], 0);
  // ...but none of their kernels ran inside a region: the outputs came from the forward.
  EXPECT_EQ(counter.kernel_counts["aten::addmm"], 0);
  EXPECT_EQ(counter.kernel_counts["aten::mm"], 0);
  // Unsaved ops did run again, the attention core among them.
  EXPECT_GT(counter.kernel_counts["aten::_softmax"] + counter.kernel_counts["aten::bmm"] +
                counter.kernel_counts["aten::_scaled_dot_product_flash_attention_for_cpu"],
            0);
  EXPECT_GT(counter.kernel_counts["aten::gelu"], 0);
  EXPECT_GT(counter.kernel_counts["aten::native_layer_norm"], 0);
}

TEST_P(Policies, SelectiveOpWithTheMatmulListKeepsTheAttentionProductsToo) {
  PolicyOptions o = variant("selective_op");
  o.save_ops = matmul_save_ops();
  apply_activation_checkpointing(*model, o);
  at::Tensor loss = model->forward(x).pow(2).mean();
  KernelCounter counter;
  loss.backward();
  EXPECT_GT(counter.call_counts["aten::mm"], 0);
  EXPECT_EQ(counter.kernel_counts["aten::mm"], 0);
  EXPECT_EQ(counter.kernel_counts["aten::bmm"], 0);
  EXPECT_EQ(counter.kernel_counts["aten::_scaled_dot_product_flash_attention_for_cpu"], 0);
  EXPECT_GT(counter.kernel_counts["aten::gelu"], 0);
}

TEST_P(Policies, TheDefaultListHoldsLessThanTheMatmulList) {
  auto held = [&](std::optional<std::vector<std::string>> ops) {
    PolicyOptions o = variant("selective_op");
    o.save_ops = std::move(ops);
    apply_activation_checkpointing(*model, o);
    at::Tensor loss = model->forward(x).pow(2).mean();
    const int64_t bytes = checkpoint_saved_bytes();
    loss.backward();
    return bytes;
  };
  const int64_t projections = held(std::nullopt), matmuls = held(matmul_save_ops());
  // The matmul list also keeps each block's attention output (B*T*C floats;
  // on LibTorch 1.13 the B*H*T*T scores as well, on 2.x the fused kernel's
  // statistics).
  EXPECT_GE(matmuls - projections, kLayers * kBatch * kSeq * 64 * 4);
}

TEST_P(Policies, FullRecomputeRunsTheMatmulsAgain) {
  apply_activation_checkpointing(*model, variant("full"));
  at::Tensor loss = model->forward(x).pow(2).mean();
  OpRecorder recorder;
  loss.backward();
  // The 4 linear matmuls of 8 blocks run again in backward, on top of the
  // gradient matmuls (2 per linear).
  EXPECT_GE(recorder.count("aten::mm"), 8 * 4 + 8 * 4 * 2);
}

TEST_P(Policies, PredicateOverModuleNames) {
  PolicyOptions o;
  o.ac_condition = [](const std::string& fqn, const torch::nn::Module&) {
    return fqn == "blocks.1" || fqn == "blocks.5";
  };
  EXPECT_EQ(apply_activation_checkpointing(*model, o), 2);
  auto plain_model = make_stack();
  at::Tensor loss = model->forward(x).pow(2).mean();
  int64_t before = checkpoint_recompute_count();
  loss.backward();
  EXPECT_EQ(checkpoint_recompute_count() - before, 2);
}

TEST_P(Policies, KeysModeAndBehaviourUnchanged) {
  std::vector<std::string> keys_before;
  for (const auto& p : model->named_parameters()) keys_before.push_back(p.key());
  apply_activation_checkpointing(*model, variant("full"));
  std::vector<std::string> keys_after;
  for (const auto& p : model->named_parameters()) keys_after.push_back(p.key());
  EXPECT_EQ(keys_before, keys_after);
  EXPECT_EQ(keys_after.front(), "blocks.0.ln1.weight");
  EXPECT_TRUE(model->is_training());
  model->eval();
  at::Tensor marked = model->forward(x);  // eval: dropout off, deterministic
  remove_activation_checkpointing(*model);
  EXPECT_TRUE(torch::equal(marked, model->forward(x)));
  EXPECT_FALSE(model->is_training());
}

TEST_P(Policies, ErrorsNameWhatToChange) {
  PolicyOptions o = variant("full");
  o.blocks = "layers";
  EXPECT_THAT(error_of<Error>([&] { apply_activation_checkpointing(*model, o); }),
              HasSubstr("the model has no submodule 'layers'; the children of the model are: "
                        "blocks (torch::nn::ModuleList), ln_f (torch::nn::LayerNorm)"));
  o.blocks = "blocks.0.qkv";
  EXPECT_THAT(error_of<Error>([&] { apply_activation_checkpointing(*model, o); }),
              HasSubstr("'blocks.0.qkv' is a remat::parallel::ColumnParallelLinear, not a torch::nn::ModuleList"));
  EXPECT_THAT(error_of<Error>([&] { apply_activation_checkpointing(*model, variant("selective_layer", 0)); }),
              HasSubstr("'activation_checkpointing.every_k' = 0 must be at least 1"));
  EXPECT_THAT(error_of<Error>([&] { apply_activation_checkpointing(*model, variant("fully")); }),
              HasSubstr("'activation_checkpointing.variant' = \"fully\" is not a variant"));
  o = variant("selective_op");
  o.save_ops = {"aten::mmm"};
  EXPECT_THAT(error_of<Error>([&] { apply_activation_checkpointing(*model, o); }),
              HasSubstr("unknown operator 'aten::mmm'"));
  EXPECT_THAT(error_of<Error>([&] { apply_activation_checkpointing(*model, o); }),
              HasSubstr("did you mean 'aten::mm'?"));
}

// The section as the JSON {"variant": "selective_layer", "every_k": 4} sets it
// (engine/checkpointing_config_test.cc reads that JSON into these fields).
TEST_P(Policies, FromConfig) {
  ActivationCheckpointingOptions section;
  section.variant = CheckpointVariant::kSelectiveLayer;
  section.every_k = 4;
  EXPECT_EQ(apply_activation_checkpointing(*model, PolicyOptions(section)), 2);
}

// The policy's settings are the section's (one declaration, one default): a
// PolicyOptions built by hand starts where an empty JSON section does
// (engine/checkpointing_config_test.cc compares the two).
TEST_P(Policies, OptionsStartFromTheSectionsDefaults) {
  const PolicyOptions by_hand;
  EXPECT_EQ(apply_activation_checkpointing(*model, by_hand), 0) << "variant none marks nothing";

  // An explicit empty save_ops list keeps no op output (every op recomputed);
  // unset keeps the default list. Both give the plain run's gradients.
  auto plain = step(model, x);
  int64_t held[2];
  for (bool empty : {true, false}) {
    PolicyOptions o = variant("selective_op");
    if (empty) o.save_ops = std::vector<std::string>{};
    apply_activation_checkpointing(*model, o);
    // What the regions hold after forward: their inputs, plus the kept op outputs.
    const int64_t before = checkpoint_saved_bytes();
    at::Tensor y = model->forward(x);
    held[empty] = checkpoint_saved_bytes() - before;
    y = at::Tensor();
    auto ckpt = step(model, x);
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
  }
  const int64_t inputs = static_cast<int64_t>(kLayers) * x.numel() * 4;  // each block's [B, T, 64] input
  EXPECT_EQ(held[1], inputs) << "the empty list keeps no op output, only the block inputs";
  EXPECT_GT(held[0], inputs) << "the default list keeps the matmul outputs too";
}

// configure_checkpointing may come after the policy: regions read the
// defaults when they run. Fixed options on the policy win over the defaults.
TEST_P(Policies, ConfigureAfterThePolicyTakesEffectAndFixedOptionsWin) {
  const CheckpointOptions saved = default_checkpoint_options();
  auto plain = step(model, x);
  apply_activation_checkpointing(*model, variant("full"));
  ActivationCheckpointingOptions offload;
  offload.cpu_checkpointing = true;
  offload.offload_keep_last = false;
  configure_checkpointing(offload);
  const int64_t copies_before = stored_input_stats().offload_copies;
  auto ckpt = step(model, x);
  const int64_t copies = stored_input_stats().offload_copies - copies_before;
  // Regions 1..7 offload their input; region 0's is x, a leaf that requires grad (kept).
  EXPECT_EQ(copies, 7);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;

  PolicyOptions fixed = variant("full");
  fixed.checkpoint = CheckpointOptions{};  // no storage options: inputs kept as they are
  apply_activation_checkpointing(*model, fixed);
  const int64_t before_fixed = stored_input_stats().offload_copies;
  step(model, x);
  EXPECT_EQ(stored_input_stats().offload_copies, before_fixed);
  default_checkpoint_options() = saved;
}

// Peak live bytes of one step above the step's start, gradients pre-allocated
// so that both runs count the same parameter-gradient memory.
int64_t peak_of_step(Stack& model, const at::Tensor& x) {
  model->zero_grad(/*set_to_none=*/false);
  MemoryTracker mem;
  model->forward(x).pow(2).mean().backward();
  return mem.peak();
}

TEST(PolicyMemory, FullCheckpointPeakIsBelowNoneAndNearTheEstimate) {
  Stack model = make_stack(/*dropout=*/0.0);
  at::Tensor x = make_input();
  model->forward(x).pow(2).mean().backward();  // allocate parameter gradients
  int64_t none = peak_of_step(model, x);
  apply_activation_checkpointing(*model, variant("full"));
  int64_t full = peak_of_step(model, x);
  remove_activation_checkpointing(*model);

  // Estimate: the boundary tensor of each region plus one block's
  // intermediates (one plain block's forward + backward peak).
  int64_t boundary = x.numel() * x.element_size();
  Stack one(stack_options(1, 0.0));
  one->forward(x).pow(2).mean().backward();
  int64_t one_block = peak_of_step(one, x);
  double estimate = static_cast<double>(kLayers * boundary + one_block);
  std::printf("peak activation bytes: none %lld, full %lld, estimate %.0f (%lld x %lld + %lld)\n",
              static_cast<long long>(none), static_cast<long long>(full), estimate,
              static_cast<long long>(kLayers), static_cast<long long>(boundary),
              static_cast<long long>(one_block));
  EXPECT_LT(full, none);
  EXPECT_LE(std::abs(full - estimate) / estimate, 0.10);
}

}  // namespace
}  // namespace remat
