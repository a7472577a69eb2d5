#include "runtime/device_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/process_env.h"

#if defined(REMAT_WITH_NCCL) || defined(REMAT_WITH_C10_CUDA)
#include <cuda_runtime_api.h>
#endif
#if defined(REMAT_WITH_C10_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace remat {
namespace {

int64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

// The host's memory as a rank can count on it whatever runs beside it: the
// physical memory, capped by a container's limit (cgroup v2 memory.max)
// where one is set. Stable from one launch to the next, unlike MemAvailable.
int64_t host_capacity() {
  int64_t bytes = physical_memory();
  std::ifstream max_file("/sys/fs/cgroup/memory.max");
  double max = 0;
  if ((max_file >> max) && max > 0 && (bytes <= 0 || max < static_cast<double>(bytes))) {
    bytes = static_cast<int64_t>(max);
  }
  return bytes;
}

// cudaMemGetInfo's total of device `index` (made current for the call, the
// current device put back).
int64_t cuda_capacity(int index) {
#if defined(REMAT_WITH_NCCL)
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  size_t free = 0, total = 0;
  const bool ok = cudaSetDevice(index) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess;
  if (previous >= 0 && previous != index) cudaSetDevice(previous);
  if (!ok) cudaGetLastError();  // cleared: the failure is answered by capacity 0
  return ok ? static_cast<int64_t>(total) : 0;
#else
  (void)index;
  return 0;
#endif
}

// The caching allocator's counts of device `index` (index 0 of each array:
// the aggregate over its small and large pools, StatType::AGGREGATE).
void read_allocator(int index, DeviceMemory& m) {
#if defined(REMAT_WITH_C10_CUDA)
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    m.allocated = stats.allocated_bytes[0].current;
    m.peak_allocated = stats.allocated_bytes[0].peak;
    m.reserved = stats.reserved_bytes[0].current;
    m.peak_reserved = stats.reserved_bytes[0].peak;
    m.allocator_stats = true;
  } catch (const c10::Error&) {
    // The allocator is not set up for this device yet: no stats.
  }
#else
  (void)index;
  (void)m;
#endif
}

// GiB to a tenth; below 1 GiB (a share REMAT_MEMORY_PER_RANK_BYTES gives) MiB.
std::string gib(int64_t bytes) {
  const bool small = bytes < (int64_t{1} << 30);
  return str(std::round(static_cast<double>(bytes) / (small ? 1 << 20 : 1 << 30) * 10) / 10, small ? " MiB" : " GiB");
}

}  // namespace

int cuda_device_count() {
#if defined(REMAT_WITH_NCCL)
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return devices;
#else
  return 0;
#endif
}

bool cuda_computes_bf16(int index) {
#if defined(REMAT_WITH_NCCL)
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 8;
#else
  (void)index;
  return false;
#endif
}

DeviceMemory device_memory(c10::Device device, const MemoryTracker* tracker) {
  DeviceMemory m;
  if (device.is_cuda()) {
    int index = device.has_index() ? device.index() : 0;
#if defined(REMAT_WITH_NCCL)
    if (!device.has_index() && cudaGetDevice(&index) != cudaSuccess) index = 0;
#endif
    m.capacity = cuda_capacity(index);
    read_allocator(index, m);
    return m;
  }
  m.capacity = physical_memory();
  if (tracker != nullptr) {
    m.allocated = tracker->current(c10::DeviceType::CPU);
    m.peak_allocated = tracker->peak(c10::DeviceType::CPU);
  }
  return m;
}

void release_cached_device_memory(c10::Device device) {
#if defined(REMAT_WITH_C10_CUDA)
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#else
  (void)device;
#endif
}

void reset_device_memory_peaks(c10::Device device) {
#if defined(REMAT_WITH_C10_CUDA)
  if (!device.is_cuda()) return;
  int index = device.has_index() ? device.index() : 0;
  if (!device.has_index() && cudaGetDevice(&index) != cudaSuccess) index = 0;
  try {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
  } catch (const c10::Error&) {
    // Not set up yet: nothing to reset.
  }
#else
  (void)device;
#endif
}

std::string DeviceBudget::text() const {
  return str(gib(budget), " = ", gib(capacity), " ", source,
             ranks_sharing > 1 ? str(" / ", ranks_sharing, " ranks sharing the device") : std::string(), " - ",
             gib(reserve), " reserve");
}

RankMemory rank_memory(c10::Device device) {
  RankMemory m;
  if (const auto given = knobs::memory_per_rank_bytes()) {
    m.total = *given;
    m.given = true;
    m.source = knobs::kMemoryPerRankBytes;
    return m;
  }
  m.ranks = std::max(ranks_sharing(device), 1);
  m.total = device.is_cuda() ? device_memory(device).capacity : host_capacity();
  m.source = device.is_cuda() ? "capacity" : "physical memory";
  return m;
}

DeviceBudget auto_device_budget(int64_t capacity, int ranks_sharing, const std::string& key, bool given) {
  if (capacity <= 0) {
    throw ConfigError(str("'", key, "' is \"auto\" but this device's capacity is unknown (no CUDA runtime in this "
                          "build, or the device could not be asked): give the budget in bytes"));
  }
  DeviceBudget b;
  b.capacity = capacity;
  b.ranks_sharing = std::max(ranks_sharing, 1);
  b.share = capacity / b.ranks_sharing;
  b.reserve = given ? b.share / 10 : std::max(b.share / 10, kMinDeviceReserveBytes);
  b.budget = b.share - b.reserve;
  if (b.budget <= 0) {
    throw ConfigError(str("'", key, "' is \"auto\" but the device's share, ", gib(b.share), " (", capacity,
                          " bytes capacity", b.ranks_sharing > 1 ? str(" / ", b.ranks_sharing, " ranks") : "",
                          "), leaves nothing above the reserve of ", gib(b.reserve),
                          ": give the budget in bytes, or run fewer ranks per device"));
  }
  return b;
}

int ranks_sharing(c10::Device device) {
  const int local = detect_process_env().local_world_size;
  if (!device.is_cuda()) return local;
  const int devices = cuda_device_count();
  return devices > 0 ? (local + devices - 1) / devices : 1;
}

DeviceBudget auto_device_budget(c10::Device device, const std::string& key) {
  const RankMemory m = rank_memory(device);
  DeviceBudget b = auto_device_budget(m.total, m.ranks, key, m.given);
  b.source = m.source;
  return b;
}

}  // namespace remat
