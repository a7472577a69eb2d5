// The measurement of an optimizer step, beside the step rather than inside
// it: memory peaks, phase timers, a snapshot of every counter turned into
// the step's StepMetrics, and the memory timeline of Engine::trace_memory.
// The engine calls it at a few points, in this order per optimizer step:
//
//   meter.begin_planning(); meter.end_planning(planned);  // variant auto
//   meter.begin_step();                  // the first micro-step, gradients cleared
//   for each micro-step:
//     meter.begin_forward(); ... meter.end_forward();
//     meter.begin_backward(); ... meter.end_backward();   // inside the backward's try
//   meter.begin_optimizer(); ... meter.end_optimizer();   // unless skipped
//   meter.count_comm(bytes);             // the engine's own collectives
//   const Counters& share = meter.read_counters();
//   StepMetrics m = meter.finish_step(outcome, plan);
//   meter.finish_trace(m);               // after the step's span ended
//
// This rank's alone: nothing here communicates.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "engine/step_counters.h"
#include "engine/step_metrics.h"
#include "parallel/zero_memory.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace remat {

class MemoryTracker;
class MemoryTrace;
struct ActivationPlan;
namespace parallel {
class ZeroModel;
}

namespace internal {

// What the meter reads, wired once by the engine; the pointers outlive it.
struct StepMeterTargets {
  MemoryTracker* memory = nullptr;
  c10::DeviceType device = c10::DeviceType::CPU;  // where the model's memory is counted
  torch::nn::Module* model = nullptr;
  parallel::ZeroModel* zero = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  // zero_optimization.offload_param is set: host_parameter_bytes is in the
  // metrics, 0 where every parameter stays whole on the device (persistent).
  bool offload_param = false;
  // offload_param.device "nvme": nvme_parameter_bytes is in the metrics.
  bool nvme_parameters = false;
  int rank = 0;
  // A memory timeline's otherData besides the step and its memory metrics.
  nlohmann::json trace_labels = nlohmann::json::object();
};

// What the step decided, for its metrics.
struct StepOutcome {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = -1;
  bool skipped = false;
};

class StepMeter {
 public:
  StepMeter();
  ~StepMeter();
  StepMeter(const StepMeter&) = delete;
  StepMeter& operator=(const StepMeter&) = delete;

  void attach(StepMeterTargets targets);

  // variant auto: the planning at a step's first micro-step (plan_ms, act_planned).
  void begin_planning();
  void end_planning(bool planned);

  void begin_step();
  void begin_forward();
  void end_forward();
  void begin_backward();
  void end_backward();
  void begin_optimizer();
  void end_optimizer();
  void count_comm(int64_t bytes) { engine_comm_bytes_ += bytes; }

  // This step's share of every counter since begin_step().
  const Counters& read_counters();
  // The step's metrics (after read_counters()); `plan`: the plan in force, if any.
  StepMetrics finish_step(const StepOutcome& outcome, const ActivationPlan* plan);

  // Engine::trace_memory: the next step's timeline is recorded and written
  // to `path` by finish_trace.
  void record_next_step(const std::string& path, int max_samples);
  bool recording() const { return trace_ != nullptr; }
  void finish_trace(const StepMetrics& m);

 private:
  using Clock = std::chrono::steady_clock;
  void start_trace();
  void classify_gradients() const;
  nlohmann::json plan_metrics(const ActivationPlan& plan) const;
  void read_cuda_allocator(StepMetrics& m) const;

  StepMeterTargets t_;
  // Where the optimizer's state lives (ZeroModel::holding): the host's
  // account is in the metrics (host_optimizer_bytes).
  parallel::Place state_place_ = parallel::Place::kDevice;
  c10::Device device_{c10::DeviceType::CPU};  // t_.device with its index (the model's)
  // The step in progress.
  bool planned_ = false;
  double plan_ms_ = 0;
  int64_t base_ = 0, saved_ = 0, act_host_ = 0, act_kept_ = 0, fwd_held_ = 0, act_peak_ = 0, step_peak_ = 0;
  int64_t micro_base_ = 0, engine_comm_bytes_ = 0;
  Counters before_, share_;
  Clock::time_point start_, plan_start_, phase_start_;
  double fwd_ms_ = 0, bwd_ms_ = 0, opt_ms_ = 0;
  // trace_memory: the file of the next step's timeline, and its recording.
  std::string trace_path_;
  int trace_samples_ = 0;
  std::unique_ptr<MemoryTrace> trace_;
};

}  // namespace internal
}  // namespace remat
