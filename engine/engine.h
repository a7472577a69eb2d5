// remat::Engine: trains any LibTorch model from a DeepSpeed-style JSON config.
// One call wires, in this order, tensor parallelism's groups, the activation
// checkpointing policy (or the planner of variant auto), activation
// offloading, sharding (ZeRO stages 0-3, hybrid), the optimizer and learning
// rate schedule, and the step counters; the training loop stays the user's.
//
//   auto engine = remat::initialize(model, "ds_config.json");  // places the model (train.device)
//   for (...) {
//     at::Tensor x = engine->to_device(batch_x), y = engine->to_device(batch_y);
//     at::Tensor loss = engine->forward([&] { return model->loss(x, y); });
//     engine->backward(loss);
//     engine->step();                      // acts at the accumulation boundary
//   }
//   engine->save_checkpoint("saves", {{"epoch", 3}});
//   nlohmann::json client = engine->load_checkpoint("saves");
//   engine->export_model("model.pt");       // torch.load-able
//
// The model contract (docs/engine.md): the model is owned by a std::shared_ptr
// (a TORCH_MODULE holder), its parameters are float32, and its blocks (the
// units of sharding and of the checkpointing policies) are one
// torch::nn::ModuleList whose members the model calls through
// remat::forward(block, ...) (nn/module_call.h). A tensor-parallel model is
// built with the groups of remat::init_distributed() before initialize().
// Every call below is collective over the engine's processes unless it says
// otherwise: every rank makes the same calls in the same order. A call that
// fails on some ranks only (a save folder one rank cannot write, a damaged
// rank file) throws the same error on every rank, naming the ranks, so a
// program that catches it goes on alike everywhere.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/auto_values.h"
#include "engine/config.h"
#include "engine/export.h"
#include "engine/micro_batch_search.h"
#include "engine/save_dir.h"
#include "engine/step_metrics.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace remat {

class Communicator;
class Context;
class MemoryTracker;
class ParallelLayout;
namespace parallel {
class ZeroModel;
}

// How Engine::save_checkpoint writes a save.
struct SaveOptions {
  // Written in the background (train.async_save's meaning): the call
  // returns once this rank's state is copied to host memory; a background
  // thread writes its file while training goes on, and the save completes
  // (manifest, `latest`) at a later step(), save, load, export or
  // wait_for_saves(), on every rank together. See docs/engine.md.
  bool async = false;
};

using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

// How Engine::load_pretrained matches a safetensors file's tensors to the
// model's parameters and buffers (state-dict names). Patterns are ECMAScript
// regular expressions matched against the whole name.
struct PretrainedOptions {
  // {pattern, replacement} rules from the file's names to the model's, in
  // order: the first rule whose pattern matches a name renames it
  // (replacement with $1, $2, ... for its groups); a name no rule matches
  // stays as it is. examples/llama's hf_llama_names() maps Hugging Face's.
  std::vector<std::pair<std::string, std::string>> rename;
  // Model parameters the file need not hold, kept as initialised (LoRA's
  // adapters: ".*\\.lora_[ab]"). Empty: every parameter must be in the file.
  std::string allow_missing;
  // File tensors (by the file's own name) left unread (rotary tables some
  // files carry). Empty: none.
  std::string ignore;
};

// What a load_pretrained did on this rank.
struct PretrainedReport {
  int64_t loaded = 0;      // parameters and buffers written from the file
  int64_t kept = 0;        // parameters kept as initialised (allow_missing)
  int64_t ignored = 0;     // file tensors left unread (ignore)
  int64_t bytes_read = 0;  // of the file's tensor data, the bytes this rank read
  int64_t file_bytes = 0;  // every file of the set, headers included
  double seconds = 0;      // opening, checking, reading and installing
};

