#include "runtime/memory.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <array>

#include "runtime/compat.h"

namespace remat {

// Receives c10's allocation reports (it is installed as the thread's
// PROFILER_STATE debug info, where the allocators look for a reporter).
struct MemoryTracker::Reporter : public c10::MemoryReportingInfoBase {
  static constexpr size_t kSlots = 2;  // CPU, CUDA
  std::array<int64_t, kSlots> live{};
  std::array<int64_t, kSlots> high{};
  // The reporter this one shadows (an enclosing tracker, or the profiler's);
  // reports are passed on so that nesting loses nothing.
  std::shared_ptr<c10::DebugInfoBase> outer;

  static size_t slot(c10::DeviceType type) { return type == c10::DeviceType::CUDA ? 1 : 0; }

  void reportMemoryUsage(void* ptr, int64_t alloc_size, compat::MemoryTotal total_allocated,
                         compat::MemoryTotal total_reserved, c10::Device device) override {
    size_t s = slot(device.type());
    live[s] += alloc_size;
    high[s] = std::max(high[s], live[s]);
    if (auto* next = dynamic_cast<c10::MemoryReportingInfoBase*>(outer.get())) {
      if (next->memoryProfilingEnabled()) {
        next->reportMemoryUsage(ptr, alloc_size, total_allocated, total_reserved, device);
      }
    }
  }

  bool memoryProfilingEnabled() const override { return true; }
};

struct MemoryTracker::Guard {
  c10::DebugInfoGuard guard;
  explicit Guard(std::shared_ptr<Reporter> r)
      : guard(c10::DebugInfoKind::PROFILER_STATE, std::move(r)) {}
};

namespace {

std::shared_ptr<c10::DebugInfoBase> current_profiler_state() {
  auto info = c10::ThreadLocalDebugInfo::current();
  if (!info) return nullptr;
  // ThreadLocalDebugInfo::get returns a raw pointer; keep the owning chain.
  c10::DebugInfoBase* raw = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
  return raw == nullptr ? nullptr : std::shared_ptr<c10::DebugInfoBase>(info, raw);
}

}  // namespace

MemoryTracker::MemoryTracker() : reporter_(std::make_shared<Reporter>()) {
  reporter_->outer = current_profiler_state();
  guard_ = std::make_unique<Guard>(reporter_);
}

MemoryTracker::~MemoryTracker() = default;

int64_t MemoryTracker::current(c10::DeviceType device) const {
  return reporter_->live[Reporter::slot(device)];
}

int64_t MemoryTracker::peak(c10::DeviceType device) const {
  return reporter_->high[Reporter::slot(device)];
}

void MemoryTracker::reset_peak() { reporter_->high = reporter_->live; }

}  // namespace remat
