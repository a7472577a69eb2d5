#include "runtime/memory.h"

#include <algorithm>

#include "runtime/internal/memory_reporter.h"

namespace remat {

void MemoryTracker::Reporter::reportMemoryUsage(void* ptr, int64_t alloc_size, compat::MemoryTotal total_allocated,
                                                compat::MemoryTotal total_reserved, c10::Device device) {
  const size_t s = slot(device.type());
  if (!keep) {
    live[s] += alloc_size;
    high[s] = std::max(high[s], live[s]);
  } else {
    std::lock_guard<std::mutex> lock(mutex);
    live[s] += alloc_size;
    high[s] = std::max(high[s], live[s]);
    if (alloc_size >= 0) {
      Allocation& a = allocations[ptr];
      a = Allocation{alloc_size, s, current_memory_category(), -1};
      if (recorder != nullptr) recorder->on_allocation(a, live[s]);
    } else {
      auto it = allocations.find(ptr);
      if (recorder != nullptr) {
        recorder->on_free(it == allocations.end() ? nullptr : &it->second, s, -alloc_size, live[s]);
      }
      if (it != allocations.end()) allocations.erase(it);
    }
  }
  if (auto* next = dynamic_cast<c10::MemoryReportingInfoBase*>(outer.get())) {
    if (next->memoryProfilingEnabled()) {
      next->reportMemoryUsage(ptr, alloc_size, total_allocated, total_reserved, device);
    }
  }
}

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

MemoryTracker::MemoryTracker(MemoryTrackerOptions options) : reporter_(std::make_shared<Reporter>()) {
  reporter_->keep = options.keep_allocations;
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

bool MemoryTracker::keeps_allocations() const { return reporter_->keep; }

}  // namespace remat