// train_micro_batch_size_per_gpu "auto" by measurement (docs/config.md,
// "auto"): what initialize() needs to decide it for a model. Without `loss`
// an "auto" micro-batch is a ConfigError asking for a number (unless
// train_batch_size and gradient_accumulation_steps give it). With it,
// initialize() times one forward+backward per pass through its wiring (the
// sharding, the checkpointing policy) at the candidates up to `fit` and takes
// the throughput knee (engine/micro_batch_search.h); every rank decides the
// same, and the parameters, gradients and random states after it are as if
// the chosen number had been given.
struct MicroBatchProbe {
  // The largest micro-batch from 1 to `limit` whose memory fits a rank, and
  // why (0: not even 1): the model's memory estimate (remat-train: the GPT's,
  // engine/memory_estimate.h). The smallest of the ranks' bounds the candidates.
  MicroBatchChooser fit;
  // The loss of one training micro-batch of `micro` samples, computed on the
  // engine's device (training_device(): the batch moved there, the model
  // called through its blocks as in a step). Called at initialize, a few
  // times per candidate.
  std::function<at::Tensor(int64_t micro)> loss;
  // Tokens per sample, for the tokens/s the search reports (1: samples/s).
  int64_t tokens_per_sample = 1;
  MicroBatchSearchOptions search;
};

struct EngineOptions {
  // Overrides applied on top of the config, validated the same way:
  // "zero_optimization.stage=3" (remat-train's --set).
  std::vector<std::string> overrides;
  // The processes and groups to train across (init_distributed()); null:
  // every process of the job, through `backend`.
  std::shared_ptr<ParallelLayout> layout;
  std::string backend = "auto";  // auto | mpi | nccl
  // Where this rank trains, in train.device's syntax (auto | cpu | cuda |
  // cuda:N); empty: the config's train.device. initialize() moves the model
  // there (docs/engine.md, "The device").
  std::string device;
  // The dotted path of the model's block list; empty: the one ModuleList the
  // model holds (find_block_list).
  std::string blocks;
  // Builds the optimizer over the tensors remat steps (ZeRO's shards, or the
  // parameters at stage 0); null: the config's optimizer section. The
  // schedule still sets its learning rate every step. Saves hold the state
  // of LibTorch's AdamW, Adam and SGD (another type trains, but does not save).
  OptimizerFactory optimizer;
  // Counts the memory metrics; null: the engine's own, started at initialize
  // (a tracker started earlier also counts what was allocated before).
  MemoryTracker* memory = nullptr;
  // What identifies the model in saves: a resume with another signature is
  // refused naming both. Empty: built from the parameters' names and shapes.
  std::string model_signature;
  // variant auto: each plan also writes the planner's frontier to
  // <plan_report_dir>/frontier.csv (rank 0; PlannerOptions::report_dir).
  std::string plan_report_dir;
  // An "auto" micro-batch decided by measurement (see MicroBatchProbe).
  MicroBatchProbe micro_batch;
  // Test seam (fault injection, docs/engine.md): with fp16.enabled, run its
  // loss scaler over float32 compute instead of refusing where fp16 compute
  // is missing, so the scaling, the unscaling, the overflow skip, the
  // metrics and the saves are tested on any device. Not for training.
  bool fp16_scaler_at_float32 = false;
};

// Builds the parallel layout a run trains across (data × tensor parallel, from
// the config's tensor_parallel.size) and seeds the default generators from
// train.seed, so every rank initialises the model alike. A tensor-parallel
// model is built after it, with layout->tp_group(); pass the layout to
// initialize() through EngineOptions::layout. initialize() seeds again
// (default generators and the tracker's model-parallel states) once the model
// is built. Collective.
std::shared_ptr<ParallelLayout> init_distributed(const Config& config, const std::string& backend = "auto");

