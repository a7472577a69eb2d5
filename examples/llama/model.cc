#include "model.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "nn/module_call.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"

namespace llama {
namespace tp = remat::parallel;
namespace {

// The model-parallel stream remat's engine seeds per tensor-parallel rank
// (train.seed + 2718 + tp rank) and checkpoint regions replay.
constexpr const char* kModelParallelRng = "model-parallel-rng";

// The values of `n` that split evenly over `parts` ranks, for error messages.
std::string multiples(int parts) {
  return std::to_string(parts) + ", " + std::to_string(2 * parts) + ", " + std::to_string(3 * parts) + ", ...";
}

// [T, head_dim / 2] cosines and sines of position t times each pair's frequency.
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t head_dim, double theta,
                                                const at::TensorOptions& options) {
  at::Tensor pairs = at::arange(0, head_dim, 2, options.dtype(at::kDouble));
  at::Tensor inv_freq = at::pow(theta, -pairs / static_cast<double>(head_dim));
  at::Tensor angles = at::outer(at::arange(T, options.dtype(at::kDouble)), inv_freq);
  return {at::cos(angles).to(options.dtype()), at::sin(angles).to(options.dtype())};
}

// Rotates each (first-half, second-half) pair of x [B, H, T, head_dim] by its angle.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cosines, const at::Tensor& sines) {
  auto halves = x.chunk(2, -1);
  const at::Tensor& x1 = halves[0];
  const at::Tensor& x2 = halves[1];
  return at::cat({x1 * cosines - x2 * sines, x2 * cosines + x1 * sines}, -1);
}

}  // namespace

void LlamaOptions::validate() const {
  auto fail = [](const std::string& what) { throw remat::ConfigError("Llama options: " + what); };
  if (vocab_size <= 0) fail("vocab_size must be > 0");
  if (n_layer <= 0) fail("n_layer (model.n_layer) must be > 0");
  if (n_head <= 0 || d_model % n_head != 0) fail("n_head (model.n_head) must divide d_model (model.d_model)");
  if ((d_model / n_head) % 2 != 0) fail("head_dim = d_model / n_head must be even (rotary pairs)");
  if (n_kv_head <= 0 || n_head % n_kv_head != 0) fail("n_kv_head (--kv-heads) must divide n_head (model.n_head)");
  if (lora_rank < 0) fail("lora_rank must be >= 0");
  // Tensor parallelism gives each rank whole heads (and with grouped-query
  // attention whole key/value heads with the query heads they serve).
  const int t = tp_size();
  auto split = [&](const char* what, int64_t n, const std::string& use) {
    if (n % t != 0) {
      fail(remat::str(what, " = ", n, " is not a multiple of tensor_parallel.size = ", t,
                      ": tensor parallelism gives each rank ", what, " / ", t, "; ", use,
                      "; or change tensor_parallel.size"));
    }
  };
  split("n_head (model.n_head)", n_head, "use a multiple of " + std::to_string(t) + " (" + multiples(t) + ")");
  split("d_ff (model.d_ff)", d_ff, "use a multiple of " + std::to_string(t) + " (" + multiples(t) + ")");
  // The key/value head counts that divide n_head and split over t ranks.
  std::string kv;
  for (int64_t k = t; k <= n_head; k += t) {
    if (n_head % k == 0) kv += (kv.empty() ? "" : ", ") + std::to_string(k);
  }
  split("n_kv_head (--kv-heads)", n_kv_head, "with n_head " + std::to_string(n_head) + " use --kv-heads " + kv);
  if (sequence_parallel_active() && seq_len % t != 0) {
    fail(remat::str("seq_len (model.seq_len) = ", seq_len, " is not a multiple of tensor_parallel.size = ", t,
                    ", which tensor_parallel.sequence_parallel splits it by (", multiples(t), ")"));
  }
}

std::string LlamaOptions::to_string() const {
  std::ostringstream s;
  s << "llama(layers " << n_layer << ", heads " << n_head << " q / " << n_kv_head << " kv, d_model " << d_model
    << ", d_ff " << d_ff << ", vocab " << vocab_size << ", seq " << seq_len << ", dropout " << dropout;
  if (lora_rank > 0) s << ", lora rank " << lora_rank << " alpha " << lora_alpha;
  s << ")";
  return s.str();
}

