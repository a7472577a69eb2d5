#include "model.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "nn/module_call.h"

namespace llama {
namespace {

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
  auto fail = [](const std::string& what) { throw std::invalid_argument("Llama options: " + what); };
  if (vocab_size <= 0) fail("vocab_size must be > 0");
  if (n_layer <= 0) fail("n_layer (model.n_layer) must be > 0");
  if (n_head <= 0 || d_model % n_head != 0) fail("n_head (model.n_head) must divide d_model (model.d_model)");
  if ((d_model / n_head) % 2 != 0) fail("head_dim = d_model / n_head must be even (rotary pairs)");
  if (n_kv_head <= 0 || n_head % n_kv_head != 0) fail("n_kv_head (--kv-heads) must divide n_head (model.n_head)");
  if (lora_rank < 0) fail("lora_rank must be >= 0");
}

std::string LlamaOptions::to_string() const {
  std::ostringstream s;
  s << "llama(layers " << n_layer << ", heads " << n_head << " q / " << n_kv_head << " kv, d_model " << d_model
    << ", d_ff " << d_ff << ", vocab " << vocab_size << ", seq " << seq_len << ", dropout " << dropout;
  if (lora_rank > 0) s << ", lora rank " << lora_rank << " alpha " << lora_alpha;
  s << ")";
  return s.str();
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

LoraLinearImpl::LoraLinearImpl(int64_t in, int64_t out, int64_t rank, double alpha) {
  weight = register_parameter("weight", at::empty({out, in}).normal_(0.0, 0.02));
  if (rank > 0) {
    lora_a = register_parameter("lora_a", at::empty({rank, in}).normal_(0.0, 0.02));
    lora_b = register_parameter("lora_b", at::zeros({out, rank}));
    scale_ = alpha / static_cast<double>(rank);
  }
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::linear(x, weight);
  if (lora_a.defined()) y = y + at::linear(at::linear(x, lora_a), lora_b) * scale_;
  return y;
}

BlockImpl::BlockImpl(const LlamaOptions& o) : options_(o) {
  const int64_t head_dim = o.d_model / o.n_head;
  auto linear = [&](const char* name, int64_t in, int64_t out) {
    return register_module(name, LoraLinear(in, out, o.lora_rank, o.lora_alpha));
  };
  attn_norm_ = register_module("attn_norm", RMSNorm(o.d_model, o.norm_eps));
  wq_ = linear("wq", o.d_model, o.n_head * head_dim);
  wk_ = linear("wk", o.d_model, o.n_kv_head * head_dim);
  wv_ = linear("wv", o.d_model, o.n_kv_head * head_dim);
  wo_ = linear("wo", o.n_head * head_dim, o.d_model);
  mlp_norm_ = register_module("mlp_norm", RMSNorm(o.d_model, o.norm_eps));
  w1_ = linear("w1", o.d_model, o.d_ff);
  w3_ = linear("w3", o.d_model, o.d_ff);
  w2_ = linear("w2", o.d_ff, o.d_model);
}

at::Tensor BlockImpl::attention(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = options_.n_head, KV = options_.n_kv_head, D = options_.d_model / H;
  const auto [cosines, sines] = rotary_tables(T, D, options_.rope_theta, x.options());
  at::Tensor q = wq_->forward(x).view({B, T, H, D}).transpose(1, 2);
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
  at::Tensor y = at::matmul(at::dropout(at::softmax(scores, -1), p, p > 0), v);
  return wo_->forward(y.transpose(1, 2).contiguous().view({B, T, H * D}));
}

at::Tensor BlockImpl::mlp(const at::Tensor& x) {
  return w2_->forward(at::silu(w1_->forward(x)) * w3_->forward(x));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const double p = options_.dropout;
  at::Tensor h = x + at::dropout(attention(attn_norm_->forward(x)), p, is_training());
  return h + at::dropout(mlp(mlp_norm_->forward(h)), p, is_training());
}

LlamaImpl::LlamaImpl(const LlamaOptions& o) : options_(o) {
  o.validate();
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(o.vocab_size, o.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) blocks->push_back(Block(o));
  norm_ = register_module("norm", RMSNorm(o.d_model, o.norm_eps));
  // "lm_head": the name activation offloading recognises as the output head.
  lm_head_ = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(o.d_model, o.vocab_size).bias(false)));
  at::NoGradGuard no_grad;
  tok_emb_->weight.normal_(0.0, 0.02);
  lm_head_->weight.normal_(0.0, 0.02);
}

at::Tensor LlamaImpl::forward(const at::Tensor& idx) {
  const int64_t T = idx.size(1);
  if (T > options_.seq_len) {
    throw std::invalid_argument("Llama: a sequence of " + std::to_string(T) + " tokens is longer than seq_len " +
                                std::to_string(options_.seq_len));
  }
  at::Tensor x = at::dropout(tok_emb_->forward(idx), options_.dropout, is_training());
  // Through remat::forward: sharding, checkpointing and offloading attach here.
  for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
  return remat::forward(lm_head_, norm_->forward(x));
}

at::Tensor LlamaImpl::loss(const at::Tensor& idx, const at::Tensor& targets) {
  at::Tensor logits = forward(idx);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
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
