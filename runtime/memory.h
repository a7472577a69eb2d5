// Live tensor bytes, current and peak, as c10's allocators report them.
//
// While a MemoryTracker is alive on a thread, every tensor allocation and free
// that thread makes (CPU, and CUDA's caching allocator on a GPU) is counted.
// Bytes are relative to the tracker's start: tensors allocated before it are
// not seen, and their frees are not counted either.
//
//   remat::MemoryTracker mem;
//   loss = model(x); loss.backward();
//   mem.peak();   // highest live bytes during the step, above the start
//
// With `keep_allocations`, the tracker also keeps each live allocation's size
// and memory category (runtime/memory_trace.h): what a memory trace starts
// from, so that memory allocated before the trace is split by category too.
// It costs a locked map update per allocation and free.
#pragma once

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <memory>

namespace remat {

struct MemoryTrackerOptions {
  bool keep_allocations = false;
};

class MemoryTracker {
 public:
  explicit MemoryTracker(MemoryTrackerOptions options = {});
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  int64_t current(c10::DeviceType device = c10::DeviceType::CPU) const;
  int64_t peak(c10::DeviceType device = c10::DeviceType::CPU) const;
  // The peak starts again from the current value.
  void reset_peak();
  bool keeps_allocations() const;

  struct Reporter;
  const std::shared_ptr<Reporter>& reporter() const { return reporter_; }

 private:
  std::shared_ptr<Reporter> reporter_;
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

}  // namespace remat
