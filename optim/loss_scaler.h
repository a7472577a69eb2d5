// fp16's loss scaler, DeepSpeed's arithmetic: the loss is multiplied by a
// scale before backward so that small gradients survive in fp16, the
// gradients are divided by it before the optimizer step, and a step whose
// gradients overflowed (inf or nan on any rank) is skipped.
//
// Dynamic scaling (loss_scale 0) starts at 2^initial_scale_power. A clean
// step that follows loss_scale_window clean steps since the last overflow (or
// the start, and again after each further window) doubles the scale. An
// overflow uses up one of `hysteresis` tolerated overflows; once none is
// left (the last one used), each overflow halves the scale, never below
// min_loss_scale, and an overflow at min_loss_scale is an error (DeepSpeed
// stops there too: training cannot go on without skipping every step). The
// tolerance is refilled by a doubling, or, with consecutive_hysteresis, by
// every clean step. A static scale (loss_scale > 0) never changes; an
// overflow still skips its step. The scaler is arithmetic only: which steps
// overflowed is the caller's to decide (one collective over every rank's
// gradients), and its state is the caller's to save.
//
//   remat::optim::LossScaler scaler(options);          // ConfigError on bad options
//   (loss * scaler.scale()).backward();
//   const bool overflow = ...;                          // the same on every rank
//   const auto update = scaler.update(overflow);       // update.skip: no optimizer step
//   if (!update.skip) { unscale the gradients by update.used_scale; step; }
#pragma once

#include <cstdint>
#include <string>

namespace remat::optim {

// DeepSpeed's fp16 section, less `enabled` and `auto_cast` (the engine's).
struct LossScalerOptions {
  // 0: dynamic loss scaling; > 0: this scale, fixed.
  double loss_scale = 0;
  // Dynamic: the first scale is 2^initial_scale_power.
  int initial_scale_power = 16;
  // Dynamic: the clean steps after which the scale doubles.
  int64_t loss_scale_window = 1000;
  // Dynamic: the overflows tolerated before the scale halves (DeepSpeed's
  // delayed shift; 1 halves at every overflow).
  int hysteresis = 2;
  // Dynamic: every clean step refills the tolerated overflows (else only a
  // doubling does), so only consecutive overflows halve the scale.
  bool consecutive_hysteresis = false;
  // Dynamic: the scale never goes below this.
  double min_loss_scale = 1;

  bool dynamic() const { return loss_scale == 0; }
};

// The rules of LossScalerOptions, written once: empty when valid, else every
// rule broken, one per line, each naming its key ('fp16.hysteresis') and what
// to change.
std::string check_loss_scaler_options(const LossScalerOptions& options);

// Where a scaler is: all of it a save needs to resume it bitwise.
struct LossScalerState {
  double scale = 1;              // the scale of the next step
  int64_t iteration = 0;         // steps updated so far
  int64_t last_overflow = -1;    // the iteration of the last overflow (-1: none)
  int hysteresis_left = 1;       // overflows still tolerated before halving
  int64_t overflows = 0;         // steps skipped for overflow so far

  bool operator==(const LossScalerState& o) const {
    return scale == o.scale && iteration == o.iteration && last_overflow == o.last_overflow &&
           hysteresis_left == o.hysteresis_left && overflows == o.overflows;
  }
};

class LossScaler {
 public:
  // Throws ConfigError with check_loss_scaler_options' message when invalid.
  explicit LossScaler(LossScalerOptions options);

  const LossScalerOptions& options() const { return options_; }
  // The scale the step in progress multiplies its loss by.
  double scale() const { return state_.scale; }

  // What update() did with a step.
  struct Update {
    bool skip = false;      // the step overflowed: no optimizer step
    double used_scale = 1;  // the scale the step's gradients carry
    double next_scale = 1;  // the scale of the next step
  };
  // Records a step's verdict (the same on every rank). Throws Error when the
  // step overflowed at min_loss_scale with no tolerance left.
  Update update(bool overflow);

  const LossScalerState& state() const { return state_; }
  // A saved state (ConfigError, naming what is wrong, when it cannot be this
  // scaler's: a scale that is not positive and finite, a negative count).
  void load_state(const LossScalerState& state);

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

}  // namespace remat::optim
