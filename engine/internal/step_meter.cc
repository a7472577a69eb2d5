#include "engine/internal/step_meter.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "checkpointing/planner.h"
#include "optim/optimizer.h"
#include "parallel/nvme_optimizer.h"
#include "parallel/zero.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"

namespace remat::internal {
namespace {

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The memory category of what lives at `place`: a host account's own, else
// the device's `on_device`.
MemoryCategory category_at(parallel::Place place, MemoryCategory on_device) {
  switch (place) {
    case parallel::Place::kHostOptimizer: return MemoryCategory::kHostOptimizer;
    case parallel::Place::kHostParameters: return MemoryCategory::kHostParameters;
    default: return on_device;
  }
}

// A part of the model state's own tensors (ZeroModel::holding).
MemoryCategory category_of(const parallel::HeldTensors& part) {
  const bool state = part.part == parallel::StatePart::kOptimizerState;
  return category_at(part.place, state ? MemoryCategory::kOptimizerState : MemoryCategory::kParameters);
}

}  // namespace

StepMeter::StepMeter() = default;
StepMeter::~StepMeter() = default;

void StepMeter::attach(StepMeterTargets targets) {
  t_ = std::move(targets);
  for (const parallel::HeldTensors& part : t_.zero->holding()) {
    if (part.part == parallel::StatePart::kOptimizerState) state_place_ = part.place;
  }
  device_ = c10::Device(t_.device);
  if (t_.device != c10::DeviceType::CPU && t_.model != nullptr) {
    for (const auto& p : t_.model->parameters()) {
      if (p.device().type() == t_.device) {
        device_ = p.device();
        break;
      }
    }
  }
}

void StepMeter::begin_planning() {
  planned_ = false;
  plan_start_ = Clock::now();
}

void StepMeter::end_planning(bool planned) {
  planned_ = planned;
  if (planned) plan_ms_ = ms_between(plan_start_, Clock::now());
}

void StepMeter::begin_step() {
  if (!trace_path_.empty() && !trace_) start_trace();
  base_ = t_.memory->current(t_.device);
  t_.memory->reset_peak();
  if (device_.is_cuda()) reset_device_memory_peaks(device_);
  t_.zero->reset_peak();
  before_ = Counters::read(t_.zero);
  start_ = Clock::now();
  fwd_ms_ = bwd_ms_ = opt_ms_ = 0;
  engine_comm_bytes_ = 0;
  saved_ = act_host_ = act_kept_ = fwd_held_ = act_peak_ = step_peak_ = 0;
}

void StepMeter::begin_forward() {
  step_peak_ = std::max(step_peak_, t_.memory->peak(t_.device));
  micro_base_ = t_.memory->current(t_.device);
  t_.memory->reset_peak();
  phase_start_ = Clock::now();
}

void StepMeter::end_forward() {
  const Counters held = Counters::read();
  saved_ = std::max(saved_, held.checkpoint_saved_bytes);
  act_host_ = std::max(act_host_, held.offload.host_bytes);
  act_kept_ = std::max(act_kept_, held.offload.kept_bytes);
  fwd_held_ = std::max(fwd_held_, t_.memory->current(t_.device) - micro_base_);
  fwd_ms_ += ms_between(phase_start_, Clock::now());
}

void StepMeter::begin_backward() { phase_start_ = Clock::now(); }

void StepMeter::end_backward() {
  if (trace_) classify_gradients();
  act_peak_ = std::max(act_peak_, t_.memory->peak(t_.device) - micro_base_);
  bwd_ms_ += ms_between(phase_start_, Clock::now());
}

void StepMeter::begin_optimizer() { phase_start_ = Clock::now(); }

void StepMeter::end_optimizer() {
  opt_ms_ = ms_between(phase_start_, Clock::now());
  // The state its first step allocated, where it lives apart from the device's.
  if (trace_ && state_place_ != parallel::Place::kDevice) {
    const MemoryCategory category = category_at(state_place_, MemoryCategory::kOptimizerState);
    for (const auto& t : optim::optimizer_state_tensors(*t_.optimizer)) classify_memory(t, category);
  }
}

const Counters& StepMeter::read_counters() {
  share_ = Counters::read(t_.zero).since(before_);
  return share_;
}

StepMetrics StepMeter::finish_step(const StepOutcome& outcome, const ActivationPlan* plan) {
  step_peak_ = std::max(step_peak_, t_.memory->peak(t_.device));
  StepMetrics m = StepMetrics::from_counters(share_);
  m.step = outcome.step;
  m.loss = outcome.loss;
  m.lr = outcome.lr;
  m.grad_norm = outcome.grad_norm;
  m.skipped = outcome.skipped;
  m.step_ms = ms_between(start_, Clock::now());
  m.fwd_ms = fwd_ms_;
  m.bwd_ms = bwd_ms_;
  m.opt_ms = opt_ms_;
  m.mem_base_bytes = base_;
  m.mem_peak_bytes = step_peak_;
  m.mem_act_peak_bytes = act_peak_;
  m.mem_fwd_held_bytes = fwd_held_;
  m.ckpt_saved_bytes = saved_;
  m.act_host_bytes = act_host_;
  m.act_kept_bytes = act_kept_;
  m.comm_bytes += engine_comm_bytes_;
  m.optimizer_state_bytes = optim::optimizer_state_bytes(*t_.optimizer);
  if (state_place_ == parallel::Place::kHostOptimizer) {
    // The optimizer's state lives beside its host parameters.
    m.offload_optimizer = true;
    m.host_optimizer_bytes = share_.zero.host_bytes + m.optimizer_state_bytes;
  }
  if (const auto nvme = parallel::nvme_optimizer_stats(*t_.optimizer)) {
    // The state on disk; the host holds the buffers it streams through.
    m.nvme_optimizer = true;
    m.host_optimizer_bytes += nvme->buffer_bytes;
    m.nvme_state_bytes = nvme->file_bytes;
    m.nvme_master_bytes = share_.zero.disk_master_bytes;
    m.nvme_master_read_bytes = share_.zero.disk_master_read_bytes;
    m.nvme_master_written_bytes = share_.zero.disk_master_written_bytes;
    m.nvme_read_bytes = nvme->bytes_read;
    m.nvme_written_bytes = nvme->bytes_written;
    m.nvme_step_ms = 1e3 * nvme->seconds;
  }
  if (t_.offload_param) {
    m.offload_param = true;
    m.host_parameter_bytes = share_.zero.host_param_bytes;
  }
  if (t_.nvme_parameters) {
    m.nvme_parameters = true;
    m.nvme_parameter_bytes = share_.zero.disk_param_bytes;
    m.nvme_parameter_read_bytes = share_.zero.disk_param_read_bytes;
    m.nvme_parameter_written_bytes = share_.zero.disk_param_written_bytes;
  }
  if (device_.is_cuda()) read_cuda_allocator(m);
  if (plan != nullptr) m.plan = plan_metrics(*plan);
  return m;
}

// The caching allocator's bytes, where a CUDA LibTorch reports them.
void StepMeter::read_cuda_allocator(StepMetrics& m) const {
  const DeviceMemory d = device_memory(device_);
  if (!d.allocator_stats) return;
  m.cuda_allocator = true;
  m.cuda_allocated_bytes = d.allocated;
  m.cuda_peak_allocated_bytes = d.peak_allocated;
  m.cuda_reserved_bytes = d.reserved;
  m.cuda_peak_reserved_bytes = d.peak_reserved;
}

nlohmann::json StepMeter::plan_metrics(const ActivationPlan& plan) const {
  nlohmann::json out = {{"act_plan", plan.summary()},
                        {"act_plan_budget_bytes", plan.budget_bytes},
                        {"act_plan_predicted_peak_bytes", plan.predicted_peak},
                        {"act_plan_extra_cpu_ms", plan.predicted_extra_cpu_ms},
                        {"act_plan_extra_wall_ms", plan.predicted_extra_wall_ms},
                        {"act_planned", planned_}};
  if (plan.device_budget_bytes > 0) {
    out["act_plan_device_budget_bytes"] = plan.device_budget_bytes;
    out["act_plan_predicted_total_peak_bytes"] = plan.predicted_total_peak;
  }
  if (planned_) out["act_plan_ms"] = plan_ms_;
  return out;
}

void StepMeter::record_next_step(const std::string& path, int max_samples) {
  trace_path_ = path;
  trace_samples_ = max_samples;
}

// The memory timeline: what is live at the start is split by what holds it,
// each part of the model state by where it lives (ZeroModel::holding): a
// host part's gradients are held with it.
void StepMeter::start_trace() {
  std::vector<MemoryTrace::Known> known;
  for (const parallel::HeldTensors& part : t_.zero->holding()) {
    // Parameters gathered on use (stage 3) are views of their gathered units.
    if (part.part == parallel::StatePart::kGatheredOnUse) continue;
    const MemoryCategory category = category_of(part);
    const bool state = part.part == parallel::StatePart::kOptimizerState;
    for (const auto& t : state ? optim::optimizer_state_tensors(*t_.optimizer) : part.tensors) {
      known.push_back({t, category});
      if (part.place != parallel::Place::kDevice && t.grad().defined()) known.push_back({t.grad(), category});
    }
  }
  trace_ = std::make_unique<MemoryTrace>(*t_.memory, known);
}

// Gradients autograd allocated count as gradients over their whole life,
// a host part's in its host account (the offloaded optimizer's host
// gradients, offload_param's shards'); the state the offloaded optimizer's
// first step allocates is classified in end_optimizer.
void StepMeter::classify_gradients() const {
  for (const parallel::HeldTensors& part : t_.zero->holding()) {
    const MemoryCategory category = category_at(part.place, MemoryCategory::kGradients);
    for (const auto& p : part.tensors) classify_memory(p.grad(), category);
  }
}

void StepMeter::finish_trace(const StepMetrics& m) {
  if (!trace_) return;
  const auto recorded = std::move(trace_);
  const std::string path = std::move(trace_path_);
  trace_path_.clear();
  recorded->stop();
  nlohmann::json other = t_.trace_labels;
  other["step"] = m.step;
  other["mem_base_bytes"] = m.mem_base_bytes;
  other["mem_peak_bytes"] = m.mem_peak_bytes;
  if (m.offload_optimizer) other["host_optimizer_bytes"] = m.host_optimizer_bytes;
  if (m.offload_param) other["host_parameter_bytes"] = m.host_parameter_bytes;
  if (m.nvme_parameters) {
    other["nvme_parameter_bytes"] = m.nvme_parameter_bytes;
    other["nvme_parameter_read_bytes"] = m.nvme_parameter_read_bytes;
    other["nvme_parameter_written_bytes"] = m.nvme_parameter_written_bytes;
  }
  if (m.nvme_optimizer) {
    other["nvme_state_bytes"] = m.nvme_state_bytes;
    other["nvme_master_bytes"] = m.nvme_master_bytes;
    other["nvme_master_read_bytes"] = m.nvme_master_read_bytes;
    other["nvme_master_written_bytes"] = m.nvme_master_written_bytes;
    other["nvme_read_bytes"] = m.nvme_read_bytes;
    other["nvme_written_bytes"] = m.nvme_written_bytes;
  }
  ChromeTraceOptions chrome;
  chrome.max_samples = trace_samples_;
  chrome.pid = t_.rank;
  chrome.process_name = str("remat rank ", t_.rank);
  try {
    recorded->write(path, chrome, other);
  } catch (const Error& e) {
    // An auxiliary output: its failure costs neither this step nor the saves after it.
    log().warn("{}; the memory timeline of step {} is not written, and training goes on", e.what(), m.step);
    return;
  }
  log().info("memory timeline of step {} written to '{}'", m.step, path);
}

}  // namespace remat::internal
