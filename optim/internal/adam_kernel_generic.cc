// The Adam loop for any x86-64 (or other) CPU: multiply and add rounded apart,
// as ATen's generic kernels compute them.
#include "optim/internal/adam_kernel_body.h"

namespace remat::optim::internal {

void adam_update_generic(const AdamArrays& arrays, const AdamScalars& s, int64_t begin, int64_t end) {
  adam_update<false>(arrays, s, begin, end);
}

}  // namespace remat::optim::internal
