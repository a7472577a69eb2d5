// The planner's measuring side (checkpointing/planner.h drives it): the hook
// that runs a block under one choice, the hook that measures a block's call
// and marks where its backward begins and ends, what one profiling run saw,
// the time model, and the measurements of every run, all-reduced into the
// costs the solver (checkpointing/plan.h) decides on.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checkpointing/checkpoint.h"
#include "checkpointing/options.h"
#include "checkpointing/plan.h"
#include "checkpointing/selective_op.h"
#include "nn/module_call.h"
#include "runtime/memory.h"

namespace remat {

class Communicator;

namespace internal {

// This thread's CPU time and the steady clock, in milliseconds.
double thread_cpu_ms();
double wall_ms();

// Runs a module under one choice: the region options are read when it runs
// (like a policy's regions), so configure_checkpointing may come later.
// `fixed`: the planner's region options (PlannerOptions::checkpoint), if set;
// `offload`: those of the offload_activations choice.
class ChoiceHook : public ModuleHook {
 public:
  ChoiceHook(BlockChoice choice, std::string name, std::optional<CheckpointOptions> fixed,
             OffloadActivationsOptions offload, std::weak_ptr<torch::nn::Module> block);

  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override;

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
  void settle_held();
  // Bytes moved to the host so far: in a forward nothing comes back before
  // the backward, so the difference between two points of it is what the
  // blocks between them moved and hold there.
  static int64_t host_moved();
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
  void settle() const;
  // The peak so far, kept in overall_peak, and a fresh one from now.
  int64_t restart_peak();
  // Block `i`'s output got its gradient: its backward begins (and the one
  // running ends). i < 0 only ends the running one.
  void boundary(int i);
};

// A block's call during profiling: its choice, with memory and time around it
// and gradient hooks marking where its backward begins and ends.
class MeasuringHook : public ModuleHook {
 public:
  MeasuringHook(std::shared_ptr<ChoiceHook> inner, int index, std::shared_ptr<RunRecord> record)
      : inner_(std::move(inner)), index_(index), record_(std::move(record)) {}

  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override;

 private:
  // `next` for the region: its first call is the forward (timed around the
  // whole call in run), every later one a recompute, timed alone here. A
  // recompute may end by throwing once it has what backward needs: still
  // counted.
  IValueFn timing_recomputes(const IValueFn& next) const;

  std::shared_ptr<ChoiceHook> inner_;
  int index_;
  std::weak_ptr<RunRecord> record_;
};

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
                           const std::vector<std::vector<std::vector<double>>>& recompute);

// What the measured runs saw, per choice and block: bytes as the largest of
// any run, times per round, and the bases.
//
//   Measurements m(choices, blocks);
//   m.add(column, record, step_tail);   // after each measured run
//   m.finish(costs, comm, device);      // costs.choices set before
class Measurements {
 public:
  Measurements(size_t columns, size_t blocks);
  // One measured run with every block under `column`; `step_tail`: the peak
  // after block 0's backward.
  void add(size_t column, const RunRecord& record, int64_t step_tail);
  // Fills costs.blocks and the bases: the time model per choice and block,
  // then the largest of every number across `comm`'s ranks (reduced on
  // `device`), so that every rank decides on the same costs. A backward that
  // ran on another thread than it began on makes it decide on wall time.
  void finish(BlockCosts& costs, Communicator* comm, c10::Device device) const;

 private:
  // Every number finish reduces, in one vector, and back into `costs`.
  std::vector<double> flatten(const std::vector<BlockChoice>& choices) const;
  void unflatten(const std::vector<double>& flat, BlockCosts& costs) const;

  size_t k_, n_;
  // [column][block]: each round's times (the block's forward and backward,
  // and its recompute alone); bytes are the same every run.
  std::vector<std::vector<std::vector<double>>> cpu_, wall_, rec_cpu_, rec_wall_;
  std::vector<std::vector<int64_t>> held_, transient_, fwd_peak_, host_;
  int64_t forward_base_, forward_live_base_, backward_base_, fixed_peak_ = 0, keep_peak_ = 0;
  bool cpu_valid_ = true;
};

}  // namespace internal
}  // namespace remat
