#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "engine/config.h"
#include "runtime/error.h"

namespace remat {
namespace {

// The warm-up's share at position 0 <= i < W: from 0 at i = 0 towards 1.
double warmup_share(const SchedulerConfig& s, int64_t i) {
  const auto w = static_cast<double>(s.warmup_steps());
  if (s.warmup_type == "linear") return static_cast<double>(i) / w;
  return 1.0 / std::log(w) * std::log(static_cast<double>(i + 1));
}

// WarmupDecayLR's share after the warm-up: 1 at i = W, 0 from i = T.
double linear_decay_share(const SchedulerConfig& s, int64_t i) {
  const auto total = static_cast<double>(s.total_num_steps.value_or(0));
  const double span = std::max(1.0, total - static_cast<double>(s.warmup_steps()));
  return std::max(0.0, (total - static_cast<double>(i)) / span);
}

// WarmupCosineLR's ratio after the warm-up: from 1 down to cos_min_ratio,
// reached at i = T - 1 and kept.
double cosine_ratio(const SchedulerConfig& s, int64_t i) {
  const int64_t w = s.warmup_steps();
  const double span = std::max<double>(1.0, static_cast<double>(s.total_num_steps.value_or(0) - w));
  const double progress = std::min(1.0, static_cast<double>(i - w + 1) / span);
  const double floor = s.floor_ratio(), half_cosine = (1.0 + std::cos(M_PI * progress)) / 2.0;
  return std::max(0.0, floor + (1.0 - floor) * half_cosine);
}

double warmup_cosine_rate(const OptimizerConfig& o, const SchedulerConfig& s, int64_t i) {
  if (i < 0) return 0.0;
  if (i < s.warmup_steps()) return o.lr * (s.min_ratio() + warmup_share(s, i) * (1.0 - s.min_ratio()));
  return o.lr * cosine_ratio(s, i);
}

// WarmupLR and WarmupDecayLR: warmup_min_lr plus a share of the climb.
double warmup_rate(const OptimizerConfig& o, const SchedulerConfig& s, int64_t i) {
  const double lo = s.min_lr(), climb = s.max_lr(o.lr) - lo;
  if (i < 0) return lo;
  if (i < s.warmup_steps()) return lo + climb * warmup_share(s, i);
  return s.type == "WarmupDecayLR" ? lo + climb * linear_decay_share(s, i) : lo + climb;
}

}  // namespace

double scheduled_rate(const OptimizerConfig& optimizer, const SchedulerConfig& scheduler, int64_t i) {
  if (scheduler.type == "none") return optimizer.lr;
  if (scheduler.type == "WarmupCosineLR") return warmup_cosine_rate(optimizer, scheduler, i);
  if (scheduler.type == "WarmupLR" || scheduler.type == "WarmupDecayLR") return warmup_rate(optimizer, scheduler, i);
  throw ConfigError(str("scheduler.type '", scheduler.type,
                        "' is not one of none, WarmupLR, WarmupDecayLR, WarmupCosineLR"));
}

double learning_rate(const OptimizerConfig& optimizer, const SchedulerConfig& scheduler, int64_t step) {
  REMAT_CHECK_GE(step, 1, "learning_rate: optimizer steps count from 1");
  const int64_t k = scheduler.last_batch_iteration;
  if (step == 1) return k == -1 ? scheduled_rate(optimizer, scheduler, -1) : optimizer.lr;
  return scheduled_rate(optimizer, scheduler, k + step - 1);
}

}  // namespace remat
