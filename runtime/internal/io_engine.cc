#include "runtime/internal/io_engine.h"

#include <cerrno>
#include <exception>
#include <set>
#include <unordered_set>
#include <utility>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace internal {

namespace {

// Each fallback is logged once per process, however many files fall back.
void log_once(const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> logged;
  std::lock_guard<std::mutex> lock(mutex);
  if (logged.insert(message).second) log().info("{}", message);
}

std::unique_ptr<IoQueue> make_queue(IoBackend backend, int depth, std::string& reason) {
  switch (backend) {
    case IoBackend::kIoUring: return make_uring_queue(depth, reason);
    case IoBackend::kLibaio: return make_libaio_queue(depth, reason);
    default: return make_thread_queue();
  }
}

// What to add to a piece's error so that the user knows what to change.
std::string advice_for(int error) {
  switch (error) {
    case ENOSPC: return ": the disk is full; free space there or give a folder on a larger disk";
    case EFBIG: return ": the file passes the largest size allowed (RLIMIT_FSIZE or the filesystem's limit)";
    case EIO: return ": the disk reported an I/O error; check it (dmesg) before trusting what it holds";
    case EINVAL: return ": the kernel refused the request (direct I/O needs aligned buffers, offsets and sizes)";
    default: return "";
  }
}

}  // namespace

IoBackend choose_io_backend(const AsyncIoOptions& options, std::string& reason) {
  std::string why;
  if (options.backend == IoBackend::kIoUring) {
    REMAT_CHECK(uring_available(why), "the io_uring backend was asked for but cannot start: ", why,
                " (a container's seccomp profile or kernel.io_uring_disabled forbids it); "
                "ask for libaio, threads or auto");
    reason = "io_uring, as asked";
    return IoBackend::kIoUring;
  }
  if (options.backend == IoBackend::kLibaio) {
    REMAT_CHECK(libaio_available(why), "the libaio backend was asked for but cannot start: ", why,
                "; ask for io_uring, threads or auto");
    reason = "libaio, as asked";
    return IoBackend::kLibaio;
  }
  if (options.backend == IoBackend::kThreads) {
    reason = "threads, as asked";
    return IoBackend::kThreads;
  }
  if (uring_available(why)) {
    reason = "io_uring (auto: the kernel allows it)";
    return IoBackend::kIoUring;
  }
  std::string aio_why;
  if (libaio_available(aio_why)) {
    reason = str("libaio (auto: io_uring cannot start: ", why, ")");
  } else {
    reason = str("threads (auto: io_uring cannot start: ", why, "; libaio cannot start: ", aio_why, ")");
  }
  log_once(str("asynchronous I/O uses ", reason));
  return aio_why.empty() ? IoBackend::kLibaio : IoBackend::kThreads;
}

struct IoEngine::Lane {
  std::unique_ptr<IoQueue> queue;
  size_t depth = 1;
  std::thread thread;
};

IoEngine::IoEngine(IoBackend backend, const AsyncIoOptions& options)
    : backend_(backend), options_(options) {
  const bool threads = backend == IoBackend::kThreads;
  const int lanes = threads ? options.thread_count * options.queue_depth : options.thread_count;
  for (int i = 0; i < lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->depth = threads ? 1 : static_cast<size_t>(options.queue_depth);
    std::string reason;
    lane->queue = make_queue(backend, options.queue_depth, reason);
    if (lane->queue == nullptr) {
      { std::lock_guard<std::mutex> lock(mutex_); stopping_ = true; }
      waiting_.notify_all();
      for (auto& started : lanes_) started->thread.join();
      REMAT_CHECK(false, io_backend_name(backend), " lane ", i + 1, " of ", lanes, " cannot start: ", reason,
                  "; lower aio.thread_count or aio.queue_depth, or choose another backend");
    }
    lanes_.push_back(std::move(lane));
    Lane& started = *lanes_.back();
    started.thread = std::thread([this, &started] { run(started); });
  }
}

