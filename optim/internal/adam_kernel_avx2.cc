// The Adam loop compiled for AVX2 and FMA (this file only: optim/BUILD and
// CMakeLists.txt add -mavx2 -mfma), called only where the CPU has both.
#include "optim/internal/adam_kernel_body.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "optim/internal/adam_kernel_avx2.cc must be compiled with -mavx2 -mfma"
#endif

namespace remat::optim::internal {

void adam_update_avx2_fma(const AdamArrays& arrays, const AdamScalars& s, int64_t begin, int64_t end) {
  adam_update<true>(arrays, s, begin, end);
}

}  // namespace remat::optim::internal
