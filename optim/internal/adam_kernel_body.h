// The Adam loop that adam_kernel_generic.cc and adam_kernel_avx2.cc each
// compile with their own flags (internal to optim/; include it in those two
// files only). Everything here has internal linkage, so the AVX2 build of a
// function can never stand in for the generic one at link time.
//
// Per element, in the order and precision of LibTorch's op sequence
// (torch/csrc/api/src/optim/adam.cpp, adamw.cpp):
//   Adam L2:    g = g + wd * p                      grad.add(p, wd)
//   AdamW:      p = p * (1 - lr * wd)               p.mul_(...)
//   m = m * beta1 + (1 - beta1) * g                 exp_avg.mul_(beta1).add_(g, 1 - beta1)
//   v = v * beta2 + ((1 - beta2) * g) * g           exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
//   d = sqrt(v) / sqrt(bias_correction2) + eps      (exp_avg_sq.sqrt() / ...).add_(eps)
//   p = p + (-step_size * m) / d                    p.addcdiv_(m, d, -step_size)
// The three `x + a * b` lines are where ATen's vectorised kernels (and its
// scalar tails, which the compiler contracts) round once; kFused says whether
// to do the same. The files compile with -ffp-contract=off, so no other
// multiply-add is fused behind the code's back.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim/internal/adam_kernel.h"

namespace remat::optim::internal {
namespace {

template <bool kFused>
inline float mul_add(float a, float b, float c) {
  if constexpr (kFused) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;
  }
}

template <bool kFused, DecayMode kDecay>
void adam_loop(const AdamArrays& arrays, const AdamScalars& s, int64_t begin, int64_t end) {
  float* __restrict param = arrays.param;
  const float* __restrict grad = arrays.grad;
  float* __restrict exp_avg = arrays.exp_avg;
  float* __restrict exp_avg_sq = arrays.exp_avg_sq;
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float g = grad[i];
    if constexpr (kDecay == DecayMode::kL2) g = mul_add<kFused>(p, s.weight_decay, g);
    if constexpr (kDecay == DecayMode::kDecoupled) p = p * s.decay_factor;
    const float m = mul_add<kFused>(g, s.one_minus_beta1, exp_avg[i] * s.beta1);
    const float v = mul_add<kFused>(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
    const float denom = std::sqrt(v) / s.sqrt_bias_correction2 + s.eps;
    param[i] = p + s.neg_step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

template <bool kFused>
void adam_update(const AdamArrays& arrays, const AdamScalars& s, int64_t begin, int64_t end) {
  switch (s.decay) {
    case DecayMode::kNone:
      return adam_loop<kFused, DecayMode::kNone>(arrays, s, begin, end);
    case DecayMode::kL2:
      return adam_loop<kFused, DecayMode::kL2>(arrays, s, begin, end);
    case DecayMode::kDecoupled:
      return adam_loop<kFused, DecayMode::kDecoupled>(arrays, s, begin, end);
  }
}

}  // namespace
}  // namespace remat::optim::internal
