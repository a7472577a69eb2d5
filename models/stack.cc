#include "models/stack.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "nn/module_call.h"
#include "rng/rng_tracker.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace remat::models {

BlockImpl::BlockImpl(const StackOptions& o) : options_(o), tp_(parallel::group_size(o.tensor_parallel)) {
  const ModelShape& m = o.shape;
  if (m.n_head % tp_ != 0 || m.d_ff % tp_ != 0) {
    throw ConfigError(str("tensor parallelism over ", tp_, " ranks splits attention heads and MLP "
                          "units evenly: model.n_head (", m.n_head, ") and model.d_ff (", m.d_ff,
                          ") must be multiples of tensor_parallel.size (", tp_, ")"));
  }
  using parallel::ParallelLinearOptions;
  const auto& group = o.tensor_parallel;
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({m.d_model})));
  // qkv's rows are [q | k | v]: stride 3 gives each rank its heads of all three.
  qkv_ = register_module("qkv", parallel::ColumnParallelLinear(
                                    ParallelLinearOptions(m.d_model, 3 * m.d_model).stride(3), group));
  proj_ = register_module("proj", parallel::RowParallelLinear(
                                      ParallelLinearOptions(m.d_model, m.d_model).input_is_parallel(true), group));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({m.d_model})));
  fc1_ = register_module("fc1", parallel::ColumnParallelLinear(ParallelLinearOptions(m.d_model, m.d_ff), group));
  fc2_ = register_module("fc2", parallel::RowParallelLinear(
                                    ParallelLinearOptions(m.d_ff, m.d_model).input_is_parallel(true), group));
}

at::Tensor BlockImpl::attention(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const int64_t H = options_.shape.n_head / tp_, D = C / options_.shape.n_head;  // heads on this rank
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  at::Tensor a = ln1_->forward(x);
  auto qkv = qkv_->forward(a).chunk(3, -1);
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
  at::Tensor a = ln2_->forward(h);
  return fc2_->forward(at::gelu(fc1_->forward(a)));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const double p = options_.shape.dropout;
  at::Tensor h = x + at::dropout(attention(x), p, is_training());
  return h + at::dropout(mlp(h), p, is_training());
}

StackImpl::StackImpl(const StackOptions& o) {
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.shape.n_layer; ++i) blocks->push_back(Block(o));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.shape.d_model})));
}

at::Tensor StackImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return ln_f->forward(x);
}

}  // namespace remat::models