class Engine {
 public:
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Runs the model's forward: `fn` computes the loss from this micro-batch
  // (calling the model's blocks through remat::forward). Returns the loss,
  // not yet scaled for accumulation. With variant auto, the first call (and
  // every call with a `plan_key` not seen before, e.g. the batch's shape)
  // profiles `fn` to plan the blocks first, so `fn` may run more than once.
  // A forward that throws leaves the engine ready for the next forward.
  at::Tensor forward(const std::function<at::Tensor()>& fn, const std::vector<int64_t>& plan_key = {});
  // Backpropagates `loss` (the tensor forward() returned) divided by the
  // accumulation steps, then reduces gradients as the sharding needs.
  void backward(const at::Tensor& loss);
  // After every backward. At the accumulation boundary: the non-finite check
  // (train.on_nonfinite; with fp16, the loss scaler's overflow), clipping (gradient_clipping), the optimizer step
  // and the gradients cleared; returns whether it stepped (false inside an
  // accumulation window, or when a non-finite step was skipped). A parameter
  // that got no gradient on any rank in the window (no forward used it) is
  // not stepped, as a plain LibTorch loop leaves a parameter without .grad:
  // its values and optimizer state stay as they were.
  bool step();

  // Runs `fn` without autograd, in eval mode, with ZeRO-3's parameters
  // gathered as forward() does (evaluation, generation). The mode is restored.
  template <class F>
  auto evaluate(F&& fn) {
    EvaluationScope scope(*this);
    return fn();
  }

  bool is_gradient_accumulation_boundary() const;
  int64_t global_steps() const { return global_steps_; }
  // Of the optimizer steps, those skipped for a non-finite gradient (an fp16
  // overflow, or train.on_nonfinite skip). As in DeepSpeed, the learning-rate
  // schedule does not advance over them: step s trains at the rate of step
  // s - skipped_steps() of a run without skips.
  int64_t skipped_steps() const { return skipped_steps_; }
  // Micro-steps since the last optimizer step.
  int64_t micro_steps() const { return micro_steps_; }
  // The learning rate of the step in progress (or the next one).
  double get_lr() const;
  // The global gradient norm of the last step (before clipping); -1 before
  // the first step, with clipping off, or after a skipped (non-finite) step.
  double get_global_grad_norm() const { return last_metrics_.grad_norm; }
  // The last optimizer step's metrics.
  const StepMetrics& last_metrics() const { return last_metrics_; }
  // The search that decided an "auto" micro-batch at initialize (null: none ran).
  const MicroBatchSearch* micro_batch_search() const;

  // Records the next optimizer step's memory timeline (its forwards,
  // backwards and optimizer step, by category, with the spans of each phase,
  // recompute and collective; runtime/memory_trace.h, docs/memory.md) and
  // writes it to `path` in Chrome's Trace Event JSON when that step() ends.
  // At most `max_samples` samples are written (runs of consecutive samples
  // by their lowest and highest, so the peak stays in). This rank's alone
  // (not collective). A ConfigError if `path` cannot be written or
  // EngineOptions::memory does not keep its allocations. A write that fails
  // when the step ends (disk full) is a warning: the step and training go on,
  // and no temporary file is left.
  void trace_memory(const std::string& path, int max_samples = 4000);

