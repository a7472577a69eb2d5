// Communicator over NCCL for CUDA tensors (built when CUDA and NCCL are found).
//
// Bootstrapped over MPI: rank 0 creates the unique id and broadcasts it. Each
// communicator owns a CUDA stream; a collective first waits (with an event) on
// the caller's current compute stream, then runs on its own stream. wait()
// blocks the host until the collective finished or the timeout passed: past
// the timeout the NCCL communicator is aborted and TimeoutError is thrown, so
// a dead peer never hangs the job. Tensors must be contiguous. A call whose
// tensors are all on the CPU goes over the bootstrap MPI communicator.
#pragma once

#include <memory>
#include <string>

#include "runtime/communicator.h"
#include "runtime/internal/mpi_communicator.h"

namespace remat::internal {

// True when this build has the NCCL backend and a CUDA device is visible.
bool nccl_available();

// Builds an NCCL communicator with the same ranks as `bootstrap`. Throws
// CommError when NCCL is not compiled in or no GPU is visible.
std::shared_ptr<Communicator> make_nccl_communicator(
    std::shared_ptr<MpiCommunicator> bootstrap);

}  // namespace remat::internal
