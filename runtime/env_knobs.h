// Every environment variable remat reads, in one place.
#pragma once

#include <chrono>
#include <cstdint>
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
// kill a save in progress: from 0 to 60000 (1 minute). Unset: no pause.
inline constexpr const char* kFaultSavePauseMs = "REMAT_FAULT_SAVE_PAUSE_MS";
inline constexpr const char* kFaultSaveFail = "REMAT_FAULT_SAVE_FAIL";
// Bytes each rank may use on this host, for remat-train's fit check and
// "auto" micro-batch, device_memory_budget_bytes "auto" and remat-estimate:
// a whole number > 0. Unset: the physical memory, capped by the cgroup's
// memory.max, over the host's ranks (a GPU: its capacity over its ranks).
inline constexpr const char* kMemoryPerRankBytes = "REMAT_MEMORY_PER_RANK_BYTES";
// Intra-op threads per process (LibTorch's and OpenMP's own variable): a whole
// number >= 1; more than the machine's cores is lowered to the cores, with a
// warning. Unset with several ranks on one machine: remat shares the cores out
// among them (cores / local ranks, at least 1); remat-run sets it the same way.
inline constexpr const char* kOmpNumThreads = "OMP_NUM_THREADS";
// Overlapped gradient reduction (zero_optimization.overlap_comm): hooks
// (default) tests the reductions in flight at every gradient, which lets MPI
// progress them during the backward; off does not (for measuring the
// difference, benchmarks/dp_bench.sh).
inline constexpr const char* kReduceProgress = "REMAT_REDUCE_PROGRESS";
// 0: build-time CUDA detection is skipped (read by Bazel's configure step).
inline constexpr const char* kCuda = "REMAT_CUDA";
// Fault-injection seam for tests: 1 makes io_uring_queue_init fail with EPERM
// in runtime/async_io.h, as in a container that forbids io_uring, so that the
// fallback to libaio (and a refusal where io_uring is asked for) can be tested.
inline constexpr const char* kFaultNoIoUring = "REMAT_FAULT_NO_IO_URING";
// Fault-injection seams for tests of a sharded safetensors export
// (engine/safetensors.h's writer): K, a whole number from 1, makes the K-th
// rename of finish() fail with EIO (..._FAIL), or kills the process with
// SIGKILL just before it (..._KILL), so that a test can see what an export
// stopped half-way through replacing a folder leaves. Unset: no fault.
inline constexpr const char* kFaultExportRenameFail = "REMAT_FAULT_EXPORT_RENAME_FAIL";
inline constexpr const char* kFaultExportRenameKill = "REMAT_FAULT_EXPORT_RENAME_KILL";
// Fault-injection seams for tests of offload_optimizer.device "nvme"
// (parallel/nvme_optimizer.h): K, a whole number from 1, kills the process
// with SIGKILL in the K-th optimizer step after its first sub-group is
// written back (..._KILL: the file holds some sub-groups stepped and others
// not), or makes that step's I/O fail with EIO (..._FAIL, as a failing
// disk). Unset: no fault.
inline constexpr const char* kFaultNvmeKill = "REMAT_FAULT_NVME_KILL";
inline constexpr const char* kFaultNvmeFail = "REMAT_FAULT_NVME_FAIL";

// The variable's value, or nullopt when unset or empty.
std::optional<std::string> get(const char* name);

// One reading for every numeric and boolean variable, so that all of them
// take the same spellings: the value exactly as set (surrounding spaces are
// not trimmed), numbers in plain decimal digits (no sign, hex, octal or
// exponent; a fraction only where the variable takes one), booleans as
// 1/true/yes/on or 0/false/no/off in any case. Anything else, or a number
// outside [min, max], is a ConfigError "NAME='VALUE' is not EXPECTED: ADVICE".
struct NumberRule {
  const char* expected;  // "a whole number of bytes > 0"
  const char* advice;    // what to do instead
};
int64_t parse_whole(const char* name, const std::string& value, int64_t min, int64_t max,
                    const NumberRule& rule);
double parse_decimal(const char* name, const std::string& value, double min, double max,
                     const NumberRule& rule);
bool parse_bool(const char* name, const std::string& value);

// True for 1/true/yes/on (any case); false when unset. Anything else is an error.
bool get_bool(const char* name);

// Default collective timeout: REMAT_COMM_TIMEOUT_S, else 300 s. A value that
// is not a finite number from 0.001 to 604800 seconds is a ConfigError naming
// the variable, the value and the range.
std::chrono::milliseconds comm_timeout();

// REMAT_FAULT_SAVE_PAUSE_MS as a duration (nullopt when unset); anything but a
// whole number of milliseconds from 0 to 60000 is an error (a longer pause
// would only stall the save past any collective timeout). remat-train reads
// it at start.
std::optional<std::chrono::milliseconds> fault_save_pause();

// REMAT_FAULT_SAVE_FAIL as the rank whose rank file write fails (nullopt when
// unset); anything but a whole number from 0 to 65535 is an error.
std::optional<int64_t> fault_save_fail();

// REMAT_FAULT_EXPORT_RENAME_FAIL or REMAT_FAULT_EXPORT_RENAME_KILL (`name`)
// as the rename it hits, from 1 (nullopt when unset); anything but a whole
// number from 1 to 1000000 is an error.
std::optional<int64_t> fault_export_rename(const char* name);

// REMAT_FAULT_NVME_KILL or REMAT_FAULT_NVME_FAIL (`name`) as the optimizer
// step it hits, from 1 (nullopt when unset); anything but a whole number from
// 1 to 1000000 is an error.
std::optional<int64_t> fault_nvme_step(const char* name);

// REMAT_MEMORY_PER_RANK_BYTES (nullopt when unset): a whole number > 0.
std::optional<int64_t> memory_per_rank_bytes();

// OMP_NUM_THREADS (nullopt when unset): a whole number >= 1.
std::optional<int64_t> omp_num_threads();

// REMAT_REDUCE_PROGRESS: true for hooks or unset, false for off; anything
// else is a ConfigError naming both values.
bool reduce_progress_in_hooks();

}  // namespace remat::knobs
