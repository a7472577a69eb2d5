// What users pass to checkpoint regions, beyond tensors the region creates:
// outputs that are inputs, views of inputs, captured tensors and parameters;
// inputs changed in place between forward and backward; fn throwing half-way;
// expanded and offset views under offloading. Each case either matches a plain
// run bitwise or is a clear error, never a hang or a silently wrong gradient.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>

#include "checkpointing/checkpoint.h"
#include "checkpointing/options.h"
#include "checkpointing/stored_inputs.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "tests/checkpoint_modes.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using remat::testing::error_of;

class CheckpointContract : public CheckpointModes {};
INSTANTIATE_CHECKPOINT_MODES(CheckpointContract);

// Runs `body` on another thread; if it has not returned after `seconds` the
// process ends with a message: a hung backward fails the test instead of
// hanging it (the stuck thread cannot be cancelled).
template <typename F>
void within_deadline(const std::string& what, F body, int seconds = 30) {
  std::packaged_task<void()> task(body);
  auto done = task.get_future();
  std::thread(std::move(task)).detach();
  if (done.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "%s did not return within %d s: a hang\n", what.c_str(), seconds);
    std::fflush(stderr);
    std::_Exit(1);
  }
  done.get();  // rethrows the body's exception
}

// fn wrapped in `depth` nested checkpoint regions (0: called plainly).
c10::IValue nest(const CheckpointFn& fn, const std::vector<c10::IValue>& args, int depth,
                 const CheckpointOptions& options = mode_options()) {
  if (depth == 0) return fn(args);
  CheckpointFn outer = [fn, depth, options](const std::vector<c10::IValue>& in) {
    return nest(fn, in, depth - 1, options);
  };
  return checkpoint_ivalues(outer, args, options);
}

std::vector<at::Tensor> tensors_in(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      for (auto& t : tensors_in(e)) out.push_back(t);
    }
  }
  return out;
}

// The values a caller sees, and the gradients of `leaves` after backward.
struct Outcome {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> grads;
};

Outcome run_once(const CheckpointFn& fn, const std::vector<c10::IValue>& args,
                 const std::vector<at::Tensor>& leaves, int depth) {
  for (auto t : leaves) t.mutable_grad() = at::Tensor();
  Outcome o;
  c10::IValue result = nest(fn, args, depth);
  // Linear in each output, weighted by position: every output receives one
  // gradient, so no sum of several terms depends on the order autograd adds them.
  at::Tensor loss = at::zeros({});
  double k = 0;
  for (auto& t : tensors_in(result)) {
    o.outputs.push_back(t.detach().clone());
    k += 1;
    if (t.requires_grad()) loss = loss + t.sum() * k;
  }
  if (loss.requires_grad()) loss.backward();
  for (const auto& t : leaves) o.grads.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
  return o;
}

void expect_same(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.outputs.size(), b.outputs.size()) << what;
  for (size_t i = 0; i < a.outputs.size(); ++i) {
    EXPECT_TRUE(at::equal(a.outputs[i], b.outputs[i])) << what << ": output " << i;
  }
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_EQ(a.grads[i].defined(), b.grads[i].defined()) << what << ": gradient " << i;
    if (a.grads[i].defined()) {
      EXPECT_TRUE(at::equal(a.grads[i], b.grads[i])) << what << ": gradient " << i << " differs";
    }
  }
}

