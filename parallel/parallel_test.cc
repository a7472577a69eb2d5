// Tensor-parallel mappings and layers under mpirun at world sizes 1, 2 and 4,
// the whole world being one tensor-parallel group. Closed forms where the
// values allow them; against the plain layer otherwise.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <functional>

#include <cmath>

#include "parallel/grad_norm.h"
#include "parallel/layers.h"
#include "parallel/mappings.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/error_of.h"

namespace remat::parallel {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

Group world() {
  static Group w = Runtime::init().world(Backend::kMpi);
  return w;
}

// Float32 results of sums taken in another order agree to a few ulps of the
// magnitudes involved (values here are O(1), sums of at most 64 terms).
constexpr double kTol = 1e-5;

TEST(Mappings, PartitionRangeCoversEveryItemOnce) {
  for (int parts : {1, 2, 3, 4, 7}) {
    for (int64_t n : {0, 1, 5, 8, 37}) {
      int64_t next = 0;
      for (int r = 0; r < parts; ++r) {
        Range range = partition_range(n, parts, r);
        EXPECT_EQ(range.start, next);
        EXPECT_LE(range.length, (n + parts - 1) / parts);
        EXPECT_GE(range.length, n / parts);
        next += range.length;
      }
      EXPECT_EQ(next, n);
    }
  }
}

TEST(Mappings, CopyToIsIdentityForwardAllReduceBackward) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  at::Tensor x = at::ones({3, 4}).requires_grad_(true);
  at::Tensor y = copy_to_tensor_parallel_region(x, g);
  EXPECT_TRUE(at::equal(y, x));
  (y * (r + 1)).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), at::full({3, 4}, n * (n + 1) / 2.0)));
}

// The bytes the mappings move count in the current context; a backward
// counts in its forward's context, whatever context (or none) it runs under.
TEST(Mappings, CommBytesCountInTheForwardsContext) {
  auto g = world();
  const int n = g->size();
  auto a = Context::create();
  auto b = Context::create();
  const int64_t outside = tensor_parallel_comm_bytes();
  at::Tensor x = at::ones({3, 4}).requires_grad_(true);
  at::Tensor y, z;
  {
    ContextScope scope(a);
    y = copy_to_tensor_parallel_region(x, g);                 // nothing moves forward
    z = scatter_to_tensor_parallel_region(y * 1.0, g);        // nor here
    EXPECT_EQ(tensor_parallel_comm_bytes(), 0);
    z = reduce_from_tensor_parallel_region(z, g);             // all-reduce forward
  }
  const int64_t share = partition_range(4, n, g->rank()).length;
  const int64_t forward_bytes = n == 1 ? 0 : 3 * share * 4;
  {
    ContextScope scope(b);
    z.sum().backward();  // the all-gather and all-reduce of backward
    EXPECT_EQ(tensor_parallel_comm_bytes(), 0) << "b ran the backward but moved nothing of its own";
  }
  ContextScope scope(a);
  // Backward: the all-gather sends this rank's share, the all-reduce the whole [3, 4].
  const int64_t backward_bytes = n == 1 ? 0 : 3 * share * 4 + 3 * 4 * 4;
  EXPECT_EQ(tensor_parallel_comm_bytes(), forward_bytes + backward_bytes);
  EXPECT_TRUE(at::equal(x.grad(), at::full({3, 4}, static_cast<double>(n))));
  {
    ContextScope none(Context::process_default());
    EXPECT_EQ(tensor_parallel_comm_bytes(), outside) << "the process default counted nothing";
  }
}

TEST(Mappings, ReduceFromIsAllReduceForwardIdentityBackward) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  at::Tensor x = at::full({2, 5}, r + 1.0).requires_grad_(true);
  at::Tensor y = reduce_from_tensor_parallel_region(x, g);
  EXPECT_TRUE(at::equal(y, at::full({2, 5}, n * (n + 1) / 2.0)));
  (y * 3).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), at::full({2, 5}, 3.0)));
}

TEST(Mappings, ScatterAndGatherAlongTheLastDimensionUneven) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  const int64_t cols = 2 * n + 1;  // uneven on purpose
  at::Tensor full = at::arange(3 * cols, at::kFloat).view({3, cols});
  at::Tensor x = full.clone().requires_grad_(true);
  at::Tensor mine = scatter_to_tensor_parallel_region(x, g);
  Range range = partition_range(cols, n, r);
  EXPECT_TRUE(at::equal(mine, full.narrow(1, range.start, range.length)));
  at::Tensor back = gather_from_tensor_parallel_region(mine, g, cols);
  EXPECT_TRUE(at::equal(back, full));
  // Gather's backward keeps this rank's chunk of (r + 1); scatter's backward
  // gathers the chunks, so column c holds (owner of c) + 1.
  (back * (r + 1)).sum().backward();
  at::Tensor want = at::empty({3, cols});
  for (int q = 0; q < n; ++q) {
    Range rq = partition_range(cols, n, q);
    want.narrow(1, rq.start, rq.length).fill_(q + 1);
  }
  EXPECT_TRUE(at::equal(x.grad(), want));
}

