// Every environment variable remat reads, in one place.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace remat::knobs {

// Log level: trace, debug, info (default), warn, error, critical, off.
inline constexpr const char* kLogLevel = "REMAT_LOG_LEVEL";
// 1: before each collective, ranks compare op, sequence number, dtype and shape
// and raise an error naming both ranks on a mismatch.
inline constexpr const char* kDebugCollectives = "REMAT_DEBUG_COLLECTIVES";
// Seconds a collective may take before wait() throws remat::TimeoutError:
// from 0.001 to 604800 (7 days); default 300.
inline constexpr const char* kCommTimeoutSeconds = "REMAT_COMM_TIMEOUT_S";
// remat-train's progress display: bar (one updating line) or lines (periodic
// lines). remat-run sets it from whether its own stdout is a terminal.
inline constexpr const char* kProgress = "REMAT_PROGRESS";
// Fault-injection seam for tests: milliseconds remat-train's save pauses after
// writing each temporary file and before renaming it into place, so a test can
// kill a save in progress. Unset: no pause.
inline constexpr const char* kFaultSavePauseMs = "REMAT_FAULT_SAVE_PAUSE_MS";
// Bytes each rank may use on this host, for remat-train's fit check and
// remat-estimate: a whole number > 0. Unset: MemAvailable, capped by the
// cgroup's memory.max less its memory.current, over the host's ranks.
inline constexpr const char* kMemoryPerRankBytes = "REMAT_MEMORY_PER_RANK_BYTES";
// Intra-op threads per process (LibTorch's and OpenMP's own variable). Unset
// with several ranks on one machine: remat shares the cores out among them
// (cores / local ranks, at least 1); remat-run sets it the same way.
inline constexpr const char* kOmpNumThreads = "OMP_NUM_THREADS";
// Overlapped gradient reduction (zero_optimization.overlap_comm): hooks
// (default) tests the reductions in flight at every gradient, which lets MPI
// progress them during the backward; off does not (for measuring the
// difference, benchmarks/dp_bench.sh).
inline constexpr const char* kReduceProgress = "REMAT_REDUCE_PROGRESS";
// 0: build-time CUDA detection is skipped (read by Bazel's configure step).
inline constexpr const char* kCuda = "REMAT_CUDA";

// The variable's value, or nullopt when unset or empty.
std::optional<std::string> get(const char* name);

// True for 1/true/yes/on (any case); false when unset. Anything else is an error.
bool get_bool(const char* name);

// Default collective timeout: REMAT_COMM_TIMEOUT_S, else 300 s. A value that
// is not a finite number from 0.001 to 604800 seconds is a ConfigError naming
// the variable, the value and the range.
std::chrono::milliseconds comm_timeout();

// REMAT_FAULT_SAVE_PAUSE_MS as a duration (nullopt when unset); anything but a
// whole number of milliseconds >= 0 is an error. remat-train reads it at start.
std::optional<std::chrono::milliseconds> fault_save_pause();

// REMAT_REDUCE_PROGRESS: true for hooks or unset, false for off; anything
// else is a ConfigError naming both values.
bool reduce_progress_in_hooks();

}  // namespace remat::knobs
