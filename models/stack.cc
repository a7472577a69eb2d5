#include "models/stack.h"

#include <ATen/ATen.h>

#include <cmath>

#include "checkpointing/policy.h"

namespace remat::models {

BlockImpl::BlockImpl(const StackOptions& o) : options_(o) {
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(o.d_model, 3 * o.d_model));
  proj_ = register_module("proj", torch::nn::Linear(o.d_model, o.d_model));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  fc1_ = register_module("fc1", torch::nn::Linear(o.d_model, o.d_ff));
  fc2_ = register_module("fc2", torch::nn::Linear(o.d_ff, o.d_model));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = options_.n_head;
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, C / H}).transpose(1, 2); };
  auto qkv = qkv_->forward(ln1_->forward(x)).chunk(3, -1);
  at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(C / H));
  at::Tensor causal = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
  at::Tensor attn = at::dropout(at::softmax(scores, -1), options_.dropout, is_training());
  at::Tensor y = at::matmul(attn, v).transpose(1, 2).contiguous().view({B, T, C});
  at::Tensor h = x + at::dropout(proj_->forward(y), options_.dropout, is_training());
  at::Tensor m = fc2_->forward(at::gelu(fc1_->forward(ln2_->forward(h))));
  return h + at::dropout(m, options_.dropout, is_training());
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
