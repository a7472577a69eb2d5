// A context's checkpointing state, in one place (internal to checkpointing/;
// one per remat::Context, runtime/context.h): the default options that
// configure_checkpointing sets and regions and policies read when they run
// (with the contiguous buffers), the registry of live regions, the prefetch
// order of stored inputs, and every counter checkpoint.h and stored_inputs.h
// report. A region keeps the context of its forward and uses its state in
// backward, wherever that runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checkpointing/region_options.h"
#include "runtime/context.h"

namespace remat {

class StoredInputs;
namespace host_transfer {
class PendingCopy;
}

namespace internal {

struct Region;  // one live checkpoint region (region.h)

// The regions with stored inputs in forward order (a region's backward
// prefetches the one before it), the region whose offload waits until the
// next one starts (offload_keep_last), and the copies to the host in flight
// (stored_inputs.cc).
struct StoredInputChain {
  std::recursive_mutex mutex;
  std::vector<StoredInputs*> regions;
  StoredInputs* pending_offload = nullptr;
  std::deque<std::shared_ptr<host_transfer::PendingCopy>> in_flight;

  void remove(StoredInputs* region);
  // Keeps at most `bound` copies in flight.
  void track(std::shared_ptr<host_transfer::PendingCopy> copy, int bound);
};

struct StoredInputCounters {
  std::atomic<int64_t> kept_bytes{0}, kept_padding_bytes{0}, gathered_bytes{0},
      offloaded_bytes{0}, fetched_bytes{0}, offload_copies{0}, fetch_copies{0},
      left_small_bytes{0};
};

struct CheckpointingState {
  CheckpointOptions defaults;

  std::atomic<int64_t> recomputes{0};
  std::atomic<int64_t> saved_bytes{0};  // held by live regions
  StoredInputCounters stored;
  StoredInputChain chain;
  std::mutex profile_mutex;
  std::map<std::string, RegionProfile> profile;

  std::mutex regions_mutex;
  std::vector<std::weak_ptr<Region>> regions;  // live regions with stored inputs

  // The current context's (Context::current()).
  static CheckpointingState& current() { return Context::current().get<CheckpointingState>(); }
};

}  // namespace internal
}  // namespace remat
