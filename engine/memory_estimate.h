// Will a configuration fit, and what holds its peak? Per rank: parameters,
// gradients, optimizer state, gathered ZeRO-3 units, activations under each
// checkpointing choice and offloaded host bytes, for every ZeRO stage x
// policy x offloading, with the configured one marked.
//
//   // cold: from the config's sizes, nothing built (the GPT of models/gpt.h)
//   remat::MemoryEstimate e = remat::estimate_memory(config, /*world_size=*/8,
//       remat::cold_gpt_inputs(config, vocab, micro_batch));
//   // live: any model, its parameters read and one step profiled on this rank
//   remat::MemoryEstimate e = remat::estimate_memory(config, 8,
//       remat::live_inputs(*model, "blocks", [&] { model->loss(x, y).backward(); }));
//   std::cout << e.table();
//
// The model (docs/memory.md, "The estimator"): per rank,
//   peak = parameters + optimizer state + activation peak + gradients
//          + gathered units
// where the activation peak is the planner's peak model (checkpointing/
// planner.h) over per-block costs that are measured (live: the planner's
// profile, which sees the gradients of a whole-model backward) or derived
// from the block's saved tensors (cold); the model state follows each stage's
// sharding rules over the parameters' sizes.
#pragma once

#include <c10/core/DeviceType.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpointing/planner.h"
#include "engine/config.h"

namespace torch::nn {
class Module;
}

