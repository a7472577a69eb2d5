// The process-group layer: an abstract Communicator with MPI (CPU tensors, and
// CUDA tensors through host memory) and NCCL (CUDA tensors) backends.
//
// Contract:
// - Every rank of a communicator calls the same collectives in the same order
//   with matching dtypes and shapes. REMAT_DEBUG_COLLECTIVES=1 checks this
//   before each collective and raises CommError naming both ranks.
// - Each call returns a Work at once; the result is valid only after wait().
//   The caller keeps the tensors alive and untouched until then (Work also
//   holds references). wait() throws TimeoutError past the timeout and
//   CommError on a backend failure.
// - In-place ops (allReduce, broadcast, recv) write the tensor passed in; a
//   non-contiguous tensor is handled through a contiguous copy.
//
//   auto work = comm->allReduce(grad, {.op = ReduceOp::kAvg});
//   ... compute that overlaps ...
//   work->wait();
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace remat {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

const char* to_string(ReduceOp op);

// Zero means: the communicator's default (REMAT_COMM_TIMEOUT_S, else 300 s).
using Timeout = std::chrono::milliseconds;

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  Timeout timeout{0};
};

struct AllGatherOptions {
  Timeout timeout{0};
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  Timeout timeout{0};
};

struct BroadcastOptions {
  int root = 0;
  Timeout timeout{0};
};

struct BarrierOptions {
  Timeout timeout{0};
};

struct SendRecvOptions {
  int tag = 0;
  Timeout timeout{0};
};

// A pending operation.
class Work {
 public:
  virtual ~Work() = default;
  // Non-blocking; drives the backend's progress. Throws if the operation failed.
  virtual bool isCompleted() = 0;
  // Blocks until done (or throws TimeoutError / CommError). Idempotent.
  virtual void wait() = 0;
};

// A Work that is already complete (size-1 fast paths).
std::shared_ptr<Work> completed_work();

// The first operation of this process that timed out or failed, logged at
// once when recorded. From then on pending work is abandoned: wait() on any
// other Work throws CommError at once (naming the first failure) instead of
// waiting out another timeout, so an error unwinding through destructors that
// wait (prefetches in flight) ends the job within one timeout.
void record_communication_failure(const std::string& error);
// The recorded failure, or empty.
std::string communication_failure();
bool communication_failed();

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual std::string backendName() const = 0;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // In place: every rank ends with the reduction over all ranks.
  virtual std::shared_ptr<Work> allReduce(at::Tensor& tensor,
                                          const AllReduceOptions& opts = {});

  // Flat: output.numel() == size() * input.numel(); rank r's input lands at
  // output.view(-1)[r * input.numel() ...].
  virtual std::shared_ptr<Work> allGather(at::Tensor& output, const at::Tensor& input,
                                          const AllGatherOptions& opts = {});

  // List: outputs[r] receives rank r's input. Sizes may differ across ranks
  // (outputs[r].numel() on every rank equals rank r's input.numel()).
  virtual std::shared_ptr<Work> allGather(std::vector<at::Tensor>& outputs,
                                          const at::Tensor& input,
                                          const AllGatherOptions& opts = {});

  // input.numel() == size() * output.numel(); rank r receives the reduction of
  // chunk r of every rank's input.
  virtual std::shared_ptr<Work> reduceScatter(at::Tensor& output, const at::Tensor& input,
                                              const ReduceScatterOptions& opts = {});

  virtual std::shared_ptr<Work> broadcast(at::Tensor& tensor,
                                          const BroadcastOptions& opts = {});

  virtual std::shared_ptr<Work> barrier(const BarrierOptions& opts = {});

  virtual std::shared_ptr<Work> send(const at::Tensor& tensor, int dst,
                                     const SendRecvOptions& opts = {});
  virtual std::shared_ptr<Work> recv(at::Tensor& tensor, int src,
                                     const SendRecvOptions& opts = {});

  // Ranks passing the same color form a new communicator, ordered by key (then
  // by rank). Collective over this communicator. color < 0: not a member, and
  // nullptr is returned.
  virtual std::shared_ptr<Communicator> split(int color, int key);

 protected:
  Communicator(int rank, int size);

  // Throws the "not implemented" error for an op this backend lacks.
  [[noreturn]] void unsupported(const char* op) const;

  // What every backend does before it starts an operation: names it for
  // errors and debug checks ("allReduce(seq=3, float[4] cpu, op=sum)"; point
  // to point calls carry no sequence number), counts collectives, and picks
  // the timeout (the call's, else default_timeout_).
  struct Call {
    std::string what;
    Timeout timeout;
  };
  Call begin_call(const char* op, const std::string& signature, Timeout requested,
                  bool collective = true);
  // ReduceOp avg on an integer tensor is a CommError naming `op`.
  static void check_reduce_op(ReduceOp reduce, at::ScalarType dtype, const char* op);

  int rank_;
  int size_;
  uint64_t seq_ = 0;         // collectives started on this communicator
  Timeout default_timeout_;  // REMAT_COMM_TIMEOUT_S, else 300 s
};

}  // namespace remat
