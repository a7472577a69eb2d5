// The optimizer the config asks for, and access to its rate and state.
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat {

struct OptimizerConfig;

// LibTorch's AdamW, Adam or SGD with the config's parameters. `on_host`
// (zero_optimization.offload_optimizer: the parameters are float32 host
// tensors): AdamW and Adam are optim/host_adam.h's fused loops, LibTorch's
// optimizers bit for bit with their state; SGD is LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& config,
                                                        std::vector<at::Tensor> params, bool on_host = false);

// Sets every parameter group's rate (engine/lr_schedule.h says which).
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

// The optimizer's per-parameter state tensors (Adam's moments, SGD's momentum
// buffers), and their bytes.
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

}  // namespace remat
