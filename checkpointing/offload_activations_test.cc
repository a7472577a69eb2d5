// Activation offloading against the contract of offload_activations.h: the
// plain run's gradients bit for bit (with dropout), what moves and what stays,
// retain_graph, in-place changes, evaluation, memory back to where it was, and
// the composition with non-reentrant checkpoint regions.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "nn/module_call.h"
#include "rng/rng_tracker.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

// Three dropout MLP blocks and a Linear head named "head".
struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < 3; ++i) {
      blocks->push_back(torch::nn::Linear(32, 64));
      blocks->push_back(torch::nn::Linear(64, 32));
    }
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(32, 10));
  }
  at::Tensor trunk(const at::Tensor& x) {
    at::Tensor h = x;
    for (size_t i = 0; i < blocks->size(); i += 2) {
      at::Tensor u = torch::gelu(blocks[i]->as<torch::nn::Linear>()->forward(h));
      u = torch::dropout(u, 0.2, is_training());
      h = h + blocks[i + 1]->as<torch::nn::Linear>()->forward(u);
    }
    return h;
  }
  at::Tensor forward(const at::Tensor& x) { return remat::forward(head, trunk(x)); }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

OffloadActivationsOptions options(int64_t min_size = 1024) {
  OffloadActivationsOptions o;
  o.min_offload_size = min_size;
  return o;
}

// Loss and every gradient of one step from a fixed RNG state; `offload` wraps the forward.
std::vector<at::Tensor> step(Net& net, const at::Tensor& x, const OffloadActivationsOptions* offload,
                             bool retain = false) {
  torch::manual_seed(7);
  net->zero_grad(/*set_to_none=*/true);
  at::Tensor loss;
  {
    std::unique_ptr<OffloadActivations> scope;
    if (offload) scope = std::make_unique<OffloadActivations>(*offload);
    loss = net->forward(x).pow(2).mean();
  }
  loss.backward({}, retain);
  std::vector<at::Tensor> out{loss.detach()};
  for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
  if (retain) {
    loss.backward();
    for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
  }
  return out;
}

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
}

at::Tensor input() {
  torch::manual_seed(1);
  return torch::randn({16, 32});
}

TEST(OffloadActivations, GradientsMatchThePlainRunBitwiseAndEveryOffloadedTensorComesBackOnce) {
  torch::manual_seed(0);
  Net net;
  const at::Tensor x = input();
  auto plain = step(net, x, nullptr);
  const auto before = activation_offload_stats();
  auto o = options();
  auto offloaded = step(net, x, &o);
  expect_equal(plain, offloaded);
  const auto after = activation_offload_stats();
  const int64_t tensors = after.offloaded_tensors - before.offloaded_tensors;
  // Per block: gelu's input, dropout's mask, the second Linear's input (and the
  // first's, x or the residual): at least 3 × 3 tensors of >= 1 KiB.
  EXPECT_GE(tensors, 9);
  EXPECT_EQ(after.restored_tensors - before.restored_tensors, tensors);
  EXPECT_EQ(after.restored_bytes - before.restored_bytes, after.offloaded_bytes - before.offloaded_bytes);
  EXPECT_EQ(after.host_bytes, 0) << "host copies outlived the backward";
  EXPECT_EQ(after.kept_bytes, 0);
}

// A scope counts into the context current when it began: its tensors come
// back into that context's counters even when the backward runs under
// another context or none, and no other context sees them.
TEST(OffloadActivations, CountersBelongToTheContextOfTheScope) {
  torch::manual_seed(0);
  Net net;
  const at::Tensor x = input();
  auto a = Context::create();
  auto b = Context::create();
  const auto outside = activation_offload_stats();
  at::Tensor loss;
  {
    ContextScope scope(a);
    OffloadActivations offload(options());
    loss = net->forward(x).pow(2).mean();
  }
  ActivationOffloadStats in_a;
  {
    ContextScope scope(a);
    in_a = activation_offload_stats();
  }
  EXPECT_GE(in_a.offloaded_tensors, 9);
  EXPECT_GT(in_a.host_bytes, 0);
  {
    ContextScope scope(b);
    loss.backward();
    loss = at::Tensor();
    const auto in_b = activation_offload_stats();
    EXPECT_EQ(in_b.offloaded_tensors, 0);
    EXPECT_EQ(in_b.restored_tensors, 0) << "the backward ran under b but restored a's tensors";
  }
  ContextScope scope(a);
  const auto after = activation_offload_stats();
  EXPECT_EQ(after.restored_tensors, in_a.offloaded_tensors);
  EXPECT_EQ(after.host_bytes, 0) << "a's host copies outlived the backward";
  ContextScope none(Context::process_default());
  EXPECT_EQ(activation_offload_stats().offloaded_tensors, outside.offloaded_tensors);
  EXPECT_EQ(activation_offload_stats().restored_tensors, outside.restored_tensors);
}