TEST_P(CheckpointContract, OutputsTheRegionDidNotCreateAtEveryNestingDepth) {
  at::manual_seed(0);
  torch::nn::Linear lin(4, 4);
  at::Tensor weight = lin->weight;         // a parameter, returned as an output
  at::Tensor buffer = at::randn({2, 4});    // captured, no grad
  at::Tensor scale = torch::randn({4}, torch::requires_grad());
  at::Tensor history = scale * 3;           // captured, with autograd history
  at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  std::vector<at::Tensor> leaves{x, lin->weight, lin->bias, scale};

  struct Case {
    std::string name;
    CheckpointFn fn;
  };
  std::vector<Case> cases = {
      {"(None, true, captured parameter)",
       [&](const std::vector<c10::IValue>& in) {
         at::Tensor y = lin->forward(in[0].toTensor());
         return c10::IValue(c10::ivalue::Tuple::create(
             {c10::IValue(), c10::IValue(true), c10::IValue(weight), c10::IValue(y)}));
       }},
      {"(input unchanged, 2.5)",
       [&](const std::vector<c10::IValue>& in) {
         return c10::IValue(c10::ivalue::Tuple::create({in[0], c10::IValue(2.5)}));
       }},
      {"(view of the input, result)",
       [&](const std::vector<c10::IValue>& in) {
         at::Tensor t = in[0].toTensor();
         return c10::IValue(c10::ivalue::Tuple::create(
             {c10::IValue(t.narrow(1, 1, 2)), c10::IValue(lin->forward(t))}));
       }},
      {"(captured tensor with history, nested tuple)",
       [&](const std::vector<c10::IValue>& in) {
         at::Tensor y = lin->forward(in[0].toTensor()) * history;
         auto inner = c10::ivalue::Tuple::create({c10::IValue(history), c10::IValue(y)});
         return c10::IValue(c10::ivalue::Tuple::create({c10::IValue(inner), c10::IValue(1)}));
       }},
      {"(captured buffer, result)",
       [&](const std::vector<c10::IValue>& in) {
         return c10::IValue(c10::ivalue::Tuple::create(
             {c10::IValue(buffer), c10::IValue(lin->forward(in[0].toTensor()) + buffer)}));
       }},
      {"(same tensor twice)",
       [&](const std::vector<c10::IValue>& in) {
         at::Tensor y = lin->forward(in[0].toTensor());
         return c10::IValue(c10::ivalue::Tuple::create({c10::IValue(y), c10::IValue(y)}));
       }},
  };
  for (const auto& c : cases) {
    const Outcome plain = run_once(c.fn, {x}, leaves, 0);
    for (int depth = 1; depth <= 3; ++depth) {
      const std::string what = c.name + " at depth " + std::to_string(depth);
      within_deadline(what, [&] {
        Outcome ckpt = run_once(c.fn, {x}, leaves, depth);
        expect_same(plain, ckpt, what);
      });
      // The region left what it did not create as it was.
      EXPECT_TRUE(lin->weight.is_leaf()) << what;
      EXPECT_FALSE(lin->weight.grad_fn()) << what;
      EXPECT_FALSE(buffer.requires_grad()) << what;
      EXPECT_EQ(history.grad_fn()->name(), scale.mul(3).grad_fn()->name()) << what;
    }
  }
}

// A stateful fn whose recompute hands back what the region returned to its
// caller: backward through it would enter the reentrant region's own node
// again. (A non-reentrant region backpropagates through the forward's graph:
// what the recompute returns is never used.)
TEST(CheckpointContractReentrant, ARecomputeReturningTheRegionsOwnOutputIsAClearError) {
  at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
  at::Tensor remembered;
  int calls = 0;
  auto fn = [&](const at::Tensor& in) { return ++calls == 1 ? in * 2 : remembered; };
  at::Tensor y = checkpoint_with(reentrant_options(), fn, x);
  remembered = y;
  within_deadline("backward through a region returning its own output", [&] {
    auto message = error_of<Error>([&] { y.sum().backward(); });
    EXPECT_THAT(message, HasSubstr("enter the region again"));
  });
}

// A chain of `n` regions, each y = tanh(x * w); the result and the regions' inputs.
struct Chain {
  at::Tensor out;
  std::vector<at::Tensor> inputs;
};

Chain run_chain(at::Tensor x, const at::Tensor& w, int n, const CheckpointOptions& options) {
  Chain c;
  for (int i = 0; i < n; ++i) {
    c.inputs.push_back(x);
    x = checkpoint_with(options, [&w](const at::Tensor& in) { return at::tanh(in * w); }, x);
  }
  c.out = x;
  return c;
}

struct Storage {
  std::string name;
  CheckpointOptions options;
};

std::vector<Storage> storages() {
  std::vector<Storage> out;
  out.push_back({"kept by autograd", mode_options()});
  CheckpointOptions offload = mode_options();
  offload.storage.offload = true;
  offload.storage.offload_min_bytes = 0;
  out.push_back({"offloaded, last kept", offload});
  offload.storage.offload_keep_last = false;
  out.push_back({"offloaded, last too", offload});
  offload.storage.contiguous = std::make_shared<ContiguousBuffers>(4);
  out.push_back({"offloaded, contiguous", offload});
  return out;
}

