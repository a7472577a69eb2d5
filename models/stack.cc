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
  if (o.n_head % tp_ != 0 || o.d_ff % tp_ != 0) {
    throw ConfigError(str("tensor parallelism over ", tp_, " ranks splits attention heads and MLP "
                          "units evenly: model.n_head (", o.n_head, ") and model.d_ff (", o.d_ff,
                          ") must be multiples of tensor_parallel.size (", tp_, ")"));
  }
  using parallel::ParallelLinearOptions;
  const auto& group = o.tensor_parallel;
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  if (tp_ == 1) {
    qkv_ = register_module("qkv", torch::nn::Linear(o.d_model, 3 * o.d_model));
    proj_ = register_module("proj", torch::nn::Linear(o.d_model, o.d_model));
  } else {
    // qkv's rows are [q | k | v]: stride 3 gives each rank its heads of all three.
    qkv_tp_ = register_module("qkv", parallel::ColumnParallelLinear(
                                         ParallelLinearOptions(o.d_model, 3 * o.d_model).stride(3), group));
    proj_tp_ = register_module("proj", parallel::RowParallelLinear(
                                           ParallelLinearOptions(o.d_model, o.d_model).input_is_parallel(true), group));
  }
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  if (tp_ == 1) {
    fc1_ = register_module("fc1", torch::nn::Linear(o.d_model, o.d_ff));
    fc2_ = register_module("fc2", torch::nn::Linear(o.d_ff, o.d_model));
  } else {
    fc1_tp_ = register_module("fc1", parallel::ColumnParallelLinear(ParallelLinearOptions(o.d_model, o.d_ff), group));
    fc2_tp_ = register_module("fc2", parallel::RowParallelLinear(
                                         ParallelLinearOptions(o.d_ff, o.d_model).input_is_parallel(true), group));
  }
}

at::Tensor BlockImpl::attention(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const int64_t H = options_.n_head / tp_, D = C / options_.n_head;  // heads on this rank
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  at::Tensor a = ln1_->forward(x);
  auto qkv = (tp_ == 1 ? qkv_->forward(a) : qkv_tp_->forward(a)).chunk(3, -1);
  at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  // Heads differ across tensor-parallel ranks, so do their dropout masks.
  std::optional<RNGStatesTracker::ForkGuard> fork;
  if (tp_ > 1) fork.emplace(get_rng_tracker().fork(kModelParallelRng));
  const double p = is_training() ? options_.dropout : 0.0;
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
  return tp_ == 1 ? proj_->forward(y) : proj_tp_->forward(y);
}

at::Tensor BlockImpl::mlp(const at::Tensor& h) {
  at::Tensor a = ln2_->forward(h);
  if (tp_ == 1) return fc2_->forward(at::gelu(fc1_->forward(a)));
  return fc2_tp_->forward(at::gelu(fc1_tp_->forward(a)));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + at::dropout(attention(x), options_.dropout, is_training());
  return h + at::dropout(mlp(h), options_.dropout, is_training());
}

StackImpl::StackImpl(const StackOptions& o) {
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) blocks->push_back(Block(o));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
}

at::Tensor StackImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return ln_f->forward(x);
}

}  // namespace remat::models
