// What non-reentrant regions add to the contract both modes share
// (checkpoint_test.cc and checkpoint_contract_test.cc run every case in both):
// gradients through torch::autograd::grad and partial backward, gradient hooks
// fired once, in-place changes of saved tensors refused, the recompute
// stopping at the last saved tensor, nested regions keeping only the
// outermost inputs, and memory returning to zero after backward.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpointing/checkpoint.h"
#include "checkpointing/checkpoint_modes.h"
#include "checkpointing/op_recorder.h"
#include "checkpointing/stored_inputs.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

CheckpointOptions named(const std::string& name, bool reentrant = false) {
  CheckpointOptions options;
  options.reentrant = reentrant;
  options.name = name;
  return options;
}

TEST(NonReentrant, IsTheDefault) {
  EXPECT_FALSE(CheckpointOptions().reentrant);
  EXPECT_FALSE(default_checkpoint_options().reentrant);
}

TEST(NonReentrant, AutogradGradAndBackwardWithInputsMatchThePlainRun) {
  torch::manual_seed(0);
  torch::nn::Linear lin(6, 5);
  at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
  auto f = [&](const at::Tensor& in) { return torch::tanh(lin->forward(in)) * in.narrow(1, 0, 5); };
  auto plain = torch::autograd::grad({f(x).pow(2).sum()}, {x, lin->weight});
  auto ckpt = torch::autograd::grad({checkpoint(f, x).pow(2).sum()}, {x, lin->weight});
  ASSERT_EQ(ckpt.size(), 2u);
  EXPECT_TRUE(torch::equal(plain[0], ckpt[0]));
  EXPECT_TRUE(torch::equal(plain[1], ckpt[1]));
  EXPECT_FALSE(lin->weight.grad().defined()) << "grad() must not accumulate into .grad()";
  // backward with `inputs`: only x's gradient is accumulated.
  checkpoint(f, x).pow(2).sum().backward({}, false, false, {x});
  EXPECT_TRUE(torch::equal(x.grad(), plain[0]));
  EXPECT_FALSE(lin->weight.grad().defined());
}

TEST(NonReentrant, PartialBackwardWhenSomeInputsNeedNoGradient) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  at::Tensor m = torch::randn({2, 4});  // no grad
  auto f = [&](const at::Tensor& a, const at::Tensor& b) { return lin->forward(a * b).relu() + b; };
  f(x, m).sum().backward();
  at::Tensor gx = x.grad().clone(), gw = lin->weight.grad().clone();
  x.mutable_grad().reset();
  lin->weight.mutable_grad().reset();
  checkpoint(f, x, m).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), gx));
  EXPECT_TRUE(torch::equal(lin->weight.grad(), gw));
  EXPECT_FALSE(m.grad().defined());
}

// A parameter used inside and outside a region: its gradient hook fires once
// per backward without checkpointing and with non-reentrant regions; a
// reentrant region backpropagates its part separately, so it fires twice.
TEST(NonReentrant, AParametersGradientHookFiresOncePerBackward) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  int fired = 0;
  lin->weight.register_hook([&fired](const at::Tensor& g) { ++fired; return g; });
  auto f = [&](const at::Tensor& in) { return lin->forward(in).tanh(); };
  auto step = [&](int mode) {  // 0 plain, 1 non-reentrant, 2 reentrant
    fired = 0;
    at::Tensor inside = mode == 0 ? f(x) : checkpoint_with(named("r", mode == 2), f, x);
    (inside.sum() + lin->forward(x * 2).sum()).backward();
    at::Tensor g = lin->weight.grad().clone();
    lin->weight.mutable_grad().reset();
    x.mutable_grad().reset();
    return g;
  };
  at::Tensor plain = step(0);
  EXPECT_EQ(fired, 1);
  EXPECT_TRUE(torch::equal(step(1), plain));
  EXPECT_EQ(fired, 1);
  step(2);
  EXPECT_EQ(fired, 2);
}