namespace remat {

// One parameter as the sharding sees it.
struct ParameterSize {
  int64_t numel = 0;
  bool trainable = true;
  int unit = -1;  // its block's index; -1: outside the blocks (the root unit)
  bool tp_sharded = false;  // split over the tensor-parallel ranks (numel: this rank's part)
};

// What an estimate is computed from.
struct MemoryEstimateInputs {
  std::string mode;  // "cold" or "live"
  std::vector<ParameterSize> parameters;
  int64_t element_bytes = 4;  // float32 parameters
  // Per block, columns keep, selective_op, full, full_offload,
  // offload_activations (planner.h), and the bases of the peak model. Cold
  // costs leave the gradients out (gradients_in_activations false); a live
  // profile's backward allocates them (true).
  BlockCosts activations;
  bool gradients_in_activations = false;
  // Host bytes each column moves off the device per block and holds there
  // until the block's backward (cold: derived; live: the offloading counters
  // during the profile). A row's host column is their sum, what the host
  // holds at the step's peak; it is not added to the peak.
  std::vector<std::vector<int64_t>> host_bytes;  // [block][column]
  // The model lives on the CPU: cpu_checkpointing's host copies, made through
  // c10's allocator, count in the same memory (in the blocks' held bytes);
  // activation offloading's host arena does not. On a GPU (false) every host
  // copy is in the host column, apart from the device's peak.
  bool host_is_device = true;
  // The device's bytes one rank has, when known (0: unknown): the estimate
  // says whether the configured peak fits, and device_memory_budget_bytes
  // "auto" plans against it less the reserve (runtime/device_memory.h);
  // unknown, "auto" plans as a config without a budget (half the peak).
  int64_t device_capacity_bytes = 0;
  // The capacity is REMAT_MEMORY_PER_RANK_BYTES, what a rank may use: "auto"
  // reserves a tenth of it, without the 1 GiB floor of a measured device.
  bool device_capacity_given = false;
  // Live: bytes the step's start held beyond the parameters and optimizer
  // state (buffers, data); cold: 0.
  int64_t other_bytes = 0;
};

// One configuration's prediction, per rank.
struct MemoryEstimateRow {
  int stage = 0;
  bool hybrid = false;
  std::string policy;  // none, full, every_k, selective_op, auto
  bool offload = false;
  bool configured = false;
  bool feasible = true;  // auto: a plan fits its budget
  std::string plan;      // the per-block choices (every_k, auto)
  int64_t parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0, gathered_bytes = 0;
  int64_t activation_bytes = 0, host_bytes = 0, comm_bytes = 0, other_bytes = 0;
  int64_t peak_bytes = 0;  // what the device (the host, for a CPU model) must hold at once
  // zero_optimization.offload_optimizer.device cpu (stages 1-3): the
  // optimizer state and the float32 master shards with their gradient
  // buffers live on the host: host_optimizer_bytes, what a run's metrics
  // report under that name. offload_optimizer: the config offloads, and the
  // columns above keep what stays on the device (no optimizer state; the
  // gradients less the shards' that leave as their reductions end:
  // docs/memory.md, "Offloading the optimizer"). At stages 1-3 every row
  // gives host_optimizer_bytes and offload_optimizer_peak_bytes, its peak
  // with the optimizer on the host, offloaded or not (0: stage 0, or an auto
  // row whose budget no plan fits then). On a CPU model the host is the
  // device: the peaks include host_optimizer_bytes.
  bool offload_optimizer = false;
  int64_t host_optimizer_bytes = 0, offload_optimizer_peak_bytes = 0;
  // offload_optimizer.device "nvme": the state file's bytes on disk (what a
  // run's metrics report as nvme_state_bytes); host_optimizer_bytes then
  // counts the buffers in place of the moments.
  int64_t disk_bytes = 0;
  // offload_optimizer.device "nvme": the float32 masters' file (a run's
  // nvme_master_bytes, within a page a master tensor).
  int64_t disk_master_bytes = 0;
  // offload_param.device "nvme", stage 3's rows: the parameter shards' bytes
  // in its file (a run's nvme_parameter_bytes), past the max_in_cpu elements
  // kept in host memory (host_parameter_bytes then counts those alone).
  int64_t disk_parameter_bytes = 0;
  // zero_optimization.offload_param.device cpu, stage 3's rows: the float32
  // parameter shards (trained and frozen) and their gradients on the host
  // (a run's host_parameter_bytes) and, with the optimizer not offloaded,
  // LibTorch's optimizer's state of them, made beside them. The columns
  // above keep the device's: the persistent parameters, their gradients and
  // optimizer state, and at the step's most a unit's reduced gradient shard
  // before its copy to the host. On a CPU model the peaks include it.
  int64_t host_parameter_bytes = 0;
  // The config offloads (offload_optimizer, or offload_param at stage 3):
  // the row's peak with neither, the optimizer and every parameter on the
  // device (0: nothing offloaded, or an auto row whose budget no plan fits
  // then). On a CPU model, where the host copies share the memory, it is
  // lower than peak_bytes.
  int64_t no_offload_peak_bytes = 0;
  // train.async_save: the host bytes a background save's snapshot holds
  // until its files are written (the float32 tensors the optimizer steps and
  // their state), through the steps after a save; in the peak on a CPU
  // model, apart on a GPU. 0 without train.async_save.
  int64_t save_snapshot_bytes = 0;
};

struct MemoryEstimate {
  std::string mode;
  bool host_is_device = true;         // the inputs': false on a GPU
  int64_t device_capacity_bytes = 0;  // the inputs' (0: unknown)
  int world_size = 1, dp = 1, tp = 1, shard_group = 1;
  bool offload_optimizer = false;    // the config's (zero_optimization.offload_optimizer)
  bool offload_param = false;        // the config's (zero_optimization.offload_param, stage 3's rows)
  bool async_save = false;           // the config's (train.async_save)
  std::vector<MemoryEstimateRow> rows;

