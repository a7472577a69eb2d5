#include "runtime/internal/nccl_communicator.h"

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/memory_trace.h"
#include "runtime/internal/tensor_checks.h"

#if defined(REMAT_WITH_C10_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace remat::internal {
namespace {

// The choke points for CUDA and NCCL return codes.
void cuda_check(cudaError_t rc, const std::string& context) {
  if (rc == cudaSuccess) return;
  throw CommError(str("CUDA error in ", context, ": ", cudaGetErrorString(rc)));
}

void nccl_check(ncclResult_t rc, ncclComm_t comm, const std::string& context) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  std::string detail = comm != nullptr ? ncclGetLastError(comm) : "";
  throw CommError(str("NCCL error in ", context, ": ", ncclGetErrorString(rc),
                      detail.empty() ? "" : " (" + detail + ")"));
}

// The stream LibTorch computes on. Builds against a CUDA LibTorch define
// REMAT_WITH_C10_CUDA; otherwise the legacy default stream, which orders with
// every blocking stream.
cudaStream_t compute_stream() {
#if defined(REMAT_WITH_C10_CUDA)
  return c10::cuda::getCurrentCUDAStream().stream();
#else
  return cudaStreamLegacy;
#endif
}

ncclDataType_t nccl_type(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte:
    case at::kBool: return ncclUint8;
    default:
      throw CommError(str(op, ": dtype ", c10::toString(t),
                          " is not supported by the nccl backend"));
  }
}

// `op` has passed Communicator::check_reduce_op.
ncclRedOp_t nccl_op(ReduceOp op, at::ScalarType t) {
  if (t == at::kBool) return op == ReduceOp::kMin ? ncclMin : ncclMax;  // all / any
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

void check_contiguous(const at::Tensor& t, const char* op) {
  if (!t.is_contiguous()) {
    throw CommError(str(op, ": the nccl backend needs contiguous tensors; call .contiguous() "
                        "first (and copy the result back for in-place ops)"));
  }
}

struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool aborted = false;
};


