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

namespace remat {

struct OptimizerConfig;
struct SchedulerConfig;

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
double scheduled_rate(const OptimizerConfig& optimizer, const SchedulerConfig& scheduler, int64_t i);

// The rate optimizer step `step` (1-based, counted from the start of the run)
// trains at.
double learning_rate(const OptimizerConfig& optimizer, const SchedulerConfig& scheduler, int64_t step);

}  // namespace remat
