// A Llama-style decoder written against LibTorch's C++ frontend, as a user of
// remat would write it: nothing here comes from remat's models/. RMSNorm,
// rotary position embeddings, grouped-query attention (fewer key/value heads
// than query heads), a SwiGLU MLP, dropout, and an LM head. The blocks live in
// one torch::nn::ModuleList and are called through remat::forward, which is
// all remat needs to shard them (ZeRO) and checkpoint or offload them.
//
// Every projection is a LoraLinear: with lora_rank 0 a plain bias-free linear
// layer; with lora_rank r it also carries low-rank adapters A [r, in] and
// B [out, r] (B starts at zero, so the adapted model starts as the base one)
// and y = x W^T + (alpha / r) (x A^T) B^T. freeze_base() then leaves only the
// adapters trainable.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "engine/memory_estimate.h"
#include <string>
#include <utility>

namespace llama {

struct LlamaOptions {
  int64_t vocab_size = 0;
  int64_t n_layer = 2;
  int64_t n_head = 4;     // query heads
  int64_t n_kv_head = 2;  // key/value heads: divides n_head
  int64_t d_model = 64;   // n_head * head_dim; head_dim even (rotary pairs)
  int64_t d_ff = 128;     // SwiGLU hidden width
  int64_t seq_len = 32;
  double dropout = 0.1;   // embeddings, attention weights and both residual branches
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  int64_t lora_rank = 0;  // 0: no adapters
  double lora_alpha = 8.0;

  // Throws std::invalid_argument naming the option that is wrong.
  void validate() const;
  std::string to_string() const;
};

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class LoraLinearImpl : public torch::nn::Module {
 public:
  LoraLinearImpl(int64_t in, int64_t out, int64_t rank, double alpha);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;            // [out, in], the base weight
  at::Tensor lora_a, lora_b;    // [rank, in], [out, rank]; undefined with rank 0

 private:
  double scale_ = 0;
};
TORCH_MODULE(LoraLinear);

// One decoder block: x + attn(norm(x)), then h + mlp(norm(h)), each branch
// followed by dropout. It takes and returns one tensor, as ZeRO stage 3's
// sharded units must (docs/engine.md): the rotary tables are made inside.
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const LlamaOptions& options);
  at::Tensor forward(const at::Tensor& x);

 private:
  at::Tensor attention(const at::Tensor& x);
  at::Tensor mlp(const at::Tensor& x);

  LlamaOptions options_;
  RMSNorm attn_norm_{nullptr}, mlp_norm_{nullptr};
  LoraLinear wq_{nullptr}, wk_{nullptr}, wv_{nullptr}, wo_{nullptr};
  LoraLinear w1_{nullptr}, w2_{nullptr}, w3_{nullptr};  // gate, down, up
};
TORCH_MODULE(Block);

class LlamaImpl : public torch::nn::Module {
 public:
  // Weights N(0, 0.02), norms 1, adapters A N(0, 0.02) and B 0, drawn from
  // the default generator in construction order: seed it first.
  explicit LlamaImpl(const LlamaOptions& options);

  // idx: [batch, time] token ids. Returns logits [batch, time, vocab].
  at::Tensor forward(const at::Tensor& idx);
  // Mean next-token cross-entropy.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets);

  // LoRA fine-tuning: every parameter but the adapters stops requiring grad.
  // Returns (trainable, frozen) element counts.
  std::pair<int64_t, int64_t> freeze_base();

  const LlamaOptions& options() const { return options_; }

  torch::nn::ModuleList blocks{nullptr};

 private:
  LlamaOptions options_;
  torch::nn::Embedding tok_emb_{nullptr};
  RMSNorm norm_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};
TORCH_MODULE(Llama);

// What remat's cold memory estimate needs of this model (remat-estimate does
// the same for remat's own GPT): its parameters by block, and what one block
// saves for backward at this micro-batch, counted from the ops above.
remat::MemoryEstimateInputs cold_memory_inputs(const LlamaOptions& options, int64_t micro_batch);

}  // namespace llama
