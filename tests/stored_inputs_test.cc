// Partitioned, offloaded and contiguous checkpoint inputs under mpirun at
// world sizes 2 and 4, with tensor-parallel sizes 1, 2 and 4 (those that
// divide the world). Parity with no checkpointing is bitwise: the same
// kernels run on the same bits, and recomputed dropout replays its RNG state.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "checkpointing/checkpoint.h"
#include "checkpointing/options.h"
#include "checkpointing/policy.h"
#include "checkpointing/stored_inputs.h"
#include "models/gpt.h"
#include "parallel/layers.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/checkpoint_modes.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

using remat::testing::layout;
using remat::testing::world;

std::vector<int> tp_sizes() { return remat::testing::tp_sizes(4); }

class StoredInputs : public CheckpointModes {};
INSTANTIATE_CHECKPOINT_MODES(StoredInputs);

ActivationCheckpointingOptions ac(const std::string& variant) {
  ActivationCheckpointingOptions c;
  c.variant = checkpoint_variant_from_name(variant);
  c.reentrant = default_checkpoint_options().reentrant;  // the mode the case runs in
  return c;
}

// Restores the process-wide defaults when a test ends.
struct DefaultOptionsGuard {
  CheckpointOptions saved = default_checkpoint_options();
  ~DefaultOptionsGuard() { default_checkpoint_options() = saved; }
};

// What one training run produced: the loss and every gradient of each step.
struct Trace {
  std::vector<at::Tensor> losses;
  std::vector<std::vector<at::Tensor>> grads;
};

constexpr int64_t kVocab = 37;  // uneven across 2 and 4 ranks

models::GptOptions gpt_options(int tp, double dropout) {
  return remat::testing::small_gpt(kVocab, 3, dropout, tp);
}

// `steps` SGD steps of a GPT at tensor-parallel size tp, checkpointed as
// `config` says (variant none: no regions). Dropout acts inside
// tensor-parallel regions (attention probabilities) and outside (residuals).
Trace train(int tp, const ActivationCheckpointingOptions& config, int steps = 3,
            double dropout = 0.1) {
  DefaultOptionsGuard guard;
  configure_checkpointing(config, &layout(tp));
  at::manual_seed(11);
  models::Gpt model(gpt_options(tp, dropout));
  model_parallel_manual_seed(11, layout(tp).tp_rank());
  if (config.variant != CheckpointVariant::kNone) {
    apply_activation_checkpointing(*model, PolicyOptions(config));
  }
  Trace trace;
  for (int step = 0; step < steps; ++step) {
    // The same data on every rank of a tensor-parallel group.
    at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12}).add(step * 5).remainder(kVocab);
    at::Tensor targets = idx.roll(-1, 1);
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor loss = model->loss(idx, targets);
    loss.backward();
    trace.losses.push_back(loss.detach().clone());
    std::vector<at::Tensor> g;
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      g.push_back(p.grad().clone());
      p.sub_(p.grad() * 0.05);
    }
    trace.grads.push_back(g);
  }
  remove_activation_checkpointing(*model);
  return trace;
}

void expect_bitwise(const Trace& a, const Trace& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_TRUE(at::equal(a.losses[s], b.losses[s]))
        << what << " step " << s << ": " << a.losses[s].item<double>() << " vs "
        << b.losses[s].item<double>();
    ASSERT_EQ(a.grads[s].size(), b.grads[s].size());
    for (size_t i = 0; i < a.grads[s].size(); ++i) {
      EXPECT_TRUE(at::equal(a.grads[s][i], b.grads[s][i])) << what << " step " << s << " grad " << i;
    }
  }
}

