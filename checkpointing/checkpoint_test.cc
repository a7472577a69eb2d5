// Bitwise parity of checkpointed and plain runs on CPU: the same kernels on
// the same bits, so outputs and every gradient compare with torch::equal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpointing/checkpoint.h"
#include "checkpointing/op_recorder.h"
#include "checkpointing/sequential.h"
#include "rng/rng_tracker.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "tests/checkpoint_modes.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

class Checkpoint : public CheckpointModes {};
INSTANTIATE_CHECKPOINT_MODES(Checkpoint);
class CheckpointSequential : public CheckpointModes {};
INSTANTIATE_CHECKPOINT_MODES(CheckpointSequential);
class SelectiveOp : public CheckpointModes {};
INSTANTIATE_CHECKPOINT_MODES(SelectiveOp);

// Gradients of the inputs and of every parameter, cloned; grads then cleared.
std::vector<at::Tensor> take_grads(const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> out;
  for (auto& t : leaves) {
    out.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
    if (t.grad().defined()) t.mutable_grad().reset();
  }
  return out;
}

void expect_all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "tensor " << i;
    if (a[i].defined()) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i << " differs";
    }
  }
}

std::vector<at::Tensor> leaves_of(const torch::nn::Module& m, std::vector<at::Tensor> inputs) {
  for (const auto& p : m.parameters()) inputs.push_back(p);
  return inputs;
}

// Runs `step` (forward + loss) plainly and checkpointed from the same RNG
// state; returns {plain outputs + grads, checkpointed outputs + grads}.
template <typename Step>
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> both(Step step,
                                                                std::vector<at::Tensor> leaves) {
  std::vector<at::Tensor> results[2];
  for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
    model_parallel_manual_seed(42, /*tp_rank=*/0);  // default and tracked streams
    std::vector<at::Tensor> outs = step(checkpointed == 1);
    at::Tensor loss = at::zeros({});
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].is_floating_point() && outs[i].requires_grad()) {
        loss = loss + outs[i].pow(2).sum() * static_cast<double>(i + 1);
      }
    }
    loss.backward();
    for (auto& o : outs) results[checkpointed].push_back(o.detach().clone());
    for (auto& g : take_grads(leaves)) results[checkpointed].push_back(g);
    // What the RNG draws next: recompute must leave it where it found it.
    results[checkpointed].push_back(torch::rand({4}));
  }
  return {results[0], results[1]};
}

TEST_P(Checkpoint, SingleLinear) {
  torch::manual_seed(0);
  torch::nn::Linear lin(16, 8);
  at::Tensor x = torch::randn({4, 16}, torch::requires_grad());
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](const at::Tensor& in) { return lin->forward(in); };
        return std::vector<at::Tensor>{c ? checkpoint(f, x) : f(x)};
      },
      leaves_of(*lin, {x}));
  expect_all_equal(plain, ckpt);
  EXPECT_TRUE(ckpt[1].abs().sum().item<float>() > 0);  // x got a gradient
}

TEST_P(Checkpoint, MaskedLinearWithBoolAndFloatMasks) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 8);
  at::Tensor x = torch::randn({5, 8}, torch::requires_grad());
  at::Tensor bool_mask = torch::rand({5, 8}) > 0.5;
  at::Tensor float_mask = torch::rand({5, 8});
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](const at::Tensor& in, const at::Tensor& bm, const at::Tensor& fm) {
          return std::make_tuple(lin->forward(in).masked_fill(bm.logical_not(), 0.0),
                                 lin->forward(in) * fm);
        };
        auto [a, b] = c ? checkpoint(f, x, bool_mask, float_mask) : f(x, bool_mask, float_mask);
        return std::vector<at::Tensor>{a, b};
      },
      leaves_of(*lin, {x}));
  expect_all_equal(plain, ckpt);
}

TEST_P(Checkpoint, SeveralOutputsInPermutedOrder) {
  torch::manual_seed(0);
  torch::nn::Linear lin(6, 6);
  at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
  at::Tensor y = torch::randn({3, 6}, torch::requires_grad());
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](const at::Tensor& a, const at::Tensor& b) {
          at::Tensor p = lin->forward(a), q = torch::tanh(b), r = p * q;
          return std::vector<at::Tensor>{r, b * 2, p};  // not in computation order
        };
        return c ? checkpoint(f, x, y) : f(x, y);
      },
      leaves_of(*lin, {x, y}));
  expect_all_equal(plain, ckpt);
}