class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, std::string what, Timeout timeout,
           std::vector<at::Tensor> keep, bool collective, bool debug_checked)
      : state_(std::move(state)), what_(std::move(what)), timeout_(timeout),
        keep_(std::move(keep)), collective_(collective), debug_checked_(debug_checked) {
    cuda_check(cudaEventCreateWithFlags(&done_event_, cudaEventDisableTiming), what_);
    cuda_check(cudaEventRecord(done_event_, state_->stream), what_);
  }
  ~NcclWork() override {
    end_trace_span(span);
    cudaEventDestroy(done_event_);
  }

  uint64_t span = 0;  // on a memory trace: from the launch to the completion seen here

  bool isCompleted() override {
    if (!error_.empty()) throw CommError(error_);
    if (done_) return true;
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(state_->comm, &async), state_->comm, what_);
    if (async != ncclSuccess && async != ncclInProgress) {
      error_ = str(what_, " failed: ", ncclGetErrorString(async), " (",
                   ncclGetLastError(state_->comm), ")");
      abort();
      record_communication_failure(error_);
      throw CommError(error_);
    }
    cudaError_t rc = cudaEventQuery(done_event_);
    if (rc == cudaErrorNotReady) return false;
    cuda_check(rc, what_);
    done_ = true;
    end_trace_span(span);
    span = 0;
    // Later work on the compute stream sees the result.
    cuda_check(cudaStreamWaitEvent(compute_stream(), done_event_, 0), what_);
    keep_.clear();
    return true;
  }

  void wait() override {
    auto start = std::chrono::steady_clock::now();
    while (!isCompleted()) {
      if (communication_failed()) {
        // The failure that ended the job first: it is what the user acts on.
        error_ = str(communication_failure(), " (", what_, " was abandoned because of it)");
        abort();
        throw CommError(error_);
      }
      if (std::chrono::steady_clock::now() - start > timeout_) {
        error_ = str(what_, " did not complete within ", timeout_.count() / 1000.0,
                     " s; the NCCL communicator was aborted. ",
                     timeout_advice(collective_ ? WaitedFor::kCollective : WaitedFor::kPointToPoint,
                                    debug_checked_));
        abort();
        record_communication_failure(error_);
        throw TimeoutError(error_);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  void abort() {
    if (!state_->aborted) {
      ncclCommAbort(state_->comm);
      state_->aborted = true;
    }
  }

  std::shared_ptr<NcclState> state_;
  std::string what_;
  Timeout timeout_;
  std::vector<at::Tensor> keep_;
  bool collective_;
  bool debug_checked_;  // REMAT_DEBUG_COLLECTIVES compared the call across ranks before it started
  cudaEvent_t done_event_ = nullptr;
  bool done_ = false;
  std::string error_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<MpiCommunicator> bootstrap)
      : Communicator(bootstrap->rank(), bootstrap->size()),
        bootstrap_(std::move(bootstrap)),
        state_(std::make_shared<NcclState>()) {
    ncclUniqueId id;
    if (rank_ == 0) nccl_check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
    int rc = MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, bootstrap_->mpiComm());
    if (rc != MPI_SUCCESS) throw CommError("broadcasting the NCCL unique id over MPI failed");
    nccl_check(ncclCommInitRank(&state_->comm, size_, id, rank_), nullptr, "ncclCommInitRank");
    cuda_check(cudaStreamCreateWithFlags(&state_->stream, cudaStreamNonBlocking),
               "creating the communication stream");
  }

  ~NcclCommunicator() override {
    if (state_->comm != nullptr && !state_->aborted) ncclCommDestroy(state_->comm);
    if (state_->stream != nullptr) cudaStreamDestroy(state_->stream);
  }

  std::string backendName() const override { return "nccl"; }

  std::shared_ptr<Work> allReduce(at::Tensor& t, const AllReduceOptions& opts) override {
    if (on_host({t})) return bootstrap_->allReduce(t, opts);
    check_reduce_op(opts.op, t.scalar_type(), "allReduce");
    return launch("allReduce", str(describe(t), ", op=", to_string(opts.op)), opts.timeout, {t},
                  [&](cudaStream_t s) {
                    return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                         nccl_type(t.scalar_type(), "allReduce"),
                                         nccl_op(opts.op, t.scalar_type()),
                                         state_->comm, s);
                  });
  }

  std::shared_ptr<Work> allGather(at::Tensor& out, const at::Tensor& in,
                                  const AllGatherOptions& opts) override {
    if (on_host({out, in})) return bootstrap_->allGather(out, in, opts);
    check_gather_flat(out, in, size_);
    return launch("allGather", describe(in), opts.timeout, {out, in}, [&](cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(),
                           nccl_type(in.scalar_type(), "allGather"), state_->comm, s);
    });
  }

  std::shared_ptr<Work> allGather(std::vector<at::Tensor>& outs, const at::Tensor& in,
                                  const AllGatherOptions& opts) override {
    std::vector<at::Tensor> all = outs;
    all.push_back(in);
    if (on_host(all)) return bootstrap_->allGather(outs, in, opts);
    std::string signature = check_gather_list(outs, in, rank_, size_);
    std::vector<at::Tensor> keep = outs;
    keep.push_back(in);
    // Sizes may differ across ranks: one broadcast per rank, grouped.
    return launch("allGatherList", signature, opts.timeout, keep, [&](cudaStream_t s) {
                    ncclDataType_t type = nccl_type(in.scalar_type(), "allGather");
                    nccl_check(ncclGroupStart(), state_->comm, "allGather");
                    for (int r = 0; r < size_; ++r) {
                      const void* send = r == rank_ ? in.data_ptr() : nullptr;
                      nccl_check(ncclBroadcast(send, outs[r].data_ptr(), outs[r].numel(), type,
                                               r, state_->comm, s),
                                 state_->comm, "allGather");
                    }
                    return ncclGroupEnd();
                  });
  }

  std::shared_ptr<Work> reduceScatter(at::Tensor& out, const at::Tensor& in,
                                      const ReduceScatterOptions& opts) override {
    if (on_host({out, in})) return bootstrap_->reduceScatter(out, in, opts);
    check_reduce_op(opts.op, in.scalar_type(), "reduceScatter");
    check_scatter(out, in, size_);
    return launch("reduceScatter", str(describe(in), ", op=", to_string(opts.op)), opts.timeout,
                  {out, in}, [&](cudaStream_t s) {
                    return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                             nccl_type(in.scalar_type(), "reduceScatter"),
                                             nccl_op(opts.op, in.scalar_type()),
                                             state_->comm, s);
                  });
  }

  std::shared_ptr<Work> broadcast(at::Tensor& t, const BroadcastOptions& opts) override {
    if (on_host({t})) return bootstrap_->broadcast(t, opts);
    check_root(opts.root, size_, "broadcast");
    return launch("broadcast", str(describe(t), ", root=", opts.root), opts.timeout, {t},
                  [&](cudaStream_t s) {
                    return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(),
                                         nccl_type(t.scalar_type(), "broadcast"), opts.root,
                                         state_->comm, s);
                  });
  }

  std::shared_ptr<Work> barrier(const BarrierOptions& opts) override {
    if (!barrier_buffer_.defined()) {
      barrier_buffer_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    }
    AllReduceOptions all;
    all.timeout = opts.timeout;
    return allReduce(barrier_buffer_, all);
  }

  std::shared_ptr<Work> send(const at::Tensor& t, int dst, const SendRecvOptions& opts) override {
    if (on_host({t})) return bootstrap_->send(t, dst, opts);
    check_peer(dst, rank_, size_, "send");
    return launch("send", str(describe(t), ", dst=", dst), opts.timeout, {t},
                  [&](cudaStream_t s) {
                    return ncclSend(t.data_ptr(), t.numel(), nccl_type(t.scalar_type(), "send"),
                                    dst, state_->comm, s);
                  },
                  /*collective=*/false);
  }

  std::shared_ptr<Work> recv(at::Tensor& t, int src, const SendRecvOptions& opts) override {
    if (on_host({t})) return bootstrap_->recv(t, src, opts);
    check_peer(src, rank_, size_, "recv");
    return launch("recv", str(describe(t), ", src=", src), opts.timeout, {t},
                  [&](cudaStream_t s) {
                    return ncclRecv(t.data_ptr(), t.numel(), nccl_type(t.scalar_type(), "recv"),
                                    src, state_->comm, s);
                  },
                  /*collective=*/false);
  }

  std::shared_ptr<Communicator> split(int color, int key) override {
    auto sub = std::dynamic_pointer_cast<MpiCommunicator>(bootstrap_->split(color, key));
    if (!sub) return nullptr;
    return std::make_shared<NcclCommunicator>(std::move(sub));
  }

 private:
  // A call whose tensors are all in host memory (the engine's agreements,
  // save metadata, a CPU scalar's all-reduce) goes over the MPI communicator
  // NCCL was bootstrapped from: NCCL reads device memory only. A call that
  // mixes host and device tensors is refused by launch(), naming the host one.
  static bool on_host(const std::vector<at::Tensor>& tensors) {
    return std::all_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.device().is_cpu(); });
  }

  // The one place every NCCL call goes through: argument checks, sequence
  // numbers, the debug check, stream ordering, return codes, the Work.
  std::shared_ptr<Work> launch(const char* op, const std::string& signature, Timeout timeout,
                               std::vector<at::Tensor> tensors,
                               const std::function<ncclResult_t(cudaStream_t)>& call,
                               bool collective = true) {
    if (state_->aborted) {
      throw CommError(str(op, ": this NCCL communicator was aborted after an earlier error"));
    }
    for (const auto& t : tensors) {
      check_tensor_device(t, /*want_cuda=*/true, op, "nccl");
      check_contiguous(t, op);
    }
    auto [what, limit] = begin_call(op, signature, timeout, collective);
    const bool debug_checked = bootstrap_->debugCollectives() && collective;
    if (debug_checked) bootstrap_->verifyCollective(what, limit);

    cudaEvent_t ready;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), what);
    cuda_check(cudaEventRecord(ready, compute_stream()), what);
    cuda_check(cudaStreamWaitEvent(state_->stream, ready, 0), what);
    cudaEventDestroy(ready);
    const uint64_t span = begin_trace_span("collective", op, what);
    try {
      nccl_check(call(state_->stream), state_->comm, what);
    } catch (...) {
      end_trace_span(span);
      throw;
    }
    auto work = std::make_shared<NcclWork>(state_, what, limit, std::move(tensors), collective, debug_checked);
    work->span = span;
    return work;
  }

  std::shared_ptr<MpiCommunicator> bootstrap_;
  std::shared_ptr<NcclState> state_;
  at::Tensor barrier_buffer_;
};

}  // namespace

bool nccl_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  return count > 0;
}

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<MpiCommunicator> bootstrap) {
  if (!nccl_available()) {
    throw CommError("the nccl backend needs a CUDA device and none is visible; use the mpi backend");
  }
  return std::make_shared<NcclCommunicator>(std::move(bootstrap));
}

}  // namespace remat::internal