TEST(Mappings, GatherRefusesAWrongShare) {
  auto g = world();
  if (g->size() == 1) {  // the fast path hands the input back untouched
    at::Tensor t = at::ones({2, 3});
    EXPECT_TRUE(gather_from_tensor_parallel_region(t, g, 100).is_same(t));
    return;
  }
  EXPECT_THAT(error_of<Error>([&] { gather_from_tensor_parallel_region(at::ones({2, 3}), g, 100); }),
              HasSubstr("holds 3 of 100 columns"));
}

// Rank r holds rows [r·k, (r+1)·k) of the sequence (dim 1 of [batch, seq, hidden]).
TEST(SequenceParallelMappings, ScatterGatherAndReduceScatterAlongTheSequence) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  const int64_t k = 3, seq = k * n;
  at::Tensor full = at::arange(2 * seq * 5, at::kFloat).view({2, seq, 5});
  // Scatter keeps this rank's rows; its backward gathers every rank's gradient.
  at::Tensor x = full.clone().requires_grad_(true);
  at::Tensor mine = scatter_to_sequence_parallel_region(x, g);
  EXPECT_TRUE(at::equal(mine, full.narrow(1, r * k, k)));
  // Gather puts the rows back in rank order; its backward reduce-scatters:
  // each rank's gradient (r + 1) summed over ranks, this rank's rows kept.
  at::Tensor back = gather_from_sequence_parallel_region(mine, g);
  EXPECT_TRUE(at::equal(back, full));
  (back * (r + 1)).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), at::full({2, seq, 5}, n * (n + 1) / 2.0)));
  // Reduce-scatter sums (r + 1) over ranks and keeps this rank's rows; its
  // backward all-gathers: row block q gets rank q's gradient, q + 1.
  at::Tensor y = at::full({2, seq, 5}, r + 1.0).requires_grad_(true);
  at::Tensor summed = reduce_scatter_to_sequence_parallel_region(y, g);
  EXPECT_TRUE(at::equal(summed, at::full({2, k, 5}, n * (n + 1) / 2.0)));
  (summed * (r + 1)).sum().backward();
  at::Tensor want = at::empty({2, seq, 5});
  for (int q = 0; q < n; ++q) want.narrow(1, q * k, k).fill_(q + 1);
  EXPECT_TRUE(at::equal(y.grad(), want));
}

// Inputs the mappings did not make: an expanded view and a transposed one
// give what their contiguous copies give, and the caller's tensors are left alone.
TEST(SequenceParallelMappings, ExpandedAndTransposedInputsActLikeTheirCopies) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  const int64_t k = 2, seq = k * n;
  at::Tensor row = at::arange(5, at::kFloat);
  at::Tensor expanded = row.expand({3, seq, 5});  // stride 0 in two dims
  at::Tensor mine = scatter_to_sequence_parallel_region(expanded, g);
  EXPECT_TRUE(at::equal(mine, expanded.contiguous().narrow(1, r * k, k)));
  at::Tensor transposed = at::arange(seq * 3 * 5, at::kFloat).view({seq, 3, 5}).transpose(0, 1);
  at::Tensor before = transposed.clone();
  at::Tensor chunk = transposed.contiguous().narrow(1, r * k, k);
  at::Tensor weight = at::arange(4 * 5, at::kFloat).view({4, 5}) / 10;
  at::Tensor from_view = linear_with_sequence_parallel_input(chunk.transpose(0, 1).contiguous().transpose(0, 1),
                                                             weight, at::Tensor(), g);
  EXPECT_TRUE(at::equal(from_view, at::linear(transposed.contiguous(), weight)));
  EXPECT_TRUE(at::equal(gather_from_sequence_parallel_region(chunk.transpose(0, 1).contiguous().transpose(0, 1), g),
                        transposed.contiguous()));
  EXPECT_TRUE(at::equal(transposed, before));
}

