// Adam and AdamW for float32 host tensors, one fused pass per step: the
// optimizer step of ZeRO-Offload (issue 42), where the fp32 master weights,
// their gradients and both moments live in host memory.
//
// HostAdamW is a torch::optim::AdamW and HostAdam a torch::optim::Adam: the
// options, parameter groups, per-parameter state (step, exp_avg, exp_avg_sq)
// and save/load are LibTorch's own, so either optimizer loads the other's
// state. Only step() differs: instead of LibTorch's nine tensor ops per
// parameter (each a pass over memory, two of them allocating), one loop reads
// p, g, m and v once and writes p, m and v, vectorised and split over the
// intra-op threads (at::parallel_for).
//
// The numbers are LibTorch's, bit for bit: the loop keeps LibTorch's op order
// (optim/internal/adam_kernel_body.h), its scalars are computed in double and cast to
// float as ATen casts them, and a multiply-add is fused exactly where ATen's
// kernels fuse it. ATen's AVX2 and AVX-512 kernels round `x + a * b` once
// (their scalar tails too, which the compiler contracts), its generic kernels
// twice; `HostAdamKernel::kAuto` runs the build of the loop that does the same
// as the ATen of this process. The math is the same in LibTorch 1.13 and 2.x
// (only the key of the state map differs, which runtime/compat.h handles).
//
// Refused, with an Error that names the parameter and what to change (no
// silent fallback, so a ZeRO-Offload step never runs LibTorch's slow path
// unnoticed): amsgrad; a parameter or gradient that is not float32, not on the
// CPU, not contiguous, or sparse; a gradient or state tensor whose size is not
// the parameter's. Parameters whose gradient is undefined are skipped, as
// LibTorch skips them.
//
//   remat::optim::HostAdamW optimizer(params, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
//   loss.backward();
//   optimizer.step();
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <vector>

namespace remat::optim {

// Which build of the fused loop a step runs. kAuto: the one whose rounding
// matches this process's ATen kernels (kAvx2Fma where ATen runs its AVX2 or
// AVX-512 kernels, kGeneric where it runs its generic ones). The others are
// for tests and benchmarks: a build that ATen does not match differs from
// LibTorch in the last bits.
enum class HostAdamKernel { kAuto, kGeneric, kAvx2Fma };

// "auto", "generic", "avx2+fma".
const char* kernel_name(HostAdamKernel kernel);
// What kAuto runs in this process (never kAuto).
HostAdamKernel auto_kernel();

// One step of Adam or AdamW over raw float32 arrays of `n` elements: the
// update HostAdam / HostAdamW apply to a parameter at step number `step` (1
// for the first), bit for bit, for callers that keep the arrays themselves
// (the NVMe optimizer store steps its sub-groups in I/O buffers with it).
struct HostAdamStep {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool decoupled = true;  // AdamW's decay; false: Adam's L2 term
  int64_t step = 1;
};
void host_adam_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                      const HostAdamStep& step, HostAdamKernel kernel = HostAdamKernel::kAuto);

class HostAdamW : public torch::optim::AdamW {
 public:
  explicit HostAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                     torch::optim::AdamWOptions defaults = {});
  explicit HostAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {});

  // LibTorch AdamW's step (decoupled weight decay), fused.
  at::Tensor step(LossClosure closure = nullptr) override;

  // Runs `kernel` from now on (an Error where the CPU lacks it); kernel()
  // says which build runs (kAuto resolved).
  void set_kernel(HostAdamKernel kernel);
  HostAdamKernel kernel() const;

 private:
  HostAdamKernel kernel_ = HostAdamKernel::kAuto;
};

class HostAdam : public torch::optim::Adam {
 public:
  explicit HostAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                    torch::optim::AdamOptions defaults = {});
  explicit HostAdam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults = {});

  // LibTorch Adam's step (weight decay as an L2 term added to the gradient), fused.
  at::Tensor step(LossClosure closure = nullptr) override;

  void set_kernel(HostAdamKernel kernel);
  HostAdamKernel kernel() const;

 private:
  HostAdamKernel kernel_ = HostAdamKernel::kAuto;
};

}  // namespace remat::optim
