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
//
// Tensor parallelism (LlamaOptions::tensor_parallel, a group of size t > 1),
// Megatron's split written on remat's public parallel/ API: wq, wk, wv and the
// MLP's gate and up projections are column-parallel (each rank holds
// n_head / t query heads, n_kv_head / t key/value heads, d_ff / t hidden
// units), wo and the down projection row-parallel; the token embedding is
// vocabulary-parallel and the head column-parallel into remat's
// vocabulary-parallel loss. RMSNorm and the rotary tables are replicated.
// Dropout on the attention weights (split by heads) draws from the tracked
// RNG's model-parallel stream, the rest from the default generator, the same
// on every rank. With sequence_parallel the RMSNorm, dropout and residual
// regions hold 1/t of the sequence (docs/parallel.md).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/memory_estimate.h"
#include "parallel/layers.h"

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
  // The tensor-parallel group (layout->tp_group()); null or size 1: none.
  remat::parallel::Group tensor_parallel;
  // tensor_parallel.sequence_parallel: between the parallel layers each rank
  // holds 1/t of the sequence (seq_len a multiple of t).
  bool sequence_parallel = false;
  // tensor_parallel.sequence_parallel_dropout "replicated": the sequence-parallel
  // regions' dropout draws the whole sequence's mask from the default
  // generator and keeps this rank's rows (else each rank's own stream).
  bool replicated_sequence_dropout = false;

  int tp_size() const { return remat::parallel::group_size(tensor_parallel); }
  bool sequence_parallel_active() const { return sequence_parallel && tp_size() > 1; }
  // Throws remat::ConfigError naming the option that is wrong (and, with
  // tensor parallelism, the values that split evenly).
  void validate() const;
  // The shape (not the parallel layout: a save resumes at another tp size).
  std::string to_string() const;
};

// With a sequence-parallel group, x is this rank's tokens: the (replicated)
// weight enters through copy_to_tensor_parallel_region, so its gradient is
// summed over the group's tokens.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, remat::parallel::Group sequence_parallel = nullptr);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;

 private:
  double eps_;
  remat::parallel::Group sequence_parallel_;
};
TORCH_MODULE(RMSNorm);

enum class Split { kNone, kColumn, kRow };

struct LoraLinearOptions {
  LoraLinearOptions(int64_t in, int64_t out) : in_features_(in), out_features_(out) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(int64_t, rank) = 0;  // adapters' rank; 0: none
  TORCH_ARG(double, alpha) = 8.0;
  // kColumn: output features split (the input replicated, or with
  // sequence_parallel this rank's tokens, all-gathered); kRow: input features
  // split (the input is a column-parallel layer's output), partial products
  // all-reduced (reduce-scattered along the sequence with sequence_parallel).
  TORCH_ARG(Split, split) = Split::kNone;
  TORCH_ARG(remat::parallel::Group, group) = nullptr;
  TORCH_ARG(bool, sequence_parallel) = false;
};

// A bias-free linear layer with optional LoRA adapters, split across a
// tensor-parallel group as LoraLinearOptions::split says. On a column-parallel
// layer A is replicated and B split along the output; on a row-parallel one A
// is split along the input and B replicated: the adapter's rank-r
// activations x A^T are whole on every rank between the two. The replicated
// adapter's gradient equals on every rank (summed over the group where each
// rank saw other tokens or other features). Full tensors are drawn on every
// rank and each keeps its share, so the model is the same at any tp size.
// It implements remat's TensorParallelModule, which is how the engine learns
// the splits (gradient norm, saves, export).
class LoraLinearImpl : public torch::nn::Module, public remat::parallel::TensorParallelModule {
 public:
  explicit LoraLinearImpl(const LoraLinearOptions& options);
  at::Tensor forward(const at::Tensor& x);

  std::vector<int64_t> full_weight_sizes() const override;
  void load_full_weight(const at::Tensor& full) override;
  at::Tensor gather_full_weight() const override;
  at::Tensor gather_full(const std::string& name, const at::Tensor& shard) const override;
  std::vector<at::Tensor> sharded_parameters() const override;
  remat::parallel::TensorSplit split_of(const std::string& name) const override;

  at::Tensor weight;            // [out, in], the base weight (this rank's share)
  at::Tensor lora_a, lora_b;    // [rank, in], [out, rank]; undefined with rank 0

 private:
  at::Tensor share(const at::Tensor& full, const std::string& name) const;

  LoraLinearOptions options_;
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
  int tp_ = 1;
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

  // idx: [batch, time] token ids. Returns logits [batch, time, vocab] (gathered
  // across the tensor-parallel group).
  at::Tensor forward(const at::Tensor& idx);
  // Mean next-token cross-entropy.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets);

  // LoRA fine-tuning: every parameter but the adapters stops requiring grad.
  // Returns (trainable, frozen) element counts.
  std::pair<int64_t, int64_t> freeze_base();

  const LlamaOptions& options() const { return options_; }

  torch::nn::ModuleList blocks{nullptr};

 private:
  // This rank's vocabulary share of the logits, [batch, time, vocab / t].
  at::Tensor logits_share(const at::Tensor& idx);

  LlamaOptions options_;
  remat::parallel::VocabParallelEmbedding tok_emb_{nullptr};
  RMSNorm norm_{nullptr};
  remat::parallel::ColumnParallelLinear lm_head_{nullptr};
};
TORCH_MODULE(Llama);

// Dropout of activations split along the sequence (sequence parallelism): each
// rank's own stream (the tracked RNG's model-parallel state), or with
// replicated_sequence_dropout this rank's rows of the whole sequence's mask;
// elsewhere at::dropout from the default generator.
at::Tensor sequence_dropout(const at::Tensor& x, double p, bool train, const LlamaOptions& options);

// What remat's cold memory estimate needs of this model (remat-estimate does
// the same for remat's own GPT): its parameters by block, and what one block
// saves for backward at this micro-batch, counted from the ops above, at
// tensor-parallel size 1.
remat::MemoryEstimateInputs cold_memory_inputs(const LlamaOptions& options, int64_t micro_batch);

}  // namespace llama
