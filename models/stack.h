// A transformer-like stack written with plain LibTorch modules and ops, its
// blocks in a ModuleList named "blocks": the model the checkpointing tests and
// the policy benchmark run.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace remat::models {

struct StackOptions {
  int64_t n_layer = 8;
  int64_t d_model = 64;
  int64_t n_head = 4;
  int64_t d_ff = 256;
  double dropout = 0.1;
};

// LayerNorm -> causal self-attention -> dropout -> residual,
// LayerNorm -> MLP (GELU) -> dropout -> residual.
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const StackOptions& options);
  at::Tensor forward(const at::Tensor& x);

 private:
  StackOptions options_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
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