  // Saves parameters, optimizer state, every random state, the step and
  // `client_state` (rank 0's) to DIR/step_NNNNNNNN (atomic, CRC-checked,
  // locked against a second job, `latest` updated). Refused inside an
  // accumulation window. Returns the step folder.
  // With train.async_save (or SaveOptions::async), the save is written in
  // the background: the returned folder exists once it completes. A save
  // still being written is completed first (waiting for it).
  std::string save_checkpoint(const std::string& dir, const nlohmann::json& client_state = nlohmann::json::object());
  std::string save_checkpoint(const std::string& dir, const nlohmann::json& client_state, SaveOptions options);
  // Completes a save still being written in the background (waiting for
  // each rank's file), so the folder save_checkpoint returned is complete
  // and `latest` names it; nothing when none is. A background write that
  // failed on any rank is the same Error on every rank, here or at the
  // step() or save that completes it. Every save, load and export does this
  // first; call it before the program ends (an engine destroyed with a save
  // pending leaves it incomplete: the previous save stays the latest).
  void wait_for_saves();
  // Whether a background save is still being written or waits to complete.
  bool save_pending() const;
  // Takes `dir` for this engine's saves now (save_checkpoint does so at its
  // first save): created, checked writable on every rank and locked against
  // a second job. Saves of another run there are refused unless
  // `options.resuming` (set by itself after a load_checkpoint from `dir`) or
  // `options.overwrite`; removing the later saves is then the caller's, once
  // its first save is complete (discard_saves_after(dir, the step it started
  // from, world, the step of that save)), so a run that fails earlier loses
  // nothing.
  void use_save_dir(const std::string& dir, SaveDirOptions options = {});
  // Loads a save (a step folder or the save root) made at any tensor-parallel
  // size, data-parallel size and ZeRO stage with this model (parameter names
  // and whole shapes, and EngineOptions::model_signature), optimizer type and
  // train.seed; returns its client state. Anything else is a ConfigError
  // naming what differs. A global batch other than the save's run trained
  // with is a warning on rank 0 saying it changes from what to what (the
  // save's "auto" values are taken before initialize: keep_saved_decisions).
  nlohmann::json load_checkpoint(const std::string& dir);
  // Fine-tuning from pretrained weights: the model's parameters (and the
  // buffers the file holds) from a safetensors file, a sharded set's
  // model.safetensors.index.json, or a folder holding either
  // (engine/safetensors.h), named as `options` maps them. Each rank reads,
  // from the memory-mapped files, only the elements it holds (its ZeRO
  // shard of its tensor-parallel share), converted to the parameter's dtype
  // (bf16, fp16, fp32, f64 into each other). Every mismatch (a parameter the
  // file lacks, a file tensor the model lacks, a shape other than the
  // parameter's whole shape, an integer or bool tensor for a float
  // parameter) is one ConfigError naming each, the same on every rank,
  // before anything is written. Between steps before the first optimizer
  // step (the optimizer's state would not match the weights): else an Error.
  PretrainedReport load_pretrained(const std::string& path, const PretrainedOptions& options = {});
  // Writes every parameter whole, by state-dict name (written by rank 0,
  // streamed one unit at a time: engine/export.h): `*.safetensors` one
  // safetensors file, a folder (an existing directory or a path ending in
  // '/') safetensors shards of at most options.max_shard_bytes with
  // model.safetensors.index.json, anything else a file torch.load and
  // torch::pickle_load read. The safetensors metadata holds "remat_step".
  // Returns the bytes written on rank 0.
  int64_t export_model(const std::string& path, const ExportOptions& options = {});
  // The dtype export_model writes: the training dtype (bf16 or fp16) when
  // zero_optimization.stage3_gather_16bit_weights_on_model_save is true, else float32.
  at::ScalarType export_dtype() const;

  // The model's parameter `name` (state-dict name), whole: at ZeRO stage 3
  // only inside a GatheredParameters scope (else an Error saying so).
  at::Tensor parameter(const std::string& name) const;

  // The device this rank trains on (train.device or EngineOptions::device,
  // resolved at initialize): the model's parameters and buffers live there.
  at::Device device() const;
  // `t` on device(): the same tensor when it is there already (no copy),
  // else a copy (non-blocking from pinned host memory). The training loop
  // moves each batch with it: the engine cannot see what `fn` captures.
  at::Tensor to_device(const at::Tensor& t) const;
  std::vector<at::Tensor> to_device(const std::vector<at::Tensor>& tensors) const;

  const Config& config() const { return config_; }
  const ParallelLayout& layout() const;
  torch::nn::Module& module() const { return *model_; }
  torch::optim::Optimizer& optimizer() const;
  // The sharding the engine drives (ZeRO stages 0-3): what the optimizer
  // steps (parameters()) and which model elements each holds (layout()).
  parallel::ZeroModel& sharding() const;
  // The engine's own checkpointing defaults, counters and RNG tracker
  // (runtime/context.h), installed for each of its calls; install it to
  // change them: { remat::ContextScope scope(engine->context()); ... }.
  const std::shared_ptr<Context>& context() const;

