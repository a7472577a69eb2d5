#include "parallel/layers.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <cmath>
#include <map>

#include "runtime/communicator.h"
#include "runtime/error.h"

namespace remat::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_full(const at::Tensor& full, const std::vector<int64_t>& want, const char* layer) {
  if (full.sizes().vec() != want) {
    throw Error(str(layer, ": load_full_weight got a ", full.sizes(), " tensor; the full weight is ",
                    c10::IntArrayRef(want)));
  }
}

// torch::nn::Linear's initialisation of the full weight and bias, drawn from
// the default generator in the same order, so that at size 1 the layers draw
// exactly what a plain Linear draws.
at::Tensor draw_linear_weight(const ParallelLinearOptions& o) {
  at::Tensor full = at::empty({o.out_features(), o.in_features()});
  torch::nn::init::kaiming_uniform_(full, std::sqrt(5.0));
  return full;
}

at::Tensor draw_linear_bias(const ParallelLinearOptions& o) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(o.in_features()));
  at::Tensor full = at::empty({o.out_features()});
  torch::nn::init::uniform_(full, -bound, bound);
  return full;
}

}  // namespace

// --- ColumnParallelLinear ---------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ParallelLinearOptions& o, Group group)
    : options_(o), group_(std::move(group)) {
  REMAT_CHECK_GE(o.stride(), 1, "ColumnParallelLinear stride");
  if (o.out_features() % o.stride() != 0) {
    throw Error(str("ColumnParallelLinear: out_features ", o.out_features(),
                    " is not a multiple of stride ", o.stride()));
  }
  if (o.gather_output() && o.stride() > 1 && group_size(group_) > 1) {
    throw Error("ColumnParallelLinear: gather_output with stride > 1 would interleave the "
                "blocks; gather each block's output instead");
  }
  weight = register_parameter("weight", shard(at::empty({o.out_features(), o.in_features()})).clone());
  if (o.bias()) bias = register_parameter("bias", shard(at::empty({o.out_features()})).clone());
  torch::NoGradGuard no_grad;
  at::Tensor full = draw_linear_weight(o);
  load_full_weight(full);
  if (bias.defined()) bias.copy_(shard(draw_linear_bias(o)));
}

at::Tensor ColumnParallelLinearImpl::shard(const at::Tensor& full) const {
  return share_of(full, split_of(full.dim() == 1 ? "bias" : "weight"), group_size(group_), group_rank(group_));
}

TensorSplit ColumnParallelLinearImpl::split_of(const std::string& name) const {
  // Weight rows and bias entries are split alike.
  std::vector<int64_t> sizes{options_.out_features()};
  if (name != "bias") sizes.push_back(options_.in_features());
  return {SplitKind::kColumn, 0, options_.stride(), sizes};
}

std::vector<int64_t> ColumnParallelLinearImpl::full_weight_sizes() const {
  return {options_.out_features(), options_.in_features()};
}

void ColumnParallelLinearImpl::load_full_weight(const at::Tensor& full) {
  check_full(full, full_weight_sizes(), "ColumnParallelLinear");
  torch::NoGradGuard no_grad;
  weight.copy_(shard(full));
}

at::Tensor ColumnParallelLinearImpl::gather_full_weight() const {
  return all_gather_uneven(weight.detach(), 0, options_.out_features(), group_, options_.stride());
}

at::Tensor ColumnParallelLinearImpl::gather_full(const std::string& /*name*/, const at::Tensor& shard) const {
  // Weight rows and bias entries are split alike.
  if (group_size(group_) == 1) return shard;
  return all_gather_uneven(shard, 0, options_.out_features(), group_, options_.stride());
}

std::vector<at::Tensor> ColumnParallelLinearImpl::sharded_parameters() const {
  if (group_size(group_) == 1) return {};
  std::vector<at::Tensor> out{weight};
  if (bias.defined()) out.push_back(bias);
  return out;
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = options_.sequence_parallel()
                     ? linear_with_sequence_parallel_input(x, weight, bias, group_, options_.sequence_dim())
                     : torch::nn::functional::linear(copy_to_tensor_parallel_region(x, group_), weight, bias);
  if (options_.gather_output()) y = gather_from_tensor_parallel_region(y, group_, options_.out_features());
  return y;
}