TEST(SequenceParallelMappings, ASequenceThatDoesNotSplitIsRefusedNamingLengthsThatDo) {
  auto g = world();
  const int n = g->size();
  if (n == 1) {
    at::Tensor t = at::ones({1, 5, 2});
    EXPECT_TRUE(scatter_to_sequence_parallel_region(t, g).is_same(t));
    return;
  }
  const std::string message =
      error_of<ConfigError>([&] { scatter_to_sequence_parallel_region(at::ones({1, 2 * n + 1, 2}), g); });
  EXPECT_THAT(message, HasSubstr(str(2 * n + 1, " is not a multiple of ", n)));
  EXPECT_THAT(message, HasSubstr(str("e.g. ", 2 * n, " or ", 3 * n)));
}

// The layer on a sequence-parallel input computes what copy + linear computes
// on the whole input: the output bitwise, the input's gradient (summed over
// the group) and the weight's to float rounding; it keeps 1/n of the input.
TEST(SequenceParallelMappings, LinearWithSequenceParallelInputMatchesTheWholeInput) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  const int64_t k = 2, seq = k * n;
  at::Generator gen = at::detail::createCPUGenerator(7);
  at::Tensor whole = at::randn({3, seq, 6}, gen);
  at::Tensor weight_full = at::randn({4, 6}, gen), bias_full = at::randn({4}, gen);
  at::Tensor out_grad = at::randn({3, seq, 4}, gen) * (r + 1);
  // Reference: every rank the whole input.
  at::Tensor xa = whole.clone().requires_grad_(true), wa = weight_full.clone().requires_grad_(true);
  at::Tensor ya = at::linear(copy_to_tensor_parallel_region(xa, g), wa, bias_full);
  ya.backward(out_grad);
  // Sequence parallel: this rank's rows only.
  at::Tensor xb = whole.narrow(1, r * k, k).clone().requires_grad_(true);
  at::Tensor wb = weight_full.clone().requires_grad_(true), bb = bias_full.clone().requires_grad_(true);
  const int64_t before = tensor_parallel_comm_bytes();
  at::Tensor yb = linear_with_sequence_parallel_input(xb, wb, bb, g);
  EXPECT_TRUE(at::equal(yb, ya.detach()));
  yb.backward(out_grad);
  EXPECT_TRUE(at::allclose(xb.grad(), xa.grad().narrow(1, r * k, k), 1e-5, kTol));
  EXPECT_TRUE(at::allclose(wb.grad(), wa.grad(), 1e-5, kTol));
  EXPECT_TRUE(at::allclose(bb.grad(), out_grad.sum(at::IntArrayRef{0, 1}), 1e-5, kTol));
  // Forward all-gather (this rank's share counted), backward the same again
  // and the reduce-scatter of the whole input's gradient.
  const int64_t gathered = 3 * k * 6 * 4, grads = 3 * seq * 6 * 4;
  EXPECT_EQ(tensor_parallel_comm_bytes() - before, n == 1 ? 0 : 2 * gathered + grads);
}

TEST(Layers, ColumnAndRowParallelMatchThePlainLinearAndGatherTheSameWeights) {
  auto g = world();
  at::manual_seed(7);
  const int64_t in = 8, hidden = 12, out = 6;
  ColumnParallelLinear col(ParallelLinearOptions(in, hidden), g);
  RowParallelLinear row(ParallelLinearOptions(hidden, out).input_is_parallel(true), g);
  // Full weights drawn the same on every rank.
  at::Tensor w1 = at::randn({hidden, in}), w2 = at::randn({out, hidden});
  col->load_full_weight(w1);
  row->load_full_weight(w2);
  EXPECT_TRUE(at::equal(col->gather_full_weight(), w1));
  EXPECT_TRUE(at::equal(row->gather_full_weight(), w2));
  {
    torch::NoGradGuard no_grad;
    col->bias.fill_(0.25);
    row->bias.fill_(-0.5);
  }
  at::Tensor x = at::randn({4, in});
  at::Tensor xp = x.clone().requires_grad_(true), xr = x.clone().requires_grad_(true);
  at::Tensor yp = row(at::gelu(col(xp)));
  at::Tensor yr = at::linear(at::gelu(at::linear(xr, w1, at::full({hidden}, 0.25))), w2,
                             at::full({out}, -0.5));
  EXPECT_TRUE(at::allclose(yp, yr, kTol, kTol)) << (yp - yr).abs().max();
  yp.sum().backward();
  yr.sum().backward();
  EXPECT_TRUE(at::allclose(xp.grad(), xr.grad(), kTol, kTol));
  EXPECT_EQ(sharded_parameters(*col).size(), g->size() > 1 ? 2u : 0u);  // weight, bias
  EXPECT_EQ(sharded_parameters(*row).size(), g->size() > 1 ? 1u : 0u);  // weight only
}

