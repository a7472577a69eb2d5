#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace remat::optim {

// The exponents whose 2^p is a normal float32: the scaled loss is float32.
constexpr int kMinPower = -126, kMaxPower = 127;

std::string check_loss_scaler_options(const LossScalerOptions& o) {
  std::string problems;
  auto add = [&](const std::string& line) { problems += (problems.empty() ? "" : "\n") + line; };
  if (!std::isfinite(o.loss_scale) || o.loss_scale < 0) {
    add(str("'fp16.loss_scale' = ", o.loss_scale, " must be 0 (dynamic loss scaling) or a finite scale > 0 "
            "(static)"));
  }
  if (o.initial_scale_power < kMinPower || o.initial_scale_power > kMaxPower) {
    add(str("'fp16.initial_scale_power' = ", o.initial_scale_power, " must be in [", kMinPower, ", ", kMaxPower,
            "]: the first scale, 2^initial_scale_power, multiplies a float32 loss (DeepSpeed's default is 16)"));
  }
  if (o.loss_scale_window < 1) {
    add(str("'fp16.loss_scale_window' = ", o.loss_scale_window, " must be at least 1 (the clean steps between "
            "doublings of the scale)"));
  }
  if (o.hysteresis < 1) {
    add(str("'fp16.hysteresis' = ", o.hysteresis, " must be at least 1 (1 halves the scale at every overflow)"));
  }
  if (!std::isfinite(o.min_loss_scale) || o.min_loss_scale <= 0) {
    add(str("'fp16.min_loss_scale' = ", o.min_loss_scale, " must be a finite scale > 0"));
  }
  return problems;
}

LossScaler::LossScaler(LossScalerOptions options) : options_(options) {
  const std::string problems = check_loss_scaler_options(options_);
  if (!problems.empty()) throw ConfigError("config error: " + problems);
  state_.scale = options_.dynamic() ? std::ldexp(1.0, options_.initial_scale_power) : options_.loss_scale;
  state_.hysteresis_left = options_.hysteresis;
}

LossScaler::Update LossScaler::update(bool overflow) {
  const LossScalerOptions& o = options_;
  LossScalerState next = state_;
  Update u;
  u.skip = overflow;
  u.used_scale = state_.scale;
  if (overflow) ++next.overflows;
  if (o.dynamic() && overflow) {
    if (o.hysteresis == 1 || state_.hysteresis_left == 1) {
      if (state_.scale == o.min_loss_scale) {
        throw Error(str("fp16: the gradients overflowed at the loss scale's floor (fp16.min_loss_scale = ",
                        o.min_loss_scale, ") with no overflow left to tolerate (fp16.hysteresis = ", o.hysteresis,
                        "): every further step would be skipped. Lower fp16.min_loss_scale, lower "
                        "optimizer.params.lr or set gradient_clipping, or train in bf16 (bf16.enabled), which "
                        "needs no loss scaling"));
      }
      next.scale = std::max(state_.scale / 2, o.min_loss_scale);
    } else {
      --next.hysteresis_left;
    }
    next.last_overflow = state_.iteration;
  } else if (o.dynamic()) {
    if (o.consecutive_hysteresis) next.hysteresis_left = o.hysteresis;
    // The clean steps since the last overflow (or the start), before this one.
    const int64_t stable = state_.iteration - state_.last_overflow - 1;
    if (stable > 0 && stable % o.loss_scale_window == 0) {
      next.hysteresis_left = o.hysteresis;
      next.scale = state_.scale * 2;
    }
  }
  ++next.iteration;
  state_ = next;
  u.next_scale = state_.scale;
  return u;
}

void LossScaler::load_state(const LossScalerState& s) {
  std::string wrong;
  if (!std::isfinite(s.scale) || s.scale <= 0) wrong = str("its scale is ", s.scale, " (not finite and > 0)");
  if (s.iteration < 0 || s.overflows < 0 || s.last_overflow < -1 || s.last_overflow >= s.iteration ||
      s.hysteresis_left < 1) {
    wrong = str("its counts are inconsistent (iteration ", s.iteration, ", last overflow ", s.last_overflow,
                ", overflows ", s.overflows, ", hysteresis left ", s.hysteresis_left, ")");
  }
  if (!wrong.empty()) {
    throw ConfigError(str("the saved fp16 loss scaler state cannot be resumed: ", wrong));
  }
  state_ = s;
  // A save of a static scale resumed with another static scale: this run's.
  if (!options_.dynamic()) state_.scale = options_.loss_scale;
}

}  // namespace remat::optim