TEST_P(Checkpoint, NoneArguments) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](const at::Tensor& in, c10::optional<at::Tensor> bias, const at::Tensor& none) {
          at::Tensor out = lin->forward(in);
          if (bias) out = out + *bias;
          EXPECT_FALSE(none.defined());
          return std::make_tuple(out, c10::optional<at::Tensor>());
        };
        auto [out, missing] = c ? checkpoint(f, x, c10::optional<at::Tensor>(), at::Tensor())
                                : f(x, c10::nullopt, at::Tensor());
        EXPECT_FALSE(missing.has_value());
        return std::vector<at::Tensor>{out};
      },
      leaves_of(*lin, {x}));
  expect_all_equal(plain, ckpt);
}

TEST_P(Checkpoint, NonTensorArgumentsAndOutputsInEveryPosition) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  at::Tensor y = torch::randn({2, 4}, torch::requires_grad());
  using Out = std::tuple<int64_t, at::Tensor, std::string, std::vector<at::Tensor>, double, bool>;
  Out results[2];
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](int64_t k, const at::Tensor& a, double s, bool flag, std::string mode,
                     std::vector<int64_t> dims, std::vector<at::Tensor> rest) -> Out {
          at::Tensor h = lin->forward(a) * s + rest[0] * static_cast<double>(k);
          if (flag) h = torch::relu(h);
          return {k + 1, h, mode + "!", {h.sum(dims), rest[0] * 3}, s * 2, !flag};
        };
        Out out = c ? checkpoint(f, 3, x, 0.5, true, std::string("gelu"),
                                 std::vector<int64_t>{1}, std::vector<at::Tensor>{y})
                    : f(3, x, 0.5, true, "gelu", {1}, {y});
        results[c] = out;
        return std::vector<at::Tensor>{std::get<1>(out), std::get<3>(out)[0], std::get<3>(out)[1]};
      },
      leaves_of(*lin, {x, y}));
  expect_all_equal(plain, ckpt);
  EXPECT_EQ(std::get<0>(results[1]), 4);
  EXPECT_EQ(std::get<2>(results[1]), "gelu!");
  EXPECT_EQ(std::get<4>(results[1]), 1.0);
  EXPECT_EQ(std::get<5>(results[1]), false);
}

TEST_P(Checkpoint, KeywordLikeArgumentsCapturedByFn) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  double scale = 0.25;
  std::string activation = "tanh";
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&, scale, activation](const at::Tensor& in) {
          at::Tensor h = lin->forward(in) * scale;
          return activation == "tanh" ? torch::tanh(h) : torch::relu(h);
        };
        return std::vector<at::Tensor>{c ? checkpoint(f, x) : f(x)};
      },
      leaves_of(*lin, {x}));
  expect_all_equal(plain, ckpt);
}

TEST_P(Checkpoint, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 3);
  at::Tensor x = torch::randn({2, 4});  // no grad
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](const at::Tensor& in) { return lin->forward(in); };
        return std::vector<at::Tensor>{c ? checkpoint(f, x) : f(x)};
      },
      leaves_of(*lin, {}));
  expect_all_equal(plain, ckpt);
  ASSERT_TRUE(ckpt[1].defined());  // weight grad
  EXPECT_GT(ckpt[1].abs().sum().item<float>(), 0);
}

// A block with dropout, a tracker fork and a residual: randomness everywhere.
struct DropoutBlock {
  torch::nn::Linear a{8, 16}, b{16, 8};
  at::Tensor operator()(const at::Tensor& x) {
    at::Tensor h = torch::gelu(a->forward(x));
    h = torch::dropout(h, 0.3, /*train=*/true);
    {
      auto guard = get_rng_tracker().fork();
      h = torch::dropout(h, 0.2, /*train=*/true);
    }
    return x + b->forward(h);
  }
  std::vector<at::Tensor> params() {
    auto p = a->parameters();
    for (auto& q : b->parameters()) p.push_back(q);
    return p;
  }
};