  class EvaluationScope {
   public:
    explicit EvaluationScope(Engine& engine);
    ~EvaluationScope();
    EvaluationScope(const EvaluationScope&) = delete;
    EvaluationScope& operator=(const EvaluationScope&) = delete;

   private:
    Engine& engine_;
    bool was_training_;
    struct Guards;
    std::unique_ptr<Guards> guards_;
  };

 private:
  friend std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module>, Config, EngineOptions);
  friend class GatheredParameters;
  Engine(std::shared_ptr<torch::nn::Module> model, Config config, EngineOptions options);
  // The engine's state between calls (engine/internal/engine_impl.h): for its own
  // calls, GatheredParameters and EvaluationScope.
  struct Impl;
  Impl& impl() const { return *impl_; }

  std::shared_ptr<torch::nn::Module> model_;
  Config config_;
  std::unique_ptr<Impl> impl_;
  int64_t global_steps_ = 0, micro_steps_ = 0, skipped_steps_ = 0;
  // The rate of the next optimizer step: the schedule's position counts the steps taken.
  double next_learning_rate() const;
  StepMetrics last_metrics_;
};

// The device an engine for `config` would train on in this process:
// train.device, or `spec` in its syntax when not empty (as
// EngineOptions::device). For what is sized before initialize(), such as
// remat-train's memory check. A ConfigError as initialize() gives one.
at::Device training_device(const Config& config, const std::string& spec = "");

// fp16.enabled on a `device` that cannot compute in fp16 with this LibTorch
// (LibTorch 1.13's CPU): the ConfigError initialize() refuses it with; nothing
// where fp16 is off or the device computes it. For what is sized before
// initialize(), such as remat-estimate.
void check_fp16_device(const Config& config, at::Device device);

// A resumed run's own decisions (engine/decisions.h): every "auto" value the
// run that made the save `resume` decided (a step folder or a save root, as
// load_checkpoint takes it), for the keys `config` still gives "auto", each
// reason saying it was kept from the save, and the budget
// device_memory_budget_bytes "auto" became; nothing is measured again. At
// another data-parallel size `dp` train_batch_size is derived afresh. Logs
// one line on rank 0 of what it took. Call it before initialize().
void keep_saved_decisions(Config& config, const std::string& resume, int dp);

// The engine for `model` from a parsed config (EngineOptions::overrides are
// applied on top). Collective. Initializing a model that another live engine
// trains is an Error.
std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, Config config,
                                   EngineOptions options = {});
// From a file path, or JSON text (text that starts with '{').
std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, const std::string& config,
                                   EngineOptions options = {});
std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, const nlohmann::json& config,
                                   EngineOptions options = {});
inline std::unique_ptr<Engine> initialize(std::shared_ptr<torch::nn::Module> model, const char* config,
                                          EngineOptions options = {}) {
  return initialize(std::move(model), std::string(config), std::move(options));
}
template <class Holder, class C>
auto initialize(const Holder& model, const C& config, EngineOptions options = {})
    -> decltype(model.ptr(), std::unique_ptr<Engine>()) {
  return initialize(std::static_pointer_cast<torch::nn::Module>(model.ptr()), config, std::move(options));
}

// Every parameter of the engine's model whole, in the parameters themselves,
// for the scope's lifetime (ZeRO stage 3 gathers them; other stages hold them
// whole already): for evaluation code that reads weights, or edits such as
// tying or re-initialising. With `modify`, edits made in the scope are written
// back to every rank's shards (and the optimizer's view of them) when it
// ends; all ranks must make the same edits (rank 0's values are the ones
// kept). Collective at both ends. Not inside forward/backward.
class GatheredParameters {
 public:
  explicit GatheredParameters(Engine& engine, bool modify = false);
  ~GatheredParameters() noexcept(false);
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;

 private:
  Engine& engine_;
  bool modify_;
  std::vector<std::pair<at::Tensor, at::Tensor>> restore_;  // parameter, its data outside the scope
  std::map<std::string, at::Tensor> installed_;              // stage 3: the values the scope began with
};

}  // namespace remat
