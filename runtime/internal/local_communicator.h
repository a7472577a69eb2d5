// A communicator over one process, for builds without MPI and runs launched
// directly: every collective over a single rank, done in place at once.
#pragma once

#include <memory>
#include <string>

#include "runtime/communicator.h"

namespace remat::internal {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator() : Communicator(0, 1) {}

  std::string backendName() const override { return "local"; }

  std::shared_ptr<Work> allReduce(at::Tensor& tensor, const AllReduceOptions& opts = {}) override;
  std::shared_ptr<Work> allGather(at::Tensor& output, const at::Tensor& input,
                                  const AllGatherOptions& opts = {}) override;
  std::shared_ptr<Work> allGather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                  const AllGatherOptions& opts = {}) override;
  std::shared_ptr<Work> reduceScatter(at::Tensor& output, const at::Tensor& input,
                                      const ReduceScatterOptions& opts = {}) override;
  std::shared_ptr<Work> broadcast(at::Tensor& tensor, const BroadcastOptions& opts = {}) override;
  std::shared_ptr<Work> barrier(const BarrierOptions& opts = {}) override;
  std::shared_ptr<Communicator> split(int color, int key) override;
};

}  // namespace remat::internal
