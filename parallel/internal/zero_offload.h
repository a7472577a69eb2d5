// The optimizer half of ZeRO-Offload (zero_optimization.offload_optimizer,
// internal to parallel/): the host mode of the master policy
// (master_policy.h), which hands the optimizer host copies of what the stage
// would have it step, so that the float32 master shards, their
// gradients and the optimizer state (made by the optimizer beside its
// parameters) live in host memory; the device keeps the tensors the stage
// gathers from and reduces into.
//
//   backward   in the last micro-step, each reduced gradient shard is copied
//              into its host master's gradient as soon as its reduction ends
//              (take_gradient) and dropped on the device; after the backward,
//              whatever is left, and the copies are waited for (take_gradients);
//   step       the optimizer steps the host masters (clipping, the
//              non-finite check and the fp16 unscale read the host gradients);
//   push       the updated masters are copied back into the device shards
//              before anything reads them (after the step, a load or a write,
//              and at the next forward), which the stage then gathers.
//
// On an accelerator the gradients' copies run on a side stream that first
// waits for the compute stream (the reduced gradient as computed), their
// device memory recorded on it (not reused before the copy ends), into
// pinned buffers without blocking where pinned; take_gradients waits for
// them. The copies back run on a second side stream that first waits for
// what the compute stream queued (which may still read the device tensors),
// without blocking the host where pinned; each tensor's copy records an
// event, and the stage makes the compute stream wait for a tensor's event
// just before it reads it (ready(): stages 1-2 before each bucket's
// all-gather, stage 3 before each unit's gather), so that later copies
// overlap the first gathers. The host masters are not written while a copy
// from them is in flight: take_gradients (before the step) and parameters()
// (ZeroModel's, before a load or a user's write) wait for the copies
// (settle()). Under masters_on_host the device tensors are 16-bit: the copy
// back rounds, as making the compute copy from a device master would. On a
// CPU every copy is done at
// once: the host and the device are one memory, the host tensors are still
// separate tensors, and the step computes the same bits as without offload.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "parallel/zero_options.h"

namespace remat::parallel {

class NvmeTensorFile;

class OptimizerOffload {
 public:
  // `device`: what the stage's optimizer would step (its parameters()); each
  // that requires a gradient gets a float32 host master, pinned when
  // options.pin_memory and this LibTorch can pin; the others (frozen, and
  // those in `on_host`: offload_param's shards, host tensors already, whose
  // reduced gradients land on them) are handed to the optimizer as they are.
  // `masters` (the stage's host_masters(), masters_on_host): where defined,
  // the host master of device[i], made by the stage (device[i] is its 16-bit
  // copy), frozen ones too, taken as it is.
  // `file`: offload_optimizer "nvme"'s, where the masters it makes are mapped from.
  OptimizerOffload(std::vector<at::Tensor> device, const OffloadOptimizerOptions& options,
                   const std::vector<at::Tensor>& on_host = {}, const std::vector<at::Tensor>& masters = {},
                   NvmeTensorFile* file = nullptr);
  // Waits for the copies in flight (their buffers are then free to go).
  ~OptimizerOffload();
  OptimizerOffload(const OptimizerOffload&) = delete;
  OptimizerOffload& operator=(const OptimizerOffload&) = delete;

  // What the optimizer steps, in the order of `device`.
  const std::vector<at::Tensor>& parameters() const { return host_; }
  // The host tensor that stands for `device` (itself when not offloaded).
  at::Tensor host_of(const at::Tensor& device) const;

  // `device`'s gradient, complete for the accumulation window, copied into
  // its master's (a host buffer kept across steps) and dropped on the device;
  // nothing where it has none or is not offloaded.
  void take_gradient(const at::Tensor& device);
  // After an accumulation window's last backward: every gradient not taken
  // yet taken, and the copies waited for (the host gradients read right).
  void take_gradients();
  // The masters copied into the device tensors: always with `force`, else
  // only when gradients were taken (a step may have followed) or a master
  // was written since the last push.
  void push(bool force);
  // Before `device` is read on the current stream: that stream waits for
  // its copy from the host (nothing where none is in flight, or on a CPU).
  void ready(const at::Tensor& device) const;
  // The host waits for the copies to the device still in flight (before the
  // host masters are written).
  void settle();
  // Drops the gradients on both sides (an abandoned backward).
  void drop_gradients();

  // Host bytes: the masters (those in host memory) and their gradient buffers.
  int64_t host_bytes() const;
  bool pinned() const { return pinned_; }

 private:
  void take(size_t i);
  void log_masters(const OffloadOptimizerOptions& options, int64_t elements, int64_t frozen, bool beside_shards,
                   const NvmeTensorFile* file) const;
  // dst (host) <- src: on an accelerator on side_, else at once.
  void copy_to_host(const at::Tensor& src, at::Tensor& dst);
  // device_[i] <- host_[i] on up_ (`waited`: up_ waits for the compute stream once per push).
  void upload(size_t i, bool& waited);

  std::vector<at::Tensor> device_, host_, grads_;  // grads_: the host gradient buffers
  std::optional<c10::Stream> side_;  // an accelerator's copy stream, from its first copy
  bool in_flight_ = false;           // copies on side_ not waited for
  std::optional<c10::Stream> up_;    // an accelerator's stream for the copies back, from the first
  std::vector<std::unique_ptr<c10::Event>> uploaded_;  // each device tensor's last copy back
  bool uploading_ = false;           // copies on up_ not waited for by the host
  std::vector<char> offloaded_;
  std::vector<int64_t> versions_;  // host_'s versions at the last push
  std::map<const void*, size_t> index_;  // device_ by TensorImpl
  bool taken_ = false;
  bool pinned_ = false;
  bool adopted_ = false;  // masters made by the stage (masters_on_host)
  const NvmeTensorFile* file_ = nullptr;  // offload_optimizer "nvme": where masters may be mapped from
};

// Whether this LibTorch can pin host memory (a CUDA build with a device).
bool can_pin_host_memory();

// `t` copied into a new float32 host tensor of its own, page-locked when
// `pinned` (the policy's host masters, offload_param's shards).
at::Tensor host_copy(const at::Tensor& t, bool pinned);

// offload_param's log lines: the host shards' elements (with "nvme", those
// in `file` and those kept in memory), and DeepSpeed's buffer keys where set
// (they change nothing here).
void log_offload_param(const OffloadParamOptions& options, const std::vector<at::Tensor>& shards,
                       const NvmeTensorFile* file);

}  // namespace remat::parallel
