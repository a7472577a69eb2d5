#include "models/gpt.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include "checkpointing/policy.h"
#include "runtime/config.h"
#include "runtime/error.h"

namespace remat::models {

GptOptions GptOptions::from_config(const ModelConfig& c, int64_t vocab_size) {
  GptOptions o;
  o.vocab_size = vocab_size;
  o.n_layer = c.n_layer;
  o.n_head = c.n_head;
  o.d_model = c.d_model;
  o.d_ff = c.d_ff;
  o.seq_len = c.seq_len;
  o.dropout = c.dropout;
  return o;
}

std::string GptOptions::to_string() const {
  return str("vocab=", vocab_size, " n_layer=", n_layer, " n_head=", n_head, " d_model=", d_model,
             " d_ff=", d_ff, " seq_len=", seq_len);
}

GptImpl::GptImpl(const GptOptions& o) : options_(o) {
  REMAT_CHECK_GT(o.vocab_size, 0, "GPT vocabulary size");
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(o.vocab_size, o.d_model));
  pos_emb_ = register_module("pos_emb", torch::nn::Embedding(o.seq_len, o.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) blocks->push_back(Block(static_cast<const StackOptions&>(o)));
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  head_ = register_module("head",
                          torch::nn::Linear(torch::nn::LinearOptions(o.d_model, o.vocab_size).bias(false)));
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* linear = m->as<torch::nn::Linear>()) {
      torch::nn::init::normal_(linear->weight, 0.0, 0.02);
      if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
    } else if (auto* emb = m->as<torch::nn::Embedding>()) {
      torch::nn::init::normal_(emb->weight, 0.0, 0.02);
    }
  }
}

at::Tensor GptImpl::forward(const at::Tensor& idx) {
  const int64_t t = idx.size(1);
  if (t > options_.seq_len) {
    throw Error(str("GPT: sequence of ", t, " tokens exceeds model.seq_len=", options_.seq_len));
  }
  at::Tensor pos = at::arange(t, idx.options().dtype(at::kLong));
  at::Tensor x = at::dropout(tok_emb_->forward(idx) + pos_emb_->forward(pos), options_.dropout,
                             is_training());
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return head_->forward(ln_f_->forward(x));
}

at::Tensor GptImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  at::Tensor logits = forward(idx);
  return at::cross_entropy_loss(logits.view({-1, options_.vocab_size}), targets.view({-1}));
}

at::Tensor GptImpl::generate(at::Tensor idx, int64_t n, double temperature, at::Generator gen) {
  bool was_training = is_training();
  eval();
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor context = idx.size(1) > options_.seq_len
                             ? idx.narrow(1, idx.size(1) - options_.seq_len, options_.seq_len)
                             : idx;
    at::Tensor logits = forward(context).select(1, -1) / std::max(temperature, 1e-6);
    at::Tensor next = at::multinomial(at::softmax(logits, -1), 1, false, gen);
    idx = at::cat({idx, next}, 1);
  }
  train(was_training);
  return idx;
}

int64_t GptImpl::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace remat::models
