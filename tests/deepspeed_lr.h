// Test helper: the learning rate each step trains at in DeepSpeed, written out
// from DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py: WarmupLR,
// WarmupDecayLR, WarmupCosineLR with their constructors' defaults) and its
// engine's order (deepspeed/runtime/engine.py, _take_model_step: the optimizer
// steps, then the scheduler). Independent of remat's schedule code, so tests
// compare remat's rates with it.
//
//   // the ds_config's "scheduler" section, its "auto" values as Hugging Face fills them
//   std::vector<double> rates = testing::deepspeed_rates(1e-3, scheduler_json, 20);
//   // rates[s - 1]: the rate step s trains at
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace remat::testing {

// One of DeepSpeed's scheduler objects: its position (last_batch_iteration)
// and get_lr() there.
class DeepSpeedScheduler {
 public:
  DeepSpeedScheduler(double optimizer_lr, const nlohmann::json& section)
      : type_(section.at("type").get<std::string>()), base_lr_(optimizer_lr) {
    const nlohmann::json p = section.value("params", nlohmann::json::object());
    // Each constructor's defaults. WarmupLR's warmup_max_lr: the optimizer's lr.
    min_lr_ = p.value("warmup_min_lr", 0.0);
    max_lr_ = p.value("warmup_max_lr", type_ == "WarmupLR" ? optimizer_lr : 0.001);
    warmup_ = std::max<int64_t>(2, p.value("warmup_num_steps", int64_t{1000}));
    log_warmup_ = p.value("warmup_type", std::string("log")) == "log";
    total_ = p.value("total_num_steps", int64_t{0});
    warmup_min_ratio_ = p.value("warmup_min_ratio", 0.0);
    cos_min_ratio_ = p.value("cos_min_ratio", 0.0001);
    last_batch_iteration_ = p.value("last_batch_iteration", int64_t{-1});
  }

  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  void step() { ++last_batch_iteration_; }

  double get_lr() const {
    const int64_t i = last_batch_iteration_;
    if (type_ == "WarmupCosineLR") {
      if (i < 0) return 0.0;
      return base_lr_ * cosine_ratio(i);
    }
    if (i < 0) return min_lr_;
    return min_lr_ + (max_lr_ - min_lr_) * gamma(i);
  }

 private:
  // WarmupLR's _get_gamma, and WarmupDecayLR's after the warm-up.
  double gamma(int64_t i) const {
    if (i < warmup_) return warmup_fraction(i);
    if (type_ == "WarmupLR") return 1.0;
    return std::max(0.0, static_cast<double>(total_ - i) / std::max(1.0, static_cast<double>(total_ - warmup_)));
  }

  double warmup_fraction(int64_t i) const {
    if (log_warmup_) return (1.0 / std::log(static_cast<double>(warmup_))) * std::log(static_cast<double>(i + 1));
    return static_cast<double>(i) / static_cast<double>(warmup_);
  }

  // WarmupCosineLR's get_lr_ratio.
  double cosine_ratio(int64_t i) const {
    if (i < warmup_) return warmup_min_ratio_ + warmup_fraction(i) * (1.0 - warmup_min_ratio_);
    const auto real_last_step = static_cast<double>(i - warmup_ + 1);
    const auto real_total_steps = static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
    const double progress = std::min(1.0, real_last_step / real_total_steps);
    const double ratio = (1.0 + std::cos(M_PI * progress)) / 2.0;
    return std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * ratio);
  }

  std::string type_;
  double base_lr_, min_lr_, max_lr_, warmup_min_ratio_, cos_min_ratio_;
  int64_t warmup_, total_, last_batch_iteration_;
  bool log_warmup_;
};

// The rate each of steps 1..n trains at: the optimizer's param group starts
// at optimizer_lr; the scheduler's constructor sets get_lr() in it only when
// its last_batch_iteration is -1; each step trains at the group's rate, then
// the engine steps the scheduler, which sets get_lr() at its new position.
inline std::vector<double> deepspeed_rates(double optimizer_lr, const nlohmann::json& scheduler, int n) {
  DeepSpeedScheduler s(optimizer_lr, scheduler);
  double group_lr = s.last_batch_iteration() == -1 ? s.get_lr() : optimizer_lr;
  std::vector<double> rates;
  for (int step = 1; step <= n; ++step) {
    rates.push_back(group_lr);  // the optimizer steps at it
    s.step();
    group_lr = s.get_lr();
  }
  return rates;
}

}  // namespace remat::testing