TEST_P(Checkpoint, DropoutMatchesBitwiseAndFailsWithoutRngPreservation) {
  torch::manual_seed(0);
  model_parallel_manual_seed(1234, /*tp_rank=*/0);
  DropoutBlock block;
  at::Tensor x = torch::randn({6, 8}, torch::requires_grad());
  auto leaves = block.params();
  leaves.push_back(x);
  auto run = [&](bool preserve) {
    return both(
        [&](bool c) {
          CheckpointOptions options = mode_options();
          options.preserve_rng_state = preserve;
          return std::vector<at::Tensor>{c ? checkpoint_with(options, block, x) : block(x)};
        },
        leaves);
  };
  auto [plain, ckpt] = run(true);
  expect_all_equal(plain, ckpt);
  // Without RNG preservation the recompute draws other masks: gradients differ.
  auto [plain2, ckpt2] = run(false);
  EXPECT_TRUE(torch::equal(plain2[0], ckpt2[0]));  // forward is unaffected
  bool any_differs = false;
  for (size_t i = 1; i + 1 < plain2.size(); ++i) {
    any_differs = any_differs || !torch::equal(plain2[i], ckpt2[i]);
  }
  EXPECT_TRUE(any_differs) << "gradients matched although the recompute drew new masks";
}

TEST_P(Checkpoint, NestedRegions) {
  torch::manual_seed(0);
  model_parallel_manual_seed(7, 0);
  DropoutBlock inner, outer;
  at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  auto leaves = inner.params();
  for (auto& p : outer.params()) leaves.push_back(p);
  leaves.push_back(x);
  auto [plain, ckpt] = both(
      [&](bool c) {
        auto f = [&](const at::Tensor& in) {
          at::Tensor h = c ? checkpoint(inner, in) : inner(in);
          return outer(h);
        };
        return std::vector<at::Tensor>{c ? checkpoint(f, x) : f(x)};
      },
      leaves);
  expect_all_equal(plain, ckpt);
}

// Each backward recomputes once; a second backward after the graph was
// released says so (reentrant regions in their own words, non-reentrant ones
// through LibTorch's: their saved tensors are autograd's own).
TEST_P(Checkpoint, RetainGraphRecomputesOncePerBackwardAndASecondBackwardIsRefused) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  at::Tensor loss = checkpoint([&](const at::Tensor& in) { return lin->forward(in).tanh(); }, x).sum();
  int64_t before = checkpoint_recompute_count();
  loss.backward({}, /*retain_graph=*/true);
  at::Tensor once = x.grad().clone();
  loss.backward();
  EXPECT_EQ(checkpoint_recompute_count() - before, 2);
  EXPECT_TRUE(torch::equal(x.grad(), once * 2));
  auto msg = error_of<std::exception>([&] { loss.backward(); });
  EXPECT_THAT(msg, HasSubstr("a second time"));
  EXPECT_THAT(msg, HasSubstr(GetParam() ? "retain_graph=true" : "retain_graph=True"));
}

TEST(CheckpointReentrant, AutogradGradIsRefusedClearly) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  at::Tensor loss = checkpoint_with(reentrant_options(), [&](const at::Tensor& in) { return lin->forward(in); }, x).sum();
  auto msg = error_of<Error>([&] { torch::autograd::grad({loss}, {x}); });
  EXPECT_THAT(msg, HasSubstr("torch::autograd::grad (or backward with `inputs`) cannot run "
                             "through a checkpointed region"));
}

TEST(CheckpointReentrant, DeterminismCheckNamesTheOutput) {
  at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  int calls = 0;
  auto f = [&calls](const at::Tensor& in) {
    ++calls;
    return std::make_tuple(in * 2, calls == 1 ? in.sum(1) : in.sum(0));
  };
  CheckpointOptions options = reentrant_options();
  options.name = "block7";
  auto [a, b] = checkpoint_with(options, f, x);
  auto msg = error_of<Error>([&] { (a.sum() + b.sum()).backward(); });
  EXPECT_THAT(msg, HasSubstr("block7: output 1 of the recompute is Float [3] on cpu but the "
                             "forward produced Float [2] on cpu"));
  // With the check off the recompute's result is used as is (here: other values).
  calls = 0;
  options.determinism_check = false;
  auto g = [&calls](const at::Tensor& in) { return in * static_cast<double>(++calls); };
  checkpoint_with(options, g, x).sum().backward();
  EXPECT_EQ(calls, 2);
}