TEST(StoredInputsParity, EveryVariantMatchesNoCheckpointingBitwise) {
  for (int tp : tp_sizes()) {
    const Trace none = train(tp, ac("none"));
    for (bool reentrant : {false, true}) {
    auto full = ac("full");
    full.reentrant = reentrant;
    auto str = [reentrant](auto&&... parts) {
      return remat::str(parts..., reentrant ? " (reentrant)" : " (non-reentrant)");
    };
    expect_bitwise(none, train(tp, full), str("tp ", tp, " full"));
    auto part = full;
    part.partition_activations = true;
    expect_bitwise(none, train(tp, part), str("tp ", tp, " partitioned"));
    auto part_contig = part;
    part_contig.contiguous_memory_optimization = true;
    part_contig.number_checkpoints = 3;
    expect_bitwise(none, train(tp, part_contig), str("tp ", tp, " partitioned + contiguous"));
    auto offload = full;
    offload.cpu_checkpointing = true;
    offload.offload_min_bytes = 0;
    expect_bitwise(none, train(tp, offload), str("tp ", tp, " offload"));
    auto part_offload = part;
    part_offload.cpu_checkpointing = true;
    part_offload.offload_min_bytes = 0;
    part_offload.offload_keep_last = false;
    expect_bitwise(none, train(tp, part_offload), str("tp ", tp, " partitioned + offload"));
    auto all = part_offload;
    all.contiguous_memory_optimization = true;
    all.number_checkpoints = 3;
    all.offload_max_in_flight = 1;
    expect_bitwise(none, train(tp, all), str("tp ", tp, " partitioned + offload + contiguous"));
    auto selective = ac("selective_op");
    selective.partition_activations = true;
    selective.reentrant = reentrant;
    expect_bitwise(none, train(tp, selective), str("tp ", tp, " selective_op + partitioned"));
    }
  }
}

TEST_P(StoredInputs, TensorParallelMatchesOneRankWithinFloatTolerance) {
  // Without dropout (the streams differ by design across tensor-parallel
  // sizes), tp > 1 computes the tp = 1 function with sums in another order:
  // row-parallel partial products meet in an all-reduce, the loss is reduced
  // across vocabulary shares. Float32 rounding of O(1) values through 3
  // blocks and 3 steps stays within a few 1e-7; 2e-6 leaves room and still
  // catches any real difference (a wrong shard moves the loss by > 1e-3).
  const Trace one = train(1, ac("none"), 3, 0.0);
  for (int tp : tp_sizes()) {
    if (tp == 1) continue;
    const Trace many = train(tp, ac("full"), 3, 0.0);
    for (size_t s = 0; s < one.losses.size(); ++s) {
      const double a = one.losses[s].item<double>(), b = many.losses[s].item<double>();
      EXPECT_NEAR(a, b, 2e-6) << "tp " << tp << " step " << s;
      std::printf("tp 1 vs %d, step %zu: %.9f vs %.9f (diff %.2e)\n", tp, s, a, b, std::abs(a - b));
    }
  }
}

TEST_P(StoredInputs, TensorParallelModelHoldsTheOneRankWeights) {
  for (int tp : tp_sizes()) {
    at::manual_seed(5);
    models::Gpt one(gpt_options(1, 0.0));
    at::manual_seed(5);
    models::Gpt many(gpt_options(tp, 0.0));
    auto a = one->named_modules();
    auto b = many->named_modules();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& item : b) {
      const auto& name = item.key();
      auto* sharded = dynamic_cast<parallel::TensorParallelModule*>(item.value().get());
      auto theirs = a[name]->named_parameters(false);
      auto ours = item.value()->named_parameters(false);
      if (theirs.find("weight") == nullptr) continue;
      const at::Tensor want = theirs["weight"];
      if (sharded != nullptr) {
        EXPECT_TRUE(at::equal(sharded->gather_full_weight(), want)) << "tp " << tp << " " << name;
      } else {
        ASSERT_NE(ours.find("weight"), nullptr) << name;
        EXPECT_TRUE(at::equal(ours["weight"], want)) << "tp " << tp << " " << name;
      }
    }
  }
}

// Regions chained by hand: x_{i+1} = region_i(x_i). Keeps the inputs so tests
// can look at what the regions hold.
struct Chain {
  std::vector<at::Tensor> inputs;
  at::Tensor out;
};

Chain run_chain(at::Tensor x, int regions, const CheckpointOptions& options) {
  Chain c;
  for (int i = 0; i < regions; ++i) {
    c.inputs.push_back(x);
    x = checkpoint_with(options, [](const at::Tensor& t) { return at::tanh(t) * 1.5 + t.sin(); }, x);
  }
  c.out = x;
  return c;
}

at::Tensor chain_input(int64_t rows, int64_t cols) {
  at::Tensor w = at::linspace(-1, 1, rows * cols).view({rows, cols}).requires_grad_(true);
  return w;
}