TEST(Layers, StridedColumnKeepsEachRanksShareOfEveryBlock) {
  auto g = world();
  const int n = g->size(), r = g->rank();
  const int64_t d = 8;  // rows per block of q | k | v; divisible by 1, 2 and 4
  ColumnParallelLinear qkv(ParallelLinearOptions(2, 3 * d).stride(3).bias(false), g);
  at::Tensor full = at::arange(3 * d * 2, at::kFloat).view({3 * d, 2});
  qkv->load_full_weight(full);
  const int64_t share = d / n;
  for (int64_t s = 0; s < 3; ++s) {
    EXPECT_TRUE(at::equal(qkv->weight.narrow(0, s * share, share),
                          full.narrow(0, s * d + r * share, share)))
        << "block " << s;
  }
  EXPECT_TRUE(at::equal(qkv->gather_full_weight(), full));
}

TEST(Layers, GatherOutputGivesTheFullWidthUneven) {
  auto g = world();
  const int64_t out = 2 * g->size() + 1;
  ColumnParallelLinear col(ParallelLinearOptions(3, out).gather_output(true).bias(false), g);
  at::Tensor w = at::randn({out, 3});
  col->load_full_weight(w);
  at::Tensor x = at::randn({5, 3});
  at::Tensor y = col(x);
  ASSERT_EQ(y.size(-1), out);
  EXPECT_TRUE(at::allclose(y, at::linear(x, w), kTol, kTol));
}

TEST(Layers, VocabParallelEmbeddingEqualsThePlainLookupBitwise) {
  auto g = world();
  const int64_t vocab = 37, dim = 5;  // uneven across 2 and 4 ranks
  VocabParallelEmbedding emb(vocab, dim, g);
  at::Tensor w = at::randn({vocab, dim});
  emb->load_full_weight(w);
  EXPECT_TRUE(at::equal(emb->gather_full_weight(), w));
  at::Tensor idx = at::arange(vocab, at::kLong).view({1, vocab}).repeat({2, 1});
  // Each row is held by one rank; the others add exact zeros.
  EXPECT_TRUE(at::equal(emb(idx), at::embedding(w, idx)));
}

TEST(Layers, VocabParallelCrossEntropyMatchesTheFullLoss) {
  auto g = world();
  const int64_t vocab = 37, tokens = 11;
  at::manual_seed(3);
  at::Tensor logits = at::randn({tokens, vocab}) * 3;
  at::Tensor target = at::randint(vocab, {tokens}, at::kLong);
  Range range = partition_range(vocab, g->size(), g->rank());
  at::Tensor mine = logits.narrow(1, range.start, range.length).clone().requires_grad_(true);
  at::Tensor full = logits.clone().requires_grad_(true);
  at::Tensor loss_p = vocab_parallel_cross_entropy(mine, target, range.start, g);
  at::Tensor loss_f = at::cross_entropy_loss(full, target, {}, at::Reduction::None);
  EXPECT_TRUE(at::allclose(loss_p, loss_f, kTol, kTol)) << (loss_p - loss_f).abs().max();
  (loss_p * at::arange(tokens, at::kFloat)).sum().backward();
  (loss_f * at::arange(tokens, at::kFloat)).sum().backward();
  EXPECT_TRUE(at::allclose(mine.grad(), full.grad().narrow(1, range.start, range.length), kTol, kTol));
}

TEST(Layers, RowParallelRefusesAnInputOfTheWrongWidth) {
  auto g = world();
  RowParallelLinear row(ParallelLinearOptions(8, 3).input_is_parallel(true), g);
  EXPECT_THAT(error_of<Error>([&] { row(at::ones({2, 9})); }),
              HasSubstr("the weight's share expects"));
}

