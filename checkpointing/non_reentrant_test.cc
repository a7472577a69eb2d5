// What non-reentrant regions add to the contract both modes share
// (checkpoint_test.cc and checkpoint_contract_test.cc run every case in both):
// gradients through torch::autograd::grad and partial backward, a backward
// inside a region's fn, gradients of gradients through nested regions,
// gradient hooks fired once, in-place changes of saved tensors refused, the
// recompute stopping at the last saved tensor, nested regions keeping only the
// outermost inputs, a forward that keeps none of fn's saved tensors, and
// memory returning to zero after backward.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>

#include "checkpointing/checkpoint.h"
#include "checkpointing/op_recorder.h"
#include "checkpointing/stored_inputs.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/checkpoint_modes.h"
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

// Backward inside a region's fn, and gradients of gradients through regions,
// composed as in a plain run: c(fn) is a region around fn, grad(fn) the
// gradient of fn(x).sum() with respect to x, with a graph (create_graph). Each
// composition runs plainly and checkpointed from the same RNG state (f draws
// a dropout mask), then backpropagates a loss on its result: with
// non-reentrant regions the values and every gradient equal the plain run's
// bit for bit; reentrant regions refuse a backward through or inside them
// with an error saying what to use instead.
class BackwardInsideRegions : public CheckpointModes {};
INSTANTIATE_CHECKPOINT_MODES(BackwardInsideRegions);

using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

TensorFn grad(TensorFn fn) {
  return [fn](const at::Tensor& x) {
    return torch::autograd::grad({fn(x).sum()}, {x}, {}, c10::nullopt, /*create_graph=*/true)[0];
  };
}

struct Composition {
  std::string name;
  TensorFn plain, ckpt;
  const char* reentrant_error;  // what the reentrant mode says instead
};

constexpr const char* kThrough = "cannot run through a checkpointed region of the reentrant mode";
constexpr const char* kInside = "inside a reentrant region, whose forward runs without grad";

TEST_P(BackwardInsideRegions, MatchThePlainRunBitwiseOrAreAClearError) {
  torch::manual_seed(0);
  torch::nn::Linear a(5, 5), b(5, 5);
  const std::vector<at::Tensor> params{a->weight, a->bias, b->weight, b->bias};
  TensorFn f = [&](const at::Tensor& x) {
    return torch::tanh(a->forward(torch::dropout(x, 0.25, true))) * x;
  };
  auto c = [](TensorFn fn) -> TensorFn {
    return [fn](const at::Tensor& x) { return checkpoint_with(mode_options(), fn, x); };
  };
  // An inner region with work before and after it, so the outer region saves
  // tensors of its own around the inner region's.
  auto around = [&](TensorFn inner) -> TensorFn {
    return [&b, inner](const at::Tensor& x) { return b->forward(inner(x.sin())).sigmoid() * x; };
  };
  // Two backward passes inside fn, without a graph: fn frees its inner graph
  // before it returns.
  TensorFn two_grads = [&](const at::Tensor& x) {
    at::Tensor ga = torch::autograd::grad({f(x).sum()}, {x})[0];
    at::Tensor gb = torch::autograd::grad({f(x).exp().sum()}, {x})[0];
    return x.sin() * ga + gb.cos();
  };
  const std::vector<Composition> cases = {
      {"grad(c(f))", grad(f), grad(c(f)), kThrough},
      {"c(grad(f))", grad(f), c(grad(f)), kInside},
      {"c(two grads inside)", two_grads, c(two_grads), kInside},
      {"grad(c(around(c(f))))", grad(around(f)), grad(c(around(c(f)))), kThrough},
      {"c(grad(c(f)))", grad(f), c(grad(c(f))), kInside},
      {"c(grad(around(c(f))))", grad(around(f)), c(grad(around(c(f)))), kInside},
      {"grad(c(grad(c(f))))", grad(grad(f)), grad(c(grad(c(f)))), kInside},
      {"grad(grad(c(around(c(f)))))", grad(grad(around(f))), grad(grad(c(around(c(f))))),
       kThrough},
  };
  // The values and gradients a composition gives; `use_grad`: the final
  // gradients come from torch::autograd::grad rather than backward().
  auto run = [&](const TensorFn& h, bool use_grad) {
    at::Tensor x = torch::randn({3, 5}, torch::requires_grad());
    torch::manual_seed(7);
    at::Tensor y = h(x);
    at::Tensor loss = (y * y.detach().cos()).sum();
    std::vector<at::Tensor> leaves{x};
    leaves.insert(leaves.end(), params.begin(), params.end());
    std::vector<at::Tensor> out{y.detach()};
    if (use_grad) {
      for (auto& g : torch::autograd::grad({loss}, leaves, {}, c10::nullopt, false, true)) {
        out.push_back(g);
      }
      for (const auto& p : params) EXPECT_FALSE(p.grad().defined()) << "grad() accumulated";
    } else {
      loss.backward();
      for (auto& l : leaves) {
        out.push_back(l.grad().defined() ? l.grad().clone() : at::Tensor());
        l.mutable_grad().reset();
      }
    }
    return out;
  };
  for (const auto& k : cases) {
    for (bool use_grad : {false, true}) {
      const std::string what = k.name + (use_grad ? ", autograd::grad" : ", backward");
      torch::manual_seed(1);
      const auto plain = run(k.plain, use_grad);
      torch::manual_seed(1);
      if (GetParam()) {  // reentrant
        auto msg = error_of<Error>([&] { run(k.ckpt, use_grad); });
        EXPECT_THAT(msg, HasSubstr(k.reentrant_error)) << what;
        EXPECT_THAT(msg, HasSubstr("non-reentrant")) << what;
        for (const auto& p : params) p.mutable_grad().reset();
        continue;
      }
      const auto ckpt = run(k.ckpt, use_grad);
      ASSERT_EQ(plain.size(), ckpt.size()) << what;
      for (size_t i = 0; i < plain.size(); ++i) {
        ASSERT_EQ(plain[i].defined(), ckpt[i].defined()) << what << ": result " << i;
        if (plain[i].defined()) {
          EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << what << ": result " << i;
        }
      }
      EXPECT_EQ(checkpoint_saved_bytes(), 0) << what;
    }
  }
}

