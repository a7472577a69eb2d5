// Process start-up: MPI, the process environment, logging, the CUDA device,
// and the world communicator.
//
//   int main(int argc, char** argv) {
//     return remat::run_main([&] {
//       auto& rt = remat::Runtime::init();
//       auto world = rt.world();           // nccl where every rank has a GPU of its own, else mpi
//       ...
//       return 0;
//     });
//   }
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "runtime/communicator.h"
#include "runtime/process_env.h"

namespace remat {

enum class Backend { kAuto, kMpi, kNccl };

// Parses "auto", "mpi" or "nccl"; anything else is a ConfigError.
Backend parse_backend(const std::string& name);

class Runtime {
 public:
  // Idempotent. Starts MPI, checks the launcher's variables against it, tags
  // the log with the rank, picks the CUDA device from the local rank (local
  // rank i uses device i % devices: with more ranks than GPUs, they share).
  static Runtime& init();

  const ProcessEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  // A new communicator over all ranks; collective (every rank asks with the
  // same backend). kAuto: nccl when compiled in and every rank has a GPU of
  // its own, else mpi (which carries CUDA tensors through host memory, so
  // ranks may share a GPU); rank 0 logs the choice and why. kNccl with a rank
  // short of a GPU is a ConfigError. In a build without MPI, the one-process
  // local backend.
  std::shared_ptr<Communicator> world(Backend backend = Backend::kAuto);

 private:
  Runtime();
  void share_cores();
  void report_blas();
  void pick_cuda_device();
  static void bound_threads(int64_t asked, int cores, int local_ranks);
  ProcessEnv env_;
  int cuda_devices_ = 0;  // CUDA devices this rank sees (0: none, or no CUDA in this build)
  int cuda_device_ = -1;  // the one it uses
};

// Runs `body`, turning an escaping exception into a clear message on stderr
// and exit code 1. With several ranks it also ends the peers (MPI_Abort), so
// one rank's error never leaves the others hanging.
int run_main(const std::function<int()>& body);

}  // namespace remat
