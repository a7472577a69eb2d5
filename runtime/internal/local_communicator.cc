#include "runtime/internal/local_communicator.h"

#include <ATen/ATen.h>

#include "runtime/error.h"
#include "runtime/memory_trace.h"
#include "runtime/internal/tensor_checks.h"

namespace remat::internal {
namespace {

// On a memory trace: the collective's span (done at once) and its buffers.
class TracedCall {
 public:
  explicit TracedCall(const char* op) : id_(begin_trace_span("collective", op, "")) {}
  ~TracedCall() { end_trace_span(id_); }
  TracedCall(const TracedCall&) = delete;
  TracedCall& operator=(const TracedCall&) = delete;

 private:
  uint64_t id_;
  MemoryCategoryScope buffers_{MemoryCategory::kCommunication};
};

}  // namespace

// With one rank every reduction is the identity (avg included); the checks are
// the same as the real backends' so that code moving to MPI fails the same way.
std::shared_ptr<Work> LocalCommunicator::allReduce(at::Tensor& tensor, const AllReduceOptions& opts) {
  TracedCall traced("allReduce");
  if (!tensor.defined()) throw CommError("allReduce: got an undefined tensor");
  check_reduce_op(opts.op, tensor.scalar_type(), "allReduce");
  return completed_work();
}

std::shared_ptr<Work> LocalCommunicator::allGather(at::Tensor& output, const at::Tensor& input,
                                                   const AllGatherOptions&) {
  TracedCall traced("allGather");
  check_gather_flat(output, input, 1);
  output.view(-1).copy_(input.reshape(-1));
  return completed_work();
}

std::shared_ptr<Work> LocalCommunicator::allGather(std::vector<at::Tensor>& outputs,
                                                   const at::Tensor& input, const AllGatherOptions&) {
  TracedCall traced("allGatherList");
  check_gather_list(outputs, input, 0, 1);
  outputs[0].copy_(input.view(outputs[0].sizes()));
  return completed_work();
}

std::shared_ptr<Work> LocalCommunicator::reduceScatter(at::Tensor& output, const at::Tensor& input,
                                                       const ReduceScatterOptions& opts) {
  TracedCall traced("reduceScatter");
  check_reduce_op(opts.op, input.scalar_type(), "reduceScatter");
  check_scatter(output, input, 1);
  output.view(-1).copy_(input.reshape(-1));
  return completed_work();
}

std::shared_ptr<Work> LocalCommunicator::broadcast(at::Tensor&, const BroadcastOptions& opts) {
  TracedCall traced("broadcast");
  check_root(opts.root, 1, "broadcast");
  return completed_work();
}

std::shared_ptr<Work> LocalCommunicator::barrier(const BarrierOptions&) { return completed_work(); }

std::shared_ptr<Communicator> LocalCommunicator::split(int color, int) {
  if (color < 0) return nullptr;
  return std::make_shared<LocalCommunicator>();
}

}  // namespace remat::internal
