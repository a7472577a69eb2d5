// The estimator's inputs (engine/memory_estimate.h): a model's parameters
// and per-block activation costs, cold from its architecture's sizes (the
// GPT's, or any block's saved bytes) or live from a profiled step.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/memory_estimate.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace remat {

MemoryEstimateInputs cold_gpt_inputs(const Config& config, int64_t vocab_size, int64_t micro_batch,
                                     c10::DeviceType device) {
  const auto& m = config.model;
  const int64_t tp = config.tensor_parallel.size;
  const int64_t B = micro_batch, T = m.seq_len, C = m.d_model, H = m.n_head / tp, F = m.d_ff / tp, V = vocab_size,
                L = m.n_layer;
  MemoryEstimateInputs in;
  // Parameters (models/gpt.h): the embeddings, per block LayerNorms, qkv,
  // proj, fc1, fc2 (the column-parallel ones split over tp), ln_f and head.
  // Those split over tp (split) stage 3 flattens apart from the replicated ones.
  const bool split = tp > 1;
  auto add = [&](int64_t numel, int unit, bool sharded = false) {
    in.parameters.push_back({numel, true, unit, sharded && split});
  };
  add((V + tp - 1) / tp * C, -1, true);
  add(T * C, -1);
  for (int u = 0; u < L; ++u) {
    add(C, u), add(C, u);                                  // ln1
    add(C * 3 * C / tp, u, true), add(3 * C / tp, u, true);  // qkv
    add(C / tp * C, u, true), add(C, u);                   // proj
    add(C, u), add(C, u);                                  // ln2
    add(C * F, u, true), add(F, u, true);                  // fc1
    add(F * C, u, true), add(C, u);                        // fc2
  }
  add(C, -1), add(C, -1);                                  // ln_f
  add(C * ((V + tp - 1) / tp), -1, true);                  // head
  // Activations, float32, per block (B batch, T time, C width, H heads and F
  // MLP width on this rank): LayerNorm outputs and statistics, q|k|v, the
  // softmax output and the dropped-out probabilities, the attention output,
  // the residual, fc1 and GELU outputs, and the dropout masks (ATen's CPU
  // dropout keeps float32 masks of the input's size). selective_op keeps the
  // projections' outputs; a full checkpoint its input alone.
  // In double, saturated: absurd sizes give absurd estimates, not overflows.
  // With sequence parallelism what lies between the tensor-parallel layers
  // (LayerNorm outputs and statistics, the residual and its dropout masks,
  // the block's input and output) is 1/tp of the sequence on each rank.
  const double b = static_cast<double>(B), t = static_cast<double>(T), btc = b * t * C, bhtt = b * H * t * t,
               btf = b * t * F;
  const double sp = config.tensor_parallel.sequence_parallel_active() ? static_cast<double>(tp) : 1.0;
  auto bytes_of = [](double x) { return static_cast<int64_t>(std::min(x, 0x1p50)); };
  // Bytes per activation element: bf16 or fp16 computes in 16 bits, its
  // saved tensors and dropout masks included; the loss is float32 either way.
  const bool half = config.bf16.enabled || config.fp16.enabled;
  const double a = half ? 2 : 4;
  // The attention's scores, probabilities and mask, and its q, k, v: float32
  // where LibTorch's attention computes reduced precision in float32.
  const double att = half && REMAT_SDPA_MATH_UPCASTS ? 4 : a;
  const int64_t block = bytes_of(a * ((3 * btc + 4 * b * t) / sp + 4 * btc + 2 * btf) + att * 3 * bhtt +
                                 (att - a) * 3 * btc + a * 2 * btc / sp);
  const int64_t boundary = bytes_of(a * btc / sp);
  const int64_t kept = bytes_of(a * (3 * btc + btc / sp + btf + btc / sp));
  // The embeddings (ids, dropout mask) and the head (the last output, ln_f
  // statistics and output, the log-softmax output in float32).
  const int64_t ends =
      bytes_of(8 * (b * t + t) + a * btc / sp + a * (btc + 2 * b * t + btc) / sp + 4 * b * t * V);
  BlockActivationBytes bytes;
  bytes.boundary = boundary;
  bytes.saved = block;
  bytes.selective_op = kept;
  bytes.embedding = bytes_of(8 * (b * t + t) + a * btc / sp);
  // save_collectives: per block two all-reduces' outputs, or with sequence
  // parallelism two all-gathers' (the whole sequence) and two reduce-scatters'.
  if (config.activation_checkpointing.save_collectives && tp > 1) {
    bytes.checkpoint_kept = bytes_of(a * (2 * btc + (sp > 1 ? 2 * btc / sp : 0)));
  }
  bytes.ends = ends;
  bytes.head_backward = bytes_of(2 * 4 * b * t * V);
  return cold_inputs(std::move(in.parameters), static_cast<int>(L), bytes, device);
}

