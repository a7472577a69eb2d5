#include "models/shape.h"

#include <utility>

#include "runtime/error.h"

namespace remat::models {

std::string check_model_shape(const ModelShape& m) {
  std::string problems;
  auto add = [&](const std::string& problem) { problems += (problems.empty() ? "" : "\n") + problem; };
  for (auto [path, v] : {std::pair{"model.n_layer", m.n_layer}, {"model.n_head", m.n_head},
                         {"model.d_model", m.d_model}, {"model.d_ff", m.d_ff},
                         {"model.seq_len", m.seq_len}}) {
    if (v < 1) add(str("'", path, "' = ", v, " must be at least 1"));
  }
  if (m.n_head >= 1 && m.d_model >= 1 && m.d_model % m.n_head != 0) {
    add(str("'model.d_model' (", m.d_model, ") must be divisible by 'model.n_head' (", m.n_head, ")"));
  }
  if (m.dropout < 0 || m.dropout >= 1) {
    add(str("'model.dropout' = ", m.dropout, " must be in [0, 1)"));
  }
  return problems;
}

const std::vector<std::string>& sequence_parallel_dropout_names() {
  static const std::vector<std::string> names{"per_rank", "replicated"};
  return names;
}

}  // namespace remat::models