// A backward inside fn reads the tensors fn saved where they still are (here
// fn's local h, the argument, and the weight whose transposed view Linear
// saves): the forward recomputes nothing, the outer backward recomputes once,
// and fn's saved tensors are not kept past the forward.
TEST(NonReentrant, ABackwardInsideFnRecomputesNothingInTheForward) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  c10::weak_intrusive_ptr<c10::TensorImpl> saved{c10::intrusive_ptr<c10::TensorImpl>()};
  auto fn = [&](const at::Tensor& in) {
    at::Tensor h = torch::tanh(lin->forward(in));  // tanh saves h
    saved = c10::weak_intrusive_ptr<c10::TensorImpl>(h.getIntrusivePtr());
    return torch::autograd::grad({(h * in).sum()}, {in}, {}, c10::nullopt, true)[0];
  };
  const int64_t before = checkpoint_recompute_count();
  at::Tensor g = checkpoint(fn, x);
  EXPECT_EQ(checkpoint_recompute_count(), before) << "the forward recomputed";
  EXPECT_TRUE(saved.expired()) << "a tensor fn saved outlived the forward";
  EXPECT_EQ(checkpoint_saved_bytes(), x.nbytes());
  g.pow(2).sum().backward();
  EXPECT_EQ(checkpoint_recompute_count(), before + 1);
  EXPECT_EQ(checkpoint_saved_bytes(), 0);
}

// The outer backward recomputes fn, its backward inside included: without
// the forward's RNG state the recompute draws another dropout mask and the
// gradients differ (the parity above is not an accident of reading the
// forward's tensors back).
TEST(NonReentrant, ABackwardInsideFnIsRecomputedUnderTheForwardsRng) {
  torch::manual_seed(0);
  torch::nn::Linear lin(6, 6);
  auto fn = [&](const at::Tensor& in) {
    at::Tensor h = torch::tanh(lin->forward(torch::dropout(in, 0.5, true)));
    return torch::autograd::grad({(h * in).sum()}, {in}, {}, c10::nullopt, true)[0] * h;
  };
  auto gradient = [&](bool checkpointed, bool preserve_rng) {
    at::Tensor x = torch::ones({4, 6}, torch::requires_grad());
    CheckpointOptions options;
    options.preserve_rng_state = preserve_rng;
    torch::manual_seed(3);
    at::Tensor y = checkpointed ? checkpoint_with(options, fn, x) : fn(x);
    y.pow(2).sum().backward();
    lin->weight.mutable_grad().reset();
    lin->bias.mutable_grad().reset();
    return x.grad();
  };
  const at::Tensor plain = gradient(false, true);
  EXPECT_TRUE(torch::equal(gradient(true, true), plain));
  EXPECT_FALSE(torch::equal(gradient(true, false), plain));
}

// A region's forward keeps none of the tensors fn saves: around a chain of
// eight tanh (each saves its output) on a 4 MiB tensor it peaks at two of
// them, where a plain forward holds all eight.
TEST(NonReentrant, TheForwardHoldsNoneOfTheTensorsFnSaves) {
  torch::manual_seed(0);
  at::Tensor x = torch::randn({1 << 20}, torch::requires_grad());
  const int64_t one = x.nbytes();
  auto chain = [](const at::Tensor& in) {
    at::Tensor h = in;
    for (int i = 0; i < 8; ++i) h = h.tanh();
    return h;
  };
  auto forward_peak = [&](bool checkpointed) {
    MemoryTracker mem;
    at::Tensor y = checkpointed ? checkpoint(chain, x) : chain(x);
    return mem.peak();
  };
  const int64_t plain = forward_peak(false), ckpt = forward_peak(true);
  EXPECT_GE(plain, 8 * one);
  EXPECT_LE(ckpt, 2 * one + one / 8) << "plain forward's peak: " << plain;
}

