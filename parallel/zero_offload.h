// The optimizer half of ZeRO-Offload (zero_optimization.offload_optimizer,
// internal to parallel/): ZeroModel hands the optimizer host copies of what
// its stage would have it step, so that the float32 master shards, their
// gradients and the optimizer state (made by the optimizer beside its
// parameters) live in host memory; the device keeps the tensors the stage
// gathers from and reduces into.
//
//   backward   after the last micro-step's reductions, each reduced gradient
//              shard is copied into its host master's gradient and dropped on
//              the device (take_gradients);
//   step       the optimizer steps the host masters (clipping, the
//              non-finite check and the fp16 unscale read the host gradients);
//   push       the updated masters are copied back into the device shards
//              before anything reads them (after the step, a load or a write,
//              and at the next forward), which the stage then gathers.
//
// Every copy is synchronous (a GPU's copies run on the current stream,
// ordered before the collectives that read them). On a CPU the host and the
// device are one memory: the host tensors are still separate tensors, and
// the step computes the same bits as without offload.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <vector>

#include "parallel/zero_options.h"

namespace remat::parallel {

class OptimizerOffload {
 public:
  // `device`: what the stage's optimizer would step (its parameters()); each
  // that requires a gradient gets a float32 host master, pinned when
  // options.pin_memory and this LibTorch can pin; the others (frozen) are
  // handed to the optimizer as they are.
  OptimizerOffload(std::vector<at::Tensor> device, const OffloadOptimizerOptions& options);

  // What the optimizer steps, in the order of `device`.
  const std::vector<at::Tensor>& parameters() const { return host_; }
  // The host tensor that stands for `device` (itself when not offloaded).
  at::Tensor host_of(const at::Tensor& device) const;

  // The reduced gradients moved to the host: each device tensor's gradient
  // copied into its master's (a host buffer kept across steps) and dropped on
  // the device. Call after the reductions of an accumulation window's last
  // micro-step.
  void take_gradients();
  // The masters copied into the device tensors: always with `force`, else
  // only when gradients were taken (a step may have followed) or a master
  // was written since the last push.
  void push(bool force);
  // Drops the gradients on both sides (an abandoned backward).
  void drop_gradients();

  // Host bytes: the masters and their gradient buffers.
  int64_t host_bytes() const;
  bool pinned() const { return pinned_; }

 private:
  std::vector<at::Tensor> device_, host_, grads_;  // grads_: the host gradient buffers
  std::vector<char> offloaded_;
  std::vector<int64_t> versions_;  // host_'s versions at the last push
  std::map<const void*, size_t> index_;  // device_ by TensorImpl
  bool taken_ = false;
  bool pinned_ = false;
};

}  // namespace remat::parallel
