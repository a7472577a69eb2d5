// Leaving parameters that got no gradient alone in an optimizer step: the
// engine's own (engine_step.cc's step()), so that a parameter no forward used on
// any rank keeps its values and optimizer state, as a plain LibTorch loop
// leaves a parameter without .grad.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "parallel/zero.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace remat::internal {

// The elements of one of the optimizer's tensors that belong to parameters
// no rank gave a gradient this step, with their values and optimizer state
// before the step.
struct UnusedElements {
  at::Tensor tensor;  // one of ZeroModel::parameters()
  std::vector<parallel::ShardSegment> segments;
  std::vector<at::Tensor> values;
  std::vector<std::map<std::string, at::Tensor>> state;
};

// A parameter no forward used on any rank (`arrived`: take_gradient_arrivals()
// reduced over every rank) is not stepped: the reduction handed the optimizer
// zeros for it, which weight decay or momentum would act on. An optimizer
// tensor holding only such parameters loses its gradient (so the optimizer
// skips it and keeps no state for it); of one that also holds used
// parameters, the unused elements' values and state are returned, for
// put_back_unused after the step.
std::vector<UnusedElements> leave_unused_alone(parallel::ZeroModel& zero, torch::nn::Module& model,
                                               const at::Tensor& arrived, const torch::optim::Optimizer& optimizer);

// After the optimizer step: the unused elements' values and state as they
// were (state the step created for them starts at zero, as it would have).
void put_back_unused(const std::vector<UnusedElements>& held, const torch::optim::Optimizer& optimizer);

}  // namespace remat::internal
