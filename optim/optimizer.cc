#include "optim/optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "optim/host_adam.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace remat::optim {

bool host_adam_fits(const std::vector<at::Tensor>& params) {
  return !params.empty() && std::all_of(params.begin(), params.end(), [](const at::Tensor& p) {
    return p.defined() && p.layout() == at::kStrided && p.device().is_cpu() && p.scalar_type() == at::kFloat &&
           p.is_contiguous();
  });
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& c, std::vector<at::Tensor> params) {
  const bool host = host_adam_fits(params);
  switch (optimizer_kind(c)) {
    case OptimizerKind::kAdamW: {
      auto options = torch::optim::AdamWOptions(c.lr).betas({c.betas[0], c.betas[1]}).eps(c.eps).weight_decay(
          c.weight_decay);
      if (host) return std::make_unique<HostAdamW>(params, options);
      return std::make_unique<torch::optim::AdamW>(params, options);
    }
    case OptimizerKind::kAdam: {
      auto options = torch::optim::AdamOptions(c.lr).betas({c.betas[0], c.betas[1]}).eps(c.eps).weight_decay(
          c.weight_decay);
      if (host) return std::make_unique<HostAdam>(params, options);
      return std::make_unique<torch::optim::Adam>(params, options);
    }
    case OptimizerKind::kSGD:
      return std::make_unique<torch::optim::SGD>(
          params,
          torch::optim::SGDOptions(c.lr).momentum(c.momentum).nesterov(c.nesterov).weight_decay(c.weight_decay));
  }
  throw Error("make_optimizer: an optimizer kind without a constructor");
}

namespace {

// The kind of a built optimizer (HostAdamW is an AdamW), if remat knows it.
std::optional<OptimizerKind> kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return OptimizerKind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return OptimizerKind::kAdam;
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr) return OptimizerKind::kSGD;
  return std::nullopt;
}

const std::string& name_of(OptimizerKind kind) { return optimizer_kind_names().at(static_cast<size_t>(kind)); }

template <typename Options>
OptimizerOptions adam_options(OptimizerKind kind, const Options& o) {
  OptimizerOptions out;
  out.type = name_of(kind);
  out.lr = o.lr();
  out.betas = {std::get<0>(o.betas()), std::get<1>(o.betas())};
  out.eps = o.eps();
  out.weight_decay = o.weight_decay();
  return out;
}

}  // namespace

std::optional<OptimizerOptions> options_of(const torch::optim::Optimizer& optimizer) {
  const auto kind = kind_of(optimizer);
  if (!kind || optimizer.param_groups().empty()) return std::nullopt;
  const auto& group = optimizer.param_groups().at(0).options();
  switch (*kind) {
    case OptimizerKind::kAdamW:
      return adam_options(*kind, static_cast<const torch::optim::AdamWOptions&>(group));
    case OptimizerKind::kAdam:
      return adam_options(*kind, static_cast<const torch::optim::AdamOptions&>(group));
    case OptimizerKind::kSGD: {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group);
      OptimizerOptions out;
      out.type = name_of(*kind);
      out.lr = o.lr();
      out.weight_decay = o.weight_decay();
      out.momentum = o.momentum();
      out.nesterov = o.nesterov();
      return out;
    }
  }
  return std::nullopt;
}

std::string optimizer_name(const torch::optim::Optimizer& optimizer) {
  const auto kind = kind_of(optimizer);
  return kind ? name_of(*kind) : std::string(typeid(optimizer).name());
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
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
  return out;
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t n = 0;
  for (const auto& t : optimizer_state_tensors(optimizer)) n += static_cast<int64_t>(t.nbytes());
  return n;
}

namespace {

using StateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

StateMap::key_type state_key(const at::Tensor& param) {
  return compat::optimizer_state_key<StateMap::key_type>(param.unsafeGetTensorImpl());
}

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::kLong); }

}  // namespace

std::map<std::string, at::Tensor> optimizer_state_of(const torch::optim::Optimizer& optimizer,
                                                     const at::Tensor& param) {
  if (const auto* external = dynamic_cast<const ExternalState*>(&optimizer)) {
    return external->external_state_of(param);
  }
  std::map<std::string, at::Tensor> out;
  auto it = optimizer.state().find(state_key(param));
  if (it == optimizer.state().end()) return out;
  auto put = [&](const char* name, const at::Tensor& t) {
    if (t.defined()) out[name] = t;
  };
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    out["step"] = step_tensor(s->step());
    put("exp_avg", s->exp_avg());
    put("exp_avg_sq", s->exp_avg_sq());
    put("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
    out["step"] = step_tensor(s->step());
    put("exp_avg", s->exp_avg());
    put("exp_avg_sq", s->exp_avg_sq());
    put("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    put("momentum_buffer", s->momentum_buffer());
  } else {
    throw Error("optimizer_state_of: the optimizer keeps a state remat does not know (AdamW, Adam and SGD are)");
  }
  return out;
}

void set_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                         const std::map<std::string, at::Tensor>& state) {
  if (auto* external = dynamic_cast<ExternalState*>(&optimizer)) {
    external->set_external_state(param, state);
    return;
  }
  auto& states = optimizer.state();
  const auto key = state_key(param);
  states.erase(key);
  if (state.empty()) return;
  std::map<std::string, at::Tensor> left = state;
  auto take = [&](const char* name) {
    auto it = left.find(name);
    if (it == left.end()) return at::Tensor();
    // Onto the parameter's device (a save's state is read onto the host).
    const at::Tensor& saved = it->second;
    at::Tensor t = saved.device() == param.device() ? saved.detach().clone() : saved.detach().to(param.device());
    left.erase(it);
    return t;
  };
  auto step = [&] {
    at::Tensor t = take("step");
    return t.defined() ? t.item<int64_t>() : int64_t{0};
  };
  std::unique_ptr<torch::optim::OptimizerParamState> made;
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step());
    s->exp_avg(take("exp_avg"));
    s->exp_avg_sq(take("exp_avg_sq"));
    s->max_exp_avg_sq(take("max_exp_avg_sq"));
    made = std::move(s);
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step());
    s->exp_avg(take("exp_avg"));
    s->exp_avg_sq(take("exp_avg_sq"));
    s->max_exp_avg_sq(take("max_exp_avg_sq"));
    made = std::move(s);
  } else if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(take("momentum_buffer"));
    take("step");
    made = std::move(s);
  } else {
    throw Error("set_optimizer_state: AdamW, Adam and SGD are the optimizers remat can set state for");
  }
  if (!left.empty()) {
    throw Error(str("set_optimizer_state: '", left.begin()->first, "' is not a state this optimizer keeps "
                    "(a save made with another optimizer.type)"));
  }
  states[key] = std::move(made);
}

}  // namespace remat::optim
