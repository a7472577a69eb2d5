// The optimizer its options ask for (optim/options.h), and access to its
// rate and state.
//
//   auto optimizer = remat::optim::make_optimizer(options, zero.parameters());
//   remat::optim::set_learning_rate(*optimizer, remat::optim::learning_rate(options, scheduler, step));
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optim/options.h"

namespace remat::optim {

// LibTorch's AdamW, Adam or SGD with `options`, over `params`. AdamW and Adam
// are optim/host_adam.h's fused loops (LibTorch's optimizers bit for bit,
// with their state) where host_adam_fits(params): the parameters live in
// host memory as the loop needs them, as the float32 masters of
// zero_optimization.offload_optimizer do. SGD is LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        std::vector<at::Tensor> params);

// Whether the fused host Adam can step `params`: at least one, and every one
// a dense, contiguous float32 tensor on the CPU.
bool host_adam_fits(const std::vector<at::Tensor>& params);

// The options an optimizer was built with, as far as they say what it keeps
// (its kind, rate, betas, eps, weight decay, momentum and nesterov, from its
// first group); none for an optimizer that is not AdamW, Adam or SGD.
std::optional<OptimizerOptions> options_of(const torch::optim::Optimizer& optimizer);

// Its optimizer.type name ("AdamW"), or the C++ type's name for another.
std::string optimizer_name(const torch::optim::Optimizer& optimizer);

// Sets every parameter group's rate (optim/lr_schedule.h says which).
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

// An optimizer that keeps its per-parameter state outside state(), where
// memory does not hold it (offload_optimizer.device "nvme": a file per rank,
// parallel/nvme_optimizer.h). optimizer_state_of and set_optimizer_state ask
// it; optimizer_state_tensors and optimizer_state_bytes count none of it.
class ExternalState {
 public:
  virtual ~ExternalState() = default;
  // As optimizer_state_of: "step", "exp_avg", "exp_avg_sq", read into new
  // host tensors; empty before the parameter's first step.
  virtual std::map<std::string, at::Tensor> external_state_of(const at::Tensor& param) const = 0;
  // As set_optimizer_state (an empty map clears it).
  virtual void set_external_state(const at::Tensor& param, const std::map<std::string, at::Tensor>& state) = 0;
  // Bytes the state takes where it is kept.
  virtual int64_t external_state_bytes() const = 0;
};

// The optimizer's per-parameter state tensors in memory (Adam's moments,
// SGD's momentum buffers), and their bytes.
std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer);
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

// The optimizer's state for `param` as named tensors: "step" (a 0-dim int64),
// and AdamW/Adam's "exp_avg", "exp_avg_sq" ("max_exp_avg_sq" with amsgrad)
// or SGD's "momentum_buffer". Empty before the parameter's first step.
std::map<std::string, at::Tensor> optimizer_state_of(const torch::optim::Optimizer& optimizer,
                                                     const at::Tensor& param);

// Sets `param`'s state from such a map (copies); an empty map clears it. A
// name the optimizer does not keep is an Error.
void set_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                         const std::map<std::string, at::Tensor>& state);

}  // namespace remat::optim
