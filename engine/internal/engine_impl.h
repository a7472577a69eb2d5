// Engine::Impl: what an engine keeps between its calls, shared by the calls
// (engine.cc: the forward; engine_step.cc: backward and step; engine_state.cc:
// saves, export, evaluation) and wiring.cc (initialize() and the
// constructor's wiring, the destructor). The engine's own: not installed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/internal/loss_scaling.h"
#include "engine/internal/step_meter.h"
#include "engine/save/dir_lock.h"
#include "engine/save/train_state.h"
#include "parallel/zero.h"
#include "runtime/context.h"
#include "runtime/memory.h"

namespace torch::nn {
class ModuleListImpl;
}

namespace remat {
namespace internal {

// Where the engine is in a micro-step: forward() and backward() alternate,
// step() follows a backward.
enum class Phase { kIdle, kForwarded, kBackwarded };

// What a micro-step starts from outside its activations: every parameter's
// and shard's storage once, the optimizer's state (before its first step,
// what it will allocate then) and, with gradient accumulation, the gradients
// held between micro-batches. For device_memory_budget_bytes. With the
// optimizer or the parameters offloaded, what lives on the host is charged
// only where the host is the device (`host_is_device`: a model on the CPU).
// `live`: the tracker's count at the step's start, when known: what it
// holds beyond the parameters and the optimizer state allocated so far (the
// batch, whatever the caller keeps) is held through the step as well.
std::pair<int64_t, std::string> resident_state(torch::nn::Module& model, parallel::ZeroModel& zero,
                                               const torch::optim::Optimizer& optimizer, int64_t accumulation,
                                               bool host_is_device, int64_t live = 0);

}  // namespace internal

struct Engine::Impl {
  // Checkpointing defaults and counters, offloading and tensor-parallel
  // counters and the RNG tracker of this engine alone: installed for each of
  // its calls (regions keep it for their backward).
  std::shared_ptr<Context> context = Context::create();
  EngineOptions options;
  std::shared_ptr<ParallelLayout> layout;
  std::shared_ptr<Communicator> world;
  BatchSizes batch;
  std::unique_ptr<MemoryTracker> own_memory;
  MemoryTracker* memory = nullptr;
  c10::DeviceType device = c10::DeviceType::CPU;  // where the model's memory is counted
  at::Device placed{at::kCPU};                    // where the model was placed (Engine::device())
  PolicyOptions policy;
  bool auto_plan = false;
  bool trains = false;  // some parameter of the model requires grad (at initialize)
  // activation_checkpointing.device_memory_budget_bytes as the planner takes
  // it ("auto" resolved against the model's device); unset without one.
  std::optional<int64_t> device_budget_bytes;
  int regions = 0;
  std::unique_ptr<ActivationPlanner> planner;
  std::unique_ptr<parallel::ZeroModel> zero;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  SaveIdentity identity;
  std::unique_ptr<SaveDirLock> save_lock;
  std::string save_lock_dir, loaded_dir;
  int gathered_scopes = 0;
  // The step's measurement: peaks, timers, counters, the memory timeline.
  internal::StepMeter meter;
  // fp16's loss scaling (null: fp16 off).
  std::unique_ptr<internal::LossScaling> loss_scaling;
  // The search that decided an "auto" micro-batch (EngineOptions::micro_batch).
  std::optional<MicroBatchSearch> search;

  // A save written in the background (train.async_save), until it completes.
  std::unique_ptr<BackgroundSave> pending_save;
  // Completes the pending save if every rank's file is written (`wait`:
  // waiting for them); collective while one is pending.
  void complete_saves(bool wait);
  // Throws `error`, one every rank raises alike at the same point (an agreed
  // verdict), after completing the pending save: it is a collective every
  // rank reaches, so a save whose files are written is kept as a blocking
  // save would be. An error one rank raises alone must not come here (the
  // other ranks would not join the completion: a hang); those leave the
  // pending save incomplete, its staging folder removed by the next run.
  [[noreturn]] void throw_agreed(std::exception_ptr error);

  // The step in progress.
  internal::Phase phase = internal::Phase::kIdle;
  double lr = 0;
  double loss_sum = 0;

  TrainShards shards(const torch::nn::Module& model) const { return train_shards(*zero, *layout, model); }

  // The constructor's wiring, in its order.
  void wire_memory();
  void wire_layout(const Config& config);
  void wire_device(torch::nn::Module& model, const Config& config);
  void wire_checkpointing(torch::nn::Module& model, const Config& config, const std::string& blocks,
                          int64_t n_blocks);
  void wire_sharding(torch::nn::Module& model, const Config& config, const torch::nn::ModuleListImpl& blocks,
                     const std::vector<at::Tensor>& sharded);
  // train_micro_batch_size_per_gpu "auto" by measurement, then the batch.
  void decide_micro_batch(torch::nn::Module& model, Config& config);
  MicroBatchSearch measure_micro_batches(torch::nn::Module& model, const Config& config, int64_t fit,
                                         int64_t divides);
  void check_device_budget(torch::nn::Module& model);
  void wire_identity(torch::nn::Module& model, const Config& config);
  void wire_meter(torch::nn::Module& model, const Config& config);

  // One forward and backward of `fn`'s micro-batch through the sharding, the
  // checkpointing hooks in place and activation offloading, its loss divided
  // by `divide_by`: the planner's profiling step and the micro-batch search's
  // pass. The gradients stay for the caller to drop (ZeroModel::zero_grad).
  void forward_backward(torch::nn::Module& model, const Config& config, const std::function<at::Tensor()>& fn,
                        double divide_by);

  // forward()'s parts.
  void check_forward_order() const;
  void plan_blocks(torch::nn::Module& model, const Config& config, const std::function<at::Tensor()>& fn,
                   const std::vector<int64_t>& plan_key);
  at::Tensor call_forward(const std::function<at::Tensor()>& fn) const;
  at::Tensor run_forward(torch::nn::Module& model, const Config& config, const std::function<at::Tensor()>& fn);

  // step()'s parts.
  struct Verdict {
    bool bad_loss = false, bad_grads = false;
    at::Tensor arrived;  // per parameter: whether any rank gave it a gradient
  };
  Verdict check_gradients();
  // Whether the step is skipped: fp16's overflow (the scale updated, the
  // gradients unscaled when it is not), else train.on_nonfinite.
  bool skip_step(int64_t step, const Verdict& verdict, const Config& config);
  double update(torch::nn::Module& model, const Config& config, const at::Tensor& arrived);
  double mean_loss();
};

}  // namespace remat