at::Tensor sequence_dropout(const at::Tensor& x, double p, bool train, const LlamaOptions& o) {
  if (!o.sequence_parallel_active() || !train || p == 0.0) return at::dropout(x, p, train);
  if (!o.replicated_sequence_dropout) {
    auto fork = remat::get_rng_tracker().fork(kModelParallelRng);
    return at::dropout(x, p, train);
  }
  // The whole sequence's mask as at::dropout draws it (ones, kept and scaled),
  // and this rank's rows of it: the masks of the run without sequence parallelism.
  auto sizes = x.sizes().vec();
  sizes[1] *= o.tp_size();
  at::Tensor mask;
  {
    at::NoGradGuard no_grad;
    at::Tensor whole = at::dropout(at::ones(sizes, x.options()), p, true);
    mask = whole.narrow(1, tp::group_rank(o.tensor_parallel) * x.size(1), x.size(1)).contiguous();
  }
  return x * mask;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, tp::Group sequence_parallel)
    : eps_(eps), sequence_parallel_(std::move(sequence_parallel)) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) *
         tp::copy_to_tensor_parallel_region(weight, sequence_parallel_);
}

LoraLinearImpl::LoraLinearImpl(const LoraLinearOptions& o) : options_(o) {
  const int64_t in = o.in_features(), out = o.out_features(), rank = o.rank();
  // Drawn whole on every rank, in the same order at every tp size.
  weight = register_parameter("weight", share(at::empty({out, in}).normal_(0.0, 0.02), "weight").clone());
  if (rank > 0) {
    lora_a = register_parameter("lora_a", share(at::empty({rank, in}).normal_(0.0, 0.02), "lora_a").clone());
    lora_b = register_parameter("lora_b", share(at::zeros({out, rank}), "lora_b").clone());
    scale_ = o.alpha() / static_cast<double>(rank);
  }
}

tp::TensorSplit LoraLinearImpl::split_of(const std::string& name) const {
  const int64_t in = options_.in_features(), out = options_.out_features(), r = options_.rank();
  const std::vector<int64_t> sizes = name == "lora_a" ? std::vector<int64_t>{r, in}
                                     : name == "lora_b" ? std::vector<int64_t>{out, r}
                                                        : std::vector<int64_t>{out, in};
  // Column: the output features (weight and B rows); row: the input features
  // (weight and A columns); the other adapter matrix is replicated.
  if (options_.split() == Split::kColumn && name != "lora_a") return {tp::SplitKind::kColumn, 0, 1, sizes};
  if (options_.split() == Split::kRow && name != "lora_b") return {tp::SplitKind::kRow, 1, 1, sizes};
  return tp::TensorSplit::replicated(sizes);
}

at::Tensor LoraLinearImpl::share(const at::Tensor& full, const std::string& name) const {
  return tp::share_of(full, split_of(name), tp::group_size(options_.group()), tp::group_rank(options_.group()));
}

std::vector<int64_t> LoraLinearImpl::full_weight_sizes() const {
  return {options_.out_features(), options_.in_features()};
}

void LoraLinearImpl::load_full_weight(const at::Tensor& full) {
  at::NoGradGuard no_grad;
  weight.copy_(share(full, "weight"));
}

at::Tensor LoraLinearImpl::gather_full_weight() const {
  return gather_full("weight", weight.detach());
}

at::Tensor LoraLinearImpl::gather_full(const std::string& name, const at::Tensor& shard) const {
  const tp::TensorSplit split = split_of(name);
  const auto& group = options_.group();
  if (split.kind == tp::SplitKind::kReplicated || tp::group_size(group) == 1) return shard;
  if (split.kind == tp::SplitKind::kColumn) return tp::all_gather_uneven(shard, 0, split.full_sizes[0], group);
  // Columns: gathered as the rows of the transposed shares.
  return tp::all_gather_uneven(shard.t(), 0, split.full_sizes[1], group).t().contiguous();
}

