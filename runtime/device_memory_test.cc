#include "runtime/device_memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <vector>

#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(DeviceMemory, CpuCapacityIsThePhysicalMemory) {
  const DeviceMemory m = device_memory(c10::Device(c10::DeviceType::CPU));
  const int64_t expected = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  EXPECT_GT(m.capacity, 0);
  EXPECT_EQ(m.capacity, expected);
  // No caching allocator on the CPU: nothing reserved, no stats.
  EXPECT_FALSE(m.allocator_stats);
  EXPECT_EQ(m.reserved, -1);
  EXPECT_EQ(m.peak_reserved, -1);
  EXPECT_EQ(m.allocated, 0);  // without a tracker nothing is counted
}

TEST(DeviceMemory, CpuAllocatedIsWhatTheTrackerCounts) {
  MemoryTracker tracker;
  at::Tensor a = torch::empty({1000}, torch::kFloat);
  {
    at::Tensor b = torch::empty({2000}, torch::kFloat);
    const DeviceMemory m = device_memory(c10::Device(c10::DeviceType::CPU), &tracker);
    EXPECT_EQ(m.allocated, tracker.current());
    EXPECT_GE(m.allocated, 12000);
  }
  const DeviceMemory m = device_memory(c10::Device(c10::DeviceType::CPU), &tracker);
  EXPECT_EQ(m.allocated, tracker.current());
  EXPECT_LT(m.allocated, 12000);
  EXPECT_GE(m.allocated, 4000);
  EXPECT_EQ(m.peak_allocated, tracker.peak());
  EXPECT_GE(m.peak_allocated, 12000);
  reset_device_memory_peaks(c10::Device(c10::DeviceType::CPU));  // nothing on the CPU
  EXPECT_EQ(device_memory(c10::Device(c10::DeviceType::CPU), &tracker).peak_allocated, tracker.peak());
}

TEST(DeviceMemory, CudaWithoutADeviceHasNoCapacity) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  const DeviceMemory m = device_memory(c10::Device(c10::DeviceType::CUDA, 0));
  EXPECT_EQ(m.capacity, 0);
  EXPECT_FALSE(m.allocator_stats);
}

