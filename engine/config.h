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

#include "checkpointing/options.h"
#include "models/shape.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "optim/options.h"
#include "parallel/zero_options.h"
#include "runtime/async_io_options.h"

namespace remat {

// tensor_parallel: ranks per tensor-parallel group (runtime/layout.h), and
// sequence parallelism over that group (models/stack.h: StackOptions).
struct TensorParallelConfig {
  int size = 1;
  // Megatron's --sequence-parallel: LayerNorm, dropout and residual activations
  // are split along the sequence across the group (model.seq_len a multiple of size).
  bool sequence_parallel = false;
  // Where those dropouts draw: "per_rank" or "replicated" (models/shape.h).
  models::SequenceParallelDropout sequence_parallel_dropout = models::SequenceParallelDropout::kPerRank;

  // Sequence parallelism in effect: asked for, over more than one rank.
  bool sequence_parallel_active() const { return sequence_parallel && size > 1; }
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
  // Where this rank trains: "auto" (the local rank's CUDA device where CUDA
  // is available, else the CPU), "cpu", "cuda" (the local rank's CUDA device)
  // or "cuda:N". The engine places the model there at initialize.
  std::string device = "auto";
  // Saves written by a background thread while training goes on
  // (Engine::save_checkpoint): the state is copied to host memory at the
  // step boundary, the write completes at a later step or save
  // (docs/engine.md, "Asynchronous saves").
  bool async_save = false;
};

// fp16: DeepSpeed's section. The loss scaler's keys are its options
// (optim/loss_scaler.h, declared and validated there); these are the engine's.
struct Fp16Config : optim::LossScalerOptions {
  // Compute in fp16 from float32 masters, with the loss scaler. Refused where
  // the device cannot compute in fp16 (docs/config.md).
  bool enabled = false;
  // DeepSpeed's cast of the floating-point inputs to fp16: accepted, with no
  // effect of its own in remat.
  bool auto_cast = false;
  // DeepSpeed's fp16 master weights and gradients (its CPU Adam only):
  // refused when true, since remat's masters are float32.
  bool fp16_master_weights_and_grads = false;
};

// DeepSpeed's tuning keys of zero_optimization and the top level that remat
// reads for the engine itself. Those without effect are kept only to say so
// (ineffective_settings names each one given): unset when not in the config.
struct DeepSpeedTuningConfig {
  // stage3_gather_16bit_weights_on_model_save (or its other spellings): the
  // export (Engine::export_model) writes the weights in the training dtype,
  // bf16 or fp16, instead of float32.
  bool gather_16bit_weights_on_model_save = false;
  std::optional<int64_t> sub_group_size;           // offload_optimizer nvme's sub-groups; no effect elsewhere
  std::optional<int64_t> max_reuse_distance;       // stage3_max_reuse_distance: no effect
  std::optional<bool> allow_untested_optimizer;    // zero_allow_untested_optimizer: no effect
  // DeepSpeed's old offload switches: false asks for nothing (true is refused,
  // naming offload_optimizer or offload_param).
  std::optional<bool> cpu_offload, cpu_offload_param, cpu_offload_use_pin_memory;
  // What remat always does, asked for explicitly (no effect; another value is
  // refused: it would change how gradients are averaged or computed).
  std::optional<bool> prescale_gradients;           // false: divide after the sum
  std::optional<double> gradient_predivide_factor;  // 1.0: no division before the sum
  std::optional<bool> memory_efficient_linear;      // zero_optimization: either value
  // Either value accepted, true said to change nothing (false asks for nothing):
  std::optional<bool> round_robin_gradients;   // zero_optimization: the order of gradient copies to the host
  std::optional<bool> force_ds_cpu_optimizer;  // zero_force_ds_cpu_optimizer: remat refuses no offloaded optimizer
  std::optional<bool> immediate_grad_update;   // bf16: when bf16 gradients join the float32 accumulation
  // bf16.check_overflow (or check_grad_overflow): remat checks every step,
  // train.on_nonfinite decides what follows (said when true).
  std::optional<bool> check_overflow;
  // zero_optimization.stage3_param_persistence_threshold as a number given
  // (the value is ZeroOptions'): said when stage 3 uses another (bf16, fp16).
  std::optional<int64_t> param_persistence_threshold;
};

// DeepSpeed's `aio` section: the asynchronous I/O of offload to NVMe
// (runtime/async_io_options.h says what each key means for each backend).
// Read and checked now, DeepSpeed's defaults as its own; offload to NVMe,
// being built (issue 53), steps its files with options() (ineffective_settings
// says so while no offload device is "nvme").
struct AioConfig {
  int64_t block_size = 1048576;  // bytes of one request piece
  int queue_depth = 8;           // pieces in flight per lane
  int thread_count = 1;          // lanes (DeepSpeed's later spelling: intra_op_parallelism)
  bool single_submit = false;    // one submission call per piece
  bool overlap_events = true;    // refill the queue as pieces complete
  // These values in runtime's options (backend auto, direct I/O preferred).
  AsyncIoOptions options() const;
};

// Resolved batch sizes: train = micro × accumulation × data-parallel size.
struct BatchSizes {
  int64_t train_batch_size = 0;
  int64_t micro_batch_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
};

// A key the config gave as "auto" (remat decides: engine/auto_values.h,
// docs/config.md) and what it became.
struct AutoValue {
  std::string key;    // dotted, as in the JSON: "optimizer.params.lr"
  std::string value;  // the value chosen, as JSON text; empty: not decided yet
  std::string why;    // the reason, one sentence
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
  // The sections that configure a library have that library's own options
  // struct as their type, declared (with each field's documentation and
  // default) and validated there; config_schema.cc binds their JSON keys onto
  // the structs' fields.
  optim::OptimizerOptions optimizer;  // optim/options.h
  optim::SchedulerOptions scheduler;  // optim/lr_schedule.h
  parallel::Bf16Options bf16;                               // parallel/zero_options.h
  Fp16Config fp16;  // its loss scaler's keys: optim/loss_scaler.h
  parallel::ZeroOptions zero_optimization;                  // parallel/zero_options.h
  DeepSpeedTuningConfig deepspeed_tuning;  // keys in zero_optimization and at the top level
  ActivationCheckpointingOptions activation_checkpointing;  // checkpointing/options.h
  OffloadActivationsOptions activation_offloading;          // checkpointing/options.h
  TensorParallelConfig tensor_parallel;
  AioConfig aio;  // DeepSpeed's aio section
  models::ModelShape model;  // models/shape.h
  DataConfig data;
  TrainConfig train;

