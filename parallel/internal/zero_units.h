// Stage 3's units (internal to parallel/, zero_stage3.cc): which parameters
// each unit flattens, and the storage a gathered unit's flat buffer holds
// only while gathered.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

namespace torch::nn {
class Module;
}

namespace remat::parallel {

// A unit's name, module (null: the root unit) and parameters, before flattening.
struct UnitParameters {
  std::string name;
  const torch::nn::Module* module = nullptr;
  std::vector<at::Tensor> params;
};

// Each given unit's parameters (a parameter shared by two units in the first
// only), then the root unit's: every other parameter of the model.
std::vector<UnitParameters> unit_parameters(torch::nn::Module& model,
                                            const std::vector<std::shared_ptr<torch::nn::Module>>& units);

// The parameters are views of a unit's flat buffer `t`: emptying its storage
// frees them all, and refilling it restores them in place (autograd's saved
// references to the parameters see the data again).
void release_storage(const at::Tensor& t);
void allocate_storage(const at::Tensor& t, int64_t nbytes);

// Whether backpropagating into `x` (the first unit's input) reaches one of
// `params` (by TensorImpl) through an op whose backward reads the
// parameter's data. An embedding's backward does not (it needs the indices
// only); anything else is taken to (a LayerNorm, a linear layer before the
// first block).
bool data_needed_in_backward(const at::Tensor& x, const std::unordered_set<const void*>& params);

}  // namespace remat::parallel
