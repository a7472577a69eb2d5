#include "checkpointing/internal/host_transfer.h"

#include <ATen/ATen.h>

#include <map>
#include <mutex>

#if defined(REMAT_WITH_C10_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "runtime/error.h"
#include "runtime/memory_trace.h"

namespace remat::host_transfer {
namespace {

class DoneCopy final : public PendingCopy {
 public:
  bool done() override { return true; }
  void wait() override {}
  void order_before_use() override {}
};

#if defined(REMAT_WITH_C10_CUDA)

void cuda_check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw Error(str("checkpoint offload: ", what, " failed: ", cudaGetErrorString(rc)));
  }
}

// An event recorded on `stream` when created.
cudaEvent_t record_on(const c10::cuda::CUDAStream& stream) {
  cudaEvent_t event;
  cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventRecord(event, stream.stream()), "cudaEventRecord");
  return event;
}

class CudaCopy final : public PendingCopy {
 public:
  CudaCopy(cudaEvent_t event, c10::DeviceIndex device) : event_(event), device_(device) {}
  ~CudaCopy() override { cudaEventDestroy(event_); }
  bool done() override {
    cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) return false;
    cuda_check(rc, "cudaEventQuery");
    return true;
  }
  void wait() override { cuda_check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }
  void order_before_use() override {
    auto current = c10::cuda::getCurrentCUDAStream(device_);
    cuda_check(cudaStreamWaitEvent(current.stream(), event_, 0), "cudaStreamWaitEvent");
  }

 private:
  cudaEvent_t event_;
  c10::DeviceIndex device_;
};

// The side stream of `device`, one per device for the process.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)).first;
  }
  return it->second;
}

// Copies src into dst on the side stream after the compute stream's work so far.
std::shared_ptr<PendingCopy> cuda_copy(const at::Tensor& src, at::Tensor& dst,
                                       c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  auto compute = c10::cuda::getCurrentCUDAStream(device);
  auto side = side_stream(device);
  cudaEvent_t ready = record_on(compute);
  cuda_check(cudaStreamWaitEvent(side.stream(), ready, 0), "cudaStreamWaitEvent");
  cudaEventDestroy(ready);
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    dst.copy_(src, /*non_blocking=*/true);
  }
  // The device tensor is in use on the side stream until the copy ends.
  const at::Tensor& on_device = src.is_cuda() ? src : dst;
  c10::cuda::CUDACachingAllocator::recordStream(on_device.storage().data_ptr(), side);
  return std::make_shared<CudaCopy>(record_on(side), device);
}

#endif

}  // namespace

bool wants_pinned(const at::Device& device) { return device.is_cuda(); }

at::Tensor empty_host_like(const at::Tensor& like) {
  MemoryCategoryScope host(MemoryCategory::kHostCopies);
  return at::empty(like.sizes(), at::TensorOptions()
                                     .dtype(like.scalar_type())
                                     .device(at::kCPU)
                                     .pinned_memory(wants_pinned(like.device())));
}

std::shared_ptr<PendingCopy> copy_to_host(const at::Tensor& src, at::Tensor& dst) {
  REMAT_CHECK(dst.device().is_cpu(), "copy_to_host: destination must be host memory");
#if defined(REMAT_WITH_C10_CUDA)
  if (src.is_cuda()) return cuda_copy(src, dst, src.device().index());
#else
  REMAT_CHECK(!src.is_cuda(), "checkpoint offload of CUDA tensors needs a build with c10_cuda");
#endif
  dst.copy_(src);
  return std::make_shared<DoneCopy>();
}

std::shared_ptr<PendingCopy> copy_to_device(const at::Tensor& src, at::Tensor& dst) {
  REMAT_CHECK(src.device().is_cpu(), "copy_to_device: source must be host memory");
#if defined(REMAT_WITH_C10_CUDA)
  if (dst.is_cuda()) return cuda_copy(src, dst, dst.device().index());
#else
  REMAT_CHECK(!dst.is_cuda(), "checkpoint offload of CUDA tensors needs a build with c10_cuda");
#endif
  dst.copy_(src);
  return std::make_shared<DoneCopy>();
}

}  // namespace remat::host_transfer
