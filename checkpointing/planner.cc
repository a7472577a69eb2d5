#include "checkpointing/planner.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <map>
#include <thread>

#include <torch/cuda.h>

#include "checkpointing/frontier.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/policy.h"
#include "checkpointing/selective_op.h"
#include "checkpointing/stored_inputs.h"
#include "rng/rng_tracker.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory.h"

namespace remat {
namespace {

constexpr const char* kChoiceNames[] = {"keep", "selective_op", "selective_op_matmuls", "full",
                                        "full_offload", "offload_activations"};

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

double wall_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string mib(int64_t bytes) { return str(std::round(static_cast<double>(bytes) / 1048576.0 * 100) / 100, " MiB"); }

// Runs a module under one choice: the region options are read when it runs
// (like a policy's regions), so configure_checkpointing may come later.
class ChoiceHook : public ModuleHook {
 public:
  ChoiceHook(BlockChoice choice, std::string name, const PlannerOptions& planner,
             std::weak_ptr<torch::nn::Module> block)
      : choice_(choice), name_(std::move(name)), fixed_(planner.checkpoint), offload_(planner.offload),
        block_(std::move(block)) {
    if (choice == BlockChoice::kSelectiveOp) {
      save_ops_ = std::make_shared<const SaveOps>(resolve_save_ops(default_save_ops()));
    } else if (choice == BlockChoice::kSelectiveOpMatmuls) {
      save_ops_ = std::make_shared<const SaveOps>(resolve_save_ops(matmul_save_ops()));
    }
  }

  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override {
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

 private:
  BlockChoice choice_;
  std::string name_;
  std::optional<CheckpointOptions> fixed_;
  OffloadActivationsOptions offload_;
  std::weak_ptr<torch::nn::Module> block_;
  std::shared_ptr<const SaveOps> save_ops_;
};

// What one profiling run measured, per block.
struct RunRecord {
  explicit RunRecord(size_t n)
      : held(n, 0), fwd_peak(n, 0), fwd_live(n, 0), after(n, 0), transient(n, 0), host(n, 0), host_live(n, 0),
        host_after(n, 0), fwd_cpu(n, 0), fwd_wall(n, 0), bwd_cpu(n, 0), bwd_wall(n, 0),
        rec_cpu(n, 0), rec_wall(n, 0), window_live(n, -1), seen(n, false) {}
  MemoryTracker memory;
  c10::DeviceType device = c10::DeviceType::CPU;
  std::vector<int64_t> held, fwd_peak, fwd_live, after, transient;
  // The same for the bytes moved to the host (host_moved() at the same points).
  std::vector<int64_t> host, host_live, host_after;

  // What each block holds: the live bytes from its call's start to the next
  // block's, so that an input the block frees once its call returns (moved to
  // the host, say) is its own; the last block's is measured over its call.
  void settle_held() {
    const size_t n = held.size();
    for (size_t i = 0; i < n; ++i) {
      held[i] = (i + 1 < n ? fwd_live[i + 1] : after[i]) - fwd_live[i];
      host[i] = (i + 1 < n ? host_live[i + 1] : host_after[i]) - host_live[i];
    }
  }
  // Bytes moved to the host so far: in a forward nothing comes back before
  // the backward, so the difference between two points of it is what the
  // blocks between them moved and hold there.
  static int64_t host_moved() {
    return activation_offload_stats().offloaded_bytes + stored_input_stats().offloaded_bytes;
  }
  std::vector<double> fwd_cpu, fwd_wall, bwd_cpu, bwd_wall;
  std::vector<double> rec_cpu, rec_wall;  // the recompute alone (inside the backward's window)
  std::vector<int64_t> window_live;  // live bytes when the block's backward began
  std::vector<bool> seen;            // the block's backward began
  int open = -1;                     // the block whose backward runs now
  int64_t open_live = 0;
  double open_cpu = 0, open_wall = 0;
  std::thread::id open_thread;
  bool cpu_valid = true;
  int64_t forward_peak = -1;  // peak from the last block's call to the first block's backward
  int64_t overall_peak = 0;   // peak of the whole run
  int64_t before_blocks = -1;  // peak before the first block's call
  std::vector<std::pair<at::Tensor, unsigned>> leaf_hooks;  // removed after the run

