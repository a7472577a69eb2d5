// A transformer-like stack written with plain LibTorch modules and ops, its
// blocks in a ModuleList named "blocks": the model the checkpointing tests and
// the policy benchmark run.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include <memory>

#include "models/shape.h"
#include "parallel/layers.h"

namespace remat::models {

struct StackOptions {
  // The model section's n_layer, n_head, d_model, d_ff and dropout (seq_len
  // is the GPT's).
  ModelShape shape;
  // The tensor-parallel group (null or size 1: none). With a group of size tp,
  // each rank holds n_head / tp heads and d_ff / tp hidden units; dropout on
  // the attention probabilities (inside the tensor-parallel region) draws from
  // the RNG tracker's model-parallel state, the other dropouts from the
  // default generator.
  parallel::Group tensor_parallel;
  // Sequence parallelism over that group (tensor_parallel.sequence_parallel):
  // between the tensor-parallel layers, i.e. for the LayerNorms, dropouts and
  // residuals, each rank holds 1/tp of the sequence. A block then takes and
  // returns [batch, seq / tp, d_model]; the gradients of the parameters used
  // there (LayerNorms, row-parallel biases, position embeddings) are summed
  // over the group. No effect without a group of size > 1.
  bool sequence_parallel = false;
  SequenceParallelDropout sequence_parallel_dropout = SequenceParallelDropout::kPerRank;

  // Sequence parallelism in effect (asked for, over more than one rank).
  bool sequence_parallel_active() const;
};

// `ln` applied to `x`; in the sequence-parallel region of `o` its weight and
// bias enter through copy_to_tensor_parallel_region, so that their gradients,
// computed from this rank's tokens, are summed over the group.
at::Tensor layer_norm(torch::nn::LayerNorm ln, const at::Tensor& x, const StackOptions& o);

// Dropout of the residual stream: at::dropout, or with sequence parallelism
// in effect the draw StackOptions::sequence_parallel_dropout names (x holds
// this rank's chunk of the sequence along dim 1).
at::Tensor residual_dropout(const at::Tensor& x, double p, bool train, const StackOptions& o);

// LayerNorm -> causal self-attention -> dropout -> residual,
// LayerNorm -> MLP (GELU) -> dropout -> residual. qkv and fc1 are
// column-parallel, proj and fc2 row-parallel: with a tensor-parallel group
// one all-reduce each for attention and MLP, forward and backward; without
// one they are plain linear layers (same initialisation, same kernels).
//
// With sequence parallelism the block takes and returns this rank's chunk of
// the sequence; qkv and fc1 all-gather it, proj and fc2 reduce-scatter back.
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const StackOptions& options);
  at::Tensor forward(const at::Tensor& x);

 private:
  at::Tensor attention(const at::Tensor& x);
  at::Tensor mlp(const at::Tensor& h);

  StackOptions options_;
  int tp_ = 1;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  parallel::ColumnParallelLinear qkv_{nullptr}, fc1_{nullptr};
  parallel::RowParallelLinear proj_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(Block);

class StackImpl : public torch::nn::Module {
 public:
  explicit StackImpl(const StackOptions& options);
  // x: [batch, seq, d_model] (this rank's chunk of seq with sequence
  // parallelism). Blocks run through remat::forward.
  at::Tensor forward(const at::Tensor& x);

  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  StackOptions options_;
};
TORCH_MODULE(Stack);

}  // namespace remat::models