TEST(NonReentrant, ATensorSavedInsideAndChangedInPlaceIsAnErrorNamingTheRegion) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  // exp saves its output, which the caller then changes.
  at::Tensor y = checkpoint_with(named("block3"), [&](const at::Tensor& in) { return lin->forward(in).exp(); }, x);
  y.mul_(2);
  auto msg = error_of<Error>([&] { y.sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("block3: a tensor the region saved for backward"));
  EXPECT_THAT(msg, HasSubstr("was modified in place"));
  // A parameter changed in place (an optimizer step) between forward and backward.
  at::Tensor z = checkpoint_with(named("block4"), [&](const at::Tensor& in) { return lin->forward(in.tanh()); }, x);
  {
    torch::NoGradGuard no_grad;
    lin->weight.add_(1);
  }
  msg = error_of<Error>([&] { z.sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("block4: a tensor the region saved for backward"));
  // The region's own input changed in place.
  at::Tensor h = x * 1;
  at::Tensor w = checkpoint_with(named("block5"), [&](const at::Tensor& in) { return in.tanh() * 3; }, h);
  {
    torch::NoGradGuard no_grad;
    h.add_(1);
  }
  msg = error_of<Error>([&] { w.sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("block5"));
  EXPECT_THAT(msg, HasSubstr("modified in place"));
}

// The recompute ends at the last tensor the forward saved: the ops after it
// (here neg, which saves nothing) are not run again. (neg runs once in the
// forward and once in its own backward.)
TEST(NonReentrant, TheRecomputeStopsAtTheLastSavedTensor) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  auto f = [&](const at::Tensor& in) { return torch::neg(torch::tanh(lin->forward(in))); };
  for (bool reentrant : {false, true}) {
    OpRecorder ops;
    checkpoint_with(named("stop", reentrant), f, x).sum().backward();
    EXPECT_EQ(ops.count("aten::tanh"), 2) << "reentrant " << reentrant;
    EXPECT_EQ(ops.count("aten::neg"), reentrant ? 3 : 2) << "reentrant " << reentrant;
  }
}

TEST(NonReentrant, SavedBytesCountTheInputsAndReturnToZero) {
  torch::manual_seed(0);
  torch::nn::Linear lin(16, 16);
  at::Tensor x = torch::randn({8, 16}, torch::requires_grad());
  ASSERT_EQ(checkpoint_saved_bytes(), 0);
  auto f = [&](const at::Tensor& in) { return lin->forward(in).tanh(); };
  at::Tensor y = checkpoint(f, x);
  EXPECT_EQ(checkpoint_saved_bytes(), x.nbytes());
  y.sum().backward();
  EXPECT_EQ(checkpoint_saved_bytes(), 0) << "after a backward without retain_graph";
  y = checkpoint(f, x);
  EXPECT_EQ(checkpoint_saved_bytes(), x.nbytes());
  y = at::Tensor();  // the graph dropped without backward
  EXPECT_EQ(checkpoint_saved_bytes(), 0);
}

// Regions inside a region: the inner region's input is an intermediate of
// the outer one and is itself recomputed, so after the forward only the
// outermost input is held.
TEST(NonReentrant, NestedRegionsHoldOnlyTheOutermostInput) {
  torch::manual_seed(0);
  model_parallel_manual_seed(5, 0);
  torch::nn::Linear a(8, 8), b(8, 8);
  at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  c10::weak_intrusive_ptr<c10::TensorImpl> inner_input{c10::intrusive_ptr<c10::TensorImpl>()};
  auto inner = [&](const at::Tensor& in) { return torch::dropout(b->forward(in), 0.3, true).tanh(); };
  auto outer = [&](const at::Tensor& in, bool c) {
    at::Tensor h = a->forward(in).relu();
    if (c) inner_input = c10::weak_intrusive_ptr<c10::TensorImpl>(h.getIntrusivePtr());
    return (c ? checkpoint(inner, h) : inner(h)) * 2;
  };
  // Both runs start from the same RNG state: the same dropout mask.
  model_parallel_manual_seed(5, 0);
  torch::manual_seed(0);
  at::Tensor plain = outer(x, false);
  plain.sum().backward();
  at::Tensor gx = x.grad().clone(), ga = a->weight.grad().clone();
  x.mutable_grad().reset();
  a->weight.mutable_grad().reset();
  b->weight.mutable_grad().reset();
  model_parallel_manual_seed(5, 0);
  torch::manual_seed(0);
  at::Tensor y = checkpoint([&](const at::Tensor& in) { return outer(in, true); }, x);
  EXPECT_TRUE(inner_input.expired()) << "the inner region's input outlived the forward";
  EXPECT_EQ(checkpoint_saved_bytes(), x.nbytes());
  EXPECT_TRUE(torch::equal(y, plain));
  y.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), gx));
  EXPECT_TRUE(torch::equal(a->weight.grad(), ga));
  EXPECT_EQ(checkpoint_saved_bytes(), 0);
}

// With stored inputs (offloaded into one contiguous slot) only the outer
// region stores: the inner one, run again inside the outer's recompute, takes
// no slot of its own.
TEST(NonReentrant, NestedRegionsStoreOnlyTheOutermostInputs) {
  torch::manual_seed(0);
  torch::nn::Linear a(8, 8), b(8, 8);
  at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  CheckpointOptions options;
  options.storage.offload = true;
  options.storage.offload_min_bytes = 0;
  options.storage.offload_keep_last = false;
  options.storage.contiguous = std::make_shared<ContiguousBuffers>(1);
  auto inner = [&](const at::Tensor& in) { return b->forward(in).tanh(); };
  auto outer = [&](const at::Tensor& in, bool c) {
    at::Tensor h = a->forward(in * 1.0).relu();
    return (c ? checkpoint_with(options, inner, h) : inner(h)) * 2;
  };
  outer(x, false).sum().backward();
  at::Tensor gx = x.grad().clone(), gb = b->weight.grad().clone();
  x.mutable_grad().reset();
  b->weight.mutable_grad().reset();
  a->weight.mutable_grad().reset();
  const auto before = stored_input_stats();
  at::Tensor y = checkpoint_with(options, [&](const at::Tensor& in) { return outer(in, true); }, x * 1.0);
  EXPECT_EQ(options.storage.contiguous->slots_in_use(), 1);
  EXPECT_EQ(stored_input_stats().offload_copies - before.offload_copies, 1);
  y.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), gx));
  EXPECT_TRUE(torch::equal(b->weight.grad(), gb));
  EXPECT_EQ(stored_input_stats().offload_copies - before.offload_copies, 1);
  EXPECT_EQ(options.storage.contiguous->slots_in_use(), 0);
  EXPECT_EQ(checkpoint_saved_bytes(), 0);
}

