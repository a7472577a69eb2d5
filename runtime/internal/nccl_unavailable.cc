// The NCCL entry points in a build without CUDA.
#include "runtime/error.h"
#include "runtime/internal/nccl_communicator.h"

namespace remat::internal {

bool nccl_available() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<MpiCommunicator>) {
  throw CommError(
      "the nccl backend is not in this build: CUDA and NCCL were not found when it was "
      "configured (set CUDA_HOME or put nvcc on PATH and rebuild), use the mpi backend");
}

}  // namespace remat::internal
