// Tensor-parallel layers (Megatron's scheme) over a tensor-parallel group.
//
//   ColumnParallelLinear  weight rows (output features) split across ranks;
//                         input copied into the region, output kept split
//                         unless gather_output.
//   RowParallelLinear     weight columns (input features) split; the partial
//                         products are summed by an all-reduce, then the bias.
//   VocabParallelEmbedding  vocabulary rows split; each rank looks up its own
//                         rows, zeros elsewhere, and the sum is all-reduced
//                         (reduce-scattered along the sequence with
//                         sequence parallelism).
//   vocab_parallel_cross_entropy  the loss over vocabulary-split logits
//                         without gathering them.
//
// Weights and biases are initialised as LibTorch's plain layers initialise
// theirs (Linear: Kaiming-uniform weight, uniform bias; Embedding: N(0, 1)),
// drawn full size from the default generator on every rank, each rank
// keeping its shard (load_full_weight): a model built at any tensor-parallel
// size holds the same full weights and computes the same function. With a
// null group or a group of size 1 the layers are plain ones: the same draws,
// the same parameters and the same kernels as torch::nn::Linear and
// torch::nn::Embedding.
//
//   auto fc1 = ColumnParallelLinear(ParallelLinearOptions(d, 4 * d), layout.tp_group());
//   auto fc2 = RowParallelLinear(ParallelLinearOptions(4 * d, d).input_is_parallel(true), group);
//   y = fc2(at::gelu(fc1(x)));
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <utility>
#include <vector>

#include "parallel/mappings.h"
#include "parallel/tensor_split.h"

namespace remat::parallel {

struct ParallelLinearOptions {
  ParallelLinearOptions(int64_t in, int64_t out) : in_features_(in), out_features_(out) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // Column: all-gather the output to full width (else each rank keeps its share).
  TORCH_ARG(bool, gather_output) = false;
  // Column: the output features are `stride` equal blocks (q | k | v), each split
  // across ranks on its own, so that a rank holds its share of every block.
  TORCH_ARG(int64_t, stride) = 1;
  // Row: the input already arrives split along its last dimension.
  TORCH_ARG(bool, input_is_parallel) = false;
  // Sequence parallelism (mappings.h): outside the layer each rank holds 1/size
  // of the sequence along sequence_dim. Column: the input is all-gathered along
  // it (reduce-scattered backward) and only this rank's chunk is kept for the
  // backward; Row (which then needs input_is_parallel): the partial products are
  // reduce-scattered along it instead of all-reduced, and the replicated bias's
  // gradient is summed over the group.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
};

// What a sharded layer has in common: the full weight it is cut from and the
// parameters that differ across tensor-parallel ranks (the others are
// replicated, with equal gradients on every rank).
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  virtual std::vector<int64_t> full_weight_sizes() const = 0;
  // Keeps this rank's shard of `full` (same on every rank) as the weight.
  virtual void load_full_weight(const at::Tensor& full) = 0;
  // The full weight, gathered from every rank (collective over the group).
  virtual at::Tensor gather_full_weight() const = 0;
  // The whole tensor of which `shard` is this rank's share, for this module's
  // parameter `name` ("weight", "bias"): `shard` itself where the parameter
  // is replicated (collective over the group).
  virtual at::Tensor gather_full(const std::string& name, const at::Tensor& shard) const = 0;
  virtual std::vector<at::Tensor> sharded_parameters() const = 0;
  // How this module's parameter `name` ("weight", "bias") is split across the
  // group, whatever the group's size (tensor_split.h): the shard a rank holds
  // is share_of(whole, split_of(name), size, rank).
  virtual TensorSplit split_of(const std::string& name) const = 0;
};

class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  ColumnParallelLinearImpl(const ParallelLinearOptions& options, Group group);
  at::Tensor forward(const at::Tensor& x);

  std::vector<int64_t> full_weight_sizes() const override;
  void load_full_weight(const at::Tensor& full) override;
  at::Tensor gather_full_weight() const override;
  at::Tensor gather_full(const std::string& name, const at::Tensor& shard) const override;
  std::vector<at::Tensor> sharded_parameters() const override;
  TensorSplit split_of(const std::string& name) const override;
  int64_t local_out_features() const { return weight.size(0); }

  at::Tensor weight, bias;

 private:
  // This rank's rows of a tensor whose dim 0 has out_features rows.
  at::Tensor shard(const at::Tensor& full) const;

  ParallelLinearOptions options_;
  Group group_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  RowParallelLinearImpl(const ParallelLinearOptions& options, Group group);
  at::Tensor forward(const at::Tensor& x);

  std::vector<int64_t> full_weight_sizes() const override;
  void load_full_weight(const at::Tensor& full) override;
  at::Tensor gather_full_weight() const override;
  at::Tensor gather_full(const std::string& name, const at::Tensor& shard) const override;
  std::vector<at::Tensor> sharded_parameters() const override;
  TensorSplit split_of(const std::string& name) const override;

  at::Tensor weight, bias;  // the bias is replicated

 private:
  ParallelLinearOptions options_;
  Group group_;
};
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  // sequence_dim >= 0: sequence parallelism along that dimension of the ids.
  VocabParallelEmbeddingImpl(int64_t vocab_size, int64_t dim, Group group, int64_t sequence_dim = -1);
  // idx: token ids in [0, vocab_size). Returns [..., dim], the same on every
  // rank, or with sequence parallelism this rank's chunk of the sequence.
  at::Tensor forward(const at::Tensor& idx);

  std::vector<int64_t> full_weight_sizes() const override;
  void load_full_weight(const at::Tensor& full) override;
  at::Tensor gather_full_weight() const override;
  at::Tensor gather_full(const std::string& name, const at::Tensor& shard) const override;
  std::vector<at::Tensor> sharded_parameters() const override;
  TensorSplit split_of(const std::string& name) const override;
  Range vocab_range() const { return range_; }

  at::Tensor weight;

 private:
  int64_t vocab_size_, dim_, sequence_dim_;
  Range range_;
  Group group_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Per-token cross-entropy of logits split along the vocabulary: `logits` is
// [N, share] holding columns [vocab_start, vocab_start + share) of the full
// [N, vocab] logits, `target` [N] holds full-vocabulary ids. Returns [N] losses,
// the same on every rank; the gradient flows to each rank's share only.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        int64_t vocab_start, const Group& group);

// The parameters of `module` and its descendants that are sharded across the
// tensor-parallel group (weights of the layers above, column biases).
std::vector<at::Tensor> sharded_parameters(const torch::nn::Module& module);

// Every parameter of `module` by state-dict name, in named_parameters()
// order, with its split: a tensor-parallel layer's as split_of() says, any
// other parameter replicated at its own shape.
std::vector<std::pair<std::string, TensorSplit>> parameter_splits(const torch::nn::Module& module);

}  // namespace remat::parallel
