#include "nn/saved_tensors_hooks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <thread>

namespace remat {
namespace {

// Hooks that count and keep a detached alias (the data, not the node).
struct Counting {
  int packs = 0, unpacks = 0;
  std::vector<at::Tensor> seen;  // what pack received
  saved_tensors_hooks scope() {
    return saved_tensors_hooks(
        [this](const at::Tensor& t) -> std::any {
          ++packs;
          seen.push_back(t.detach());
          return t.detach();
        },
        [this](const std::any& packed) {
          ++unpacks;
          return std::any_cast<at::Tensor>(packed);
        });
  }
};

TEST(SavedTensorsHooks, EverySavedTensorIsPackedAndComesBackThroughUnpack) {
  torch::manual_seed(0);
  at::Tensor x = torch::randn({4, 5}, torch::requires_grad());
  at::Tensor w = torch::randn({4, 5}, torch::requires_grad());
  auto plain = torch::autograd::grad({(x * w).sin().sum()}, {x, w});
  Counting c;
  at::Tensor loss;
  {
    auto scope = c.scope();
    EXPECT_TRUE(saved_tensors_hooks_active());
    loss = (x * w).sin().sum();  // mul saves x and w, sin its input; sum nothing
  }
  EXPECT_FALSE(saved_tensors_hooks_active());
  EXPECT_EQ(c.packs, 3);
  EXPECT_EQ(c.unpacks, 0);
  auto hooked = torch::autograd::grad({loss}, {x, w});
  EXPECT_EQ(c.unpacks, 3);
  EXPECT_TRUE(torch::equal(plain[0], hooked[0]));
  EXPECT_TRUE(torch::equal(plain[1], hooked[1]));
}

// Wrapped numbers (scalars turned into 0-dim tensors, as Python's `x * 2.0`
// makes them; made here by hand): LibTorch 1.13 hands them to pack, 2.x keeps
// them out of the hooks. Gradients are the same either way.
TEST(SavedTensorsHooks, WrappedNumbersAreHookedOnlyBeforeLibTorch2) {
  at::Tensor x = torch::randn({3}, torch::requires_grad());
  at::Tensor two = at::scalar_tensor(2.0, at::kDouble);
  two.unsafeGetTensorImpl()->set_wrapped_number(true);
  Counting c;
  at::Tensor loss;
  {
    auto scope = c.scope();
    loss = x.mul(two).sum();  // mul saves self and other
  }
#if TORCH_VERSION_MAJOR >= 2
  EXPECT_EQ(c.packs, 0);
#else
  EXPECT_EQ(c.packs, 1);
  ASSERT_EQ(c.seen.size(), 1u);
  EXPECT_TRUE(c.seen[0].unsafeGetTensorImpl()->is_wrapped_number() || c.seen[0].dim() == 0);
#endif
  loss.backward();
  EXPECT_TRUE(torch::equal(x.grad(), torch::full({3}, 2.0)));
}

// A custom Function: save_for_backward (inputs and its own output) is hooked,
// ctx->saved_data is not.
struct ScaleExp : public torch::autograd::Function<ScaleExp> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& s) {
    at::Tensor out = x.exp() * s;
    ctx->save_for_backward({x, out});
    ctx->saved_data["s"] = s;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    return {grads[0] * saved[1], at::Tensor()};
  }
};

TEST(SavedTensorsHooks, CustomFunctionsSaveForBackwardIsHookedSavedDataIsNot) {
  at::Tensor x = torch::randn({6}, torch::requires_grad());
  at::Tensor s = torch::full({6}, 2.0);
  Counting c;
  at::Tensor y;
  {
    auto scope = c.scope();
    y = ScaleExp::apply(x, s);
  }
  EXPECT_EQ(c.packs, 2) << "x and the output; s in saved_data is not a saved variable";
  y.sum().backward();
  EXPECT_EQ(c.unpacks, 2);
  EXPECT_TRUE(torch::equal(x.grad(), x.exp() * 2));
}

TEST(SavedTensorsHooks, AnOutputArrivesWithItsGradFnAndKeepingItMakesACycle) {
  at::Tensor x = torch::randn({1000}, torch::requires_grad());
  // exp saves its own result: pack receives that output, grad_fn set.
  bool output_with_grad_fn = false;
  at::Storage cycled;
  {
    saved_tensors_hooks scope(
        [&](const at::Tensor& t) -> std::any {
          output_with_grad_fn = output_with_grad_fn || t.grad_fn() != nullptr;
          return t;  // the tensor itself: it holds its grad_fn, which holds this
        },
        [](const std::any& packed) { return std::any_cast<at::Tensor>(packed); });
    at::Tensor y = (x * 1).exp();
    cycled = y.storage();
  }
  EXPECT_TRUE(output_with_grad_fn);
  EXPECT_GT(cycled.use_count(), 1u) << "the graph was dropped but the cycle keeps the output";

  // Keeping a detached alias instead: the data goes with the graph.
  at::Storage freed;
  {
    saved_tensors_hooks scope([](const at::Tensor& t) -> std::any { return t.detach(); },
                              [](const std::any& packed) { return std::any_cast<at::Tensor>(packed); });
    at::Tensor y = (x * 1).exp();
    freed = y.storage();
  }
  EXPECT_EQ(freed.use_count(), 1u) << "only this test's handle is left";
}

