// The optimizer and learning-rate schedule the config asks for.
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat {

struct OptimizerConfig;
struct SchedulerConfig;

// LibTorch's AdamW, Adam or SGD with the config's parameters. `on_host`
// (zero_optimization.offload_optimizer: the parameters are float32 host
// tensors): AdamW and Adam are optim/host_adam.h's fused loops, LibTorch's
// optimizers bit for bit with their state; SGD is LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& config,
                                                        std::vector<at::Tensor> params, bool on_host = false);

// The learning rate of `step` (1-based): the optimizer's lr without a
// scheduler; DeepSpeed's WarmupLR (warm up from warmup_min_lr to warmup_max_lr
// over warmup_num_steps, log or linear, then constant) and WarmupDecayLR (the
// same, then linear decay to warmup_min_lr at total_num_steps). With
// scheduler.last_batch_iteration k, step s takes the rate of step s + k + 1:
// a resumed run (its step from the save) with the value it was started with
// continues its schedule; saves do not record k.
double learning_rate(const OptimizerConfig& optimizer, const SchedulerConfig& scheduler,
                     int64_t step);

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