std::vector<at::Tensor> LoraLinearImpl::sharded_parameters() const {
  std::vector<at::Tensor> out;
  if (tp::group_size(options_.group()) == 1) return out;
  for (const auto& item : named_parameters(/*recurse=*/false)) {
    if (split_of(item.key()).kind != tp::SplitKind::kReplicated) out.push_back(item.value());
  }
  return out;
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  const auto& g = options_.group();
  const bool sp = options_.sequence_parallel() && tp::group_size(g) > 1;
  const bool lora = lora_a.defined();
  at::Tensor y, u;  // u: the adapter's x A^T, whole on every rank
  switch (options_.split()) {
    case Split::kNone:
      y = at::linear(x, weight);
      if (lora) u = at::linear(x, lora_a);
      break;
    case Split::kColumn:
      y = sp ? tp::linear_with_sequence_parallel_input(x, weight, at::Tensor(), g)
             : at::linear(tp::copy_to_tensor_parallel_region(x, g), weight);
      // x A^T enters the region as x does: its gradient, partial on each rank
      // (each holds some of B's rows), is summed over the group, so A's is whole.
      if (lora) {
        u = sp ? tp::gather_from_sequence_parallel_region(
                     at::linear(x, tp::copy_to_tensor_parallel_region(lora_a, g)), g)
               : tp::copy_to_tensor_parallel_region(at::linear(x, lora_a), g);
      }
      break;
    case Split::kRow:
      // x holds this rank's input features: partial products, summed.
      y = sp ? tp::reduce_scatter_to_sequence_parallel_region(at::linear(x, weight), g)
             : tp::reduce_from_tensor_parallel_region(at::linear(x, weight), g);
      if (lora) {
        u = sp ? tp::reduce_scatter_to_sequence_parallel_region(at::linear(x, lora_a), g)
               : tp::reduce_from_tensor_parallel_region(at::linear(x, lora_a), g);
      }
      break;
  }
  if (!lora) return y;
  // With sequence parallelism after a row-parallel layer, u holds this rank's
  // tokens: B's gradient is summed over the group.
  const at::Tensor b = sp && options_.split() == Split::kRow ? tp::copy_to_tensor_parallel_region(lora_b, g) : lora_b;
  return y + at::linear(u, b) * scale_;
}

BlockImpl::BlockImpl(const LlamaOptions& o) : options_(o), tp_(o.tp_size()) {
  const int64_t head_dim = o.d_model / o.n_head;
  const bool sp = o.sequence_parallel_active();
  auto linear = [&](const char* name, int64_t in, int64_t out, Split split) {
    return register_module(name, LoraLinear(LoraLinearOptions(in, out)
                                                .rank(o.lora_rank)
                                                .alpha(o.lora_alpha)
                                                .split(split)
                                                .group(o.tensor_parallel)
                                                .sequence_parallel(sp)));
  };
  const tp::Group norm_group = sp ? o.tensor_parallel : nullptr;
  attn_norm_ = register_module("attn_norm", RMSNorm(o.d_model, o.norm_eps, norm_group));
  wq_ = linear("wq", o.d_model, o.n_head * head_dim, Split::kColumn);
  wk_ = linear("wk", o.d_model, o.n_kv_head * head_dim, Split::kColumn);
  wv_ = linear("wv", o.d_model, o.n_kv_head * head_dim, Split::kColumn);
  wo_ = linear("wo", o.n_head * head_dim, o.d_model, Split::kRow);
  mlp_norm_ = register_module("mlp_norm", RMSNorm(o.d_model, o.norm_eps, norm_group));
  w1_ = linear("w1", o.d_model, o.d_ff, Split::kColumn);
  w3_ = linear("w3", o.d_model, o.d_ff, Split::kColumn);
  w2_ = linear("w2", o.d_ff, o.d_model, Split::kRow);
}

