#include "runtime/tensor_checks.h"

#include "runtime/error.h"

namespace remat {

void check_tensor_device(const at::Tensor& t, bool want_cuda, const char* op,
                         const char* backend) {
  if (!t.defined()) throw CommError(str(op, ": got an undefined tensor"));
  if (t.is_cuda() != want_cuda) {
    throw CommError(str(op, ": the ", backend, " backend takes ", want_cuda ? "CUDA" : "CPU",
                        " tensors, got one on ", t.device().str(), "; ",
                        want_cuda ? "move it with .cuda() or use the mpi backend"
                                  : "move it with .cpu() or use the nccl backend"));
  }
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  if (a.scalar_type() != b.scalar_type()) {
    throw CommError(str(op, ": dtypes differ (", c10::toString(a.scalar_type()), " vs ",
                        c10::toString(b.scalar_type()), "); pass tensors of one dtype"));
  }
}

}  // namespace remat