TEST_P(Checkpoint, EvaluationRunsOnceAndKeepsNothing) {
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  int calls = 0;
  at::NoGradGuard no_grad;
  at::Tensor y = checkpoint([&](const at::Tensor& in) { ++calls; return lin->forward(in); }, x);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_FALSE(y.grad_fn());
}

TEST_P(Checkpoint, UnsupportedArgumentIsAClearError) {
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("a", torch::ones({1}));
  auto msg = error_of<Error>([&] {
    checkpoint_ivalues([](const std::vector<c10::IValue>& in) { return in[0]; },
                       {c10::IValue(dict)});
  });
  EXPECT_THAT(msg, HasSubstr("checkpoint argument: values of type GenericDict are not supported"));
}

TEST_P(Checkpoint, ProfileAggregatesPerRegion) {
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  CheckpointOptions options = mode_options();
  options.profile = true;
  options.name = "profiled";
  log_checkpoint_profile_step(0);  // start from an empty aggregate
  for (int i = 0; i < 3; ++i) {
    checkpoint_with(options, [&](const at::Tensor& in) { return lin->forward(in); }, x)
        .sum()
        .backward();
  }
  auto profile = checkpoint_profile();
  ASSERT_TRUE(profile.count("profiled"));
  EXPECT_EQ(profile["profiled"].calls, 3);
  EXPECT_EQ(profile["profiled"].recomputes, 3);
  EXPECT_GT(profile["profiled"].backward_ms, 0);
  EXPECT_GE(profile["profiled"].backward_ms, profile["profiled"].recompute_ms);
}

// Two contexts in one process: each has its own defaults and counters, and a
// region counts into the context of its forward even when its backward runs
// under another context or under none.
TEST_P(Checkpoint, EachContextHasItsOwnDefaultsAndCounters) {
  auto a = Context::create();
  auto b = Context::create();
  const bool reentrant = default_checkpoint_options().reentrant;  // this case's mode
  {
    ContextScope scope(a);
    EXPECT_EQ(default_checkpoint_options().name, "checkpoint") << "a new context has the defaults";
    default_checkpoint_options().reentrant = reentrant;
    default_checkpoint_options().name = "in-a";
    default_checkpoint_options().profile = true;
  }
  {
    ContextScope scope(b);
    EXPECT_EQ(default_checkpoint_options().name, "checkpoint") << "b sees nothing of a's defaults";
    EXPECT_FALSE(default_checkpoint_options().profile);
  }
  EXPECT_EQ(default_checkpoint_options().name, "checkpoint") << "nor does the process default";
  const int64_t outside_recomputes = checkpoint_recompute_count();
  const int64_t outside_saved = checkpoint_saved_bytes();

  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  for (const auto& backward_in : {b, std::shared_ptr<Context>()}) {
    at::Tensor loss;
    {
      ContextScope scope(a);
      loss = checkpoint([&](const at::Tensor& in) { return lin->forward(in).tanh(); }, x).sum();
      EXPECT_GT(checkpoint_saved_bytes(), 0);
    }
    {
      ContextScope scope(b);
      EXPECT_EQ(checkpoint_saved_bytes(), 0) << "a's region is not b's";
    }
    {
      ContextScope scope(backward_in);
      loss.backward();
      loss = at::Tensor();
      EXPECT_EQ(checkpoint_recompute_count(), backward_in ? 0 : outside_recomputes)
          << "the recompute counted where the backward ran, not where the region was made";
    }
  }
  {
    ContextScope scope(a);
    EXPECT_EQ(checkpoint_recompute_count(), 2);
    EXPECT_EQ(checkpoint_saved_bytes(), 0);
    auto profile = checkpoint_profile();
    ASSERT_TRUE(profile.count("in-a"));
    EXPECT_EQ(profile["in-a"].calls, 2);
    EXPECT_EQ(profile["in-a"].recomputes, 2);
  }
  {
    ContextScope scope(b);
    EXPECT_EQ(checkpoint_recompute_count(), 0);
    EXPECT_TRUE(checkpoint_profile().empty());
  }
  EXPECT_EQ(checkpoint_recompute_count(), outside_recomputes);
  EXPECT_EQ(checkpoint_saved_bytes(), outside_saved);
  EXPECT_EQ(checkpoint_profile().count("in-a"), 0u);
}

