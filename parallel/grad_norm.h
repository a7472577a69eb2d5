// Global-norm gradient clipping over tensors that live on different sets of
// ranks.
//
// Each group lists tensors whose squared gradient norms add up across the
// communicators in `summed_over` (a data-parallel shard is summed over the
// data-parallel group, a tensor-parallel shard over the tensor-parallel
// group, a shard of both over both; a replicated tensor over none). The
// global norm is the square root of the sum over groups, the same on every
// rank; when it exceeds max_norm every gradient is scaled by
// max_norm / (norm + 1e-6).
//
//   double norm = remat::parallel::clip_grad_norm(
//       {{shards, {dp_group}}, {replicated, {}}}, /*max_norm=*/1.0);
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

namespace remat {
class Communicator;
}

namespace remat::parallel {

struct GradGroup {
  std::vector<at::Tensor> tensors;
  std::vector<std::shared_ptr<Communicator>> summed_over;  // null or size 1: skipped
};

// Returns the global norm before clipping. Tensors without a gradient count
// as zero. Every rank of each communicator must make the same call. The
// squared norms are summed across ranks on `reduce_on` (default: the first
// tensor's device), where host tensors' communicator wants another device.
double clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm,
                      std::optional<at::Device> reduce_on = std::nullopt);

}  // namespace remat::parallel
