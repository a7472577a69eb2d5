#include "checkpointing/internal/profiling.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <limits>

#include <torch/cuda.h>

#include "checkpointing/offload_activations.h"
#include "checkpointing/stored_inputs.h"
#include "runtime/communicator.h"
#include "runtime/logging.h"

namespace remat::internal {
namespace {

// The first tensor in `value` that requires grad, or an undefined one.
at::Tensor first_grad_tensor(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    return t.defined() && t.requires_grad() ? t : at::Tensor();
  }
  if (value.isTuple()) {
    for (const auto& v : value.toTupleRef().elements()) {
      at::Tensor t = first_grad_tensor(v);
      if (t.defined()) return t;
    }
  }
  if (value.isList()) {
    for (const c10::IValue& v : value.toListRef()) {
      at::Tensor t = first_grad_tensor(v);
      if (t.defined()) return t;
    }
  }
  return at::Tensor();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

}  // namespace

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

double wall_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ChoiceHook::ChoiceHook(BlockChoice choice, std::string name, std::optional<CheckpointOptions> fixed,
                       OffloadActivationsOptions offload, std::weak_ptr<torch::nn::Module> block)
    : choice_(choice), name_(std::move(name)), fixed_(std::move(fixed)), offload_(std::move(offload)),
      block_(std::move(block)) {
  if (choice == BlockChoice::kSelectiveOp) {
    save_ops_ = std::make_shared<const SaveOps>(resolve_save_ops(default_save_ops()));
  } else if (choice == BlockChoice::kSelectiveOpMatmuls) {
    save_ops_ = std::make_shared<const SaveOps>(resolve_save_ops(matmul_save_ops()));
  }
}

c10::IValue ChoiceHook::run(const std::vector<c10::IValue>& args, const IValueFn& next) {
  if (choice_ == BlockChoice::kKeep) return next(args);
  if (choice_ == BlockChoice::kOffloadActivations) {
    auto block = block_.lock();
    OffloadActivations offload(offload_, block.get());
    return next(args);
  }
  CheckpointOptions options = fixed_ ? *fixed_ : default_checkpoint_options();
  options.name = name_;
  options.save_ops = save_ops_;
  if (choice_ == BlockChoice::kFullOffload) {
    options.storage.offload = true;
    // Each block's inputs leave during its own call, so what it holds is
    // measured where it is held, whatever the neighbours choose.
    options.storage.offload_keep_last = false;
  }
  return checkpoint_ivalues(next, args, options);
}

void RunRecord::settle_held() {
  const size_t n = held.size();
  for (size_t i = 0; i < n; ++i) {
    held[i] = (i + 1 < n ? fwd_live[i + 1] : after[i]) - fwd_live[i];
    host[i] = (i + 1 < n ? host_live[i + 1] : host_after[i]) - host_live[i];
  }
}

int64_t RunRecord::host_moved() {
  return activation_offload_stats().offloaded_bytes + stored_input_stats().offloaded_bytes;
}

void RunRecord::settle() const {
  if (device == c10::DeviceType::CUDA) torch::cuda::synchronize();
}

int64_t RunRecord::restart_peak() {
  const int64_t p = memory.peak(device);
  overall_peak = std::max(overall_peak, p);
  memory.reset_peak();
  return p;
}

void RunRecord::boundary(int i) {
  settle();
  if (open >= 0) {
    transient[open] = std::max(transient[open], memory.peak(device) - open_live);
    if (std::this_thread::get_id() != open_thread) cpu_valid = false;
    bwd_cpu[open] += thread_cpu_ms() - open_cpu;
    bwd_wall[open] += wall_ms() - open_wall;
    open = -1;
  }
  const int64_t p = restart_peak();
  if (forward_peak < 0) forward_peak = p;
  if (i >= 0) {
    open = i;
    seen[i] = true;
    open_live = memory.current(device);
    window_live[i] = open_live;
    open_thread = std::this_thread::get_id();
    open_cpu = thread_cpu_ms();
    open_wall = wall_ms();
  }
}

c10::IValue MeasuringHook::run(const std::vector<c10::IValue>& args, const IValueFn& next) {
  auto record = record_.lock();
  if (!record) return inner_->run(args, next);
  record->settle();
  const int64_t before = record->memory.current(record->device);
  const int64_t host_before = RunRecord::host_moved();
  const int64_t earlier = record->restart_peak();
  if (record->before_blocks < 0) record->before_blocks = earlier;
  const double cpu0 = thread_cpu_ms(), wall0 = wall_ms();
  c10::IValue out = inner_->run(args, timing_recomputes(next));
  record->settle();
  record->fwd_cpu[index_] += thread_cpu_ms() - cpu0;
  record->fwd_wall[index_] += wall_ms() - wall0;
  record->fwd_live[index_] = before;
  record->fwd_peak[index_] = std::max(record->fwd_peak[index_], record->restart_peak() - before);
  record->after[index_] = record->memory.current(record->device);
  record->host_live[index_] = host_before;
  record->host_after[index_] = RunRecord::host_moved();
  std::weak_ptr<RunRecord> weak = record_;
  const int i = index_;
  at::Tensor output = first_grad_tensor(out);
  if (output.defined()) {
    output.register_hook([weak, i](const at::Tensor&) {
      if (auto r = weak.lock()) r->boundary(i);
    });
  }
  // A block's backward lasts until the next one's begins, so what runs
  // between them (a sharded unit's gradient reduction and the next unit's
  // gather) is charged to it; the first block's ends at its input's gradient.
  for (const auto& arg : args) {
    if (i != 0) break;
    at::Tensor input = first_grad_tensor(arg);
    if (!input.defined()) continue;
    const unsigned handle = input.register_hook([weak, i](const at::Tensor&) {
      if (auto r = weak.lock(); r && r->open == i) r->boundary(-1);
    });
    // A leaf (the caller's own tensor) outlives the run: its hook is removed then.
    if (input.is_leaf()) record->leaf_hooks.emplace_back(input, handle);
    break;
  }
  return out;
}

IValueFn MeasuringHook::timing_recomputes(const IValueFn& next) const {
  struct Timer {
    std::shared_ptr<RunRecord> record;
    int index;
    double cpu0 = thread_cpu_ms(), wall0 = wall_ms();
    ~Timer() {
      try {
        record->settle();
      } catch (...) {  // unwinding maybe: the device's error comes again at the next reading
      }
      record->rec_cpu[index] += thread_cpu_ms() - cpu0;
      record->rec_wall[index] += wall_ms() - wall0;
    }
  };
  auto calls = std::make_shared<int>(0);
  return [next, calls, weak = record_, i = index_](const std::vector<c10::IValue>& args) {
    auto record = weak.lock();
    if ((*calls)++ == 0 || !record) return next(args);
    record->settle();
    Timer timer{record, i};
    return next(args);
  };
}

TimeModel model_extra_time(const std::vector<BlockChoice>& choices,
                           const std::vector<std::vector<std::vector<double>>>& total,
                           const std::vector<std::vector<std::vector<double>>>& recompute) {
  const size_t k = total.size(), n = k ? total[0].size() : 0;
  TimeModel m{std::vector<std::vector<double>>(k, std::vector<double>(n, 0.0)), {}};
  m.recompute = m.extra;
  for (size_t c = 1; c < k; ++c) {
    const bool offloads = choices[c] == BlockChoice::kFullOffload || choices[c] == BlockChoice::kOffloadActivations;
    for (size_t i = 0; i < n; ++i) {
      m.recompute[c][i] = median(recompute[c][i]);
      double rest = 0;
      if (offloads) {
        std::vector<double> over;
        for (size_t r = 0; r < total[c][i].size(); ++r) {
          over.push_back(total[c][i][r] - recompute[c][i][r] - total[0][i][r]);
        }
        rest = std::max(0.0, median(over));
      }
      m.extra[c][i] = m.recompute[c][i] + rest;
    }
  }
  return m;
}

namespace {
constexpr int64_t kLowest = std::numeric_limits<int64_t>::min() / 4;
}  // namespace

Measurements::Measurements(size_t columns, size_t blocks)
    : k_(columns), n_(blocks), cpu_(columns, std::vector<std::vector<double>>(blocks)), wall_(cpu_),
      rec_cpu_(cpu_), rec_wall_(cpu_), held_(columns, std::vector<int64_t>(blocks, 0)), transient_(held_),
      fwd_peak_(held_), host_(held_), forward_base_(kLowest), forward_live_base_(kLowest),
      backward_base_(kLowest) {}

void Measurements::add(size_t column, const RunRecord& record, int64_t step_tail) {
  if (!record.cpu_valid) cpu_valid_ = false;
  int64_t s = 0;
  for (size_t i = 0; i < n_; ++i) {
    forward_live_base_ = std::max(forward_live_base_, record.fwd_live[i] - s);
    fwd_peak_[column][i] = std::max(fwd_peak_[column][i], record.fwd_peak[i]);
    held_[column][i] = std::max(held_[column][i], record.held[i]);
    host_[column][i] = std::max(host_[column][i], record.host[i]);
    transient_[column][i] = std::max(transient_[column][i], record.transient[i]);
    cpu_[column][i].push_back(record.fwd_cpu[i] + record.bwd_cpu[i]);
    wall_[column][i].push_back(record.fwd_wall[i] + record.bwd_wall[i]);
    rec_cpu_[column][i].push_back(record.rec_cpu[i]);
    rec_wall_[column][i].push_back(record.rec_wall[i]);
    s += record.held[i];
    backward_base_ = std::max(backward_base_, record.window_live[i] - s);
  }
  forward_base_ = std::max(forward_base_, record.forward_peak - s);
  fixed_peak_ = std::max({fixed_peak_, step_tail, record.before_blocks});
  if (column == 0) keep_peak_ = std::max({keep_peak_, record.overall_peak, step_tail});
}

std::vector<double> Measurements::flatten(const std::vector<BlockChoice>& choices) const {
  // The time model, per block and choice (model_extra_time).
  const TimeModel cpu_model = model_extra_time(choices, cpu_, rec_cpu_);
  const TimeModel wall_model = model_extra_time(choices, wall_, rec_wall_);
  std::vector<double> flat;
  for (size_t c = 0; c < k_; ++c) {
    for (size_t i = 0; i < n_; ++i) {
      flat.insert(flat.end(), {static_cast<double>(held_[c][i]), static_cast<double>(fwd_peak_[c][i]),
                               static_cast<double>(transient_[c][i]), cpu_model.extra[c][i], wall_model.extra[c][i],
                               cpu_model.recompute[c][i], wall_model.recompute[c][i],
                               static_cast<double>(host_[c][i])});
    }
  }
  flat.insert(flat.end(), {static_cast<double>(forward_base_), static_cast<double>(forward_live_base_),
                           static_cast<double>(backward_base_), static_cast<double>(fixed_peak_),
                           static_cast<double>(keep_peak_), cpu_valid_ ? 0.0 : 1.0});
  return flat;
}

void Measurements::unflatten(const std::vector<double>& flat, BlockCosts& costs) const {
  size_t at_ = 0;
  costs.blocks.assign(n_, std::vector<ChoiceCost>(k_));
  for (size_t c = 0; c < k_; ++c) {
    for (size_t i = 0; i < n_; ++i) {
      ChoiceCost& cost = costs.blocks[i][c];
      cost.held_bytes = static_cast<int64_t>(flat[at_++]);
      cost.forward_peak_bytes = static_cast<int64_t>(flat[at_++]);
      cost.transient_bytes = static_cast<int64_t>(flat[at_++]);
      cost.extra_cpu_ms = flat[at_++];
      cost.extra_wall_ms = flat[at_++];
      cost.recompute_cpu_ms = flat[at_++];
      cost.recompute_wall_ms = flat[at_++];
      cost.host_bytes = static_cast<int64_t>(flat[at_++]);
    }
  }
  costs.forward_base = static_cast<int64_t>(flat[at_++]);
  costs.forward_live_base = static_cast<int64_t>(flat[at_++]);
  costs.backward_base = static_cast<int64_t>(flat[at_++]);
  costs.fixed_peak = static_cast<int64_t>(flat[at_++]);
  costs.keep_peak = static_cast<int64_t>(flat[at_++]);
  if (flat[at_++] > 0 && !costs.decide_on_wall_time) {
    log_rank0().warn("activation planner: a block's backward ran on another thread than it began on, so its "
                     "thread CPU time is not comparable: deciding on wall time");
    costs.decide_on_wall_time = true;
  }
}

void Measurements::finish(BlockCosts& costs, Communicator* comm, c10::Device device) const {
  std::vector<double> flat = flatten(costs.choices);
  // Every rank decides on the same numbers: the largest of each.
  if (comm != nullptr && comm->size() > 1) {
    // On the model's device: an NCCL communicator reduces device tensors.
    at::Tensor t = at::tensor(flat, at::kDouble).to(device);
    comm->allReduce(t, {ReduceOp::kMax})->wait();
    t = t.cpu();
    flat.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  unflatten(flat, costs);
  // The reference of a fraction: at least what the model predicts with every
  // block kept, so that a fraction of 1 always fits keeping everything.
  costs.keep_peak = std::max(costs.keep_peak, predict_peak(costs, std::vector<size_t>(n_, 0)));
}

}  // namespace remat::internal
