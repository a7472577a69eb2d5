#include "models/stack.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "nn/module_call.h"
#include "rng/rng_tracker.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace remat::models {

bool StackOptions::sequence_parallel_active() const {
  return sequence_parallel && parallel::group_size(tensor_parallel) > 1;
}

at::Tensor layer_norm(torch::nn::LayerNorm ln, const at::Tensor& x, const StackOptions& o) {
  if (!o.sequence_parallel_active()) return ln->forward(x);
  const auto& g = o.tensor_parallel;
  return at::layer_norm(x, ln->options.normalized_shape(), parallel::copy_to_tensor_parallel_region(ln->weight, g),
                        parallel::copy_to_tensor_parallel_region(ln->bias, g), ln->options.eps());
}

at::Tensor residual_dropout(const at::Tensor& x, double p, bool train, const StackOptions& o) {
  if (!o.sequence_parallel_active() || !train || p == 0.0 || x.numel() == 0) return at::dropout(x, p, train);
  if (o.sequence_parallel_dropout == SequenceParallelDropout::kPerRank) {
    auto fork = get_rng_tracker().fork(kModelParallelRng);
    return at::dropout(x, p, train);
  }
  // The whole sequence's mask, as at::dropout draws it (ones scaled by the
  // kept mask: exactly the mask), and this rank's rows of it.
  const int tp = parallel::group_size(o.tensor_parallel);
  auto sizes = x.sizes().vec();
  sizes[1] *= tp;
  at::Tensor mask;
  {
    at::NoGradGuard no_grad;
    at::Tensor whole = at::dropout(at::ones(sizes, x.options()), p, true);
    mask = at::empty_like(x).copy_(whole.narrow(1, parallel::group_rank(o.tensor_parallel) * x.size(1), x.size(1)));
  }
  return x * mask;
}

BlockImpl::BlockImpl(const StackOptions& o) : options_(o), tp_(parallel::group_size(o.tensor_parallel)) {
  const ModelShape& m = o.shape;
  if (m.n_head % tp_ != 0 || m.d_ff % tp_ != 0) {
    throw ConfigError(str("tensor parallelism over ", tp_, " ranks splits attention heads and MLP "
                          "units evenly: model.n_head (", m.n_head, ") and model.d_ff (", m.d_ff,
                          ") must be multiples of tensor_parallel.size (", tp_, ")"));
  }
  using parallel::ParallelLinearOptions;
  const auto& group = o.tensor_parallel;
  const bool sp = o.sequence_parallel_active();
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({m.d_model})));
  // qkv's rows are [q | k | v]: stride 3 gives each rank its heads of all three.
  qkv_ = register_module("qkv", parallel::ColumnParallelLinear(
                                    ParallelLinearOptions(m.d_model, 3 * m.d_model).stride(3).sequence_parallel(sp), group));
  proj_ = register_module("proj", parallel::RowParallelLinear(
                                      ParallelLinearOptions(m.d_model, m.d_model).input_is_parallel(true).sequence_parallel(sp),
                                      group));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({m.d_model})));
  fc1_ = register_module("fc1", parallel::ColumnParallelLinear(
                                   ParallelLinearOptions(m.d_model, m.d_ff).sequence_parallel(sp), group));
  fc2_ = register_module("fc2", parallel::RowParallelLinear(
                                    ParallelLinearOptions(m.d_ff, m.d_model).input_is_parallel(true).sequence_parallel(sp),
                                    group));
}

at::Tensor BlockImpl::attention(const at::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(2);
  const int64_t H = options_.shape.n_head / tp_, D = C / options_.shape.n_head;  // heads on this rank
  at::Tensor a = layer_norm(ln1_, x, options_);
  at::Tensor fused = qkv_->forward(a);  // the whole sequence, also with sequence parallelism
  const int64_t T = fused.size(1);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  auto qkv = fused.chunk(3, -1);
  at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  // Heads differ across tensor-parallel ranks, so do their dropout masks.
  std::optional<RNGStatesTracker::ForkGuard> fork;
  if (tp_ > 1) fork.emplace(get_rng_tracker().fork(kModelParallelRng));
  const double p = is_training() ? options_.shape.dropout : 0.0;
#if REMAT_HAS_SDPA
  at::Tensor y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);
#else
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
  at::Tensor causal = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
  at::Tensor y = at::matmul(at::dropout(at::softmax(scores, -1), p, p > 0), v);
#endif
  fork.reset();
  y = y.transpose(1, 2).contiguous().view({B, T, H * D});
  return proj_->forward(y);
}

at::Tensor BlockImpl::mlp(const at::Tensor& h) {
  at::Tensor a = layer_norm(ln2_, h, options_);
  return fc2_->forward(at::gelu(fc1_->forward(a)));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const double p = options_.shape.dropout;
  at::Tensor h = x + residual_dropout(attention(x), p, is_training(), options_);
  return h + residual_dropout(mlp(h), p, is_training(), options_);
}

StackImpl::StackImpl(const StackOptions& o) : options_(o) {
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.shape.n_layer; ++i) blocks->push_back(Block(o));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.shape.d_model})));
}

at::Tensor StackImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return layer_norm(ln_f, x, options_);
}

}  // namespace remat::models
