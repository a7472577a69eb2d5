// A GPT-style decoder: token + position embeddings, blocks of (LayerNorm ->
// causal self-attention -> dropout -> residual, LayerNorm -> MLP with GELU ->
// dropout -> residual) in a ModuleList named "blocks", a final LayerNorm and
// an LM head. Blocks run through remat::forward, so checkpointing policies
// apply to them by name.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <string>

#include "models/stack.h"

namespace remat::models {

// The model section (shape) and the tensor-parallel group, plus the
// vocabulary size, which the data decides.
struct GptOptions : StackOptions {
  int64_t vocab_size = 0;

  std::string to_string() const;  // compared when a save is resumed
};

// The blocks are tensor parallel over options.tensor_parallel (see Block),
// the token embedding is vocab-parallel and the LM head column-parallel; with
// a group of size tp > 1 the loss is computed on vocabulary-split logits.
// With sequence parallelism (StackOptions::sequence_parallel) the embedding's
// sum is reduce-scattered along the sequence, the position embeddings,
// dropouts, blocks and final LayerNorm work on 1/tp of it, and the head
// all-gathers it: seq_len and every sequence given must be multiples of tp.
class GptImpl : public torch::nn::Module {
 public:
  // Weights are N(0, 0.02) (linears and embeddings; biases zero), drawn in
  // module order from a generator seeded by one draw from the default
  // generator: seed that first for a reproducible model. Tensor-parallel
  // layers keep their shard of the same full weights, so the model computes
  // the same function at every tensor-parallel size.
  explicit GptImpl(const GptOptions& options);

  // idx: [batch, time] token ids, time <= seq_len. Returns logits [batch, time, vocab]
  // (gathered across tensor-parallel ranks).
  at::Tensor forward(const at::Tensor& idx);

  // Mean cross-entropy of the next-token prediction.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets);

  // Appends `n` tokens sampled at `temperature` from `gen` (eval mode, no grad).
  at::Tensor generate(at::Tensor idx, int64_t n, double temperature, at::Generator gen);

  const GptOptions& options() const { return options_; }
  int64_t num_parameters() const;

  torch::nn::ModuleList blocks{nullptr};

 private:
  // Embeddings, blocks and the final LayerNorm: [batch, time, d_model].
  at::Tensor trunk(const at::Tensor& idx);

  GptOptions options_;
  int tp_ = 1;
  parallel::VocabParallelEmbedding tok_emb_{nullptr};
  torch::nn::Embedding pos_emb_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  parallel::ColumnParallelLinear head_{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace remat::models
