#include "optim/options.h"

#include <algorithm>
#include <optional>

#include "runtime/error.h"

namespace remat::optim {
namespace {

// The kind a name gives, if any.
std::optional<OptimizerKind> kind_named(const std::string& type) {
  const auto& names = optimizer_kind_names();
  const auto at = std::find(names.begin(), names.end(), type);
  if (at == names.end()) return std::nullopt;
  return static_cast<OptimizerKind>(at - names.begin());
}

std::string unknown_type(const std::string& type) {
  return str("'optimizer.type' = \"", type, "\" is not one of AdamW, Adam, SGD");
}

}  // namespace

const std::vector<std::string>& optimizer_kind_names() {
  static const std::vector<std::string> names = {"AdamW", "Adam", "SGD"};
  return names;
}

OptimizerKind optimizer_kind(const OptimizerOptions& options) {
  const auto kind = kind_named(options.type);
  if (!kind) throw ConfigError(unknown_type(options.type));
  return *kind;
}

std::string check_optimizer_options(const OptimizerOptions& o) {
  std::string problems;
  auto add = [&](const std::string& problem) { problems += (problems.empty() ? "" : "\n") + problem; };
  const auto kind = kind_named(o.type);
  if (!kind) add(unknown_type(o.type));
  if (o.lr <= 0) add(str("'optimizer.params.lr' = ", o.lr, " must be > 0"));
  for (int i = 0; i < 2; ++i) {
    if (o.betas[i] < 0 || o.betas[i] >= 1) {
      add(str("'optimizer.params.betas' [", o.betas[0], ", ", o.betas[1], "]: beta", i + 1, " must be in [0, 1)"));
    }
  }
  if (o.eps <= 0) add(str("'optimizer.params.eps' = ", o.eps, " must be > 0"));
  if (o.weight_decay < 0) add(str("'optimizer.params.weight_decay' = ", o.weight_decay, " must be >= 0"));
  if (o.momentum < 0) add(str("'optimizer.params.momentum' = ", o.momentum, " must be >= 0"));
  const bool sgd = kind == OptimizerKind::kSGD;
  if (o.nesterov && (!sgd || o.momentum <= 0)) {
    add(!sgd ? str("'optimizer.params.nesterov' applies to SGD only (optimizer.type is ", o.type, "): remove it")
             : std::string("'optimizer.params.nesterov' needs 'optimizer.params.momentum' > 0"));
  }
  return problems;
}

int64_t state_bytes_per_element(const OptimizerOptions& options, int64_t element_size) {
  switch (optimizer_kind(options)) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return 2 * element_size;  // exp_avg, exp_avg_sq
    case OptimizerKind::kSGD:
      return options.momentum > 0 ? element_size : 0;  // momentum_buffer
  }
  return 0;
}

}  // namespace remat::optim
