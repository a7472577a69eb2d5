#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/error.h"

namespace remat::optim {
namespace {

// The warm-up's share at position 0 <= i < W: from 0 at i = 0 towards 1.
double warmup_share(const SchedulerOptions& s, int64_t i) {
  const auto w = static_cast<double>(s.warmup_steps());
  if (s.warmup_type == "linear") return static_cast<double>(i) / w;
  return 1.0 / std::log(w) * std::log(static_cast<double>(i + 1));
}

// WarmupDecayLR's share after the warm-up: 1 at i = W, 0 from i = T.
double linear_decay_share(const SchedulerOptions& s, int64_t i) {
  const auto total = static_cast<double>(s.total_num_steps.value_or(0));
  const double span = std::max(1.0, total - static_cast<double>(s.warmup_steps()));
  return std::max(0.0, (total - static_cast<double>(i)) / span);
}

// WarmupCosineLR's ratio after the warm-up: from 1 down to cos_min_ratio,
// reached at i = T - 1 and kept.
double cosine_ratio(const SchedulerOptions& s, int64_t i) {
  const int64_t w = s.warmup_steps();
  const double span = std::max<double>(1.0, static_cast<double>(s.total_num_steps.value_or(0) - w));
  const double progress = std::min(1.0, static_cast<double>(i - w + 1) / span);
  const double floor = s.floor_ratio(), half_cosine = (1.0 + std::cos(M_PI * progress)) / 2.0;
  return std::max(0.0, floor + (1.0 - floor) * half_cosine);
}

double warmup_cosine_rate(const OptimizerOptions& o, const SchedulerOptions& s, int64_t i) {
  if (i < 0) return 0.0;
  if (i < s.warmup_steps()) return o.lr * (s.min_ratio() + warmup_share(s, i) * (1.0 - s.min_ratio()));
  return o.lr * cosine_ratio(s, i);
}

// WarmupLR and WarmupDecayLR: warmup_min_lr plus a share of the climb.
double warmup_rate(const OptimizerOptions& o, const SchedulerOptions& s, int64_t i) {
  const double lo = s.min_lr(), climb = s.max_lr(o.lr) - lo;
  if (i < 0) return lo;
  if (i < s.warmup_steps()) return lo + climb * warmup_share(s, i);
  return s.type == "WarmupDecayLR" ? lo + climb * linear_decay_share(s, i) : lo + climb;
}

}  // namespace

double scheduled_rate(const OptimizerOptions& optimizer, const SchedulerOptions& scheduler, int64_t i) {
  if (scheduler.type == "none") return optimizer.lr;
  if (scheduler.type == "WarmupCosineLR") return warmup_cosine_rate(optimizer, scheduler, i);
  if (scheduler.type == "WarmupLR" || scheduler.type == "WarmupDecayLR") return warmup_rate(optimizer, scheduler, i);
  throw ConfigError(str("scheduler.type '", scheduler.type,
                        "' is not one of none, WarmupLR, WarmupDecayLR, WarmupCosineLR"));
}

double learning_rate(const OptimizerOptions& optimizer, const SchedulerOptions& scheduler, int64_t step) {
  REMAT_CHECK_GE(step, 1, "learning_rate: optimizer steps count from 1");
  const int64_t k = scheduler.last_batch_iteration;
  if (step == 1) return k == -1 ? scheduled_rate(optimizer, scheduler, -1) : optimizer.lr;
  return scheduled_rate(optimizer, scheduler, k + step - 1);
}

const std::vector<std::string>& scheduler_type_names() {
  static const std::vector<std::string> names = {"none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
  return names;
}

SchedulerOptions with_defaults(SchedulerOptions s, double optimizer_lr) {
  if (s.type == "WarmupLR" || s.type == "WarmupDecayLR") {
    s.warmup_min_lr = s.min_lr();
    s.warmup_max_lr = s.max_lr(optimizer_lr);
  } else if (s.type == "WarmupCosineLR") {
    s.warmup_min_ratio = s.min_ratio();
    s.cos_min_ratio = s.floor_ratio();
  }
  return s;
}

namespace {

using Add = std::function<void(const std::string&)>;

// The keys of scheduler.params each type takes are its DeepSpeed constructor's
// arguments: another type's key is refused, as that constructor refuses it.
void check_keys(const SchedulerOptions& sc, const Add& add) {
  const bool cosine = sc.type == "WarmupCosineLR";
  // `name` belongs to another type and was given.
  auto refuse = [&](const std::string& name, bool foreign, bool given, const std::string& instead) {
    if (!foreign || !given) return;
    add(str("'scheduler.params.", name, "' is not a parameter of ", sc.type, " (DeepSpeed's constructor refuses it): ",
            instead));
  };
  const std::string ratios = "WarmupCosineLR's rates are optimizer.params.lr times a ratio: remove it, and give "
                             "warmup_min_ratio and cos_min_ratio (optimizer.params.lr is the peak)";
  refuse("warmup_min_lr", cosine, sc.warmup_min_lr.has_value(), ratios);
  refuse("warmup_max_lr", cosine, sc.warmup_max_lr.has_value(), ratios);
  refuse("total_num_steps", sc.type == "WarmupLR", sc.total_num_steps.has_value(),
         "WarmupLR keeps warmup_max_lr after the warm-up; remove it, or set scheduler.type to WarmupDecayLR or "
         "WarmupCosineLR to decay over total_num_steps");
  const std::string cosine_only = "it is WarmupCosineLR's; remove it, or set scheduler.type to WarmupCosineLR";
  refuse("warmup_min_ratio", !cosine, sc.warmup_min_ratio.has_value(), cosine_only);
  refuse("cos_min_ratio", !cosine, sc.cos_min_ratio.has_value(), cosine_only);
}

// The ranges of the values.
void check_ranges(const SchedulerOptions& sc, const Add& add) {
  auto at_least = [&](const std::string& name, std::optional<double> v, const std::string& why) {
    if (v && *v < 0) add(str("'scheduler.params.", name, "' = ", *v, " must be >= 0", why));
  };
  at_least("warmup_min_lr", sc.warmup_min_lr, "");
  at_least("warmup_min_ratio", sc.warmup_min_ratio, " (the warm-up starts at that share of optimizer.params.lr)");
  at_least("cos_min_ratio", sc.cos_min_ratio,
           " (DeepSpeed stops the rate at 0, before total_num_steps): give 0 to decay to 0");
  if (sc.warmup_max_lr && *sc.warmup_max_lr <= 0) {
    add(str("'scheduler.params.warmup_max_lr' = ", *sc.warmup_max_lr,
            " must be > 0 (a negative rate climbs the loss)"));
  }
  if (sc.warmup_num_steps < 0) {
    add(str("'scheduler.params.warmup_num_steps' = ", sc.warmup_num_steps,
            " must be >= 0 (DeepSpeed warms up over at least 2 steps: 0 and 1 give 2)"));
  }
  if (sc.last_batch_iteration < -1) {
    add(str("'scheduler.params.last_batch_iteration' = ", sc.last_batch_iteration,
            " must be -1 (a fresh run) or the index of the last batch trained on (>= 0)"));
  }
}

// The schedule's length against its warm-up and against last_batch_iteration
// (step s >= 2 trains at the rate of position last_batch_iteration + s - 1).
void check_length(const SchedulerOptions& sc, const std::string& total_note, const Add& add) {
  if (sc.type != "WarmupDecayLR" && sc.type != "WarmupCosineLR") return;
  const std::string total_key = "scheduler.params.total_num_steps";
  if (!sc.total_num_steps) {
    add(str("scheduler ", sc.type, " needs '", total_key, "' (DeepSpeed's constructor requires it): give "
            "the run's optimizer steps, or \"auto\" (train.steps)"));
    return;
  }
  const int64_t total = *sc.total_num_steps, k = sc.last_batch_iteration;
  const bool decay = sc.type == "WarmupDecayLR";
  // total_num_steps at or below the warm-up is DeepSpeed's warning, not an
  // error (scheduler_settings_without_effect): the rate warms up, then ends at once.
  if (const int64_t end = decay ? total : total - 1; total > sc.warmup_steps() && k + 1 >= end) {
    // Step 2 would train at position k + 1, where the decay has ended.
    add(str("'scheduler.params.last_batch_iteration' = ", k, " starts the run past the end of ", sc.type,
            "'s schedule ('", total_key, "' = ", total, total_note, "): from step 2 on every step would train at ",
            decay ? "warmup_min_lr" : "cos_min_ratio x optimizer.params.lr", "; raise total_num_steps above ",
            decay ? k + 1 : k + 2, " plus the steps to train, or set last_batch_iteration to -1"));
  }
}

}  // namespace

std::string check_scheduler_options(const SchedulerOptions& scheduler, const std::string& total_note) {
  std::string problems;
  if (scheduler.type == "none") return problems;
  const Add add = [&](const std::string& problem) { problems += (problems.empty() ? "" : "\n") + problem; };
  check_keys(scheduler, add);
  check_ranges(scheduler, add);
  check_length(scheduler, total_note, add);
  return problems;
}

std::vector<std::string> scheduler_settings_without_effect(const SchedulerOptions& sc,
                                                           const std::string& total_note) {
  std::vector<std::string> out;
  if (sc.type != "none" && sc.warmup_num_steps < 2) {
    out.push_back(str("scheduler.params.warmup_num_steps = ", sc.warmup_num_steps, ": the warm-up lasts 2 steps, "
                      "as DeepSpeed raises it to at least 2 (and from 0.19.3 refuses 0); give 2 to say so"));
  }
  if ((sc.type == "WarmupDecayLR" || sc.type == "WarmupCosineLR") && sc.total_num_steps &&
      *sc.total_num_steps <= sc.warmup_steps()) {
    out.push_back(str("scheduler ", sc.type, ": 'scheduler.params.total_num_steps' (", *sc.total_num_steps,
                      total_note, ") is not above the warm-up (", sc.warmup_steps(), " steps), so the rate warms "
                      "up and then ends at its minimum without decaying (DeepSpeed warns likewise); raise "
                      "total_num_steps or lower warmup_num_steps"));
  }
  return out;
}

}  // namespace remat::optim