// A region's recompute runs in its forward's context, whatever context (or
// none) the backward runs under: it replays the forward's RNG into that
// context's tracker (bitwise the plain run's gradients, though the other
// context's tracker has another seed), and a region nested in fn that the
// recompute makes takes that context's defaults.
TEST_P(Checkpoint, TheRecomputeRunsInItsForwardsContext) {
  torch::manual_seed(0);
  DropoutBlock inner, outer;
  at::Tensor x = torch::randn({6, 8}, torch::requires_grad());
  auto leaves = inner.params();
  for (auto& p : outer.params()) leaves.push_back(p);
  leaves.push_back(x);
  auto a = Context::create();
  auto other = Context::create();
  const bool reentrant = default_checkpoint_options().reentrant;
  {
    ContextScope scope(a);
    default_checkpoint_options().reentrant = reentrant;
    default_checkpoint_options().name = "nested-in-a";
    default_checkpoint_options().profile = true;
  }
  {
    ContextScope scope(other);
    model_parallel_manual_seed(999, 0);
  }
  auto run = [&](bool checkpointed, const std::shared_ptr<Context>& backward_in) {
    at::Tensor y;
    {
      ContextScope scope(a);
      model_parallel_manual_seed(42, 0);
      auto f = [&](const at::Tensor& in) { return outer(checkpointed ? checkpoint(inner, in) : inner(in)); };
      y = checkpointed ? checkpoint_with(mode_options(), f, x) : f(x);
    }
    {
      ContextScope scope(backward_in);
      y.pow(2).sum().backward();
    }
    std::vector<at::Tensor> out{y.detach().clone()};
    for (auto& g : take_grads(leaves)) out.push_back(g);
    return out;
  };
  const auto plain = run(false, nullptr);
  int64_t recomputes_in_a = 0;
  for (const auto& backward_in : {std::shared_ptr<Context>(), other}) {
    expect_all_equal(plain, run(true, backward_in));
    ContextScope scope(a);
    // The outer region and the inner one each recompute once, in a.
    EXPECT_EQ(checkpoint_recompute_count() - recomputes_in_a, 2);
    recomputes_in_a = checkpoint_recompute_count();
  }
  {
    // The inner region takes a's defaults (its name, profiling on) also when
    // it is made in the outer's recompute: a non-reentrant outer makes it in
    // its forward and again in its recompute, a reentrant one (whose forward
    // runs fn without grad) only in its recompute.
    ContextScope scope(a);
    auto profile = checkpoint_profile();
    ASSERT_TRUE(profile.count("nested-in-a"));
    EXPECT_EQ(profile["nested-in-a"].calls, reentrant ? 2 : 4);
    EXPECT_EQ(profile["nested-in-a"].recomputes, 2);
  }
  ContextScope scope(other);
  EXPECT_EQ(checkpoint_recompute_count(), 0);
  EXPECT_TRUE(checkpoint_profile().empty());
}

// Counts its forward calls.
struct CountingImpl : torch::nn::Module {
  explicit CountingImpl(int64_t* calls) : calls(calls) { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) {
    ++*calls;
    return torch::tanh(lin->forward(x));
  }
  int64_t* calls;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Counting);

