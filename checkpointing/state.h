// The process's checkpointing state, in one place (internal to
// checkpointing/): the default options that configure_checkpointing sets and
// regions and policies read when they run (with the contiguous buffers), the
// registry of live regions, and every counter checkpoint.h and
// stored_inputs.h report. The prefetch order of offloaded inputs is kept by
// the stored inputs themselves (StoredInputs::Chain).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checkpointing/checkpoint.h"

namespace remat {

struct Region;  // one live checkpoint region (checkpoint.cc)

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
  std::mutex profile_mutex;
  std::map<std::string, RegionProfile> profile;

  std::mutex regions_mutex;
  std::vector<std::weak_ptr<Region>> regions;  // live regions with stored inputs

  static CheckpointingState& get();
};

}  // namespace remat
