// The fused Adam update over one range of a parameter (internal to optim/).
//
// One pass per element reads the parameter, its gradient and both moments and
// writes the parameter and the moments, in LibTorch's op order and precision
// (see host_adam.h). Two builds of the same loop: a generic one, and one
// compiled for AVX2 and FMA; `select_adam_kernel` picks the one whose rounding
// matches the ATen kernels this process runs.
#pragma once

#include <cstdint>

namespace remat::optim::internal {

// How weight decay enters the step: not at all, LibTorch Adam's L2 term added
// to the gradient (g += wd * p), or AdamW's decoupled decay (p *= 1 - lr * wd).
enum class DecayMode { kNone, kL2, kDecoupled };

// One step's scalars, each computed in double and cast to float as ATen casts
// a Scalar operand for a float tensor.
struct AdamScalars {
  DecayMode decay = DecayMode::kNone;
  float weight_decay = 0;           // kL2: the gradient's extra p term
  float decay_factor = 1;           // kDecoupled: 1 - lr * weight_decay
  float beta1 = 0, one_minus_beta1 = 0;
  float beta2 = 0, one_minus_beta2 = 0;
  float sqrt_bias_correction2 = 1;  // sqrt(1 - beta2^step)
  float eps = 0;
  float neg_step_size = 0;          // -lr / (1 - beta1^step)
};

// The four float32 arrays of one parameter; the update reads [begin, end).
struct AdamArrays {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
};

using AdamKernelFn = void (*)(const AdamArrays&, const AdamScalars&, int64_t begin, int64_t end);

// a * b + c rounded twice (ATen's generic kernels).
void adam_update_generic(const AdamArrays& arrays, const AdamScalars& s, int64_t begin, int64_t end);
// a * b + c rounded once (ATen's AVX2 and AVX-512 kernels). Needs AVX2 and FMA.
void adam_update_avx2_fma(const AdamArrays& arrays, const AdamScalars& s, int64_t begin, int64_t end);

}  // namespace remat::optim::internal