MemoryEstimateInputs cold_inputs(std::vector<ParameterSize> parameters, int n_blocks,
                                 const BlockActivationBytes& bytes, c10::DeviceType device) {
  REMAT_CHECK(n_blocks > 0, "memory estimate: the model has no blocks");
  MemoryEstimateInputs in;
  in.mode = "cold";
  in.parameters = std::move(parameters);
  in.gradients_in_activations = false;
  in.host_is_device = device == c10::DeviceType::CPU;  // on a GPU the host copies are apart
  const int64_t boundary = bytes.boundary, block = bytes.saved, kept = bytes.selective_op;
  BlockCosts& c = in.activations;
  c.choices = {BlockChoice::kKeep, BlockChoice::kSelectiveOp, BlockChoice::kFull, BlockChoice::kFullOffload,
               BlockChoice::kOffloadActivations};
  for (int i = 0; i < n_blocks; ++i) {
    std::vector<ChoiceCost> row(5);
    row[0].held_bytes = boundary + block;
    row[1].held_bytes = boundary + kept + bytes.checkpoint_kept;
    row[2].held_bytes = boundary + bytes.checkpoint_kept;
    // The input moves to the host: cpu_checkpointing's host copy is made
    // through c10's allocator, so on a CPU model it is counted where it was.
    row[3].held_bytes = bytes.checkpoint_kept + (in.host_is_device ? boundary : 0);
    row[4].held_bytes = 0;  // everything it saves moves to the host (an arena outside c10's allocator)
    for (auto& x : row) x.forward_peak_bytes = boundary + block;
    // Offloaded as they are saved: about half the block's saved bytes are on
    // the device at once during its forward, as in its backward.
    row[4].forward_peak_bytes = boundary + block / 2;
    row[0].transient_bytes = 0;
    row[1].transient_bytes = block;
    row[2].transient_bytes = block;
    row[3].transient_bytes = block + boundary;  // restored, then recomputed
    // Restored one saved tensor at a time as the backward reaches it, each
    // freed after its use: about half the block's saved bytes are back at
    // once (0.51 in the GPT's live profile), not all of them.
    row[4].transient_bytes = block / 2;
    // No time is measured cold: a block's recompute in units of its
    // forward (selective_op recomputes the cheap ops only), so that the auto
    // row prefers keeping, then selective_op, then full.
    row[1].extra_cpu_ms = row[1].extra_wall_ms = 0.3;
    row[2].extra_cpu_ms = row[2].extra_wall_ms = 1.0;
    row[3].extra_cpu_ms = row[3].extra_wall_ms = 1.1;
    row[4].extra_cpu_ms = row[4].extra_wall_ms = 0.2;
    c.blocks.push_back(row);
    in.host_bytes.push_back({0, 0, 0, boundary, boundary + block});
  }
  // The head's backward runs with every block's saved tensors still live.
  c.forward_base = bytes.ends + bytes.head_backward;
  c.forward_live_base = bytes.embedding;
  c.backward_base = bytes.ends;
  c.fixed_peak = bytes.ends;
  c.keep_peak = predict_peak(c, std::vector<size_t>(static_cast<size_t>(n_blocks), 0));
  return in;
}

MemoryEstimateInputs live_inputs(torch::nn::Module& model, const std::string& blocks,
                                 const std::function<void()>& step) {
  MemoryEstimateInputs in;
  in.mode = "live";
  in.gradients_in_activations = true;
  // Which block each parameter belongs to: by address, through the block list.
  std::map<const void*, int> unit_of;
  std::shared_ptr<torch::nn::Module> list;
  for (const auto& item : model.named_modules()) {
    if (item.key() == blocks) list = item.value();
  }
  if (!list) throw ConfigError(str("memory estimate: the model has no module '", blocks, "' (the block list)"));
  int u = 0;
  for (const auto& block : list->children()) {
    for (const auto& p : block->parameters()) unit_of[p.unsafeGetTensorImpl()] = u;
    ++u;
  }
  in.host_is_device = true;
  for (const auto& p : model.parameters()) {
    auto it = unit_of.find(p.unsafeGetTensorImpl());
    in.parameters.push_back({p.numel(), p.requires_grad(), it == unit_of.end() ? -1 : it->second});
    in.element_bytes = static_cast<int64_t>(p.element_size());
    if (!p.device().is_cpu()) in.host_is_device = false;
  }
  for (const auto& b : model.buffers()) in.other_bytes += static_cast<int64_t>(b.nbytes());
  PlannerOptions options;
  options.blocks = blocks;
  options.rounds = 1;
  options.choices = {BlockChoice::kSelectiveOp, BlockChoice::kFull, BlockChoice::kFullOffload,
                     BlockChoice::kOffloadActivations};
  in.activations = profile_activation_choices(model, step, options);
  for (const auto& block : in.activations.blocks) {
    std::vector<int64_t> host;
    for (const ChoiceCost& cost : block) host.push_back(cost.host_bytes);
    in.host_bytes.push_back(std::move(host));
  }
  return in;
}

}  // namespace remat