TEST(OffloadActivations, MinOffloadSizeParametersAndTheHeadStay) {
  torch::manual_seed(0);
  Net net;
  const at::Tensor x = input();
  auto count = [&](int64_t min_size, bool exclude_head) {
    if (exclude_head) {
      auto o = options(min_size);
      EXPECT_EQ(exclude_output_head(*net, o).get(), net->head.ptr().get());
    } else {
      set_module_hook(*net->head, HookSlot::kNoOffload, nullptr);
    }
    const auto before = activation_offload_stats();
    auto o = options(min_size);
    at::Tensor loss;
    int64_t host_during = 0;
    {
      OffloadActivations scope(o);
      loss = net->forward(x).sum();
      host_during = activation_offload_stats().host_bytes;
    }
    loss.backward();
    const auto after = activation_offload_stats();
    return std::make_tuple(after.offloaded_tensors - before.offloaded_tensors,
                           after.kept_tensors - before.kept_tensors, host_during);
  };
  // No tensor of the net reaches 1 GiB: everything stays, none of it a parameter.
  auto [none_moved, kept, host0] = count(int64_t{1} << 30, true);
  EXPECT_EQ(none_moved, 0);
  EXPECT_GT(kept, 0);
  EXPECT_EQ(host0, 0);
  // min_offload_size 0: every activation moves; parameters (weight.t() views) never.
  auto [all_moved, kept0, host_all] = count(0, true);
  EXPECT_EQ(kept0, 0);
  int64_t param_bytes = 0;
  for (const auto& p : net->parameters()) param_bytes += p.nbytes();
  EXPECT_GT(all_moved, 0);
  EXPECT_LT(host_all, 16 * 32 * 4 * 40) << "more than the activations moved";
  // The head's input (16 x 32 floats) is saved by its addmm: offloaded only
  // when the head is not excluded.
  auto [with_head, kept1, host_with_head] = count(0, false);
  EXPECT_EQ(with_head, all_moved + 1);
  EXPECT_EQ(host_with_head - host_all, 16 * 32 * 4);
  (void)kept1;
  (void)param_bytes;
}

// Frozen weights (requires_grad false) are parameters too when the scope knows
// the model; what runs after the head (the loss) stays on the device.
TEST(OffloadActivations, FrozenWeightsAndWhatFollowsTheHeadStay) {
  torch::manual_seed(0);
  Net net;
  for (auto& p : net->blocks->parameters()) p.set_requires_grad(false);
  exclude_output_head(*net, options(0));
  const at::Tensor x = input().requires_grad_(true);  // so that the frozen Linears save weight.t()
  auto moved = [&](const torch::nn::Module* model) {
    const auto before = activation_offload_stats();
    at::Tensor loss;
    int64_t host = 0;
    {
      OffloadActivations scope(options(0), model);
      loss = net->forward(x).pow(2).mean();  // pow saves the logits, after the head
      host = activation_offload_stats().host_bytes;
    }
    loss.backward();
    const auto after = activation_offload_stats();
    return std::make_pair(host, after.kept_tensors - before.kept_tensors);
  };
  int64_t weights = 0;
  for (auto& p : net->blocks->parameters()) {
    if (p.dim() == 2) weights += p.nbytes();
  }
  auto [without_model, kept_without] = moved(nullptr);
  auto [with_model, kept_with] = moved(net.ptr().get());
  EXPECT_EQ(without_model - with_model, weights) << "the frozen weights.t() views moved";
  EXPECT_EQ(kept_without, 1) << "the logits saved by pow, after the head";
  EXPECT_EQ(kept_with, 1);
}

TEST(OffloadActivations, RetainGraphBringsTensorsBackForEachBackward) {
  torch::manual_seed(0);
  Net net;
  const at::Tensor x = input();
  auto plain = step(net, x, nullptr, /*retain=*/true);
  const auto before = activation_offload_stats();
  auto o = options();
  auto offloaded = step(net, x, &o, /*retain=*/true);
  expect_equal(plain, offloaded);
  const auto after = activation_offload_stats();
  EXPECT_EQ(after.restored_tensors - before.restored_tensors,
            2 * (after.offloaded_tensors - before.offloaded_tensors));
  EXPECT_EQ(after.host_bytes, 0);
}