TEST_P(StoredInputs, PartitionedRegionsKeepCeilOfNumelOverMpExactly) {
  for (int tp : tp_sizes()) {
    const auto& group = layout(tp).tp_group();
    const int mp = group->size(), r = group->rank();
    CheckpointOptions options = mode_options();
    options.storage.partition_group = group;
    // 35 elements: uneven over 2 and 4 ranks. Two float inputs, both split;
    // an integer one kept whole.
    at::Tensor leaf_a = chain_input(5, 7), leaf_b = chain_input(3, 3);
    at::Tensor a = leaf_a * 2, b = leaf_b * 3;  // not leaves: stored
    at::Tensor k = at::arange(4, at::kLong);
    const int64_t saved0 = checkpoint_saved_bytes();
    const auto stats0 = stored_input_stats();
    at::Tensor y = checkpoint_with(
        options,
        [](const at::Tensor& x, const at::Tensor& z, const at::Tensor& n) {
          return x.sum() * z.mean() + n.sum().to(at::kFloat);
        },
        a, b, k);
    const int64_t share_a = (35 + mp - 1) / mp, share_b = (9 + mp - 1) / mp;
    const int64_t pad_a = std::max<int64_t>(0, share_a - std::max<int64_t>(0, 35 - r * share_a));
    const int64_t pad_b = std::max<int64_t>(0, share_b - std::max<int64_t>(0, 9 - r * share_b));
    const auto stats1 = stored_input_stats();
    if (mp > 1) {
      EXPECT_EQ(checkpoint_saved_bytes() - saved0, (share_a + share_b) * 4 + k.nbytes())
          << "tp " << tp << " rank " << r;
      EXPECT_EQ(stats1.kept_bytes - stats0.kept_bytes, (share_a + share_b) * 4);
      EXPECT_EQ(stats1.kept_padding_bytes - stats0.kept_padding_bytes, (pad_a + pad_b) * 4);
    } else {
      EXPECT_EQ(checkpoint_saved_bytes() - saved0, (35 + 9) * 4 + k.nbytes());
    }
    y.backward();
    const auto stats2 = stored_input_stats();
    EXPECT_EQ(stats2.gathered_bytes - stats1.gathered_bytes, mp > 1 ? (share_a + share_b) * mp * 4 : 0);
    EXPECT_EQ(stats2.kept_bytes, stats0.kept_bytes) << "released after backward";
    // The same gradients as without a region.
    at::Tensor ra = leaf_a.grad().clone(), rb = leaf_b.grad().clone();
    leaf_a.mutable_grad() = at::Tensor();
    leaf_b.mutable_grad() = at::Tensor();
    ((leaf_a * 2).sum() * (leaf_b * 3).mean() + k.sum().to(at::kFloat)).backward();
    EXPECT_TRUE(at::equal(ra, leaf_a.grad()));
    EXPECT_TRUE(at::equal(rb, leaf_b.grad()));
  }
}

TEST_P(StoredInputs, OffloadMovesEveryStoredInputToTheHostAndBackOncePerBackward) {
  for (int tp : tp_sizes()) {
    for (bool partition : {false, true}) {
      CheckpointOptions options = mode_options();
      if (partition) options.storage.partition_group = layout(tp).tp_group();
      options.storage.offload = true;
      options.storage.offload_min_bytes = 0;
      options.storage.offload_keep_last = false;
      at::Tensor leaf = chain_input(6, 10);
      const auto before = stored_input_stats();
      const int64_t saved0 = checkpoint_saved_bytes();
      Chain c = run_chain(leaf * 1.0, 4, options);
      const auto after_fwd = stored_input_stats();
      // Nothing a region holds shares memory with an input it was given.
      auto held = checkpoint_stored_tensors();
      EXPECT_FALSE(held.empty());
      for (const auto& t : held) {
        EXPECT_TRUE(t.device().is_cpu());
        for (const auto& x : c.inputs) EXPECT_FALSE(t.is_alias_of(x)) << "tp " << tp;
      }
      EXPECT_EQ(after_fwd.offload_copies - before.offload_copies, 4);
      EXPECT_EQ(after_fwd.offloaded_bytes - before.offloaded_bytes, checkpoint_saved_bytes() - saved0);
      c.out.sum().backward({}, /*retain_graph=*/true);
      const auto after_one = stored_input_stats();
      EXPECT_EQ(after_one.fetch_copies - after_fwd.fetch_copies, 4) << "each came back once";
      EXPECT_EQ(after_one.fetched_bytes - after_fwd.fetched_bytes,
                after_fwd.offloaded_bytes - before.offloaded_bytes);
      at::Tensor g1 = leaf.grad().clone();
      c.out.sum().backward();
      const auto after_two = stored_input_stats();
      EXPECT_EQ(after_two.fetch_copies - after_one.fetch_copies, 4) << "once per backward";
      EXPECT_TRUE(at::equal(leaf.grad(), g1 * 2));
      EXPECT_EQ(after_two.kept_bytes, before.kept_bytes) << "released after the last backward";
    }
  }
}

