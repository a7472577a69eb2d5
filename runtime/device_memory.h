// The memory of the device a rank computes on: how much it has, and on a CUDA
// device what LibTorch's caching allocator holds. What the metrics, the
// memory estimate and `device_memory_budget_bytes: "auto"` read.
//
//   remat::DeviceMemory m = remat::device_memory(param.device(), &tracker);
//   m.capacity;   // bytes the device has
//   m.allocated;  // bytes in live tensors now (m.peak_allocated: the most since the reset)
//
// CUDA: `capacity` is cudaMemGetInfo's total (0 in a build without the CUDA
// runtime, or where the device cannot be asked). `allocated` is the bytes in
// live tensors and `reserved` what the caching allocator holds from the
// driver (allocated included, and the cached blocks it keeps for reuse);
// their peaks run from reset_device_memory_peaks(). These four come from the
// caching allocator of a CUDA LibTorch only (`allocator_stats` true); ask
// after the device's first tensor (before it the allocator may not be set up,
// and the stats read as absent).
// CPU: `capacity` is the physical memory (sysconf: pages x page size; a
// container's memory limit is not applied). `allocated` and its peak are
// what `tracker` counts on the CPU (0 without one). There is no reserved
// memory: LibTorch's CPU allocator holds nothing beyond the live tensors, so
// `reserved` and `peak_reserved` are -1 and `allocator_stats` is false.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace remat {

class MemoryTracker;

struct DeviceMemory {
  int64_t capacity = 0;  // 0: unknown
  bool allocator_stats = false;
  int64_t allocated = 0, peak_allocated = 0;
  int64_t reserved = -1, peak_reserved = -1;
};

DeviceMemory device_memory(c10::Device device, const MemoryTracker* tracker = nullptr);

// CUDA (a CUDA LibTorch): the caching allocator's peaks start again from its
// current values. Nothing on the CPU (a MemoryTracker resets its own).
void reset_device_memory_peaks(c10::Device device);

// CUDA (a CUDA LibTorch): hands the caching allocator's unused blocks back
// to the driver (what a measurement that allocated much and freed it leaves
// reserved). Nothing on the CPU.
void release_cached_device_memory(c10::Device device);

// The CUDA devices this process sees (0 in a build without the CUDA runtime).
int cuda_device_count();

// Whether CUDA device `index` computes bf16 well: compute capability 8.0 or
// higher (bf16 tensor cores, Ampere on). false in a build without the CUDA
// runtime, or where the device cannot be asked.
bool cuda_computes_bf16(int index);

// The memory one rank of this host has on `device`, and where the figure
// comes from: REMAT_MEMORY_PER_RANK_BYTES when set (`given`); else a GPU's
// capacity over the ranks sharing it, the CPU's physical memory (capped by a
// cgroup v2 memory.max where one is set) over the host's ranks. A capacity,
// never what is free at the moment: the same figure at every launch, so
// that what is decided from it (an "auto" micro-batch's candidates) does not
// drift. What remat-train's fit check and "auto" micro-batch, remat-estimate
// and device_memory_budget_bytes "auto" read. `total` 0: unknown.
struct RankMemory {
  int64_t total = 0;  // the device's bytes (given: the rank's)
  int ranks = 1;      // ranks on this host sharing them (given: 1)
  bool given = false;
  std::string source;  // "REMAT_MEMORY_PER_RANK_BYTES", "capacity", "physical memory"
  int64_t per_rank() const { return total / ranks; }
};
RankMemory rank_memory(c10::Device device);

// `device_memory_budget_bytes: "auto"`: a rank's share of its device less a
// reserve for what no tensor holds (on a GPU: the CUDA context, the caching
// allocator's fragmentation, NCCL's buffers; on the CPU: the process's own
// heap), a tenth of the share and at least 1 GiB; a tenth alone of a share
// REMAT_MEMORY_PER_RANK_BYTES gives (the bytes a rank may use, a device's
// fixed costs left out).
struct DeviceBudget {
  int64_t capacity = 0;   // the device's bytes
  int ranks_sharing = 1;  // ranks on this host computing on the same device
  std::string source = "capacity";  // what `capacity` is (RankMemory::source)
  int64_t share = 0;      // capacity / ranks_sharing
  int64_t reserve = 0;
  int64_t budget = 0;  // share - reserve
  // "71.3 GiB = 79.2 GiB capacity - 7.9 GiB reserve" (with " / 2 ranks" after the capacity when shared).
  std::string text() const;
};
constexpr int64_t kMinDeviceReserveBytes = int64_t{1} << 30;
// A ConfigError naming `key` when the capacity is unknown (0) or the share
// leaves nothing above the reserve. `given`: the capacity is
// REMAT_MEMORY_PER_RANK_BYTES (a tenth reserved, no floor).
DeviceBudget auto_device_budget(int64_t capacity, int ranks_sharing, const std::string& key, bool given = false);
// The ranks on this host that compute on `device`, this one among them: the
// CPU: every local rank; CUDA: the local ranks over the devices (Runtime gives
// local rank r device r % devices), rounded up.
int ranks_sharing(c10::Device device);
// The same for a rank of this process computing on `device`: its
// rank_memory().
DeviceBudget auto_device_budget(c10::Device device, const std::string& key);

}  // namespace remat
