#include "runtime/internal/tensor_checks.h"

#include "runtime/error.h"

namespace remat::internal {

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

namespace {

std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; t.defined() && i < t.dim(); ++i) {
    out += (i ? ", " : "") + std::to_string(t.size(i));
  }
  return out + "]";
}

}  // namespace

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  return str("dtype=", c10::toString(t.scalar_type()), ", shape=", shape_of(t));
}

void check_gather_flat(const at::Tensor& output, const at::Tensor& input, int size) {
  check_same_dtype(output, input, "allGather");
  REMAT_CHECK_EQ(output.numel(), input.numel() * size,
                 "allGather: the output must hold size() inputs");
}

std::string check_gather_list(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              int rank, int size) {
  REMAT_CHECK_EQ(static_cast<int>(outputs.size()), size,
                 "allGather: the output list needs one tensor per rank");
  std::string shapes;
  for (const auto& o : outputs) {
    check_same_dtype(o, input, "allGather");
    shapes += (shapes.empty() ? "" : " ") + shape_of(o);
  }
  REMAT_CHECK_EQ(outputs[rank].numel(), input.numel(),
                 "allGather: outputs[rank] must match this rank's input");
  return str("dtype=", c10::toString(input.scalar_type()), ", outputs=", shapes);
}

void check_scatter(const at::Tensor& output, const at::Tensor& input, int size) {
  check_same_dtype(output, input, "reduceScatter");
  REMAT_CHECK_EQ(input.numel(), output.numel() * size,
                 "reduceScatter: the input must hold size() outputs (pad it to a multiple)");
}

void check_root(int root, int size, const char* op) {
  if (root < 0 || root >= size) {
    throw CommError(str(op, ": root ", root, " is not a rank of this communicator (0..",
                        size - 1, ")"));
  }
}

void check_peer(int peer, int rank, int size, const char* op) {
  if (peer < 0 || peer >= size || peer == rank) {
    throw CommError(str(op, ": peer ", peer, " must be another rank of this communicator (0..",
                        size - 1, ", not ", rank, ")"));
  }
}

std::string timeout_advice(WaitedFor waited, bool debug) {
  const char* slow = "raise REMAT_COMM_TIMEOUT_S if it is only slow";
  switch (waited) {
    case WaitedFor::kPointToPoint:
      return str("the peer may have exited or stalled, or sent (or received) no matching message with this "
                 "tag", debug ? " (REMAT_DEBUG_COLLECTIVES checks collectives, not send and recv)" : "",
                 "; ", slow, ", or give the call a longer timeout");
    case WaitedFor::kCollective:
      if (debug) {
        return str("REMAT_DEBUG_COLLECTIVES is on and its check passed, so every rank called this same "
                   "collective: a peer exited or stalled inside it, or the transport hangs. The peers' own "
                   "errors name what they were doing; ", slow);
      }
      return str("a peer may have exited, stalled, or called a different collective. Run with "
                 "REMAT_DEBUG_COLLECTIVES=1 to compare the calls across ranks, or ", slow);
    case WaitedFor::kDebugCheck:
      return str("REMAT_DEBUG_COLLECTIVES is on and not every rank reached this collective's check (a rank "
                 "that called another collective, or this one with another sequence number, would have been "
                 "named as a mismatch): a peer exited, stalled, or is busy elsewhere (computing, another "
                 "communicator, I/O) and has not called it. The peers' own errors name what they were doing; ",
                 slow);
  }
  return slow;
}

}  // namespace remat::internal