TEST_P(StoredInputs, TheLastRegionStaysOnTheDeviceAndSmallOrIntegerInputsStay) {
  CheckpointOptions options = mode_options();
  options.storage.offload = true;
  options.storage.offload_min_bytes = 0;  // keep_last defaults to true
  at::Tensor leaf = chain_input(6, 10);
  const auto before = stored_input_stats();
  Chain c = run_chain(leaf * 1.0, 3, options);
  EXPECT_EQ(stored_input_stats().offload_copies - before.offload_copies, 2);
  bool last_kept = false;
  for (const auto& t : checkpoint_stored_tensors()) last_kept = last_kept || t.is_alias_of(c.inputs[2]);
  EXPECT_TRUE(last_kept) << "the last region keeps its input where it is";
  c.out.sum().backward();
  EXPECT_EQ(stored_input_stats().fetch_copies - before.fetch_copies, 2);

  // Under the minimum size, or not floating point: not stored at all.
  options.storage.offload_min_bytes = 1 << 20;
  at::Tensor mask = at::ones({6, 10}, at::kBool);
  at::Tensor ids = at::arange(60, at::kLong);
  const auto s0 = stored_input_stats();
  at::Tensor x = leaf * 1.0;
  at::Tensor y = checkpoint_with(
      options,
      [](const at::Tensor& t, const at::Tensor& m, const at::Tensor& n) {
        return (t.masked_fill(m.logical_not(), 0) * n.view({6, 10}).to(at::kFloat)).sum();
      },
      x, mask, ids);
  const auto s1 = stored_input_stats();
  EXPECT_EQ(s1.offload_copies, s0.offload_copies);
  EXPECT_EQ(s1.kept_bytes, s0.kept_bytes);
  y.backward();
}

TEST_P(StoredInputs, ContiguousBuffersHoldEverySlotAndRefuseOneRegionTooMany) {
  const auto& group = layout(tp_sizes().back()).tp_group();
  const int mp = group->size();
  CheckpointOptions options = mode_options();
  options.storage.partition_group = group;
  options.storage.contiguous = std::make_shared<ContiguousBuffers>(3);
  at::Tensor leaf = chain_input(4, 8);
  {
    Chain c = run_chain(leaf * 1.0, 3, options);
    const int64_t share = (32 + mp - 1) / mp;
    EXPECT_EQ(options.storage.contiguous->allocated_bytes(), mp > 1 ? 3 * share * 4 : 0);
    EXPECT_EQ(options.storage.contiguous->slots_in_use(), 3);
    c.out.sum().backward();
    EXPECT_EQ(options.storage.contiguous->slots_in_use(), 0) << "slots free after backward";
  }
  {
    Chain c = run_chain(leaf * 1.0, 3, options);  // the slots are reused
    EXPECT_EQ(options.storage.contiguous->slots_in_use(), 3);
    auto message = error_of<Error>([&] {
      checkpoint_with(options, [](const at::Tensor& t) { return t * 2; }, c.out);
    });
    EXPECT_THAT(message, HasSubstr("checkpoint region 4 alive at once, but number_checkpoints is 3"));
  }
  options.storage.contiguous->reset();
  EXPECT_EQ(options.storage.contiguous->allocated_bytes(), 0);
  EXPECT_EQ(options.storage.contiguous->slots_in_use(), 0);
}

TEST_P(StoredInputs, ConfigurationErrorsNameTheKeyToChange) {
  DefaultOptionsGuard guard;
  // What the JSON section refuses: engine/checkpointing_config_test.cc.
  auto partition = ac("full");
  partition.partition_activations = true;
  auto message = error_of<ConfigError>([&] { configure_checkpointing(partition); });
  EXPECT_THAT(message, HasSubstr("pass the parallel layout to remat::configure_checkpointing"));
  message = error_of<ConfigError>([] {
    models::GptOptions o = gpt_options(1, 0.0);
    o.shape.n_head = 3;
    o.shape.d_model = 15;
    o.tensor_parallel = layout(tp_sizes().back()).tp_group();
    models::Gpt gpt(o);
  });
  EXPECT_THAT(message, HasSubstr("must be multiples of tensor_parallel.size"));
}