  // Work queued on a GPU finishes before a time or a peak is read.
  void settle() const {
    if (device == c10::DeviceType::CUDA) torch::cuda::synchronize();
  }

  // The peak so far, kept in overall_peak, and a fresh one from now.
  int64_t restart_peak() {
    const int64_t p = memory.peak(device);
    overall_peak = std::max(overall_peak, p);
    memory.reset_peak();
    return p;
  }

  // Block `i`'s output got its gradient: its backward begins (and the one
  // running ends). i < 0 only ends the running one.
  void boundary(int i) {
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
};

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

// A block's call during profiling: its choice, with memory and time around it
// and gradient hooks marking where its backward begins and ends.
class MeasuringHook : public ModuleHook {
 public:
  MeasuringHook(std::shared_ptr<ChoiceHook> inner, int index, std::shared_ptr<RunRecord> record)
      : inner_(std::move(inner)), index_(index), record_(std::move(record)) {}

  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override {
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

 private:
  // `next` for the region: its first call is the forward (timed around the
  // whole call above), every later one a recompute, timed alone here. A
  // recompute may end by throwing once it has what backward needs: still
  // counted.
  IValueFn timing_recomputes(const IValueFn& next) const {
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

  std::shared_ptr<ChoiceHook> inner_;
  int index_;
  std::weak_ptr<RunRecord> record_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

// The predicted extra time of each choice per block ([column][block]; column
// 0 is keep), from each round's time of the block's forward and backward
// (`total`) and of its recompute alone (`recompute`), both [column][block]
// [round]. A checkpoint (selective_op, selective_op_matmuls, full) costs its
// recompute: the median over rounds of that alone. Its forward and the rest
// of its backward run the same kernels as keeping's, and their difference
// from keeping's, two long measurements of separate steps, is mostly the
// machine's noise (docs/checkpointing.md, "The time model"). An offloading
// choice costs what is not a recompute as well: per round, the block's time
// less its recompute over keeping's in the same round (the copies and their
// waits), the median over rounds, at least 0.
struct TimeModel {
  std::vector<std::vector<double>> extra, recompute;  // [column][block]
};
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

std::vector<std::shared_ptr<torch::nn::Module>> block_modules(torch::nn::Module& model,
                                                              const std::string& path) {
  auto list = find_block_list(model, path);
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (size_t i = 0; i < list->size(); ++i) out.push_back(list->ptr(i));
  if (out.empty()) {
    throw ConfigError(str("activation checkpointing planner: the ModuleList '", path,
                          "' has no blocks to plan for"));
  }
  return out;
}

c10::Device model_device(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) return p.device();
  return c10::Device(c10::DeviceType::CPU);
}

// The decision time of a cost.
double decision_ms(const BlockCosts& costs, const ChoiceCost& c) {
  return costs.decide_on_wall_time ? c.extra_wall_ms : c.extra_cpu_ms;
}

// A partial plan of blocks 0..i: held bytes so far and time, with the path back.
struct State {
  int64_t held;
  double time;
  int parent;  // index into the previous layer
  int column;
};

// Whether block i under `c` stays within `budget` in its forward and its
// backward, with `held` bytes held by the blocks before it.
bool fits(const BlockCosts& costs, int64_t held, const ChoiceCost& c, int64_t budget) {
  return costs.forward_live_base + held + c.forward_peak_bytes <= budget &&
         costs.backward_base + held + c.held_bytes + c.transient_bytes <= budget;
}

// The error for a budget no plan meets: the smallest one any plan meets, and
// what to change. `offloading`: every forward runs in an activation
// offloading scope (activation_offloading.enabled), which is then the cause.
[[noreturn]] void throw_budget_unmet(const BlockCosts& costs, int64_t budget, bool offloading) {
  const int64_t least = smallest_feasible_budget(costs);
  const double fraction = costs.keep_peak > 0 ? std::ceil(1000.0 * static_cast<double>(least) /
                                                          static_cast<double>(costs.keep_peak)) / 1000.0
                                              : 1.0;
  const std::string unmet = str("activation checkpointing: the memory budget of ", budget, " bytes (", mib(budget),
                                ") cannot be met: the smallest peak any plan reaches is ", least, " bytes (",
                                mib(least), "; every block kept: ", costs.keep_peak, " bytes). ");
  const std::string raise = str("activation_checkpointing.memory_budget_bytes to at least ", least,
                                " or memory_budget_fraction to at least ", fraction);
  if (!offloading) throw ConfigError(str(unmet, "Raise ", raise, ", or lower the batch size"));
  throw ConfigError(str(
      unmet, "The cause is activation offloading: activation_offloading.enabled is true, so every step runs "
      "inside an offloading scope that already moves what the blocks save to the host. Keeping a block then "
      "costs the device little and checkpointing it saves little more, so the peak with every block kept is "
      "about the least any plan reaches and a memory_budget_fraction below ", fraction,
      " cannot be met. Set activation_offloading.enabled to false, so that the planner weighs offloading per "
      "block itself (its offload_activations and full_offload choices, on a GPU) against checkpointing; or "
      "raise ", raise, "; or keep offloading with activation_checkpointing.variant \"none\" or \"full\""));
}

}  // namespace

const char* block_choice_name(BlockChoice choice) { return kChoiceNames[static_cast<int>(choice)]; }

const std::vector<BlockChoice>& all_block_choices() {
  static const std::vector<BlockChoice> all = {BlockChoice::kKeep,        BlockChoice::kSelectiveOp,
                                               BlockChoice::kSelectiveOpMatmuls, BlockChoice::kFull,
                                               BlockChoice::kFullOffload, BlockChoice::kOffloadActivations};
  return all;
}

BlockChoice block_choice_from_name(const std::string& name) {
  for (BlockChoice c : all_block_choices()) {
    if (name == block_choice_name(c)) return c;
  }
  throw ConfigError(str("unknown block choice '", name,
                        "'; use keep, selective_op, selective_op_matmuls, full, full_offload or "
                        "offload_activations"));
}

std::string describe_costs(const BlockCosts& costs) {
  std::string out = str("measured: forward_live_base ", costs.forward_live_base, ", forward_base ",
                        costs.forward_base, ", backward_base ", costs.backward_base, ", fixed_peak ",
                        costs.fixed_peak, ", every block kept ", costs.keep_peak, " bytes\n");
  out += "  block  choice                 held bytes  forward peak  transient bytes  extra ms (CPU)  extra ms (wall)"
         "  of which recompute (CPU)  (wall)\n";
  for (size_t i = 0; i < costs.blocks.size(); ++i) {
    for (size_t c = 0; c < costs.choices.size(); ++c) {
      const ChoiceCost& x = costs.blocks[i][c];
      char line[240];
      std::snprintf(line, sizeof(line), "  %5zu  %-21s %11lld  %12lld  %15lld  %14.2f  %15.2f  %24.2f  %6.2f\n", i,
                    block_choice_name(costs.choices[c]), static_cast<long long>(x.held_bytes),
                    static_cast<long long>(x.forward_peak_bytes), static_cast<long long>(x.transient_bytes),
                    x.extra_cpu_ms, x.extra_wall_ms, x.recompute_cpu_ms, x.recompute_wall_ms);
      out += line;
    }
  }
  return out;
}

std::string ActivationPlan::summary() const {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) out += (i ? "," : "") + std::string(block_choice_name(choices[i]));
  return out;
}

std::string ActivationPlan::table(const BlockCosts& costs) const {
  std::string out = str("activation plan for a budget of ", budget_bytes, " bytes (", mib(budget_bytes),
                        "; every block kept: ", mib(costs.keep_peak), "), predicted peak ",
                        predicted_peak, " bytes (", mib(predicted_peak), "), predicted extra ",
                        std::round(predicted_extra_cpu_ms * 10) / 10, " ms CPU / ",
                        std::round(predicted_extra_wall_ms * 10) / 10, " ms wall per step\n");
  out += "  block  choice                 kept bytes   extra ms (CPU)  extra ms (wall)\n";
  for (size_t i = 0; i < choices.size(); ++i) {
    const auto col = static_cast<size_t>(std::find(costs.choices.begin(), costs.choices.end(), choices[i]) -
                                         costs.choices.begin());
    const ChoiceCost& c = costs.blocks[i][col];
    char line[160];
    std::snprintf(line, sizeof(line), "  %5zu  %-21s %11lld  %14.2f  %15.2f\n", i, block_choice_name(choices[i]),
                  static_cast<long long>(c.held_bytes), c.extra_cpu_ms, c.extra_wall_ms);
    out += line;
  }
  return out;
}

int64_t predict_peak(const BlockCosts& costs, const std::vector<size_t>& columns) {
  REMAT_CHECK_EQ(columns.size(), costs.blocks.size(), "one column per block");
  int64_t held = 0, peak = costs.fixed_peak;
  for (size_t i = 0; i < columns.size(); ++i) {
    const ChoiceCost& c = costs.blocks[i].at(columns[i]);
    peak = std::max(peak, costs.forward_live_base + held + c.forward_peak_bytes);
    held += c.held_bytes;
    peak = std::max(peak, costs.backward_base + held + c.transient_bytes);
  }
  return std::max(peak, costs.forward_base + held);
}

int64_t smallest_feasible_budget(const BlockCosts& costs) {
  // For feasibility only the least held bytes so far matters (every later
  // bound is easier with less), so a budget is feasible when the greedy walk
  // keeping the least held bytes that respects each block's bound finishes.
  auto feasible = [&](int64_t budget) {
    if (costs.fixed_peak > budget) return false;
    int64_t held = 0;
    for (const auto& block : costs.blocks) {
      int64_t best = std::numeric_limits<int64_t>::max();
      for (const ChoiceCost& c : block) {
        if (fits(costs, held, c, budget)) {
          best = std::min(best, c.held_bytes);
        }
      }
      if (best == std::numeric_limits<int64_t>::max()) return false;
      held += best;
    }
    return costs.forward_base + held <= budget;
  };
  int64_t hi = std::max<int64_t>(costs.fixed_peak, 0) + std::max<int64_t>(costs.forward_base, 0) +
               std::max<int64_t>(costs.forward_live_base, 0) + std::max<int64_t>(costs.backward_base, 0);
  for (const auto& block : costs.blocks) {
    int64_t m = 0;
    for (const ChoiceCost& c : block) {
      m = std::max(m, std::max<int64_t>(c.held_bytes, 0) + std::max<int64_t>(c.transient_bytes, 0) +
                          std::max<int64_t>(c.forward_peak_bytes, 0));
    }
    hi += m;
  }
  int64_t lo = std::numeric_limits<int64_t>::min() / 4;
  if (!feasible(hi)) throw Error("activation planner: no budget is feasible (inconsistent costs)");
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (feasible(mid) ? hi : lo) = mid;
  }
  return hi;
}

ActivationPlan solve_activation_plan(const BlockCosts& costs, int64_t budget) {
  const size_t n = costs.blocks.size();
  REMAT_CHECK(n > 0, "activation planner: no blocks");
  REMAT_CHECK(!costs.choices.empty(), "activation planner: no choices");
  // Layered dynamic programming over the Pareto frontier of (held bytes, time):
  // a state with no more held bytes and no more time than another dominates it
  // (every later bound is easier with fewer held bytes).
  std::vector<std::vector<State>> layers;
  std::vector<State> frontier = {{0, 0.0, -1, -1}};
  for (size_t i = 0; i < n && !frontier.empty(); ++i) {
    std::vector<State> next;
    for (size_t p = 0; p < frontier.size(); ++p) {
      for (size_t col = 0; col < costs.blocks[i].size(); ++col) {
        const ChoiceCost& c = costs.blocks[i][col];
        if (!fits(costs, frontier[p].held, c, budget)) continue;
        const int64_t held = frontier[p].held + c.held_bytes;
        next.push_back({held, frontier[p].time + decision_ms(costs, c), static_cast<int>(p),
                        static_cast<int>(col)});
      }
    }
    // Deterministic order: held, then time, then the earliest path.
    std::stable_sort(next.begin(), next.end(), [](const State& a, const State& b) {
      return a.held != b.held ? a.held < b.held : a.time < b.time;
    });
    std::vector<State> kept;
    double best_time = std::numeric_limits<double>::infinity();
    for (const State& s : next) {
      if (s.time < best_time) {
        kept.push_back(s);
        best_time = s.time;
      }
    }
    layers.push_back(frontier);
    frontier = std::move(kept);
  }
  // The last layer: states whose forward bound holds; least time, then least held.
  int best = -1;
  if (layers.size() == n && costs.fixed_peak <= budget) {
    for (size_t s = 0; s < frontier.size(); ++s) {
      if (costs.forward_base + frontier[s].held > budget) continue;
      if (best < 0 || frontier[s].time < frontier[best].time) best = static_cast<int>(s);
    }
  }
  if (best < 0) throw_budget_unmet(costs, budget, /*offloading=*/false);
  std::vector<size_t> columns(n);
  const State* s = &frontier[best];
  for (size_t i = n; i-- > 0;) {
    columns[i] = static_cast<size_t>(s->column);
    if (i > 0) s = &layers[i][s->parent];
  }
  ActivationPlan plan;
  plan.budget_bytes = budget;
  for (size_t i = 0; i < n; ++i) {
    const ChoiceCost& c = costs.blocks[i][columns[i]];
    plan.choices.push_back(costs.choices[columns[i]]);
    plan.predicted_extra_cpu_ms += c.extra_cpu_ms;
    plan.predicted_extra_wall_ms += c.extra_wall_ms;
  }
  plan.predicted_peak = predict_peak(costs, columns);
  return plan;
}

void apply_activation_plan(torch::nn::Module& model, const ActivationPlan& plan, const PlannerOptions& options) {
  auto blocks = block_modules(model, options.blocks);
  if (plan.choices.size() != blocks.size()) {
    throw Error(str("activation plan: the plan has ", plan.choices.size(), " choices but '", options.blocks,
                    "' has ", blocks.size(), " blocks: plan again for this model"));
  }
  remove_activation_checkpointing(model);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (plan.choices[i] == BlockChoice::kKeep) continue;
    set_module_hook(*blocks[i], HookSlot::kCheckpoint,
                    std::make_shared<ChoiceHook>(plan.choices[i], str(options.blocks, ".", i), options, blocks[i]));
  }
}

BlockCosts profile_activation_choices(torch::nn::Module& model, const std::function<void()>& step,
                                      const PlannerOptions& options, Communicator* comm) {
  auto blocks = block_modules(model, options.blocks);
  const size_t n = blocks.size();
  if (options.rounds < 1) throw ConfigError(str("activation planner: rounds = ", options.rounds, " must be at least 1"));
  BlockCosts costs;
  const c10::Device model_at = model_device(model);
  const c10::DeviceType device = model_at.type();
  // On a GPU the host thread's CPU time is launch time, not the kernels':
  // the measurements synchronize the device and the decision uses wall time.
  costs.decide_on_wall_time = options.decide_on_wall_time || device != c10::DeviceType::CPU;
  costs.choices = {BlockChoice::kKeep};
  const CheckpointOptions& base = options.checkpoint ? *options.checkpoint : default_checkpoint_options();
  for (BlockChoice c : options.choices.empty() ? all_block_choices() : options.choices) {
    if (std::find(costs.choices.begin(), costs.choices.end(), c) != costs.choices.end()) continue;
    if (options.choices.empty()) {
      const bool offloads = c == BlockChoice::kFullOffload || c == BlockChoice::kOffloadActivations;
      if (offloads && device == c10::DeviceType::CPU) continue;
      // A full checkpoint whose inputs the defaults offload already is the same choice twice.
      if (c == BlockChoice::kFullOffload && base.storage.offload) continue;
    }
    costs.choices.push_back(c);
  }
  const size_t k = costs.choices.size();

  // What the step changes besides activations: the RNG and the gradients.
  const RngSnapshot rng = capture_rng();
  std::vector<std::pair<at::Tensor, at::Tensor>> grads;  // parameter, its gradient's values (or undefined)
  for (auto& p : model.parameters()) {
    grads.emplace_back(p, p.grad().defined() ? p.grad().clone() : at::Tensor());
  }
  auto reset_grads = [&](bool values) {
    at::NoGradGuard no_grad;
    for (auto& [p, g] : grads) {
      if (!g.defined()) {
        if (p.grad().defined()) p.mutable_grad() = at::Tensor();
      } else if (!p.grad().defined()) {
        p.mutable_grad() = g.clone();
      } else if (values) {
        p.mutable_grad().copy_(g);
      }
    }
  };

  // [column][block]: each round's times (the block's forward and backward,
  // and its recompute alone); bytes are the same every run.
  std::vector<std::vector<std::vector<double>>> cpu(k, std::vector<std::vector<double>>(n));
  std::vector<std::vector<std::vector<double>>> wall = cpu, rec_cpu = cpu, rec_wall = cpu;
  std::vector<std::vector<int64_t>> held(k, std::vector<int64_t>(n, 0)), transient = held, fwd_peak = held,
      host = held;
  const int64_t lowest = std::numeric_limits<int64_t>::min() / 4;
  int64_t forward_base = lowest, forward_live_base = lowest, backward_base = lowest, fixed_peak = 0, keep_peak = 0;
  bool cpu_valid = true;

  auto run = [&](size_t column, bool measured) {
    reset_grads(false);
    restore_rng(rng);
    auto record = std::make_shared<RunRecord>(n);
    record->device = device;
    for (size_t i = 0; i < n; ++i) {
      auto inner = std::make_shared<ChoiceHook>(costs.choices[column], str(options.blocks, ".", i), options,
                                                blocks[i]);
      set_module_hook(*blocks[i], HookSlot::kCheckpoint,
                      std::make_shared<MeasuringHook>(inner, static_cast<int>(i), record));
    }
    // Hooks on the caller's leaf tensors go with the run, whatever happens.
    struct LeafHooks {
      RunRecord& record;
      ~LeafHooks() {
        for (auto& [tensor, handle] : record.leaf_hooks) {
          try {
            tensor.remove_hook(handle);
          } catch (...) {  // the tensor's hooks are gone already
          }
        }
      }
    } leaf_hooks{*record};
    int64_t step_tail = 0;
    try {
      step();
      // After block 0's backward: the peak of what follows (embedding backward).
      step_tail = record->open >= 0 ? 0 : record->memory.peak(device);
      record->boundary(-1);
      for (size_t i = 0; i < n && measured; ++i) {
        if (!record->seen[i]) {
          throw Error(str("activation planner: the profiling step ran no backward through ", options.blocks, ".", i,
                          " (its output does not require grad, or the step does not call backward): the step "
                          "must run one forward and one backward on the real batch in training mode"));
        }
      }
    } catch (...) {
      remove_activation_checkpointing(model);
      reset_grads(true);
      restore_rng(rng);
      throw;
    }
    if (!measured) return;
    record->settle_held();
    if (!record->cpu_valid) cpu_valid = false;
    int64_t s = 0;
    for (size_t i = 0; i < n; ++i) {
      forward_live_base = std::max(forward_live_base, record->fwd_live[i] - s);
      fwd_peak[column][i] = std::max(fwd_peak[column][i], record->fwd_peak[i]);
      held[column][i] = std::max(held[column][i], record->held[i]);
      host[column][i] = std::max(host[column][i], record->host[i]);
      transient[column][i] = std::max(transient[column][i], record->transient[i]);
      cpu[column][i].push_back(record->fwd_cpu[i] + record->bwd_cpu[i]);
      wall[column][i].push_back(record->fwd_wall[i] + record->bwd_wall[i]);
      rec_cpu[column][i].push_back(record->rec_cpu[i]);
      rec_wall[column][i].push_back(record->rec_wall[i]);
      s += record->held[i];
      backward_base = std::max(backward_base, record->window_live[i] - s);
    }
    forward_base = std::max(forward_base, record->forward_peak - s);
    fixed_peak = std::max({fixed_peak, step_tail, record->before_blocks});
    if (column == 0) keep_peak = std::max({keep_peak, record->overall_peak, step_tail});
  };

  run(0, /*measured=*/false);  // first-call allocations, caches
  for (int r = 0; r < options.rounds; ++r) {
    for (size_t column = 0; column < k; ++column) run(column, /*measured=*/true);
  }
  remove_activation_checkpointing(model);
  reset_grads(true);
  restore_rng(rng);

  // The time model, per block and choice (model_extra_time).
  const TimeModel cpu_model = model_extra_time(costs.choices, cpu, rec_cpu);
  const TimeModel wall_model = model_extra_time(costs.choices, wall, rec_wall);
  // Every rank decides on the same numbers: the largest of each.
  std::vector<double> flat;
  for (size_t c = 0; c < k; ++c) {
    for (size_t i = 0; i < n; ++i) {
      flat.insert(flat.end(), {static_cast<double>(held[c][i]), static_cast<double>(fwd_peak[c][i]),
                               static_cast<double>(transient[c][i]), cpu_model.extra[c][i], wall_model.extra[c][i],
                               cpu_model.recompute[c][i], wall_model.recompute[c][i],
                               static_cast<double>(host[c][i])});
    }
  }
  flat.insert(flat.end(), {static_cast<double>(forward_base), static_cast<double>(forward_live_base),
                           static_cast<double>(backward_base), static_cast<double>(fixed_peak),
                           static_cast<double>(keep_peak), cpu_valid ? 0.0 : 1.0});
  if (comm != nullptr && comm->size() > 1) {
    // On the model's device: an NCCL communicator reduces device tensors.
    at::Tensor t = at::tensor(flat, at::kDouble).to(model_at);
    comm->allReduce(t, {ReduceOp::kMax})->wait();
    t = t.cpu();
    flat.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  size_t at_ = 0;
  costs.blocks.assign(n, std::vector<ChoiceCost>(k));
  for (size_t c = 0; c < k; ++c) {
    for (size_t i = 0; i < n; ++i) {
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
  // The reference of a fraction: at least what the model predicts with every
  // block kept, so that a fraction of 1 always fits keeping everything.
  costs.keep_peak = std::max(costs.keep_peak, predict_peak(costs, std::vector<size_t>(n, 0)));
  return costs;
}

void check_planner_options(torch::nn::Module& model, const PlannerOptions& options) {
  const std::string invalid = check_memory_budget(options);
  if (!invalid.empty()) throw ConfigError("activation checkpointing planner: " + invalid);
  if (options.rounds < 1) throw ConfigError(str("activation planner: rounds = ", options.rounds, " must be at least 1"));
  const size_t n = block_modules(model, options.blocks).size();
  if (options.memory_budget_knee && n < 2) {
    throw ConfigError(str(
        "activation_checkpointing.memory_budget_fraction is \"knee\", the plan where the planner's frontier of "
        "predicted peak against extra time bends, but the model has ", n, " block in '", options.blocks,
        "': one block has one plan per choice and no frontier across blocks to find a knee on. Set "
        "memory_budget_fraction to a number (e.g. 0.5) or memory_budget_bytes, or give the model more blocks"));
  }
}

ActivationPlan plan_activation_checkpointing(torch::nn::Module& model, const std::function<void()>& step,
                                             const PlannerOptions& options, Communicator* comm) {
  check_planner_options(model, options);
  BlockCosts costs = profile_activation_choices(model, step, options, comm);
  log_rank0().debug("{}", describe_costs(costs));
  std::vector<FrontierPoint> frontier;
  if (options.memory_budget_knee || !options.report_dir.empty()) frontier = activation_frontier(costs);
  ActivationPlan plan;
  if (options.memory_budget_knee) {
    const size_t knee = frontier_knee(frontier);
    plan = frontier[knee].plan;
    log_rank0().info("activation planner: the knee is point {} of the {} on the frontier (peak {} of every block "
                     "kept), the budget memory_budget_fraction \"knee\" plans for",
                     knee, frontier.size(),
                     std::round(1000.0 * static_cast<double>(plan.predicted_peak) /
                                static_cast<double>(std::max<int64_t>(costs.keep_peak, 1))) / 1000.0);
  } else if (options.device_memory_budget_bytes) {
    // The whole device: what the state takes is not the activations' to use.
    const int64_t device = *options.device_memory_budget_bytes;
    const int64_t least = smallest_feasible_budget(costs);
    if (device - options.state_bytes < least) {
      const std::string state = str(mib(options.state_bytes), options.state_description.empty() ? "" : ": ",
                                    options.state_description);
      throw ConfigError(str(
          "activation checkpointing: device_memory_budget_bytes = ", device, " (", mib(device), ") cannot be met",
          device <= options.state_bytes ? ", it is below the model state alone" : "", ": the model state takes ",
          state, " and the smallest activation peak any plan reaches is ", mib(least), " (every block kept: ",
          mib(costs.keep_peak), "). The smallest feasible budget is ", options.state_bytes + least,
          " bytes: raise activation_checkpointing.device_memory_budget_bytes to at least that, shard more (a "
          "higher zero_optimization.stage, more data-parallel ranks) or lower the batch size"));
    }
    plan = solve_activation_plan(costs, device - options.state_bytes);
    plan.device_budget_bytes = device;
    plan.predicted_total_peak = options.state_bytes + plan.predicted_peak;
    log_rank0().info("activation planner: whole device: budget {}, state {} + predicted activation peak {} = {}",
                     mib(device), mib(options.state_bytes), mib(plan.predicted_peak), mib(plan.predicted_total_peak));
  } else {
    const int64_t budget =
        options.memory_budget_bytes
            ? *options.memory_budget_bytes
            : static_cast<int64_t>(std::min(1e18, std::floor(*options.memory_budget_fraction *
                                                             static_cast<double>(costs.keep_peak))));
    // With every step offloaded, a budget no plan meets is offloading's doing: said so.
    if (options.offload.enabled && smallest_feasible_budget(costs) > budget) {
      throw_budget_unmet(costs, budget, /*offloading=*/true);
    }
    plan = solve_activation_plan(costs, budget);
  }
  if (!options.report_dir.empty() && (comm == nullptr || comm->rank() == 0)) {
    const std::string path = (std::filesystem::path(options.report_dir) / "frontier.csv").string();
    write_frontier_csv(path, costs, frontier, plan);
    log_rank0().info("activation planner: wrote the frontier ({} plans) to {}", frontier.size(), path);
  }
  apply_activation_plan(model, plan, options);
  log_rank0().info("{}", plan.table(costs));
  return plan;
}

bool ActivationPlanner::ensure(const std::vector<int64_t>& batch_shape, const std::function<void()>& step) {
  if (plan_ && plan_->batch_shape == batch_shape) return false;
  ActivationPlan plan = plan_activation_checkpointing(model_, step, options_, comm_);
  plan.batch_shape = batch_shape;
  plan_ = std::move(plan);
  ++plans_made_;
  return true;
}

}  // namespace remat
