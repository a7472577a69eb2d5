// The lanes behind an AsyncFile: a queue of pieces waiting, and `thread_count`
// threads (x queue_depth for the thread backend), each draining it into its own
// IoQueue with at most `depth` pieces in flight, resubmitting what a short
// transfer left and finishing each request when its last piece is done.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/async_io_options.h"
#include "runtime/internal/io_queue.h"

namespace remat {
namespace internal {

// The backend that starts for `options` (kAuto: io_uring, libaio, threads, in
// that order), with why in `reason`; the fallbacks are logged once per process.
// A backend named in the options that cannot start is an Error.
IoBackend choose_io_backend(const AsyncIoOptions& options, std::string& reason);

class IoEngine {
 public:
  IoEngine(IoBackend backend, const AsyncIoOptions& options);
  ~IoEngine();  // finishes every piece queued, then joins the lanes

  // Queues a request's pieces; its state finishes when the last completes.
  void enqueue(std::vector<IoPiece*> pieces);
  IoBackend backend() const { return backend_; }
  // The requests and bytes handed to enqueue, by direction.
  void count(bool write, uint64_t bytes);
  AsyncIoStats stats() const;

 private:
  struct Lane;
  void run(Lane& lane);
  // Up to `room` waiting pieces into `batch`; blocks for one when `block`.
  // False when stopping with nothing left to take.
  bool take(std::vector<IoPiece*>& batch, size_t room, bool block);
  void complete(const IoCompletion& done);
  void finish(IoPiece* piece, const std::string& error);

  IoBackend backend_;
  AsyncIoOptions options_;
  std::mutex mutex_;
  std::condition_variable waiting_;
  std::deque<IoPiece*> pending_;
  bool stopping_ = false;
  std::atomic<uint64_t> reads_{0}, writes_{0}, bytes_read_{0}, bytes_written_{0};
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace internal
}  // namespace remat