TEST_P(StoredInputs, ASecondBackwardAfterReleaseIsAClearError) {
  CheckpointOptions options = mode_options();
  options.storage.partition_group = layout(tp_sizes().back()).tp_group();
  options.storage.offload = true;
  options.storage.offload_min_bytes = 0;
  at::Tensor leaf = chain_input(4, 4);
  Chain c = run_chain(leaf * 1.0, 2, options);
  c.out.sum().backward();
  auto message = error_of<std::exception>([&] { c.out.sum().backward(); });
  EXPECT_THAT(message, HasSubstr("retain_graph"));
}

// Partitioned storage copies each share at the forward; an input changed in
// place afterwards is still the clear error a plain region gives, on every
// rank, never a gradient from the changed value.
TEST_P(StoredInputs, PartitionedInputChangedInPlaceIsAClearError) {
  const auto& group = layout(tp_sizes().back()).tp_group();
  for (bool offload : {false, true}) {
    for (bool contiguous : {false, true}) {
      CheckpointOptions options = mode_options();
      options.storage.partition_group = group;
      options.storage.offload = offload;
      options.storage.offload_min_bytes = 0;
      if (contiguous) options.storage.contiguous = std::make_shared<ContiguousBuffers>(3);
      for (int changed : {0, 2}) {
        {
          at::Tensor leaf = chain_input(6, 10);
          Chain c = run_chain(leaf * 1.0, 3, options);
          {
            at::NoGradGuard no_grad;
            c.inputs[changed].add_(1);
          }
          auto message = error_of<std::exception>([&] { c.out.sum().backward(); });
          EXPECT_THAT(message, HasSubstr("modified in place"))
              << "offload " << offload << " contiguous " << contiguous << " region " << changed;
        }
        // A failed backward's pending nodes (with their saved tensors) stay
        // in LibTorch's per-thread ready queue until that thread's next
        // backward, with or without checkpointing.
        torch::ones({1}, torch::requires_grad()).sum().backward();
        EXPECT_EQ(stored_input_stats().kept_bytes, 0);
        if (contiguous) {
          EXPECT_EQ(options.storage.contiguous->slots_in_use(), 0);
        }
      }
    }
  }
}

// fn throwing in a partitioned (and contiguous) region's forward leaves the
// counters, the slots and the RNG as they were; the region alive before is intact.
TEST_P(StoredInputs, PartitionedRegionThatThrowsLeavesEverythingAsBefore) {
  const auto& group = layout(tp_sizes().back()).tp_group();
  model_parallel_manual_seed(9, 0);
  for (bool contiguous : {false, true}) {
    CheckpointOptions options = mode_options();
    options.storage.partition_group = group;
    if (contiguous) options.storage.contiguous = std::make_shared<ContiguousBuffers>(2);
    at::Tensor leaf = chain_input(5, 7);
    Chain earlier = run_chain(leaf * 1.0, 1, options);
    const int64_t saved = checkpoint_saved_bytes();
    const auto stats = stored_input_stats();
    const int64_t slots = contiguous ? options.storage.contiguous->slots_in_use() : 0;
    const RngSnapshot rng = capture_rng();
    at::Tensor expected_next = at::rand({4});
    restore_rng(rng);
    auto message = error_of<std::runtime_error>([&] {
      checkpoint_with(
          options,
          [](const at::Tensor& t) -> at::Tensor {
            at::Tensor h = at::dropout(t, 0.5, /*train=*/true);
            if (h.numel() > 0) throw std::runtime_error("fn failed half-way");
            return h;
          },
          earlier.out * 1.0);
    });
    EXPECT_THAT(message, HasSubstr("fn failed half-way"));
    EXPECT_EQ(checkpoint_saved_bytes(), saved) << "contiguous " << contiguous;
    EXPECT_EQ(stored_input_stats().kept_bytes, stats.kept_bytes);
    EXPECT_EQ(stored_input_stats().kept_padding_bytes, stats.kept_padding_bytes);
    if (contiguous) {
      EXPECT_EQ(options.storage.contiguous->slots_in_use(), slots);
    }
    EXPECT_TRUE(at::equal(at::rand({4}), expected_next)) << "the generator moved";
    earlier.out.sum().backward();
    EXPECT_TRUE(leaf.grad().defined());
    EXPECT_EQ(stored_input_stats().kept_bytes, 0);
  }
}

}  // namespace
}  // namespace remat