  // The keys given "auto", in key order (section by section): those whose value
  // the config alone decides are decided by parse_config; the batch sizes and
  // bf16/fp16 need the device and the model (decide_precision_autos,
  // decide_batch_autos in engine/auto_values.h). The structs' members hold
  // the decided values (until then, their defaults).
  std::vector<AutoValue> auto_values;
  // Whether `key` (dotted) was given "auto" / was given "auto" and is not decided yet.
  bool is_auto(const std::string& key) const;
  bool is_undecided_auto(const std::string& key) const;

  // Fills in the batch sizes that were left out, given the data-parallel size.
  // Inconsistent values are a ConfigError that shows the arithmetic.
  BatchSizes resolve_batch(int data_parallel_size) const;

  // The effective configuration (defaults filled in) as pretty JSON.
  std::string to_json() const;
};

// Every key that takes "auto", dotted (the others refuse it, naming the key;
// engine/auto_values.h decides them).
const std::vector<std::string>& auto_keys();

// Parses JSON text. `source` names it in errors (a path, "<default>").
// `overrides` are "a.b.c=value" strings applied on top, validated the same way;
// value is JSON (8, true, "x", [1,2]) or else taken as a plain string. A rule
// broken by a value an override gave names that override ("--set a.b.c=value")
// as the source, not `source`.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

// The rules parse_config checks, again, over a config changed since (its
// "auto" values decided: engine/auto_values.h); every broken one in one
// ConfigError naming `source`, or the `overrides` that set one of its keys.
void check_config_rules(const Config& config, const std::string& source,
                        const std::vector<std::string>& overrides = {});

// Settings that are valid but would have no effect in `config` (e.g.
// sequence_parallel_dropout with sequence parallelism off, or a DeepSpeed
// tuning key remat does not need), one sentence each saying what to change
// or why it changes nothing; the engine logs them as warnings on rank 0.
std::vector<std::string> ineffective_settings(const Config& config);

// The device syntax of train.device (and EngineOptions::device): empty when
// `spec` is auto, cpu, cuda or cuda:N, else the problem, naming `key`.
std::string device_spec_problem(const std::string& spec, const std::string& key = "train.device");

// Stores `value` (JSON text) into the member the dotted `key` binds,
// validated as the config's own JSON is (a ConfigError naming `source`
// otherwise): an "auto" key decided elsewhere, such as a resumed run taking
// its save's decision (engine/engine.h, keep_saved_decisions). Only the
// member: the key's AutoValue is the caller's to record.
void set_config_value(Config& config, const std::string& key, const std::string& value, const std::string& source);

// Reads and parses a file; an unreadable file is a ConfigError.
Config load_config(const std::string& path,
                   const std::vector<std::string>& overrides = {});

// The configuration embedded in the binaries (configs/default.json).
const std::string& default_config_text();

}  // namespace remat
