// Communicator over MPI for CPU and CUDA tensors.
//
// Collectives use MPI's nonblocking calls (MPI_Iallreduce, ...); Open MPI
// progresses them inside MPI calls, which Work::isCompleted() and wait() make.
// All calls on one communicator must come from one thread at a time.
//
// CUDA tensors travel through pinned host buffers (host_staging.h): copied
// to the host on the tensor's current stream before the call starts, copied
// back when its Work completes (wait() or isCompleted() returning true), so
// several ranks can share one GPU. All tensors of one call are on one device.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/communicator.h"

namespace remat::internal {

// Initialises MPI for the process's lifetime (MPI_Init_thread on construction,
// MPI_Finalize on destruction) unless something else already did.
class MpiSession {
 public:
  MpiSession();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  static bool initialized();
  // Ends every rank of the job (after a fatal error on one rank).
  [[noreturn]] static void abort(int code);

 private:
  bool owns_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  // A communicator over all processes (a duplicate of MPI_COMM_WORLD). Its
  // first exchange agrees on REMAT_DEBUG_COLLECTIVES: a ConfigError on every
  // rank, naming each rank's value, where they differ or one is no boolean.
  static std::shared_ptr<MpiCommunicator> world();

  ~MpiCommunicator() override;

  std::string backendName() const override { return "mpi"; }

  std::shared_ptr<Work> allReduce(at::Tensor& tensor,
                                  const AllReduceOptions& opts = {}) override;
  std::shared_ptr<Work> allGather(at::Tensor& output, const at::Tensor& input,
                                  const AllGatherOptions& opts = {}) override;
  std::shared_ptr<Work> allGather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                  const AllGatherOptions& opts = {}) override;
  std::shared_ptr<Work> reduceScatter(at::Tensor& output, const at::Tensor& input,
                                      const ReduceScatterOptions& opts = {}) override;
  std::shared_ptr<Work> broadcast(at::Tensor& tensor,
                                  const BroadcastOptions& opts = {}) override;
  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) override;
  std::shared_ptr<Work> send(const at::Tensor& tensor, int dst,
                             const SendRecvOptions& opts = {}) override;
  std::shared_ptr<Work> recv(at::Tensor& tensor, int src,
                             const SendRecvOptions& opts = {}) override;
  std::shared_ptr<Communicator> split(int color, int key) override;

  // Debug mode (REMAT_DEBUG_COLLECTIVES=1): every rank passes a description of
  // the collective it is about to run; a mismatch throws CommError naming both
  // ranks and both descriptions. Used by the NCCL backend too.
  void verifyCollective(const std::string& description, Timeout timeout);

  bool debugCollectives() const { return debug_; }
  Timeout defaultTimeout() const { return default_timeout_; }
  MPI_Comm mpiComm() const { return comm_; }

  // Every rank's `mine` (at most 255 bytes each; longer is cut), in rank
  // order. Collective, but outside the numbered collectives (no sequence
  // number, no debug check): for agreements when a communicator is set up.
  std::vector<std::string> gatherStrings(const std::string& mine, const std::string& what);

  // Bytes copied between tensors and host stand-ins so far, both ways.
  int64_t stagedBytes() const { return staged_bytes_; }
  // Tests' switch: CPU tensors go through host stand-ins too, as CUDA ones do.
  void stageCpuTensorsForTesting(bool on) { stage_cpu_ = on; }

 private:
  // `debug`: REMAT_DEBUG_COLLECTIVES as the ranks agreed on it (world()), or
  // the parent's (split()).
  MpiCommunicator(MPI_Comm comm, bool debug);

  struct Launch;
  // The one place every MPI collective goes through: checks arguments' device,
  // numbers the call, runs the debug check, stages CUDA tensors through host
  // buffers, starts it, wraps errors.
  std::shared_ptr<Work> launch(Launch&& launch);
  // Counts a staged call's bytes; the first is logged (debug level).
  void note_staged(int64_t bytes, bool pinned, const std::string& what);

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm check_comm_ = MPI_COMM_NULL;  // debug-mode traffic, apart from data
  bool debug_ = false;
  bool stage_cpu_ = false;
  int64_t staged_bytes_ = 0;
};

}  // namespace remat::internal