TEST_P(CheckpointContract, AnInputChangedInPlaceBeforeBackwardIsAClearErrorInEveryStorage) {
  at::manual_seed(1);
  at::Tensor w = torch::randn({6, 10}, torch::requires_grad());
  for (const auto& s : storages()) {
    // Region 0: changed before region 1 starts (its host copy not yet made
    // when the last region stays); region 2: the last one, kept on the device.
    for (int changed : {0, 1, 2}) {
      const std::string what = s.name + ", region " + std::to_string(changed) + " of 3";
      at::Tensor leaf = torch::randn({6, 10}, torch::requires_grad());
      {
      Chain c;
      if (changed == 0) {
        // The input is changed between region 0's forward and region 1's.
        c.inputs.push_back(leaf * 1.0);
        at::Tensor h = checkpoint_with(
            s.options, [&w](const at::Tensor& in) { return at::tanh(in * w); }, c.inputs[0]);
        c.inputs[0].mul_(2);
        Chain rest = run_chain(h, w, 2, s.options);
        c.out = rest.out;
      } else {
        c = run_chain(leaf * 1.0, w, 3, s.options);
        at::NoGradGuard no_grad;
        c.inputs[changed].add_(1);
      }
      auto message = error_of<Error>([&] { c.out.sum().backward(); });
      EXPECT_THAT(message, HasSubstr("modified in place")) << what;
      EXPECT_THAT(message, HasSubstr("clone")) << what;
      EXPECT_THAT(message, Not(HasSubstr("a second time"))) << what;
      }
      EXPECT_EQ(checkpoint_saved_bytes(), 0) << what << ": the graph is gone";
      if (s.options.storage.contiguous) s.options.storage.contiguous->reset();
    }
  }
}

TEST_P(CheckpointContract, ASecondBackwardWithoutRetainGraphSaysSo) {
  at::Tensor w = torch::randn({6, 10}, torch::requires_grad());
  for (const auto& s : storages()) {
    Chain c = run_chain(torch::randn({6, 10}, torch::requires_grad()) * 1.0, w, 2, s.options);
    c.out.sum().backward();
    // Reentrant regions say it in their own words, non-reentrant ones through
    // LibTorch's (their saved tensors are autograd's own).
    auto message = error_of<std::exception>([&] { c.out.sum().backward(); });
    EXPECT_THAT(message, HasSubstr("a second time")) << s.name;
    EXPECT_THAT(message, HasSubstr("retain_graph")) << s.name;
    EXPECT_THAT(message, Not(HasSubstr("modified in place"))) << s.name;
  }
}

// fn computes a gradient of its own, with a graph (a region around a gradient
// computation), and the caller backpropagates through it: at every nesting
// depth and in every storage, non-reentrant regions give the plain run's
// values and gradients; reentrant ones, whose forward has no graph, refuse it.
TEST_P(CheckpointContract, ABackwardInsideFnAtEveryNestingDepthAndStorage) {
  at::manual_seed(2);
  torch::nn::Linear lin(4, 4);
  at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
  const std::vector<at::Tensor> leaves{x, lin->weight, lin->bias};
  CheckpointFn fn = [&](const std::vector<c10::IValue>& in) {
    at::Tensor t = in[0].toTensor();
    at::Tensor inner = (at::tanh(lin->forward(t)) * t).sum();
    at::Tensor g = torch::autograd::grad({inner}, {t}, {}, c10::nullopt, /*create_graph=*/true)[0];
    return c10::IValue(g * t);
  };
  auto outcome = [&](int depth, const CheckpointOptions& options) {
    for (auto t : leaves) t.mutable_grad() = at::Tensor();
    at::Tensor h = x * 1.0;  // not a leaf: offloaded when the storage says so
    at::Tensor y = nest(fn, {h}, depth, options).toTensor();
    y.pow(2).sum().backward();
    Outcome o;
    o.outputs.push_back(y.detach());
    for (const auto& t : leaves) o.grads.push_back(t.grad().clone());
    return o;
  };
  const Outcome plain = outcome(0, mode_options());
  for (const auto& s : storages()) {
    for (int depth = 1; depth <= 3; ++depth) {
      const std::string what = s.name + " at depth " + std::to_string(depth);
      within_deadline(what, [&] {
        if (GetParam()) {
          auto message = error_of<Error>([&] { outcome(depth, s.options); });
          EXPECT_THAT(message, HasSubstr("inside a reentrant region")) << what;
          EXPECT_THAT(message, HasSubstr("use a non-reentrant region")) << what;
          return;
        }
        expect_same(plain, outcome(depth, s.options), what);
      });
      EXPECT_EQ(checkpoint_saved_bytes(), 0) << what;
      if (s.options.storage.contiguous) s.options.storage.contiguous->reset();
    }
  }
}

// What the default generator and the tracked state draw next (without moving them).
std::pair<at::Tensor, at::Tensor> next_draws() {
  const RngSnapshot now = capture_rng();
  at::Tensor a = at::rand({8});
  at::Tensor b;
  {
    auto guard = get_rng_tracker().fork();
    b = at::rand({8});
  }
  restore_rng(now);
  return {a, b};
}

