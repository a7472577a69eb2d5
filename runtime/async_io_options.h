// The options of remat's asynchronous block I/O (async_io.h): the backend,
// direct I/O, and DeepSpeed's `aio` keys, with what each means here; and the
// counts a file keeps of what it moved.
//
// DeepSpeed's `aio` keys, and what each means here:
//   block_size     every backend: the size of one piece (DeepSpeed's default
//                  1048576). With direct I/O, a multiple of `alignment`.
//   queue_depth    io_uring: the ring's size and the pieces in flight per lane;
//                  libaio: io_setup's nr_events and the pieces in flight per
//                  lane; threads: each lane has queue_depth threads, so that the
//                  same number of pieces is in flight (DeepSpeed's default 8).
//   thread_count   every backend: the lanes, each with its own thread and its
//                  own ring (io_uring) or context (libaio), taking pieces from
//                  one queue; in flight at most thread_count x queue_depth.
//   single_submit  io_uring, libaio: one submission call per piece instead of
//                  one per batch. Threads: no meaning (each call is one piece).
//   overlap_events io_uring, libaio: true refills the queue as each piece
//                  completes; false submits a batch and waits for all of it
//                  before the next. Threads: no meaning (a thread takes the
//                  next piece as soon as its call returns).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace remat {

enum class IoBackend { kAuto, kIoUring, kLibaio, kThreads };

// "auto", "io_uring", "libaio", "threads".
const char* io_backend_name(IoBackend backend);

// What to do where the filesystem refuses O_DIRECT.
enum class DirectIo {
  kRequired,   // a ConfigError naming the path and what to change
  kPreferred,  // buffered I/O, with a warning naming the path
  kOff,        // buffered I/O, asked for: no alignment rule
};

struct AsyncIoOptions {
  IoBackend backend = IoBackend::kAuto;
  DirectIo direct = DirectIo::kPreferred;
  size_t block_size = 1 << 20;  // DeepSpeed's aio.block_size default
  int queue_depth = 8;          // aio.queue_depth
  int thread_count = 1;         // aio.thread_count
  bool single_submit = false;   // aio.single_submit
  bool overlap_events = true;   // aio.overlap_events
  size_t alignment = 4096;      // the logical block size direct I/O needs
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // of IoRequest::wait()
  bool preallocate = false;     // reserve the file's blocks at open (ENOSPC then, not mid-run)
};

// The options' problems, one a line naming the field and what to change; ""
// when there are none. AsyncFile throws them as a ConfigError.
std::string check_async_io_options(const AsyncIoOptions& options);

// What a file moved, for the step's metrics (requests counted when submitted).
struct AsyncIoStats {
  uint64_t reads = 0;
  uint64_t writes = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

}  // namespace remat
