#include "runtime/memory.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace remat {
namespace {

TEST(Memory, CountsAllocationsAndFreesOfThisThread) {
  MemoryTracker mem;
  EXPECT_EQ(mem.current(), 0);
  {
    at::Tensor a = torch::empty({1000}, torch::kFloat);
    EXPECT_GE(mem.current(), 4000);
    at::Tensor b = torch::empty({500}, torch::kDouble);
    EXPECT_GE(mem.current(), 8000);
  }
  EXPECT_EQ(mem.current(), 0);
  EXPECT_GE(mem.peak(), 8000);
  mem.reset_peak();
  EXPECT_EQ(mem.peak(), 0);
}

TEST(Memory, TensorsFromBeforeTheTrackerAreNotCounted) {
  at::Tensor before = torch::empty({1000});
  MemoryTracker mem;
  before = at::Tensor();  // freed, but allocated before: not counted
  EXPECT_EQ(mem.current(), 0);
}

TEST(Memory, NestedTrackersBothSeeTheTraffic) {
  MemoryTracker outer;
  at::Tensor a = torch::empty({256});
  {
    MemoryTracker inner;
    at::Tensor b = torch::empty({512});
    EXPECT_GE(inner.current(), 2048);
    EXPECT_LT(inner.current(), 3072);
    EXPECT_GE(outer.current(), 3072);
  }
  EXPECT_GE(outer.current(), 1024);
  EXPECT_LT(outer.current(), 2048);
}

}  // namespace
}  // namespace remat