// Without a group a parallel layer is the plain LibTorch layer: the same
// draws from the default generator (so a model's later dropout masks do not
// depend on which layers it uses), the same parameters, the same outputs.
TEST(Layers, WithoutAGroupTheyAreThePlainLayersBitForBit) {
  auto same_after = [](const std::function<std::vector<at::Tensor>()>& plain,
                       const std::function<std::vector<at::Tensor>()>& parallel, const char* what) {
    at::manual_seed(7);
    std::vector<at::Tensor> a = plain();
    at::Tensor next_a = at::rand({4});
    at::manual_seed(7);
    std::vector<at::Tensor> b = parallel();
    at::Tensor next_b = at::rand({4});
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " tensor " << i;
    EXPECT_TRUE(at::equal(next_a, next_b)) << what << ": the generator moved differently";
  };
  at::Tensor x = at::randn({3, 5, 6});
  at::Tensor idx = at::randint(11, {3, 5}, at::kLong);
  auto parameters_and_output = [&](auto layer) {
    std::vector<at::Tensor> out = layer->parameters();
    out.push_back(layer->forward(x));
    return out;
  };
  for (bool bias : {true, false}) {
    same_after(
        [&] { return parameters_and_output(torch::nn::Linear(torch::nn::LinearOptions(6, 9).bias(bias))); },
        [&] {
          return parameters_and_output(
              ColumnParallelLinear(ParallelLinearOptions(6, 9).bias(bias).stride(3), nullptr));
        },
        "ColumnParallelLinear");
    same_after(
        [&] { return parameters_and_output(torch::nn::Linear(torch::nn::LinearOptions(6, 9).bias(bias))); },
        [&] { return parameters_and_output(RowParallelLinear(ParallelLinearOptions(6, 9).bias(bias), nullptr)); },
        "RowParallelLinear");
  }
  same_after(
      [&] {
        torch::nn::Embedding e(11, 6);
        return std::vector<at::Tensor>{e->weight, e->forward(idx)};
      },
      [&] {
        VocabParallelEmbedding e(11, 6, nullptr);
        return std::vector<at::Tensor>{e->weight, e->forward(idx)};
      },
      "VocabParallelEmbedding");
}

TEST(GradNorm, ShardsCountOnceAcrossTheGroup) {
  auto g = world();
  const int n = g->size();
  // A sharded parameter whose gradient is 1 everywhere on each rank (4
  // elements per rank) and a replicated one with gradient 2 (1 element).
  at::Tensor sharded = at::zeros({4}).requires_grad_(true);
  at::Tensor replicated = at::zeros({1}).requires_grad_(true);
  sharded.mutable_grad() = at::ones({4});
  replicated.mutable_grad() = at::full({1}, 2.0);
  const std::vector<GradGroup> groups{{{sharded}, {g}}, {{replicated}, {}}};
  const double norm = clip_grad_norm(groups, 1e9);
  const double want = std::sqrt(4.0 * n + 4.0);
  EXPECT_NEAR(norm, want, 1e-9);
  clip_grad_norm(groups, want / 2);
  EXPECT_NEAR(replicated.grad().item<double>(), 1.0, 1e-5);
}

TEST(GradNorm, EachGroupIsSummedOverItsOwnCommunicators) {
  const int n = world()->size();
  const int tp = n >= 2 ? 2 : 1;
  ParallelLayout l(world(), ParallelDims::from_world(n, tp));
  const int dp = n / tp;
  // Gradients of ones: a group's square on one rank is its numel.
  auto grad_of = [](int64_t numel) {
    at::Tensor t = at::zeros({numel}).requires_grad_(true);
    t.mutable_grad() = at::ones({numel});
    return t;
  };
  at::Tensor both = grad_of(3), over_dp = grad_of(5), over_tp = grad_of(7), local = grad_of(11);
  at::Tensor no_grad = at::zeros({2}).requires_grad_(true);  // counts as zero
  const std::vector<GradGroup> groups{{{both}, {l.dp_group(), l.tp_group()}},
                                      {{over_dp, no_grad}, {l.dp_group()}},
                                      {{over_tp}, {l.tp_group()}},
                                      {{local}, {}}};
  const double want = std::sqrt(3.0 * dp * tp + 5.0 * dp + 7.0 * tp + 11.0);
  EXPECT_NEAR(clip_grad_norm(groups, 1e9), want, 1e-6);  // per-tensor norms are float32
  EXPECT_EQ(local.grad()[0].item<float>(), 1.0f) << "no clipping under the norm";
  clip_grad_norm(groups, want / 4);
  for (const auto& t : {both, over_dp, over_tp, local}) {
    EXPECT_NEAR(t.grad()[0].item<double>(), 0.25, 1e-6);
  }
  EXPECT_FALSE(no_grad.grad().defined());
}

TEST(Layout, AWorldThatTheTensorParallelSizeDoesNotDivideIsRefused) {
  const int n = world()->size();
  EXPECT_THAT(error_of<ConfigError>([&] { ParallelDims::from_world(n, 3); }),
              HasSubstr(n == 4 ? "choose one of 1, 2, 4" : (n == 2 ? "choose one of 1, 2" : "choose one of 1")));
}

}  // namespace
}  // namespace remat::parallel