at::Tensor BlockImpl::attention(const at::Tensor& x) {
  // This rank's heads: n_head / t query heads and the n_kv_head / t key/value
  // heads they use (query head h reads key/value head h / (n_head / n_kv_head),
  // so a rank's query heads find theirs on the same rank).
  const int64_t H = options_.n_head / tp_, KV = options_.n_kv_head / tp_, D = options_.d_model / options_.n_head;
  at::Tensor q = wq_->forward(x);  // the whole sequence, also with sequence parallelism
  const int64_t B = q.size(0), T = q.size(1);
  const auto [cosines, sines] = rotary_tables(T, D, options_.rope_theta, x.options());
  q = q.view({B, T, H, D}).transpose(1, 2);
  at::Tensor k = wk_->forward(x).view({B, T, KV, D}).transpose(1, 2);
  at::Tensor v = wv_->forward(x).view({B, T, KV, D}).transpose(1, 2);
  q = apply_rotary(q, cosines, sines);
  k = apply_rotary(k, cosines, sines);
  // Grouped-query attention: each key/value head serves H / KV query heads.
  if (KV != H) {
    k = k.repeat_interleave(H / KV, /*dim=*/1);
    v = v.repeat_interleave(H / KV, /*dim=*/1);
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
  at::Tensor future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  const double p = is_training() ? options_.dropout : 0.0;
  // Heads differ across tensor-parallel ranks, so do their dropout masks: the
  // tracked model-parallel stream, which checkpoint regions replay.
  std::optional<remat::RNGStatesTracker::ForkGuard> fork;
  if (tp_ > 1) fork.emplace(remat::get_rng_tracker().fork(kModelParallelRng));
  at::Tensor y = at::matmul(at::dropout(at::softmax(scores, -1), p, p > 0), v);
  fork.reset();
  return wo_->forward(y.transpose(1, 2).contiguous().view({B, T, H * D}));
}

at::Tensor BlockImpl::mlp(const at::Tensor& x) {
  return w2_->forward(at::silu(w1_->forward(x)) * w3_->forward(x));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const double p = options_.dropout;
  const bool train = is_training();
  at::Tensor h = x + sequence_dropout(attention(attn_norm_->forward(x)), p, train, options_);
  return h + sequence_dropout(mlp(mlp_norm_->forward(h)), p, train, options_);
}

LlamaImpl::LlamaImpl(const LlamaOptions& o) : options_(o) {
  o.validate();
  const bool sp = o.sequence_parallel_active();
  tok_emb_ = register_module("tok_emb", tp::VocabParallelEmbedding(o.vocab_size, o.d_model, o.tensor_parallel,
                                                                  /*sequence_dim=*/sp ? 1 : -1));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) blocks->push_back(Block(o));
  norm_ = register_module("norm", RMSNorm(o.d_model, o.norm_eps, sp ? o.tensor_parallel : nullptr));
  // "lm_head": the name activation offloading recognises as the output head.
  lm_head_ = register_module(
      "lm_head",
      tp::ColumnParallelLinear(tp::ParallelLinearOptions(o.d_model, o.vocab_size).bias(false).sequence_parallel(sp),
                               o.tensor_parallel));
  // The layers drew LibTorch's initialisation; these weights are N(0, 0.02),
  // drawn whole (the same at every tensor-parallel size).
  at::NoGradGuard no_grad;
  tok_emb_->load_full_weight(at::empty({o.vocab_size, o.d_model}).normal_(0.0, 0.02));
  lm_head_->load_full_weight(at::empty({o.vocab_size, o.d_model}).normal_(0.0, 0.02));
}

at::Tensor LlamaImpl::logits_share(const at::Tensor& idx) {
  const int64_t T = idx.size(1);
  if (T > options_.seq_len) {
    throw remat::ConfigError("Llama: a sequence of " + std::to_string(T) + " tokens is longer than seq_len " +
                             std::to_string(options_.seq_len));
  }
  if (options_.sequence_parallel_active()) {
    tp::check_sequence_split(T, options_.tensor_parallel, "a sequence of " + std::to_string(T) + " tokens");
  }
  // With sequence parallelism the embedding's partial lookups are
  // reduce-scattered: from here to the head each rank holds its tokens.
  at::Tensor x = sequence_dropout(tok_emb_->forward(idx), options_.dropout, is_training(), options_);
  // Through remat::forward: sharding, checkpointing and offloading attach here.
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return remat::forward(lm_head_, norm_->forward(x));
}