void expect_same_draws(const std::pair<at::Tensor, at::Tensor>& a,
                       const std::pair<at::Tensor, at::Tensor>& b, const std::string& what) {
  EXPECT_TRUE(at::equal(a.first, b.first)) << what << ": the default generator moved";
  EXPECT_TRUE(at::equal(a.second, b.second)) << what << ": the tracked state moved";
}

TEST_P(CheckpointContract, AnExceptionHalfWayLeavesCountersSlotsAndRngAsBefore) {
  model_parallel_manual_seed(5, 0);
  at::Tensor w = torch::randn({6, 10}, torch::requires_grad());
  for (const auto& s : storages()) {
    // fn draws dropout masks (default and tracked), then throws: in the
    // forward, or only in the recompute (its second call).
    for (bool in_recompute : {false, true}) {
      const std::string what = s.name + (in_recompute ? ", thrown in the recompute" : "");
      auto* buffers = s.options.storage.contiguous.get();
      at::Tensor leaf = torch::randn({6, 10}, torch::requires_grad());
      // A region alive before the failing one: its storage must survive.
      Chain earlier = run_chain(leaf * 1.0, w, 1, s.options);
      const int64_t saved = checkpoint_saved_bytes();
      const auto stats = stored_input_stats();
      const int64_t slots = buffers ? buffers->slots_in_use() : 0;
      int calls = 0;
      CheckpointFn failing = [&](const std::vector<c10::IValue>& in) -> c10::IValue {
        at::Tensor h = at::dropout(in[0].toTensor(), 0.5, /*train=*/true);
        {
          auto guard = get_rng_tracker().fork();
          h = at::dropout(h, 0.5, /*train=*/true);
        }
        if (++calls == (in_recompute ? 2 : 1)) throw std::runtime_error("fn failed half-way");
        return h * w;
      };
      auto draws = next_draws();
      if (!in_recompute) {
        auto message = error_of<std::runtime_error>([&] {
          checkpoint_ivalues(failing, {c10::IValue(earlier.out * 1.0)}, s.options);
        });
        EXPECT_THAT(message, HasSubstr("fn failed half-way")) << what;
        EXPECT_EQ(checkpoint_saved_bytes(), saved) << what;
        EXPECT_EQ(stored_input_stats().kept_bytes, stats.kept_bytes) << what;
        EXPECT_EQ(stored_input_stats().kept_padding_bytes, stats.kept_padding_bytes) << what;
        if (buffers) {
          EXPECT_EQ(buffers->slots_in_use(), slots) << what;
        }
        expect_same_draws(draws, next_draws(), what);
        // The region alive before still backpropagates; everything is freed after.
        earlier.out.sum().backward();
        EXPECT_TRUE(leaf.grad().defined()) << what;
      } else {
        {
          at::Tensor y = checkpoint_ivalues(failing, {c10::IValue(earlier.out * 1.0)}, s.options)
                             .toTensor();
          draws = next_draws();
          auto message = error_of<std::exception>([&] { y.sum().backward(); });
          EXPECT_THAT(message, HasSubstr("fn failed half-way")) << what;
          expect_same_draws(draws, next_draws(), what);
        }
        earlier = Chain();  // the graph is dropped
      }
      EXPECT_EQ(checkpoint_saved_bytes(), 0) << what;
      EXPECT_EQ(stored_input_stats().kept_bytes, 0) << what;
      if (buffers) {
        EXPECT_EQ(buffers->slots_in_use(), 0) << what;
      }
    }
  }
}

// fn may write to an argument itself (running statistics, a workspace):
// versions are taken when fn returns, as autograd takes them.
TEST_P(CheckpointContract, FnWritingToItsOwnArgumentIsNotAnInPlaceError) {
  at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
  at::Tensor stats = torch::zeros({4});
  at::Tensor y = checkpoint(
      [](const at::Tensor& in, const at::Tensor& running) {
        running.add_(in.detach().mean(0));
        return in * 2;
      },
      x, stats);
  y.sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), torch::full({3, 4}, 2.0)));
}

// Inside a tracker fork the RNG cannot be put back; the caller still gets
// fn's own exception.
TEST_P(CheckpointContract, FnThrowingInsideAForkKeepsItsException) {
  model_parallel_manual_seed(3, 0);
  at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
  auto guard = get_rng_tracker().fork();
  auto message = error_of<std::runtime_error>([&] {
    checkpoint([](const at::Tensor& in) -> at::Tensor { throw std::runtime_error("fn's own error"); },
               x);
  });
  EXPECT_THAT(message, HasSubstr("fn's own error"));
}