// On a GPU (tools/gpu_checks.sh): the capacity is the card's, and a CUDA
// LibTorch's caching allocator counts a tensor's bytes, holds at least them,
// and keeps the peak until it is reset.
TEST(DeviceMemory, CudaAllocatorCountsTensors) {
  if (cuda_device_count() == 0 || !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const c10::Device gpu(c10::DeviceType::CUDA, 0);
  EXPECT_GT(device_memory(gpu).capacity, kGiB / 2);
  at::Tensor warm = torch::empty({16}, torch::TensorOptions().device(gpu));  // the allocator set up
  const DeviceMemory before = device_memory(gpu);
  if (!before.allocator_stats) GTEST_SKIP() << "runtime built without REMAT_WITH_C10_CUDA: no allocator stats";
  constexpr int64_t kBytes = 64 << 20;
  {
    at::Tensor big = torch::empty({kBytes / 4}, torch::TensorOptions().device(gpu));
    const DeviceMemory held = device_memory(gpu);
    EXPECT_EQ(held.allocated - before.allocated, kBytes);
    EXPECT_GE(held.reserved, held.allocated);
    EXPECT_GE(held.peak_allocated, held.allocated);
    EXPECT_GE(held.peak_reserved, held.reserved);
  }
  const DeviceMemory after = device_memory(gpu);
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_GE(after.peak_allocated, before.allocated + kBytes);
  EXPECT_GE(after.reserved, kBytes);  // cached for reuse, not given back
  reset_device_memory_peaks(gpu);
  EXPECT_EQ(device_memory(gpu).peak_allocated, after.allocated);
  EXPECT_EQ(device_memory(gpu).peak_reserved, after.reserved);
}

TEST(DeviceMemory, AutoBudgetIsTheShareLessATenthOrOneGiB) {
  // 80 GB card, one rank: a tenth is reserved.
  const int64_t h100 = 85'032'714'240;  // 79.2 GiB
  DeviceBudget b = auto_device_budget(h100, 1, "k");
  EXPECT_EQ(b.share, h100);
  EXPECT_EQ(b.reserve, h100 / 10);
  EXPECT_EQ(b.budget, h100 - h100 / 10);
  EXPECT_EQ(b.text(), "71.3 GiB = 79.2 GiB capacity - 7.9 GiB reserve");
  // Two ranks sharing it: each has half, less a tenth of the half.
  b = auto_device_budget(h100, 2, "k");
  EXPECT_EQ(b.share, h100 / 2);
  EXPECT_EQ(b.budget, h100 / 2 - h100 / 2 / 10);
  EXPECT_THAT(b.text(), HasSubstr("/ 2 ranks sharing the device"));
  // A small device: at least 1 GiB is reserved.
  b = auto_device_budget(4 * kGiB, 1, "k");
  EXPECT_EQ(b.reserve, kGiB);
  EXPECT_EQ(b.budget, 3 * kGiB);
  EXPECT_EQ(b.text(), "3 GiB = 4 GiB capacity - 1 GiB reserve");
}

TEST(DeviceMemory, AutoBudgetRefusesAnUnknownOrTooSmallDevice) {
  const std::string key = "activation_checkpointing.device_memory_budget_bytes";
  EXPECT_THAT(error_of<ConfigError>([&] { auto_device_budget(0, 1, key); }),
              HasSubstr("'" + key + "' is \"auto\" but this device's capacity is unknown"));
  EXPECT_THAT(error_of<ConfigError>([&] { auto_device_budget(kGiB, 1, key); }),
              HasSubstr("leaves nothing above the reserve of 1 GiB"));
  EXPECT_THAT(error_of<ConfigError>([&] { auto_device_budget(3 * kGiB, 4, key); }),
              HasSubstr("/ 4 ranks"));
}

// REMAT_MEMORY_PER_RANK_BYTES gives what a rank may use: "auto" keeps a tenth
// of it, without the 1 GiB floor of a measured device; unset, the CPU's
// figure is the host's physical memory (within a cgroup's limit) over its
// ranks (issue 49, item 11: "auto" on the CPU ignored the variable; issue 50,
// item 1: MemAvailable moved between launches, and the "auto" micro-batch
// with it).
TEST(DeviceMemory, AGivenShareReservesATenth) {
  const int64_t sixteen = int64_t{16} << 20;
  const DeviceBudget b = auto_device_budget(sixteen, 1, "k", /*given=*/true);
  EXPECT_EQ(b.reserve, sixteen / 10);
  EXPECT_EQ(b.budget, sixteen - sixteen / 10);
  EXPECT_EQ(b.text(), "14.4 MiB = 16 MiB capacity - 1.6 MiB reserve");
}

TEST(DeviceMemory, RankMemoryIsTheGivenBytesOrTheStableCapacity) {
  const c10::Device cpu(c10::DeviceType::CPU);
  ASSERT_EQ(::setenv("REMAT_MEMORY_PER_RANK_BYTES", "16777216", 1), 0);
  const RankMemory given = rank_memory(cpu);
  EXPECT_TRUE(given.given);
  EXPECT_EQ(given.per_rank(), int64_t{16} << 20);
  const DeviceBudget b = auto_device_budget(cpu, "k");
  EXPECT_EQ(b.budget, (int64_t{16} << 20) - (int64_t{16} << 20) / 10);
  EXPECT_EQ(b.text(), "14.4 MiB = 16 MiB REMAT_MEMORY_PER_RANK_BYTES - 1.6 MiB reserve");
  ASSERT_EQ(::unsetenv("REMAT_MEMORY_PER_RANK_BYTES"), 0);
  const RankMemory host = rank_memory(cpu);
  EXPECT_FALSE(host.given);
  EXPECT_EQ(host.source, "physical memory");
  EXPECT_GT(host.total, 0);
  EXPECT_LE(host.total, device_memory(cpu).capacity) << "the physical memory, or a cgroup's lower limit";
  // A capacity, not what is free now: the same at every call.
  std::vector<char> held(64 << 20, 1);
  EXPECT_EQ(rank_memory(cpu).total, host.total) << static_cast<int>(held[12345]);
}

}  // namespace
}  // namespace remat