// --- RowParallelLinear ------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(const ParallelLinearOptions& o, Group group)
    : options_(o), group_(std::move(group)) {
  if (o.sequence_parallel() && !o.input_is_parallel() && group_size(group_) > 1) {
    throw Error("RowParallelLinear: sequence_parallel takes an input split along its last dimension "
                "(the output of a ColumnParallelLinear): set input_is_parallel(true)");
  }
  Range range = partition_range(o.in_features(), group_size(group_), group_rank(group_));
  weight = register_parameter("weight", at::empty({o.out_features(), range.length}));
  if (o.bias()) bias = register_parameter("bias", at::empty({o.out_features()}));
  torch::NoGradGuard no_grad;
  load_full_weight(draw_linear_weight(o));
  if (bias.defined()) bias.copy_(draw_linear_bias(o));
}

std::vector<int64_t> RowParallelLinearImpl::full_weight_sizes() const {
  return {options_.out_features(), options_.in_features()};
}

void RowParallelLinearImpl::load_full_weight(const at::Tensor& full) {
  check_full(full, full_weight_sizes(), "RowParallelLinear");
  torch::NoGradGuard no_grad;
  weight.copy_(share_of(full, split_of("weight"), group_size(group_), group_rank(group_)));
}

TensorSplit RowParallelLinearImpl::split_of(const std::string& name) const {
  if (name == "bias") return TensorSplit::replicated({options_.out_features()});
  return {SplitKind::kRow, 1, 1, full_weight_sizes()};
}

at::Tensor RowParallelLinearImpl::gather_full_weight() const {
  // Columns: gather the transposed shards as rows.
  return all_gather_uneven(weight.detach().t(), 0, options_.in_features(), group_).t().contiguous();
}

at::Tensor RowParallelLinearImpl::gather_full(const std::string& name, const at::Tensor& shard) const {
  if (name != "weight" || group_size(group_) == 1) return shard;  // the bias is replicated
  return all_gather_uneven(shard.t(), 0, options_.in_features(), group_).t().contiguous();
}

std::vector<at::Tensor> RowParallelLinearImpl::sharded_parameters() const {
  if (group_size(group_) == 1) return {};
  return {weight};
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor xp = options_.input_is_parallel() ? x : scatter_to_tensor_parallel_region(x, group_);
  if (xp.size(-1) != weight.size(1)) {
    throw Error(str("RowParallelLinear: input has ", xp.size(-1),
                    " features on this rank but the weight's share expects ", weight.size(1),
                    " (in_features ", options_.in_features(), " over ", group_size(group_),
                    " ranks)"));
  }
  if (group_size(group_) == 1) return torch::nn::functional::linear(xp, weight, bias);
  if (options_.sequence_parallel()) {
    at::Tensor y = reduce_scatter_to_sequence_parallel_region(torch::nn::functional::linear(xp, weight), group_,
                                                              options_.sequence_dim());
    // Each rank adds the bias to its own tokens: the gradients are summed over the group.
    return bias.defined() ? y + copy_to_tensor_parallel_region(bias, group_) : y;
  }
  at::Tensor y = reduce_from_tensor_parallel_region(torch::nn::functional::linear(xp, weight), group_);
  return bias.defined() ? y + bias : y;
}

// --- VocabParallelEmbedding -------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab_size, int64_t dim, Group group,
                                                       int64_t sequence_dim)
    : vocab_size_(vocab_size), dim_(dim), sequence_dim_(sequence_dim), group_(std::move(group)) {
  range_ = partition_range(vocab_size, group_size(group_), group_rank(group_));
  weight = register_parameter("weight", at::empty({range_.length, dim}));
  // torch::nn::Embedding's initialisation, drawn full size.
  torch::NoGradGuard no_grad;
  at::Tensor full = at::empty({vocab_size, dim});
  torch::nn::init::normal_(full);
  load_full_weight(full);
}

std::vector<int64_t> VocabParallelEmbeddingImpl::full_weight_sizes() const {
  return {vocab_size_, dim_};
}

void VocabParallelEmbeddingImpl::load_full_weight(const at::Tensor& full) {
  check_full(full, full_weight_sizes(), "VocabParallelEmbedding");
  torch::NoGradGuard no_grad;
  weight.copy_(share_of(full, split_of("weight"), group_size(group_), group_rank(group_)));
}