TEST_P(CheckpointSequential, CheckpointedSegmentsRunTwiceTheLastOnce) {
  torch::manual_seed(0);
  std::vector<int64_t> calls(6, 0);
  torch::nn::Sequential seq;
  for (auto& c : calls) seq->push_back(Counting(&c));
  at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
  at::Tensor plain = seq->forward(x);
  plain.sum().backward();
  auto plain_grads = take_grads(leaves_of(*seq, {x}));
  std::fill(calls.begin(), calls.end(), 0);

  at::Tensor y = checkpoint_sequential(seq, /*segments=*/3, x);
  y.sum().backward();
  // Segments {0,1} {2,3} are checkpointed; {4,5} is the last and runs once.
  EXPECT_EQ(calls, (std::vector<int64_t>{2, 2, 2, 2, 1, 1}));
  EXPECT_TRUE(torch::equal(plain, y));
  expect_all_equal(plain_grads, take_grads(leaves_of(*seq, {x})));
  EXPECT_THAT(error_of<Error>([&] { checkpoint_sequential(seq, 7, x); }),
              HasSubstr("segments=7 must be between 1 and the 6 modules"));
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

TEST_P(SelectiveOp, RetainGraphReplaysTwiceBitwise) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 8);
  at::Tensor x = torch::randn({2, 3, 8}, torch::requires_grad());
  auto f = [&](const at::Tensor& in) { return torch::gelu(lin->forward(in)); };
  f(x).pow(2).sum().backward();
  at::Tensor plain = x.grad().clone();
  x.mutable_grad().reset();
  CheckpointOptions options = mode_options();
  options.save_ops = std::make_shared<const std::set<std::string>>(std::set<std::string>{"aten::mm"});
  at::Tensor loss = checkpoint_with(options, f, x).pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(torch::equal(x.grad(), plain));
  loss.backward();
  EXPECT_TRUE(torch::equal(x.grad(), plain * 2));
}

TEST_P(SelectiveOp, ReplayOfAnotherCallIsAClearError) {
  at::Tensor x = torch::randn({4, 4}, torch::requires_grad());
  int calls = 0;
  auto f = [&](const at::Tensor& in) {
    ++calls;
    // tanh saves after the mm: a non-reentrant recompute, which stops at the
    // last saved tensor, reaches the mm's kernel too.
    return (calls == 1 ? in.mm(in) : in.narrow(0, 0, 2).mm(in)).tanh();
  };
  CheckpointOptions options = mode_options();
  options.determinism_check = false;
  options.save_ops = std::make_shared<const std::set<std::string>>(std::set<std::string>{"aten::mm"});
  at::Tensor y = checkpoint_with(options, f, x);
  auto msg = error_of<Error>([&] { y.sum().backward(); });
  EXPECT_THAT(msg, HasSubstr("selective_op: the recompute called aten::mm("));
  EXPECT_THAT(msg, HasSubstr("the region must run the same ops in the same order both times"));
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

TEST_P(Checkpoint, DebugOptionRecordsOpSequencesWithoutChangingResults) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  auto f = [&](const at::Tensor& in) { return torch::tanh(lin->forward(in)); };
  f(x).sum().backward();
  at::Tensor plain = x.grad().clone();
  x.mutable_grad().reset();
  CheckpointOptions options = mode_options();
  options.debug = true;
  options.name = "debugged";
  OpRecorder outer;  // recorders nest: the region's own recorder does not hide ops from this one
  checkpoint_with(options, f, x).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), plain));
  EXPECT_GE(outer.count("aten::tanh"), 2);  // forward and recompute
}

TEST(Checkpoint, RegionsReportTheirSavedBytes) {
  at::Tensor x = torch::randn({64, 32}, torch::requires_grad());
  auto w = torch::randn({32, 32}, torch::requires_grad());
  const int64_t before = checkpoint_saved_bytes();
  at::Tensor y = checkpoint([&](const at::Tensor& in) { return torch::tanh(in.mm(w)); }, x);
  EXPECT_EQ(checkpoint_saved_bytes() - before, 64 * 32 * 4);  // the input only
  CheckpointOptions selective;
  selective.save_ops = std::make_shared<const std::set<std::string>>(std::set<std::string>{"aten::mm"});
  at::Tensor z = checkpoint_with(selective, [&](const at::Tensor& in) { return torch::tanh(in.mm(w)); }, y);
  // The second region keeps its input and the saved mm output.
  EXPECT_EQ(checkpoint_saved_bytes() - before, 64 * 32 * 4 * 3);
  z.sum().backward();
  y = at::Tensor();
  z = at::Tensor();
  EXPECT_EQ(checkpoint_saved_bytes(), before);  // released with the graph
}

}  // namespace
}  // namespace remat
