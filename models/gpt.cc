#include "models/gpt.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "nn/module_call.h"
#include "parallel/mappings.h"
#include "runtime/error.h"

namespace remat::models {

std::string GptOptions::to_string() const {
  return str("vocab=", vocab_size, " n_layer=", shape.n_layer, " n_head=", shape.n_head,
             " d_model=", shape.d_model, " d_ff=", shape.d_ff, " seq_len=", shape.seq_len);
}

GptImpl::GptImpl(const GptOptions& o) : options_(o), tp_(parallel::group_size(o.tensor_parallel)) {
  REMAT_CHECK_GT(o.vocab_size, 0, "GPT vocabulary size");
  // One draw seeds the initialisation, whatever the layers' constructors draw.
  const uint64_t init_seed = static_cast<uint64_t>(at::randint(1LL << 62, {1}, at::kLong).item<int64_t>());
  const auto& group = o.tensor_parallel;
  const ModelShape& shape = o.shape;
  const bool sp = o.sequence_parallel_active();
  if (sp) parallel::check_sequence_split(shape.seq_len, group, str("model.seq_len=", shape.seq_len));
  tok_emb_ = register_module("tok_emb", parallel::VocabParallelEmbedding(o.vocab_size, shape.d_model, group,
                                                                         /*sequence_dim=*/sp ? 1 : -1));
  pos_emb_ = register_module("pos_emb", torch::nn::Embedding(shape.seq_len, shape.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < shape.n_layer; ++i) blocks->push_back(Block(static_cast<const StackOptions&>(o)));
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.d_model})));
  head_ = register_module("head", parallel::ColumnParallelLinear(
                                      parallel::ParallelLinearOptions(shape.d_model, o.vocab_size).bias(false).sequence_parallel(sp),
                                      group));
  at::Generator gen = at::detail::createCPUGenerator(init_seed);
  auto draw = [&](c10::IntArrayRef sizes) { return at::empty(sizes).normal_(0.0, 0.02, gen); };
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* emb = m->as<torch::nn::Embedding>()) {
      emb->weight.copy_(draw(emb->weight.sizes()));
    } else if (auto* tp = dynamic_cast<parallel::TensorParallelModule*>(m.get())) {
      tp->load_full_weight(draw(tp->full_weight_sizes()));
      for (auto& p : m->parameters(/*recurse=*/false)) {
        if (p.dim() == 1) p.zero_();  // biases
      }
    }
  }
}

at::Tensor GptImpl::trunk(const at::Tensor& idx) {
  const int64_t t = idx.size(1);
  if (t > options_.shape.seq_len) {
    throw Error(str("GPT: sequence of ", t, " tokens exceeds model.seq_len=", options_.shape.seq_len));
  }
  const auto& group = options_.tensor_parallel;
  at::Tensor x;
  if (options_.sequence_parallel_active()) {
    // From here to the head each rank holds its 1/tp of the sequence.
    parallel::check_sequence_split(t, group, str("a sequence of ", t, " tokens"));
    const int64_t share = t / tp_, start = parallel::group_rank(group) * share;
    at::Tensor pos = at::arange(start, start + share, idx.options().dtype(at::kLong));
    at::Tensor positions = at::embedding(parallel::copy_to_tensor_parallel_region(pos_emb_->weight, group), pos);
    x = tok_emb_->forward(idx) + positions;
  } else {
    at::Tensor pos = at::arange(t, idx.options().dtype(at::kLong));
    x = tok_emb_->forward(idx) + pos_emb_->forward(pos);
  }
  x = residual_dropout(x, options_.shape.dropout, is_training(), options_);
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return layer_norm(ln_f_, x, options_);
}

at::Tensor GptImpl::forward(const at::Tensor& idx) {
  return parallel::gather_from_tensor_parallel_region(remat::forward(head_, trunk(idx)), options_.tensor_parallel,
                                                      options_.vocab_size);
}

at::Tensor GptImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  if (tp_ == 1) {
    // The loss in float32 whatever the compute dtype (bf16 under ZeRO stage 3).
    at::Tensor logits = forward(idx).to(at::kFloat);
    return at::cross_entropy_loss(logits.view({-1, options_.vocab_size}), targets.view({-1}));
  }
  at::Tensor logits = remat::forward(head_, trunk(idx)).to(at::kFloat);
  const auto start = parallel::partition_range(options_.vocab_size, tp_, parallel::group_rank(options_.tensor_parallel)).start;
  return parallel::vocab_parallel_cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1}),
                                                start, options_.tensor_parallel)
      .mean();
}

at::Tensor GptImpl::generate(at::Tensor idx, int64_t n, double temperature, at::Generator gen) {
  bool was_training = is_training();
  eval();
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t window = options_.shape.seq_len;
    at::Tensor context = idx.size(1) > window ? idx.narrow(1, idx.size(1) - window, window) : idx;
    const int64_t last = context.size(1) - 1;
    if (options_.sequence_parallel_active() && context.size(1) % tp_ != 0) {
      // Padded at the end to split evenly: causal attention keeps the padding
      // out of the logits at `last`.
      const int64_t padded = (context.size(1) / tp_ + 1) * tp_;
      context = at::cat({context, at::zeros({context.size(0), padded - context.size(1)}, context.options())}, 1);
    }
    at::Tensor logits = forward(context).select(1, last).to(at::kFloat) / std::max(temperature, 1e-6);
    at::Tensor probabilities = at::softmax(logits, -1);
    if (!at::isfinite(probabilities).all().item<bool>()) {
      train(was_training);
      throw Error(str("Gpt::generate: the next-token probabilities of token ", i + 1, " are not finite (NaN or inf), "
                      "so the model's weights or activations are not: the weights have diverged (a learning rate "
                      "too high, no gradient clipping) or were loaded so"));
    }
    // Drawn where the generator is (a CPU generator for a model on a GPU).
    at::Tensor next = at::multinomial(probabilities.to(gen.device()), 1, false, gen).to(idx.device());
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