TensorSplit VocabParallelEmbeddingImpl::split_of(const std::string& /*name*/) const {
  return {SplitKind::kVocabulary, 0, 1, full_weight_sizes()};
}

at::Tensor VocabParallelEmbeddingImpl::gather_full_weight() const {
  return all_gather_uneven(weight.detach(), 0, vocab_size_, group_);
}

at::Tensor VocabParallelEmbeddingImpl::gather_full(const std::string& /*name*/, const at::Tensor& shard) const {
  if (group_size(group_) == 1) return shard;
  return all_gather_uneven(shard, 0, vocab_size_, group_);
}

std::vector<at::Tensor> VocabParallelEmbeddingImpl::sharded_parameters() const {
  if (group_size(group_) == 1) return {};
  return {weight};
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& idx) {
  if (group_size(group_) == 1) return at::embedding(weight, idx);
  at::Tensor outside = (idx < range_.start).logical_or(idx >= range_.start + range_.length);
  at::Tensor local = (idx - range_.start).masked_fill(outside, 0);
  at::Tensor out = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  if (sequence_dim_ >= 0) return reduce_scatter_to_sequence_parallel_region(out, group_, sequence_dim_);
  return reduce_from_tensor_parallel_region(out, group_);
}

// --- vocab_parallel_cross_entropy -------------------------------------------

namespace {

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, int64_t vocab_start, Group group) {
    at::Tensor x = logits.detach();
    at::Tensor max = std::get<0>(x.max(-1));
    group->allReduce(max, {ReduceOp::kMax})->wait();
    at::Tensor shifted = x - max.unsqueeze(-1);
    const int64_t share = x.size(-1);
    at::Tensor outside = (target < vocab_start).logical_or(target >= vocab_start + share);
    at::Tensor local = (target - vocab_start).masked_fill(outside, 0);
    at::Tensor predicted =
        shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = exp.sum(-1);
    // One all-reduce for both sums.
    at::Tensor sums = at::stack({predicted, sum_exp});
    group->allReduce(sums)->wait();
    at::Tensor loss = sums[1].log() - sums[0];
    exp.div_(sums[1].unsqueeze(-1));  // softmax of this rank's share
    ctx->save_for_backward({exp, local, outside});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    at::Tensor inside = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(-1, saved[1].unsqueeze(-1), -inside.unsqueeze(-1));
    grad.mul_(grads[0].unsqueeze(-1));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        int64_t vocab_start, const Group& group) {
  REMAT_CHECK_EQ(logits.dim(), 2, "vocab_parallel_cross_entropy: logits must be [N, share]");
  REMAT_CHECK_EQ(target.dim(), 1, "vocab_parallel_cross_entropy: target must be [N]");
  REMAT_CHECK_EQ(logits.size(0), target.size(0), "vocab_parallel_cross_entropy: N");
  if (group_size(group) == 1) {
    return at::cross_entropy_loss(logits, target, {}, at::Reduction::None);
  }
  return VocabParallelCrossEntropy::apply(logits, target, vocab_start, group);
}

// --- helpers ----------------------------------------------------------------

std::vector<at::Tensor> sharded_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* tp = dynamic_cast<const TensorParallelModule*>(m.get())) {
      for (auto& p : tp->sharded_parameters()) out.push_back(p);
    }
  }
  return out;
}

std::vector<std::pair<std::string, TensorSplit>> parameter_splits(const torch::nn::Module& module) {
  std::map<std::string, const TensorParallelModule*> layers;
  for (const auto& item : module.named_modules()) {
    if (auto* tp = dynamic_cast<const TensorParallelModule*>(item.value().get())) layers[item.key()] = tp;
  }
  std::vector<std::pair<std::string, TensorSplit>> out;
  for (const auto& item : module.named_parameters()) {
    const std::string& name = item.key();
    const auto dot = name.rfind('.');
    auto layer = layers.find(dot == std::string::npos ? std::string() : name.substr(0, dot));
    out.emplace_back(name, layer != layers.end() ? layer->second->split_of(name.substr(dot + 1))
                                                 : TensorSplit::replicated(item.value().sizes().vec()));
  }
  return out;
}

}  // namespace remat::parallel