IoEngine::~IoEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  waiting_.notify_all();
  for (auto& lane : lanes_) lane->thread.join();
}

void IoEngine::enqueue(std::vector<IoPiece*> pieces) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.insert(pending_.end(), pieces.begin(), pieces.end());
  }
  waiting_.notify_all();
}

void IoEngine::count(bool write, uint64_t bytes) {
  (write ? writes_ : reads_).fetch_add(1, std::memory_order_relaxed);
  (write ? bytes_written_ : bytes_read_).fetch_add(bytes, std::memory_order_relaxed);
}

AsyncIoStats IoEngine::stats() const {
  AsyncIoStats stats;
  stats.reads = reads_.load();
  stats.writes = writes_.load();
  stats.bytes_read = bytes_read_.load();
  stats.bytes_written = bytes_written_.load();
  return stats;
}

bool IoEngine::take(std::vector<IoPiece*>& batch, size_t room, bool block) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (block) waiting_.wait(lock, [&] { return !pending_.empty() || stopping_; });
  while (room > 0 && !pending_.empty()) {
    batch.push_back(pending_.front());
    pending_.pop_front();
    --room;
  }
  return !(stopping_ && pending_.empty() && batch.empty());
}

void IoEngine::run(Lane& lane) {
  std::vector<IoPiece*> batch;
  std::vector<IoCompletion> done;
  std::unordered_set<IoPiece*> in_flight;
  std::string broken;  // a queue that failed fails every piece after it
  for (;;) {
    batch.clear();
    const bool refill = options_.overlap_events || in_flight.empty();
    const size_t room = refill ? lane.depth - in_flight.size() : 0;
    if (!take(batch, room, in_flight.empty()) && in_flight.empty()) return;
    done.clear();
    try {
      if (!broken.empty()) throw Error(broken);
      if (!batch.empty()) {
        in_flight.insert(batch.begin(), batch.end());
        lane.queue->submit(batch, options_.single_submit);
      }
      if (!in_flight.empty()) lane.queue->reap(done);
    } catch (const std::exception& e) {
      broken = str(": ", io_backend_name(backend_), " failed: ", e.what());
      in_flight.insert(batch.begin(), batch.end());
      for (IoPiece* piece : in_flight) finish(piece, broken);
      in_flight.clear();
      continue;
    }
    for (const IoCompletion& completion : done) {
      in_flight.erase(completion.piece);
      complete(completion);
    }
  }
}

void IoEngine::complete(const IoCompletion& done) {
  IoPiece* piece = done.piece;
  const std::string where = str(" at offset ", piece->offset, " (", piece->bytes, " bytes)");
  if (done.result < 0) {
    const int error = static_cast<int>(-done.result);
    finish(piece, str(where, ": ", errno_text(error), advice_for(error)));
  } else if (done.result == 0) {
    finish(piece, str(where, piece->write ? ": the write moved no bytes"
                                          : ": met the end of the file; it is shorter than when opened "
                                            "(truncated by another process?)"));
  } else if (static_cast<size_t>(done.result) < piece->bytes) {
    // A short transfer: the rest goes again (a full disk answers it with ENOSPC).
    piece->offset += static_cast<uint64_t>(done.result);
    piece->buffer += done.result;
    piece->bytes -= static_cast<size_t>(done.result);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_front(piece);
    }
    waiting_.notify_all();
  } else {
    finish(piece, "");
  }
}

void IoEngine::finish(IoPiece* piece, const std::string& error) {
  std::shared_ptr<IoRequestState> request = std::move(piece->request);
  delete piece;
  {
    std::lock_guard<std::mutex> lock(request->mutex);
    if (!error.empty() && request->error.empty()) request->error = request->what + error;
    if (--request->pieces_left > 0) return;
  }
  request->finished.notify_all();
}

}  // namespace internal
}  // namespace remat
