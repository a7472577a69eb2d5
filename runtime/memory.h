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
#pragma once

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <memory>

namespace remat {

class MemoryTracker {
 public:
  MemoryTracker();
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  int64_t current(c10::DeviceType device = c10::DeviceType::CPU) const;
  int64_t peak(c10::DeviceType device = c10::DeviceType::CPU) const;
  // The peak starts again from the current value.
  void reset_peak();

  struct Reporter;

 private:
  std::shared_ptr<Reporter> reporter_;
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

}  // namespace remat
