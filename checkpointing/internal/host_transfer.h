// Copies between a device and host memory for offloaded checkpoint inputs
// (internal to checkpointing/).
//
// For CUDA tensors the copy runs on a side stream that first waits for the
// compute stream (so it sees the data as computed), with the source's memory
// recorded on the side stream (so the allocator does not reuse it before the
// copy ends); the compute stream waits for the copy before the data is used.
// For CPU tensors the copy is done at once: the same bookkeeping runs on a
// CPU-only build, where "device" and host are both CPU memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace remat::host_transfer {

class PendingCopy {
 public:
  virtual ~PendingCopy() = default;
  virtual bool done() = 0;
  // Blocks the calling thread until the copy has finished.
  virtual void wait() = 0;
  // Makes the current stream wait for the copy (does not block the thread).
  virtual void order_before_use() = 0;
};

// A new host tensor for `like`: pinned when `like` is on a GPU.
at::Tensor empty_host_like(const at::Tensor& like);
bool wants_pinned(const at::Device& device);

// dst (host) <- src (device).
std::shared_ptr<PendingCopy> copy_to_host(const at::Tensor& src, at::Tensor& dst);
// dst (device) <- src (host).
std::shared_ptr<PendingCopy> copy_to_device(const at::Tensor& src, at::Tensor& dst);

}  // namespace remat::host_transfer