at::Tensor LlamaImpl::forward(const at::Tensor& idx) {
  return tp::gather_from_tensor_parallel_region(logits_share(idx), options_.tensor_parallel, options_.vocab_size);
}

at::Tensor LlamaImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  at::Tensor logits = logits_share(idx);
  if (options_.tp_size() == 1) {
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }
  // Over the vocabulary-split logits, without gathering them.
  const tp::Range vocab = tp::partition_range(options_.vocab_size, options_.tp_size(),
                                              tp::group_rank(options_.tensor_parallel));
  return tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), vocab.start,
                                          options_.tensor_parallel)
      .mean();
}

std::pair<int64_t, int64_t> LlamaImpl::freeze_base() {
  int64_t trainable = 0, frozen = 0;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    const bool adapter = name.size() > 7 && (name.rfind(".lora_a") == name.size() - 7 ||
                                             name.rfind(".lora_b") == name.size() - 7);
    item.value().set_requires_grad(adapter);
    (adapter ? trainable : frozen) += item.value().numel();
  }
  return {trainable, frozen};
}

remat::MemoryEstimateInputs cold_memory_inputs(const LlamaOptions& o, int64_t micro_batch) {
  const int64_t C = o.d_model, H = o.n_head, KV = o.n_kv_head, D = C / H, F = o.d_ff, V = o.vocab_size;
  const bool lora = o.lora_rank > 0;
  std::vector<remat::ParameterSize> params;
  // A LoRA model trains its adapters alone (freeze_base).
  auto linear = [&](int64_t in, int64_t out, int unit) {
    params.push_back({in * out, !lora, unit});
    if (lora) {
      params.push_back({o.lora_rank * in, true, unit});
      params.push_back({out * o.lora_rank, true, unit});
    }
  };
  params.push_back({V * C, !lora, -1});  // tok_emb
  for (int u = 0; u < o.n_layer; ++u) {
    params.push_back({C, !lora, u});  // attn_norm
    linear(C, H * D, u), linear(C, KV * D, u), linear(C, KV * D, u), linear(H * D, C, u);
    params.push_back({C, !lora, u});  // mlp_norm
    linear(C, F, u), linear(C, F, u), linear(F, C, u);
  }
  params.push_back({C, !lora, -1});  // norm
  params.push_back({C * V, !lora, -1});  // lm_head
  // Float32 bytes a block saves (B batch, T time): per RMSNorm x*rsqrt, its
  // output and the rsqrt (BT); q and k before rotary (k at KV/H of the
  // width), q after it, k and v as the attention's matmuls see them; the
  // softmax output, its dropout mask and output (BHTT, ATen's CPU dropout
  // keeping a float mask), the causal mask (TT bools); the attention output
  // into wo; both residual dropouts' masks and the residual h; w1's and w3's
  // outputs, SiLU's and the product into w2 (BTF).
  const double B = static_cast<double>(micro_batch), T = static_cast<double>(o.seq_len);
  const double r = static_cast<double>(KV) / static_cast<double>(H), btc = B * T * C, bt = B * T;
  const double bhtt = B * H * T * T, btf = B * T * F;
  const double kv_saved = KV == H ? 0 : r;  // k before the repeat, when there is one
  remat::BlockActivationBytes bytes;
  bytes.boundary = static_cast<int64_t>(4 * btc);
  bytes.saved = static_cast<int64_t>(4 * ((12 + kv_saved) * btc + 2 * bt + 3 * bhtt + 4 * btf) + T * T);
  // The projections' outputs: wq, wk, wv, wo, w1, w3, w2.
  bytes.selective_op = static_cast<int64_t>(4 * ((3 + 2 * r) * btc + 2 * btf));
  // The token ids and the embedding's dropout mask; the final norm, the
  // log-softmax output and the targets.
  bytes.embedding = static_cast<int64_t>(8 * bt + 4 * btc);
  bytes.ends = bytes.embedding + static_cast<int64_t>(4 * (2 * btc + bt + B * T * V) + 8 * bt);
  return remat::cold_inputs(std::move(params), static_cast<int>(o.n_layer), bytes);
}

}  // namespace llama
