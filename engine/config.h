// remat's configuration, read from JSON into typed structs.
//
// Key names and defaults are DeepSpeed's wherever DeepSpeed has the key;
// remat's own keys are documented in docs/config.md. Validation is strict:
// every unknown key is named with its full path (and a valid key when one is
// close), DeepSpeed keys remat does not implement are named with the reason,
// a wrong type names path, expected and actual type, all of them in one
// error; malformed JSON gives line and column. An error in a value given by
// an override names the override ("--set train.steps=-1") as its source.
//
//   remat::Config cfg = remat::load_config("configs/default.json",
//                                          {"activation_checkpointing.variant=full"});
//   remat::BatchSizes batch = cfg.resolve_batch(layout.dims().dp);
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat {

// optimizer (launch/optim.h builds it).
struct OptimizerConfig {
  std::string type = "AdamW";  // AdamW | Adam | SGD
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  // SGD
  bool nesterov = false;  // SGD
};

// scheduler: the learning rate per step (launch/optim.h).
struct SchedulerConfig {
  std::string type = "none";  // none | WarmupLR | WarmupDecayLR
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // log | linear
  int64_t total_num_steps = 0;      // WarmupDecayLR only; required there
};

// bf16: compute in bf16 from fp32 master shards (ZeRO stage 3 only; parallel/zero.h).
struct Bf16Config {
  bool enabled = false;
};

// zero_optimization: consumed by parallel::ZeroModel (parallel/zero.h).
struct ZeroConfig {
  // 0: data parallel (gradients all-reduced); 1: optimizer state sharded;
  // 2: optimizer state and gradients sharded; 3: parameters too.
  int stage = 0;
  // Elements per gradient reduce collective (stages 1 and 2: per gradient
  // bucket, each bucket sharded on its own).
  int64_t reduce_bucket_size = 500000000;
  // Stages 1 and 2: gradients reduce-scattered into the shards (false: all-reduced,
  // each rank keeping its shard).
  bool reduce_scatter = true;
  // Stages 1 and 2: elements per all-gather of the updated parameters.
  int64_t allgather_bucket_size = 500000000;
  // Stages 1 and 2: the updated parameters come back by all-gather (false: one
  // broadcast per rank's shard).
  bool allgather_partitions = true;
  // Stage 3: a unit is prefetched only when it has at most this many elements.
  int64_t stage3_prefetch_bucket_size = 50000000;
  // Stage 3: parameters with fewer elements stay whole on every rank.
  int64_t stage3_param_persistence_threshold = 100000;
  // Stage 2: a gradient bucket's reduce-scatter runs while the backward goes on
  // (waited for at finish_backward); false waits for each at once. Stage 3
  // overlaps by prefetching whatever this says.
  bool overlap_comm = false;
  // Stages 1 and 2: each gradient is moved into its bucket's flat buffer as
  // soon as it is computed (and the parameter's own freed); false keeps
  // gradients on the parameters until their bucket is reduced.
  bool contiguous_gradients = true;
  // Stages 1-3: shard within groups of this many data-parallel ranks and
  // replicate across the groups (FSDP's HYBRID_SHARD); 0: one group of all.
  int hybrid_shard_size = 0;
};

// cpu_checkpointing's settings beyond on/off, shared by the JSON section and
// the stored-input options of a checkpoint region (checkpointing/stored_inputs.h).
struct OffloadSettings {
  // Offloaded tensors (or shares) smaller than this many bytes stay on the
  // device. 0 moves every input, as DeepSpeed's cpu_checkpointing does; 1024
  // (torchtune's min_offload_size) keeps tiny tensors whose copy costs more
  // latency than the memory is worth.
  int64_t offload_min_bytes = 0;
  // Copies to the host in flight at once.
  int offload_max_in_flight = 2;
  // The last region's inputs stay on the device (backward needs them first).
  bool offload_keep_last = true;
};

// Which blocks a whole-model policy checkpoints, shared by the JSON section
// and the policy options (checkpointing/policy.h).
struct PolicySettings {
  // One of checkpoint_variants().
  std::string variant = "none";
  // selective_layer: checkpoint every k-th block.
  int every_k = 1;
  // selective_layer: which block of each k is checkpointed. "first": blocks
  // 0, k, 2k, ...; "last": the last block and every k-th before it (n-1,
  // n-1-k, ...), so the block that runs last is always among them.
  std::string every_k_from = "first";
  // selective_op: the ops whose outputs are kept; unset (null): the default
  // list of checkpointing/selective_op.h.
  std::optional<std::vector<std::string>> save_ops;
  // auto: the budget for a step's activation peak per rank (live tensor bytes
  // above those at the step's start), in bytes or as a fraction of the peak
  // with no checkpointing; exactly one is set (checkpointing/planner.h).
  std::optional<int64_t> memory_budget_bytes;
  std::optional<double> memory_budget_fraction;
};

// activation_checkpointing: DeepSpeed's keys, then remat's (docs/config.md).
struct ActivationCheckpointingConfig : OffloadSettings, PolicySettings {
  // Each tensor-parallel rank keeps 1/tp of a region's inputs.
  bool partition_activations = false;
  // A region's inputs (or their shares) move to host memory until recompute.
  bool cpu_checkpointing = false;
  // Stored inputs go into preallocated buffers with number_checkpoints slots.
  bool contiguous_memory_optimization = false;
  // Regions alive at once (contiguous_memory_optimization needs it).
  std::optional<int64_t> number_checkpoints;
  // Synchronize the device at region boundaries.
  bool synchronize_checkpoint_boundary = false;
  // Time forward, recompute and backward per region.
  bool profile = false;
  // Regions as one custom autograd Function (true) or through saved-tensor
  // hooks (false); see checkpointing/checkpoint.h.
  bool reentrant = false;
};

// activation_offloading: torchtune's OffloadActivations options (the names of
// Axolotl's get_lora_act_offloading_ctx_manager), checkpointing/offload_activations.h.
struct ActivationOffloadingConfig {
  // remat-train runs each forward inside an offloading scope.
  bool enabled = false;
  // Host copies of GPU tensors in pinned memory.
  bool use_pin_memory = true;
  // Copies on a side stream (GPU), overlapping compute.
  bool use_streams = true;
  // Saved tensors smaller than this many bytes stay on the device.
  int64_t min_offload_size = 1024;
  // Copies to the host in flight at once (with use_streams).
  int max_fwd_stash_size = 5;
  // Warn when no output head is found to keep on the device.
  bool warn_if_no_head = true;
  // The head's dotted module path; empty: found by name or type (find_output_head).
  std::string head;
};

// none | full | selective_layer | selective_op | auto.
const std::vector<std::string>& checkpoint_variants();

// The rules of the activation_checkpointing section, written once: an empty
// string when `config` (or the variant and every_k of a policy) is valid,
// else what is wrong and which key to change.
std::string check_checkpoint_variant(const std::string& variant, int every_k);
std::string check_activation_checkpointing(const ActivationCheckpointingConfig& config);

// tensor_parallel: ranks per tensor-parallel group (runtime/layout.h).
struct TensorParallelConfig {
  int size = 1;
};

// model: the GPT's and the test stack's shape (models/stack.h, models/gpt.h).
struct ModelConfig {
  int n_layer = 4;   // transformer blocks
  int n_head = 4;    // attention heads (a multiple of tensor_parallel.size)
  int d_model = 128; // hidden width (a multiple of n_head)
  int d_ff = 512;    // MLP width (a multiple of tensor_parallel.size)
  int seq_len = 64;  // longest sequence (position embeddings)
  double dropout = 0.1;
};

// data: the corpus remat-train reads (data/dataset.h).
struct DataConfig {
  std::string path;  // empty: the embedded default corpus
  double train_fraction = 0.9;
};

// remat-train's loop (extension).
struct TrainConfig {
  int64_t steps = 200;
  int64_t seed = 1234;
  int64_t eval_interval = 50;  // 0: no evaluation
  int64_t eval_batches = 4;
  int64_t save_interval = 0;   // 0: save only when --save-dir is given, at the end
  int64_t sample_chars = 200;  // generated after training (0: none)
  // A step whose loss or gradients are not finite (nan, inf): "stop" ends the
  // run with an error naming the step (nothing non-finite is saved); "skip"
  // drops that step's update and goes on.
  std::string on_nonfinite = "stop";
};

// Resolved batch sizes: train = micro × accumulation × data-parallel size.
struct BatchSizes {
  int64_t train_batch_size = 0;
  int64_t micro_batch_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
};

struct Config {
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  double gradient_clipping = 0.0;  // 0: off
  int steps_per_print = 10;
  // DeepSpeed's wall_clock_breakdown: the trainer logs each step's forward,
  // backward and optimizer-step times every steps_per_print steps.
  bool wall_clock_breakdown = false;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Bf16Config bf16;
  ZeroConfig zero_optimization;
  ActivationCheckpointingConfig activation_checkpointing;
  ActivationOffloadingConfig activation_offloading;
  TensorParallelConfig tensor_parallel;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;

  // Fills in the batch sizes that were left out, given the data-parallel size.
  // Inconsistent values are a ConfigError that shows the arithmetic.
  BatchSizes resolve_batch(int data_parallel_size) const;

  // The effective configuration (defaults filled in) as pretty JSON.
  std::string to_json() const;
};

// Parses JSON text. `source` names it in errors (a path, "<default>").
// `overrides` are "a.b.c=value" strings applied on top, validated the same way;
// value is JSON (8, true, "x", [1,2]) or else taken as a plain string. A rule
// broken by a value an override gave names that override ("--set a.b.c=value")
// as the source, not `source`.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

// Reads and parses a file; an unreadable file is a ConfigError.
Config load_config(const std::string& path,
                   const std::vector<std::string>& overrides = {});

// The configuration embedded in the binaries (configs/default.json).
const std::string& default_config_text();

}  // namespace remat