TEST_P(CheckpointContract, OffloadingAViewMovesNoMoreThanTheStorageItCovers) {
  CheckpointOptions options = mode_options();
  options.storage.offload = true;
  options.storage.offload_min_bytes = 0;
  options.storage.offload_keep_last = false;
  at::Tensor w = torch::randn({4, 8}, torch::requires_grad());
  at::Tensor base = torch::randn({1, 4, 8}, torch::requires_grad());
  at::Tensor big = torch::randn({200}, torch::requires_grad());
  at::Tensor square = torch::randn({8, 4}, torch::requires_grad());
  struct Case {
    std::string name;
    std::function<at::Tensor()> make;
    int64_t bytes;  // what the view covers of its storage
  };
  std::vector<Case> cases = {
      {"expanded [2,4,8] over [1,4,8]", [&] { return (base * 1.0).expand({2, 4, 8}); }, 128},
      {"offset view of 32 of 200", [&] { return (big * 1.0).narrow(0, 40, 32).view({4, 8}); }, 128},
      {"transposed", [&] { return (square * 1.0).t(); }, 128},
      {"every other row (moved dense)", [&] { return (big * 1.0).narrow(0, 0, 64).view({8, 8}).slice(0, 0, 8, 2); }, 128},
      {"8 of 50 columns (a slice of a fused projection)", [&] { return (big * 1.0).view({4, 50}).narrow(1, 0, 8); }, 128},
  };
  std::vector<at::Tensor> leaves{w, base, big, square};
  for (const auto& c : cases) {
    for (auto t : leaves) t.mutable_grad() = at::Tensor();
    at::Tensor x = c.make();
    at::Tensor plain = at::tanh(x * w).sum();
    plain.backward();
    std::vector<at::Tensor> expected;
    for (auto& t : leaves) expected.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());

    for (auto t : leaves) t.mutable_grad() = at::Tensor();
    x = c.make();
    const auto before = stored_input_stats();
    at::Tensor y = checkpoint_with(options, [&w](const at::Tensor& in) { return at::tanh(in * w); }, x)
                       .sum();
    const auto after = stored_input_stats();
    EXPECT_EQ(after.offloaded_bytes - before.offloaded_bytes, c.bytes) << c.name;
    EXPECT_LE(after.offloaded_bytes - before.offloaded_bytes,
              static_cast<int64_t>(x.storage().nbytes())) << c.name;
    EXPECT_LE(after.offloaded_bytes - before.offloaded_bytes, static_cast<int64_t>(x.nbytes()))
        << c.name;
    EXPECT_TRUE(at::equal(y, plain)) << c.name;
    y.backward();
    for (size_t i = 0; i < leaves.size(); ++i) {
      ASSERT_EQ(leaves[i].grad().defined(), expected[i].defined()) << c.name;
      if (expected[i].defined()) {
        EXPECT_TRUE(at::equal(leaves[i].grad(), expected[i])) << c.name << ": gradient " << i;
      }
    }
  }
}

TEST_P(CheckpointContract, CpuCheckpointingOffloadsDeepSpeedSizedInputsByDefault) {
  // DeepSpeed's own checkpointing tests use inputs of a few KiB; turning
  // cpu_checkpointing on must move them to the host.
  // The section as {"cpu_checkpointing": true} sets it (engine/checkpointing_config_test.cc).
  ActivationCheckpointingOptions section;
  section.cpu_checkpointing = true;
  EXPECT_EQ(section.offload_min_bytes, 0);
  CheckpointOptions saved = default_checkpoint_options();
  configure_checkpointing(section);
  CheckpointOptions options = default_checkpoint_options();
  default_checkpoint_options() = saved;
  options.storage.offload_keep_last = false;
  at::Tensor w = torch::randn({16, 128}, torch::requires_grad());
  at::Tensor x = torch::randn({16, 128}, torch::requires_grad()) * 1.0;  // 8 KiB
  auto before = stored_input_stats();
  at::Tensor y = checkpoint_with(options, [&w](const at::Tensor& in) { return (in * w).sum(); }, x);
  EXPECT_EQ(stored_input_stats().offloaded_bytes - before.offloaded_bytes, 8192);
  y.backward();

  // Below an explicit minimum: left on the device, and counted as such.
  options.storage.offload_min_bytes = 1024;
  at::Tensor small = torch::randn({8, 16}, torch::requires_grad()) * 1.0;  // 512 B
  before = stored_input_stats();
  y = checkpoint_with(options, [](const at::Tensor& in) { return (in * in).sum(); }, small);
  EXPECT_EQ(stored_input_stats().offloaded_bytes - before.offloaded_bytes, 0);
  EXPECT_EQ(stored_input_stats().left_small_bytes - before.left_small_bytes, 512);
  y.backward();
}

}  // namespace
}  // namespace remat
