#include "launch/optim.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>

#include "runtime/config.h"
#include "runtime/error.h"

namespace remat {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& c,
                                                        std::vector<at::Tensor> params) {
  if (c.type == "AdamW") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(c.lr)
                    .betas({c.betas[0], c.betas[1]})
                    .eps(c.eps)
                    .weight_decay(c.weight_decay));
  }
  if (c.type == "Adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(c.lr)
                    .betas({c.betas[0], c.betas[1]})
                    .eps(c.eps)
                    .weight_decay(c.weight_decay));
  }
  if (c.type == "SGD") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(c.lr)
                    .momentum(c.momentum)
                    .nesterov(c.nesterov)
                    .weight_decay(c.weight_decay));
  }
  throw ConfigError(str("optimizer.type '", c.type, "' is not one of AdamW, Adam, SGD"));
}

double learning_rate(const OptimizerConfig& optimizer, const SchedulerConfig& s, int64_t step) {
  if (s.type == "none") return optimizer.lr;
  const double lo = s.warmup_min_lr, hi = s.warmup_max_lr;
  const auto warmup = std::max<int64_t>(s.warmup_num_steps, 1);
  if (step < warmup) {
    double gamma = s.warmup_type == "log"
                       ? std::log(static_cast<double>(step + 1)) / std::log(static_cast<double>(warmup))
                       : static_cast<double>(step) / static_cast<double>(warmup);
    return lo + (hi - lo) * std::min(gamma, 1.0);
  }
  if (s.type == "WarmupDecayLR") {
    double gamma = static_cast<double>(s.total_num_steps - step) /
                   static_cast<double>(std::max<int64_t>(s.total_num_steps - warmup, 1));
    return lo + (hi - lo) * std::clamp(gamma, 0.0, 1.0);
  }
  return hi;
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t n = 0;
  auto add = [&](const at::Tensor& t) { n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; };
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      add(s->exp_avg());
      add(s->exp_avg_sq());
      add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      add(s->exp_avg());
      add(s->exp_avg_sq());
      add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      add(s->momentum_buffer());
    }
  }
  return n;
}

}  // namespace remat
