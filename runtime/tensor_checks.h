// Argument checks shared by the communication backends.
#pragma once

#include <ATen/core/Tensor.h>

namespace remat {

// Defined tensor on the backend's device kind, else CommError naming the fix.
void check_tensor_device(const at::Tensor& t, bool want_cuda, const char* op,
                         const char* backend);

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op);

}  // namespace remat