// What a backward inside fn had recomputed and did not read goes when that
// backward ends: here it reads only the last tanh's output, and the seven
// before it, recomputed with it, do not stay for the rest of fn.
TEST(NonReentrant, WhatABackwardInsideFnDidNotReadGoesWhenItEnds) {
  torch::manual_seed(0);
  at::Tensor x = torch::randn({1 << 20}, torch::requires_grad());
  const int64_t one = x.nbytes();
  int64_t after_grad = -1;
  const int64_t before = checkpoint_recompute_count();
  MemoryTracker mem;
  at::Tensor y = checkpoint(
      [&](const at::Tensor& in) {
        at::Tensor h = in;
        for (int i = 0; i < 8; ++i) h = h.tanh();
        at::Tensor s = h.tanh().sum();  // tanh's output is dropped here
        at::Tensor g = torch::autograd::grad({s}, {h})[0];
        after_grad = mem.current();  // h and g
        return g * h;
      },
      x);
  EXPECT_EQ(checkpoint_recompute_count(), before + 1);
  EXPECT_LE(after_grad, 2 * one + one / 8);
  EXPECT_LE(mem.current(), one + one / 8) << "the output only";
}

// A backward inside fn that needs tensors fn saved and dropped gets them
// recomputed from the region's arguments under the forward's starting RNG
// state (one recompute for all of them), and the forward then goes on as a
// plain one: the dropout after the backward draws the plain run's mask, and
// the RNG ends where the plain run leaves it.
TEST(NonReentrant, ABackwardInsideFnRecomputesWhatFnDroppedAndTheForwardGoesOn) {
  torch::manual_seed(0);
  torch::nn::Linear lin(6, 6);
  at::Tensor x = torch::randn({4, 6}, torch::requires_grad());
  auto fn = [&](const at::Tensor& in) {
    at::Tensor h = torch::dropout(lin->forward(in), 0.5, true).tanh().exp();
    at::Tensor g = torch::autograd::grad({h.sum()}, {in}, {}, c10::nullopt, true)[0];
    return torch::dropout(g * h, 0.5, true);
  };
  auto run = [&](bool checkpointed) {
    torch::manual_seed(3);
    const int64_t before = checkpoint_recompute_count();
    at::Tensor y = checkpointed ? checkpoint(fn, x) : fn(x);
    const int64_t in_forward = checkpoint_recompute_count() - before;
    at::Tensor next = torch::rand({4});
    y.pow(2).sum().backward();
    std::vector<at::Tensor> out{y.detach(), next, x.grad().clone(), lin->weight.grad().clone()};
    x.mutable_grad().reset();
    lin->weight.mutable_grad().reset();
    lin->bias.mutable_grad().reset();
    return std::make_pair(out, in_forward);
  };
  const auto plain = run(false).first;
  const auto [ckpt, recomputes] = run(true);
  EXPECT_EQ(recomputes, 1);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
  EXPECT_EQ(checkpoint_saved_bytes(), 0);
}

// fn changed an argument in place before a backward inside it that needs a
// recompute: recomputing from the changed value would give other tensors.
TEST(NonReentrant, ABackwardInsideFnAfterFnChangedAnArgumentInPlaceIsAnError) {
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  at::Tensor scale = torch::ones({3});
  auto fn = [](const at::Tensor& in, const at::Tensor& s) {
    s.add_(1);
    at::Tensor h = (in * s).tanh().exp();  // tanh's output is dropped
    return torch::autograd::grad({h.sum()}, {in})[0];
  };
  auto msg = error_of<Error>([&] { checkpoint_with(named("block9"), fn, x, scale); });
  EXPECT_THAT(msg, HasSubstr("block9: a backward inside fn needs saved tensors that fn freed"));
  EXPECT_THAT(msg, HasSubstr("fn changed tensor argument 1 in place"));
}

// Recomputing for a backward inside fn puts back the RNG state fn started
// with, which cannot be done inside a fork of the RNG tracker.
TEST(NonReentrant, ABackwardInsideFnThatNeedsARecomputeInsideATrackerForkIsAnError) {
  auto fn = [](const at::Tensor& in) {
    auto fork = get_rng_tracker().fork();
    at::Tensor h = torch::dropout(in, 0.5, true).tanh().exp();  // tanh's output is dropped
    return torch::autograd::grad({h.sum()}, {in})[0];
  };
  model_parallel_manual_seed(5, 0);
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  const RngSnapshot start = capture_rng();
  auto msg = error_of<Error>([&] { checkpoint_with(named("block10"), fn, x); });
  EXPECT_THAT(msg, HasSubstr("block10: a backward inside fn needs saved tensors that fn freed"));
  EXPECT_THAT(msg, HasSubstr("run that backward outside the fork"));
  // The RNG is where fn started, the tracker's state included.
  const RngSnapshot now = capture_rng();
  EXPECT_TRUE(torch::equal(now.defaults.cpu, start.defaults.cpu));
  EXPECT_TRUE(torch::equal(now.tracker.at(kModelParallelRng).cpu,
                           start.tracker.at(kModelParallelRng).cpu));
}

}  // namespace
}  // namespace remat
