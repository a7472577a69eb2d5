// The tracker's allocation reporter and a memory trace's recording, shared by
// memory.cc and memory_trace.cc (internal to runtime/).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/compat.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"

namespace remat {

struct TraceRecorder;

// Receives c10's allocation reports (it is installed as the thread's
// PROFILER_STATE debug info, where the allocators look for a reporter).
struct MemoryTracker::Reporter : public c10::MemoryReportingInfoBase {
  static constexpr size_t kSlots = 2;  // CPU, CUDA
  static size_t slot(c10::DeviceType type) { return type == c10::DeviceType::CUDA ? 1 : 0; }

  std::array<int64_t, kSlots> live{};
  std::array<int64_t, kSlots> high{};
  // The reporter this one shadows (an enclosing tracker, or the profiler's);
  // reports are passed on so that nesting loses nothing.
  std::shared_ptr<c10::DebugInfoBase> outer;

  // With keep_allocations: every live allocation this tracker counted, and
  // the trace recording now (if any). Guarded by `mutex`, as are live and
  // high then.
  bool keep = false;
  struct Allocation {
    int64_t bytes = 0;
    size_t slot = 0;
    MemoryCategory category = MemoryCategory::kOther;
    int64_t record = -1;  // its record in the recording trace
  };
  std::mutex mutex;
  std::unordered_map<const void*, Allocation> allocations;
  TraceRecorder* recorder = nullptr;

  void reportMemoryUsage(void* ptr, int64_t alloc_size, compat::MemoryTotal total_allocated,
                         compat::MemoryTotal total_reserved, c10::Device device) override;
  bool memoryProfilingEnabled() const override { return true; }
};

// One trace's recording. Allocation records and events are guarded by the
// reporter's mutex; spans by span_mutex.
struct TraceRecorder {
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kSlots = MemoryTracker::Reporter::kSlots;

  std::shared_ptr<MemoryTracker::Reporter> reporter;  // what it records
  Clock::time_point start = Clock::now();
  int64_t now_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  }

  // An allocation seen by the trace: its category may change during the
  // trace (classify_memory), and then counts so over its whole life.
  struct Record {
    MemoryCategory category;
    size_t slot;
  };
  struct Event {
    int64_t t_ns;
    int64_t record;
    int64_t delta;
    int64_t tracked;  // the tracker's count for the slot after this report
  };
  std::vector<Record> records;
  std::vector<std::pair<int64_t, int64_t>> initial;  // record, bytes live at the start
  std::vector<Event> events;
  // Per slot: a record for what the tracker counted at the start that no
  // kept allocation explains, and for frees of allocations it never kept.
  std::array<int64_t, kSlots> remainder{};
  std::array<int64_t, kSlots> tracked_at_start{}, tracked_at_stop{};
  bool stopped = false;
  int64_t stop_ns = 0;

  // Called by the reporter under its mutex after it updated its counts.
  void on_allocation(MemoryTracker::Reporter::Allocation& allocation, int64_t tracked);
  void on_free(const MemoryTracker::Reporter::Allocation* allocation, size_t slot, int64_t bytes,
               int64_t tracked);

  std::mutex span_mutex;
  bool recording = true;  // spans are still taken
  struct Span {
    std::string kind, name, detail;
    int64_t begin_ns = 0, end_ns = -1;
    int thread = 0;
    bool async = false;
  };
  std::vector<Span> spans;
  std::unordered_map<uint64_t, Span> open;  // async spans begun, not yet ended
  std::vector<std::thread::id> threads;     // index + 1: the span's thread number
  int thread_number();                      // under span_mutex
};

}  // namespace remat
