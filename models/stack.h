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
};

// LayerNorm -> causal self-attention -> dropout -> residual,
// LayerNorm -> MLP (GELU) -> dropout -> residual. qkv and fc1 are
// column-parallel, proj and fc2 row-parallel: with a tensor-parallel group
// one all-reduce each for attention and MLP, forward and backward; without
// one they are plain linear layers (same initialisation, same kernels).
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
  // x: [batch, seq, d_model]. Blocks run through remat::forward.
  at::Tensor forward(const at::Tensor& x);

  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Stack);

}  // namespace remat::models