TEST(NonReentrant, DeterminismCheckNamesTheSavedTensor) {
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  int calls = 0;
  auto f = [&calls](const at::Tensor& in) {
    ++calls;
    return (calls == 1 ? in : in.narrow(0, 0, 1)).exp().sum();
  };
  auto msg = error_of<Error>([&] { checkpoint_with(named("block7"), f, x).backward(); });
  EXPECT_THAT(msg, HasSubstr("block7: saved tensor #0 of the recompute is Float [1, 3] on cpu but "
                             "the forward saved Float [2, 3] on cpu"));
  calls = 0;
  auto g = [&calls](const at::Tensor& in) {
    ++calls;
    return calls == 1 ? in.exp().tanh() : in.exp() * 2;  // the recompute saves one tensor of two
  };
  msg = error_of<Error>([&] { checkpoint_with(named("block8"), g, x).sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("block8: the recompute saved 1 tensors for backward but the forward "
                             "saved 2"));
}

TEST(NonReentrant, FnThrowingInTheRecomputeSurfacesAndLeavesTheRngAsItWas) {
  torch::manual_seed(0);
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  int calls = 0;
  auto f = [&calls](const at::Tensor& in) {
    if (++calls == 2) throw std::runtime_error("recompute failed here");
    return torch::dropout(in, 0.5, true).exp();
  };
  at::Tensor y = checkpoint(f, x);
  torch::manual_seed(11);
  at::Tensor expected = torch::rand({3});
  torch::manual_seed(11);
  auto msg = error_of<std::runtime_error>([&] { y.sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("recompute failed here"));
  EXPECT_TRUE(torch::equal(torch::rand({3}), expected)) << "the recompute moved the RNG";
}

TEST(NonReentrant, ZeroSizeIntegerAndViewInputsMatchThePlainRun) {
  torch::manual_seed(0);
  torch::nn::Embedding emb(10, 4);
  torch::nn::Linear lin(4, 4);
  at::Tensor ids = torch::randint(0, 10, {3, 2});           // integer input
  at::Tensor empty = torch::randn({0, 4}, torch::requires_grad());  // zero-size input
  at::Tensor base = torch::randn({4, 6}, torch::requires_grad());
  at::Tensor view = base.t().narrow(0, 1, 4);             // offset, strided view
  at::Tensor expanded = torch::randn({1, 4}, torch::requires_grad()).expand({3, 4});
  auto f = [&](const at::Tensor& i, const at::Tensor& e, const at::Tensor& v, const at::Tensor& x) {
    at::Tensor h = emb->forward(i).sum(1) + x;
    return std::make_tuple(lin->forward(h).tanh(), lin->forward(e).exp(), (v * v).sum());
  };
  auto run = [&](bool c) {
    auto [a, b, d] = c ? checkpoint(f, ids, empty, view, expanded) : f(ids, empty, view, expanded);
    (a.sum() + b.sum() + d).backward();
    std::vector<at::Tensor> out{a.detach(), b.detach(), d.detach(), base.grad().clone(),
                                emb->weight.grad().clone(), lin->weight.grad().clone()};
    base.mutable_grad().reset();
    emb->weight.mutable_grad().reset();
    lin->weight.mutable_grad().reset();
    return out;
  };
  auto plain = run(false), ckpt = run(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
}

// Regions of both modes inside each other.
TEST(NonReentrant, MixedNestingMatchesThePlainRun) {
  torch::manual_seed(0);
  torch::nn::Linear a(6, 6), b(6, 6);
  at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
  auto inner = [&](const at::Tensor& in) { return b->forward(in).tanh(); };
  for (bool outer_reentrant : {false, true}) {
    auto outer = [&](const at::Tensor& in, int mode) {
      at::Tensor h = a->forward(in).relu();
      if (mode == 0) return inner(h) * h;
      return checkpoint_with(named("inner", !outer_reentrant), inner, h) * h;
    };
    outer(x, 0).sum().backward();
    at::Tensor gx = x.grad().clone(), gb = b->weight.grad().clone();
    x.mutable_grad().reset();
    b->weight.mutable_grad().reset();
    a->weight.mutable_grad().reset();
    checkpoint_with(named("outer", outer_reentrant), [&](const at::Tensor& in) { return outer(in, 1); }, x)
        .sum()
        .backward();
    EXPECT_TRUE(torch::equal(x.grad(), gx)) << "outer reentrant " << outer_reentrant;
    EXPECT_TRUE(torch::equal(b->weight.grad(), gb)) << "outer reentrant " << outer_reentrant;
    x.mutable_grad().reset();
    b->weight.mutable_grad().reset();
    a->weight.mutable_grad().reset();
  }
}

}  // namespace
}  // namespace remat
