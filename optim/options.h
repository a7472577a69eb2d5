// The optimizer's options (the config's optimizer section: engine/config.h
// binds its JSON keys onto them), their rules, and what they say of the
// state an optimizer keeps. The factory is optim/optimizer.h.
//
//   remat::optim::OptimizerOptions o;  // AdamW, lr 1e-3
//   if (std::string bad = remat::optim::check_optimizer_options(o); !bad.empty()) ...
//   int64_t per_element = remat::optim::state_bytes_per_element(o);  // 8: two float32 moments
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace remat::optim {

// The optimizers remat builds: LibTorch's AdamW, Adam and SGD (AdamW and
// Adam as optim/host_adam.h's fused loops where the parameters are host tensors).
enum class OptimizerKind { kAdamW, kAdam, kSGD };

// Their names, as optimizer.type gives them, in OptimizerKind's order.
const std::vector<std::string>& optimizer_kind_names();

struct OptimizerOptions {
  std::string type = "AdamW";  // a name of optimizer_kind_names()
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};  // AdamW, Adam
  double eps = 1e-8;                           // AdamW, Adam
  double weight_decay = 0.0;
  double momentum = 0.0;  // SGD
  bool nesterov = false;  // SGD
};

// The kind `options.type` names: the one place the name is read. A name
// that is not one of optimizer_kind_names() is a ConfigError naming it.
OptimizerKind optimizer_kind(const OptimizerOptions& options);

// The rules of OptimizerOptions, written once: empty when valid, else every
// rule broken, one per line, each naming its key ('optimizer.params.lr') and
// what to change (LibTorch would stop with a backtrace).
std::string check_optimizer_options(const OptimizerOptions& options);

// The bytes of state the optimizer keeps per parameter element, for
// parameters of `element_size` bytes (its state tensors take the
// parameter's dtype): AdamW and Adam two moments, SGD its momentum buffer
// when momentum > 0, else nothing. For the float32 masters remat's
// optimizers step: 8, 4 or 0.
int64_t state_bytes_per_element(const OptimizerOptions& options, int64_t element_size = 4);

}  // namespace remat::optim