TEST(SavedTensorsHooks, InPlaceChangesAreNotCheckedUnlessTheHooksDoIt) {
  at::Tensor x = torch::randn({5}, torch::requires_grad());
  at::Tensor w = torch::randn({5}, torch::requires_grad());
  // Without hooks autograd refuses the changed input.
  {
    at::Tensor h = x * 1;
    at::Tensor loss = (h * w).sum();
    h.mul_(2);
    EXPECT_THROW(loss.backward(), c10::Error);
  }
  // With hooks that keep an alias, it goes through with the changed value: a
  // silently wrong gradient for w.
  {
    w.mutable_grad() = at::Tensor();
    Counting c;
    at::Tensor h = x * 1;
    at::Tensor loss;
    {
      auto scope = c.scope();
      loss = (h * w).sum();
    }
    at::Tensor expected = h.detach().clone();
    h.mul_(2);
    loss.backward();
    EXPECT_TRUE(torch::equal(w.grad(), expected * 2)) << "the changed value was used";
  }
  // Hooks that compare the version counter turn it into an error.
  {
    at::Tensor h = x * 1;
    at::Tensor loss;
    {
      saved_tensors_hooks scope(
          [](const at::Tensor& t) -> std::any { return std::make_pair(t.detach(), t._version()); },
          [](const std::any& packed) {
            const auto& [t, version] = std::any_cast<const std::pair<at::Tensor, int64_t>&>(packed);
            if (t._version() != version) throw std::runtime_error("saved tensor changed in place");
            return t;
          });
      loss = (h * w).sum();
    }
    h.mul_(2);
    EXPECT_THROW(loss.backward(), std::exception);
  }
}

TEST(SavedTensorsHooks, ScopesArePerThread) {
  Counting c;
  auto scope = c.scope();
  int other_thread_packs = -1;
  std::thread t([&] {
    at::Tensor x = torch::randn({3}, torch::requires_grad());
    (x * x).sum();
    other_thread_packs = c.packs;
  });
  t.join();
  EXPECT_EQ(other_thread_packs, 0) << "another thread's forward does not see this thread's hooks";
  at::Tensor x = torch::randn({3}, torch::requires_grad());
  (x * x).sum();
  EXPECT_EQ(c.packs, 2);
}

TEST(SavedTensorsHooks, ModuleParametersArriveAsViewsRecognisedByStorage) {
  torch::nn::Linear linear(4, 3);
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  bool weight_view = false, weight_itself = false;
  {
    saved_tensors_hooks scope(
        [&](const at::Tensor& t) -> std::any {
          weight_view = weight_view || same_storage(t, linear->weight);
          weight_itself = weight_itself || t.unsafeGetTensorImpl() == linear->weight.unsafeGetTensorImpl();
          return t.detach();
        },
        [](const std::any& packed) { return std::any_cast<at::Tensor>(packed); });
    linear(x).sum().backward();
  }
  EXPECT_TRUE(weight_view) << "the weight's storage reaches pack";
  EXPECT_FALSE(weight_itself) << "as a view (weight.t()), not the parameter";
  EXPECT_FALSE(same_storage(x, linear->weight));
}

TEST(SavedTensorsHooks, ScopesNestAndCanBeDisabled) {
  at::Tensor x = torch::randn({3}, torch::requires_grad());
  Counting outer, inner;
  {
    auto a = outer.scope();
    (x * x).sum();  // outer: 2
    {
      auto b = inner.scope();
      (x * x).sum();  // inner: 2
      {
        disable_saved_tensors_hooks off;
        EXPECT_FALSE(saved_tensors_hooks_active());
        (x * x).sum();  // none
      }
      x.sin();  // inner: 1
    }
    x.cos();  // outer: 1
  }
  EXPECT_EQ(outer.packs, 3);
  EXPECT_EQ(inner.packs, 3);
}

// Hooks that keep a copy (what offloading does) give the plain run's
// gradients bitwise, dropout included.
TEST(SavedTensorsHooks, CopyingHooksKeepGradientsBitwise) {
  torch::nn::Sequential mlp(torch::nn::Linear(8, 16), torch::nn::GELU(), torch::nn::Dropout(0.2),
                            torch::nn::Linear(16, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  at::Tensor x = torch::randn({4, 8});
  auto run = [&](bool hooked) {
    mlp->zero_grad();
    torch::manual_seed(7);
    std::optional<saved_tensors_hooks> scope;
    if (hooked) {
      scope.emplace([](const at::Tensor& t) -> std::any { return t.detach().clone(); },
                    [](const std::any& packed) { return std::any_cast<at::Tensor>(packed); });
    }
    at::Tensor loss = mlp->forward(x).pow(2).mean();
    scope.reset();
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : mlp->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  auto plain = run(false), hooked = run(true);
  ASSERT_EQ(plain.size(), hooked.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], hooked[i])) << i;
  EXPECT_TRUE(saved_tensors_hooks_engine_installed());
}

}  // namespace
}  // namespace remat