  // The configured row (an Error when the configuration has none: variant
  // auto whose budget no plan fits is still a row, marked infeasible).
  const MemoryEstimateRow& configured() const;
  // The row of `stage`, `policy`, `offload` (hybrid at stages 1-3 when the config shards hybrid).
  const MemoryEstimateRow& row(int stage, const std::string& policy, bool offload = false) const;
  // A table like DeepSpeed's estimators print, the configured row marked '*'.
  std::string table() const;
  // One line for the configured row (remat-train prints it at start), with
  // the device's capacity and whether the peak fits it when known.
  std::string line() const;
  nlohmann::json to_json() const;
};

// Past this many blocks the estimate solves no auto row: the planner's
// exact solve grows with the square of the blocks (the configured auto row
// is kept, unsolved, at full checkpointing's peak).
inline constexpr size_t kMaxPlannedBlocks = 1024;

// Every stage (0-3; 1-3 hybrid too when the config sets hybrid_shard_size)
// x none, full, every_k, selective_op, auto x offloading off/on for `config`
// at `world_size` ranks, the optimizer offloaded as configured (each row at
// stages 1-3 with its peak had the optimizer been on the host beside it). auto uses the config's budget when its variant is
// auto, else memory_budget_fraction 0.5.
MemoryEstimate estimate_memory(const Config& config, int world_size, const MemoryEstimateInputs& inputs);

// A cold estimate of a model remat did not build: its parameters (sizes and
// blocks) and what one block saves for backward, in bytes, as its
// architecture gives them (docs/memory.md derives the GPT's; the examples'
// Llama gives its own).
struct BlockActivationBytes {
  int64_t boundary = 0;      // a block's input (the previous block's output)
  int64_t saved = 0;         // what a block saves with no checkpoint, its input apart
  int64_t selective_op = 0;  // what selective_op keeps of it (the projections' outputs), its input apart
  int64_t embedding = 0;     // what the embeddings save (live before the first block)
  int64_t ends = 0;          // the embeddings', the head's and the loss's saved tensors
  // What the head's backward adds on top of everything saved, at the step's
  // start of the backward: the loss's gradient and the logits' (float32).
  int64_t head_backward = 0;
  // What a checkpointed block keeps besides its input and selective_op's
  // outputs: the tensor-parallel collectives' outputs under
  // activation_checkpointing.save_collectives.
  int64_t checkpoint_kept = 0;
};
// `device`: where the model computes (host_is_device: the CPU).
MemoryEstimateInputs cold_inputs(std::vector<ParameterSize> parameters, int n_blocks,
                                 const BlockActivationBytes& bytes, c10::DeviceType device = c10::DeviceType::CPU);

// The GPT of models/gpt.h from the config's sizes (model section, vocabulary
// and micro-batch), at its tensor-parallel size: nothing is built.
MemoryEstimateInputs cold_gpt_inputs(const Config& config, int64_t vocab_size, int64_t micro_batch,
                                     c10::DeviceType device = c10::DeviceType::CPU);

// Any model: its parameters as they are, its activations profiled by running
// `step` (one forward and backward on the real micro-batch, on one rank,
// without sharding) under every block choice (profile_activation_choices).
MemoryEstimateInputs live_inputs(torch::nn::Module& model, const std::string& blocks,
                                 const std::function<void()>& step);

// train_micro_batch_size_per_gpu "auto" (engine/auto_values.h): the largest
// micro-batch from 1 to `limit` whose configured row fits `have` bytes per
// rank (its peak at most `have`: memory alone; under variant auto a budget no
// plan meets is the planner's to refuse, at the micro-batch chosen, and the
// row is judged at full checkpointing's peak), with `inputs(micro)` the
// estimate's inputs at that micro-batch; 0 when not even 1 fits. The peak
// grows with the micro-batch, so the answer is found by bisection (about
// log2(limit) estimates).
int64_t largest_fitting_micro_batch(const Config& config, int world_size, int64_t have, int64_t limit,
                                    const std::function<MemoryEstimateInputs(int64_t micro)>& inputs);

// The cheapest change to `config` whose row fits `have` bytes per rank (the
// configured offloading off where that fits, as on a CPU, then a higher
// stage, then the optimizer offloaded to the host, then another policy at
// this stage, then a memory budget), as the keys to set; empty when none
// fits. `host_have` (0: unknown): the host memory each rank has beside its
// device; the optimizer is named for the host only where what the host then
// holds fits it.
std::string cheapest_fitting_change(const MemoryEstimate& estimate, int64_t have, int64_t host_have = 0);

}  // namespace remat