TEST(OffloadActivations, ASavedTensorChangedInPlaceIsAClearError) {
  at::Tensor x = torch::randn({16, 32}, torch::requires_grad());
  at::Tensor y;
  {
    OffloadActivations scope(options(0));
    y = (x * 2).exp();  // exp saves its output, which is then changed
  }
  y.mul_(3);
  auto msg = error_of<Error>([&] { y.sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("activation offloading: a tensor saved for backward (Float [16, 32]"));
  EXPECT_THAT(msg, HasSubstr("modified in place"));
}

TEST(OffloadActivations, EvaluationOffloadsNothing) {
  torch::manual_seed(0);
  Net net;
  net->eval();
  const auto before = activation_offload_stats();
  {
    at::NoGradGuard no_grad;
    OffloadActivations scope(options(0));
    net->forward(input());
  }
  EXPECT_EQ(activation_offload_stats().offloaded_tensors, before.offloaded_tensors);
  EXPECT_EQ(activation_offload_stats().kept_tensors, before.kept_tensors);
}

// What the forward leaves on the "device" (c10's CPU allocator) for backward:
// with offloading, only the head's and the small tensors.
TEST(OffloadActivations, TheForwardLeavesLittleOnTheDeviceAndMemoryReturnsToBaseline) {
  torch::manual_seed(0);
  Net net;
  exclude_output_head(*net, options());
  const at::Tensor x = torch::randn({256, 32});
  auto held_after_forward = [&](bool offload) {
    MemoryTracker memory;
    const int64_t base = memory.current();
    at::Tensor loss;
    int64_t held = 0;
    {
      std::unique_ptr<OffloadActivations> scope;
      if (offload) scope = std::make_unique<OffloadActivations>(options());
      loss = net->forward(x).pow(2).mean();
    }
    held = memory.current() - base;
    loss.backward();
    loss = at::Tensor();
    net->zero_grad(/*set_to_none=*/true);
    EXPECT_EQ(memory.current(), base) << "offload " << offload;
    return held;
  };
  const int64_t plain = held_after_forward(false);
  const int64_t offloaded = held_after_forward(true);
  EXPECT_LT(offloaded, plain / 4) << offloaded << " of " << plain << " bytes";
  EXPECT_EQ(activation_offload_stats().host_bytes, 0);
}

TEST(OffloadActivations, ComposesWithNonReentrantRegionsByOffloadingTheirInputs) {
  torch::manual_seed(0);
  Net net;
  at::Tensor x = torch::randn({16, 32}, torch::requires_grad());
  auto run = [&](bool offload) {
    torch::manual_seed(3);
    net->zero_grad(true);
    x.mutable_grad() = at::Tensor();
    at::Tensor loss;
    {
      std::unique_ptr<OffloadActivations> scope;
      if (offload) scope = std::make_unique<OffloadActivations>(options(0));
      at::Tensor h = x * 1.5;
      h = checkpoint([&](const at::Tensor& in) { return net->trunk(in); }, h);
      loss = net->head->forward(h).pow(2).mean();
    }
    const int64_t saved = checkpoint_saved_bytes();
    loss.backward();
    std::vector<at::Tensor> out{x.grad().clone(), at::full({}, static_cast<double>(saved))};
    for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  auto plain = run(false);
  const auto before = activation_offload_stats();
  auto offloaded = run(true);
  const auto after = activation_offload_stats();
  EXPECT_EQ(plain[1].item<double>(), 16 * 32 * 4) << "the region holds its input";
  EXPECT_EQ(offloaded[1].item<double>(), 0) << "the offloading scope holds the region's input";
  plain.erase(plain.begin() + 1);
  offloaded.erase(offloaded.begin() + 1);
  expect_equal(plain, offloaded);
  // Moved: the region's input, and the head's input and the loss's saves (the
  // region's own saved tensors are recomputed, not offloaded).
  EXPECT_GE(after.offloaded_bytes - before.offloaded_bytes, 16 * 32 * 4);
  EXPECT_LT(after.offloaded_bytes - before.offloaded_bytes, 16 * 64 * 4 * 3);
}

TEST(OffloadActivations, OptionsAndConfigErrorsSayWhatToChange) {
  OffloadActivationsOptions bad;
  bad.max_fwd_stash_size = 0;
  EXPECT_THAT(error_of<ConfigError>([&] { OffloadActivations scope(bad); }),
              HasSubstr("'activation_offloading.max_fwd_stash_size' = 0 must be at least 1"));
  // The JSON section's keys and errors: engine/checkpointing_config_test.cc.
  torch::manual_seed(0);
  Net net;
  OffloadActivationsOptions named;
  named.head = "nothead";
  EXPECT_THAT(error_of<ConfigError>([&] { exclude_output_head(*net, named); }),
              HasSubstr("activation_offloading.head: the model has no module 'nothead'"));
}

// remat-train applies the head option whether offloading is on or not: a
// name that matches no module is an error at once, not when offloading is
// turned on later; with offloading off nothing is marked.
TEST(OffloadActivations, TheHeadIsCheckedWhenOffloadingIsOffAndMarkedWhenOn) {
  torch::manual_seed(0);
  Net net;
  OffloadActivationsOptions off;
  off.head = "hed";
  const std::string msg = error_of<ConfigError>([&] { prepare_output_head(*net, off); });
  EXPECT_THAT(msg, HasSubstr("activation_offloading.head: the model has no module 'hed'; its children are: "
                             "blocks (torch::nn::ModuleList), head (torch::nn::Linear)"));
  EXPECT_THAT(msg, HasSubstr("checked although activation_offloading.enabled is false"));
  off.head = "head";
  EXPECT_EQ(prepare_output_head(*net, off).get(), net->head.ptr().get());
  EXPECT_EQ(module_hook(*net->head, HookSlot::kNoOffload), nullptr) << "offloading off marks nothing";
  off.head = "";
  EXPECT_EQ(prepare_output_head(*net, off), nullptr);
  OffloadActivationsOptions on = off;
  on.enabled = true;
  EXPECT_EQ(prepare_output_head(*net, on).get(), net->head.ptr().get());
  EXPECT_NE(module_hook(*net->head, HookSlot::kNoOffload), nullptr);
  on.head = "blocks.7";
  EXPECT_THAT(error_of<ConfigError>([&] { prepare_output_head(*net, on); }),
              HasSubstr("the model has no module 'blocks.7'"));
  // A module that is not an output head: a block, or the list of blocks.
  for (bool enabled : {true, false}) {
    OffloadActivationsOptions o;
    o.enabled = enabled;
    o.head = "blocks.0";
    EXPECT_THAT(error_of<ConfigError>([&] { prepare_output_head(*net, o); }),
                HasSubstr("activation_offloading.head 'blocks.0' is not an output head: it is one of the blocks in 'blocks'"));
    o.head = "blocks";
    EXPECT_THAT(error_of<ConfigError>([&] { prepare_output_head(*net, o); }),
                HasSubstr("activation_offloading.head 'blocks' is not an output head: it holds the blocks of 'blocks'"));
  }
}

// A marked head that the forward does not call through remat::forward is
// offloaded like any module, which the option meant to prevent: the scope
// (given the model) says so once the forward is over, naming the module.
TEST(OffloadActivations, AMarkedHeadNotCalledThroughRematForwardIsAnErrorNamingIt) {
  torch::manual_seed(0);
  Net net;
  const at::Tensor x = input();
  auto backward_after = [&](const std::function<at::Tensor()>& forward, const torch::nn::Module* model) {
    at::Tensor loss;
    {
      OffloadActivations scope(options(0), model);
      loss = forward().pow(2).mean();
    }
    loss.backward();
  };
  auto direct = [&] { return net->head->forward(net->trunk(x)); };  // not through the call route
  auto routed = [&] { return net->forward(x); };
  exclude_output_head(*net, options(0));
  std::string msg = error_of<Error>([&] { backward_after(direct, net.ptr().get()); });
  EXPECT_THAT(msg, HasSubstr("activation offloading: the output head 'head' was not called through "
                             "remat::forward in this forward, so excluding it had no effect"));
  EXPECT_THAT(msg, HasSubstr("Call it through remat::forward(module, args...)"));
  EXPECT_NO_THROW(backward_after(routed, net.ptr().get()));
  EXPECT_NO_THROW(backward_after(direct, nullptr)) << "without the model the scope knows no head";
  // A module that is no head, named by path, is refused before anything runs.
  set_module_hook(*net->head, HookSlot::kNoOffload, nullptr);
  OffloadActivationsOptions block = options(0);
  block.head = "blocks.1";
  EXPECT_THAT(error_of<ConfigError>([&] { exclude_output_head(*net, block); }),
              HasSubstr("'blocks.1' is not an output head"));
  EXPECT_EQ(module_hook(*net->blocks[1], HookSlot::kNoOffload), nullptr);
}

}  // namespace
}  // namespace remat
