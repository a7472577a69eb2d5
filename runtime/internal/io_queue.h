// The pieces of AsyncFile's requests and the queues that carry them to the
// kernel: one interface, three backends (io_uring, libaio, blocking calls).
// Each lane of an IoEngine (io_engine.h) owns one queue and is the only thread
// that touches it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace remat {
namespace internal {

// What a request shares with its pieces: how many are left and the first error.
struct IoRequestState {
  std::string what;  // "write of 'f' at offset 0 (4096 bytes)", for messages
  std::chrono::milliseconds timeout{0};
  std::mutex mutex;
  std::condition_variable finished;
  size_t pieces = 0;
  size_t pieces_left = 0;
  std::string error;  // the first failed piece's message
};

// One block of a request: a single pread or pwrite at an offset.
struct IoPiece {
  std::shared_ptr<IoRequestState> request;
  int fd = -1;
  bool write = false;
  uint64_t offset = 0;
  char* buffer = nullptr;
  size_t bytes = 0;
};

// A finished piece: `result` is what the system call returned (bytes moved, or
// -errno).
struct IoCompletion {
  IoPiece* piece = nullptr;
  int64_t result = 0;
};

class IoQueue {
 public:
  virtual ~IoQueue() = default;
  // Hands `pieces` to the kernel (one call, or one per piece when
  // `single_submit`). A piece the kernel refused completes with its error at
  // the next reap.
  virtual void submit(const std::vector<IoPiece*>& pieces, bool single_submit) = 0;
  // Appends at least one completion to `out` (waiting for it), and any others
  // already there. Only called with pieces in flight.
  virtual void reap(std::vector<IoCompletion>& out) = 0;
};

// Each returns nullptr, with why in `reason` ("io_uring_queue_init: Operation
// not permitted"), where the kernel refuses the backend.
std::unique_ptr<IoQueue> make_uring_queue(int depth, std::string& reason);
std::unique_ptr<IoQueue> make_libaio_queue(int depth, std::string& reason);
std::unique_ptr<IoQueue> make_thread_queue();

// Whether io_uring can start here (one ring of a single entry, made and closed),
// for the choice of backend and for tests; why not in `reason`.
bool uring_available(std::string& reason);
bool libaio_available(std::string& reason);

// "No space left on device (ENOSPC)".
std::string errno_text(int error);

}  // namespace internal
}  // namespace remat
