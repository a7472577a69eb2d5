#include "runtime/communicator.h"

#include <atomic>
#include <mutex>

#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

namespace {

class CompletedWork final : public Work {
 public:
  bool isCompleted() override { return true; }
  void wait() override {}
};

}  // namespace

std::shared_ptr<Work> completed_work() { return std::make_shared<CompletedWork>(); }

namespace {
std::atomic<bool> g_failed{false};
std::mutex g_failure_mutex;
std::string g_failure;
}  // namespace

void record_communication_failure(const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(g_failure_mutex);
    if (!g_failure.empty()) return;
    g_failure = error;
  }
  g_failed = true;
  log().error("{}", error);
}

std::string communication_failure() {
  std::lock_guard<std::mutex> lock(g_failure_mutex);
  return g_failure;
}

bool communication_failed() { return g_failed.load(std::memory_order_relaxed); }

Communicator::Communicator(int rank, int size)
    : rank_(rank), size_(size), default_timeout_(knobs::comm_timeout()) {}

Communicator::Call Communicator::begin_call(const char* op, const std::string& signature,
                                            Timeout requested, bool collective) {
  Call call;
  call.what = collective ? str(op, "(seq=", seq_, ", ", signature, ")") : str(op, "(", signature, ")");
  if (collective) ++seq_;
  call.timeout = requested.count() > 0 ? requested : default_timeout_;
  return call;
}

void Communicator::check_reduce_op(ReduceOp reduce, at::ScalarType dtype, const char* op) {
  if (reduce == ReduceOp::kAvg && !at::isFloatingType(dtype)) {
    throw CommError(str(op, ": ReduceOp avg needs a floating-point tensor, got ",
                        c10::toString(dtype), "; use sum and divide yourself"));
  }
}

void Communicator::unsupported(const char* op) const {
  throw CommError(str("communication backend '", backendName(), "' does not implement ",
                      op));
}

std::shared_ptr<Work> Communicator::allReduce(at::Tensor&, const AllReduceOptions&) {
  unsupported("allReduce");
}
std::shared_ptr<Work> Communicator::allGather(at::Tensor&, const at::Tensor&,
                                              const AllGatherOptions&) {
  unsupported("allGather");
}
std::shared_ptr<Work> Communicator::allGather(std::vector<at::Tensor>&, const at::Tensor&,
                                              const AllGatherOptions&) {
  unsupported("allGather (list)");
}
std::shared_ptr<Work> Communicator::reduceScatter(at::Tensor&, const at::Tensor&,
                                                  const ReduceScatterOptions&) {
  unsupported("reduceScatter");
}
std::shared_ptr<Work> Communicator::broadcast(at::Tensor&, const BroadcastOptions&) {
  unsupported("broadcast");
}
std::shared_ptr<Work> Communicator::barrier(const BarrierOptions&) { unsupported("barrier"); }
std::shared_ptr<Work> Communicator::send(const at::Tensor&, int, const SendRecvOptions&) {
  unsupported("send");
}
std::shared_ptr<Work> Communicator::recv(at::Tensor&, int, const SendRecvOptions&) {
  unsupported("recv");
}
std::shared_ptr<Communicator> Communicator::split(int, int) { unsupported("split"); }

}  // namespace remat
