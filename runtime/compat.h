// The one place where LibTorch 1.13 and 2.x differ for remat.
#pragma once

#include <torch/version.h>

#define REMAT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||        \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

namespace remat::compat {

// c10::MemoryReportingInfoBase::reportMemoryUsage's running totals: int64_t in
// 1.13, size_t from 2.0 on.
#if REMAT_TORCH_AT_LEAST(2, 0)
using MemoryTotal = size_t;
#else
using MemoryTotal = int64_t;
#endif

// at::scaled_dot_product_attention (2.0 on): the fused kernels on GPU, the
// flash-for-CPU or math path here. 1.13 has none; attention is written out.
#if REMAT_TORCH_AT_LEAST(2, 0)
#define REMAT_HAS_SDPA 1
#else
#define REMAT_HAS_SDPA 0
#endif

// Its math path (the one a CPU takes with dropout) computes bf16 and fp16
// attention in float32 on 2.5 and later (q, k, v upcast, the scores and
// probabilities saved in float32): a bf16 block's attention saves 4 bytes per
// element there (measured on Debian's 2.6: the cold estimate without it was
// 0.69 x a bf16 run's peak).
#if REMAT_TORCH_AT_LEAST(2, 5)
#define REMAT_SDPA_MATH_UPCASTS 1
#else
#define REMAT_SDPA_MATH_UPCASTS 0
#endif

// The key torch::optim::Optimizer::state() files a parameter's state under,
// from its TensorImpl: the address as text (1.13), the address (2.x). `Key`
// is the state map's key_type.
template <typename Key>
Key optimizer_state_key(const void* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << impl;
    return text.str();
  } else {
    return static_cast<Key>(const_cast<void*>(impl));
  }
}

// "1.13.1", "2.4.0", ...
inline const char* torch_version() { return TORCH_VERSION; }

}  // namespace remat::compat
