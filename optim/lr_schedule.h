// The learning rate each optimizer step trains at: DeepSpeed's WarmupLR,
// WarmupDecayLR and WarmupCosineLR (deepspeed/runtime/lr_schedules.py),
// stepped as DeepSpeed's engine steps them (deepspeed/runtime/engine.py), so a
// config gives the same rate at every step in remat as in DeepSpeed.
//
// DeepSpeed's scheduler holds a position, last_batch_iteration i, and sets the
// rate of i in the optimizer: its constructor with i = -1 (with any other
// given value it leaves the optimizer's own rate), and the engine steps it to
// i + 1 after each optimizer step. So with scheduler.params.last_batch_iteration
// k, step 1 trains at rate(-1) (k = -1) or at optimizer.params.lr (k >= 0),
// and step s >= 2 at rate(k + s - 1): a fresh run's step s at rate(s - 2).
// docs/config.md tabulates the first steps.
//
//   engine step s:  set learning_rate(optimizer, scheduler, s); forward,
//                   backward, optimizer step
//
// `s` counts the run's optimizer steps from its start, those before a resume
// included (a save records its step), so a resumed run trains each step at
// the rate the uninterrupted run would. Saves do not record k: a resume with
// another k shifts the schedule. Steps skipped for a non-finite gradient (an
// fp16 overflow) do not advance it, as DeepSpeed's engine does not step its
// scheduler after one: the engine passes s - skipped steps (saved with the step).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optim/options.h"

namespace remat::optim {

// The scheduler section: DeepSpeed's learning-rate schedules, with the
// parameters of DeepSpeed's constructors: each type takes its own (a key of
// another type is refused, as DeepSpeed's constructor refuses it). A key left
// out takes DeepSpeed's default: the accessors below hold them, and
// with_defaults writes them into the keys the type takes.
struct SchedulerOptions {
  std::string type = "none";  // none | WarmupLR | WarmupDecayLR | WarmupCosineLR
  std::optional<double> warmup_min_lr;     // WarmupLR, WarmupDecayLR
  std::optional<double> warmup_max_lr;     // WarmupLR, WarmupDecayLR
  int64_t warmup_num_steps = 1000;         // below 2: 2 (warmup_steps())
  std::string warmup_type = "log";         // log | linear
  std::optional<int64_t> total_num_steps;  // WarmupDecayLR, WarmupCosineLR: required
  std::optional<double> warmup_min_ratio;  // WarmupCosineLR: of optimizer.params.lr
  std::optional<double> cos_min_ratio;     // WarmupCosineLR: of optimizer.params.lr
  // DeepSpeed's index of the last batch already trained on: -1 (a fresh run)
  // or k >= 0, which starts the schedule after it (see above).
  int64_t last_batch_iteration = -1;

  // DeepSpeed's defaults, for a key left out. warmup_max_lr: the optimizer's
  // rate under WarmupLR, 0.001 under WarmupDecayLR.
  double min_lr() const { return warmup_min_lr.value_or(0.0); }
  double max_lr(double optimizer_lr) const {
    return warmup_max_lr.value_or(type == "WarmupLR" ? optimizer_lr : 1e-3);
  }
  double min_ratio() const { return warmup_min_ratio.value_or(0.0); }
  double floor_ratio() const { return cos_min_ratio.value_or(1e-4); }
  // The warm-up's length: DeepSpeed raises warmup_num_steps to at least 2.
  int64_t warmup_steps() const { return warmup_num_steps < 2 ? 2 : warmup_num_steps; }
};

// The names of scheduler.type.
const std::vector<std::string>& scheduler_type_names();

// `scheduler` with the defaults of the keys its type takes written in (so
// that a dumped config shows the rates the run trains with); another type's
// keys stay unset. `optimizer_lr`: WarmupLR's default warmup_max_lr.
SchedulerOptions with_defaults(SchedulerOptions scheduler, double optimizer_lr);

// The rules of SchedulerOptions, written once: empty when valid (and for
// type none, which reads no other key), else every rule broken, one per
// line, each naming its key ('scheduler.params.total_num_steps') and what to
// change. `total_note`: said after total_num_steps' value where a problem
// quotes it (where the caller took the value from, "" for nothing).
std::string check_scheduler_options(const SchedulerOptions& scheduler, const std::string& total_note = "");

// Values that are valid but change less than they seem (a warm-up below 2
// steps, a decay no longer than the warm-up), one sentence each, as
// DeepSpeed warns of them; `total_note` as above.
std::vector<std::string> scheduler_settings_without_effect(const SchedulerOptions& scheduler,
                                                           const std::string& total_note = "");

// DeepSpeed's get_lr() with the scheduler at last_batch_iteration `i` (>= -1),
// with `i` < 0 the rate its constructor sets. W is warmup_steps() (at least 2),
// T total_num_steps, g(i) the warm-up's share: ln(i + 1) / ln(W) (log) or i / W
// (linear), for 0 <= i < W.
//   WarmupLR:       min_lr at i < 0, min_lr + (max_lr - min_lr) g(i) in the
//                   warm-up, max_lr after it.
//   WarmupDecayLR:  the same, then min_lr + (max_lr - min_lr) d(i) from i = W,
//                   d(i) = max(0, (T - i) / max(1, T - W)): min_lr from i = T.
//   WarmupCosineLR: optimizer.params.lr times a ratio: 0 at i < 0,
//                   r + (1 - r) g(i) in the warm-up (r warmup_min_ratio), then
//                   max(0, c + (1 - c) (1 + cos(pi p)) / 2) (c cos_min_ratio),
//                   p = min(1, (i - W + 1) / max(1, T - W)): c from i = T - 1.
//   none:           optimizer.params.lr.
double scheduled_rate(const OptimizerOptions& optimizer, const SchedulerOptions& scheduler, int64_t i);

// The rate optimizer step `step` (1-based, counted from the start of the run)
// trains at.
double learning_rate(const OptimizerOptions& optimizer, const SchedulerOptions& scheduler, int64_t step);

}  // namespace remat::optim
