// The three IoQueue backends: io_uring (liburing), Linux AIO (libaio) and
// blocking pread/pwrite on the lane's own thread.
#include "runtime/internal/io_queue.h"

#include <libaio.h>
#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "runtime/env_knobs.h"
#include "runtime/error.h"

namespace remat {
namespace internal {

std::string errno_text(int error) {
  const char* name = strerrorname_np(error);
  return str(std::strerror(error), " (", name ? name : "errno " + std::to_string(error), ")");
}

namespace {

class UringQueue : public IoQueue {
 public:
  // 0, or -errno where the kernel refuses a ring.
  int init(int depth) {
    const int rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    ready_ = rc == 0;
    return rc;
  }
  ~UringQueue() override {
    if (ready_) io_uring_queue_exit(&ring_);
  }

  void submit(const std::vector<IoPiece*>& pieces, bool single_submit) override {
    for (IoPiece* piece : pieces) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {  // the ring is full: the lane never queues more than its depth
        refused_.push_back({piece, -EAGAIN});
        continue;
      }
      if (piece->write) {
        io_uring_prep_write(sqe, piece->fd, piece->buffer, piece->bytes, piece->offset);
      } else {
        io_uring_prep_read(sqe, piece->fd, piece->buffer, piece->bytes, piece->offset);
      }
      io_uring_sqe_set_data(sqe, piece);
      if (single_submit) flush();
    }
    flush();
  }

  void reap(std::vector<IoCompletion>& out) override {
    const size_t before = out.size();
    out.insert(out.end(), refused_.begin(), refused_.end());
    refused_.clear();
    io_uring_cqe* cqe = nullptr;
    if (out.size() == before) {
      int rc;
      while ((rc = io_uring_wait_cqe(&ring_, &cqe)) == -EINTR) {
      }
      REMAT_CHECK(rc == 0, "io_uring_wait_cqe: ", errno_text(-rc));
    }
    while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
      out.push_back({static_cast<IoPiece*>(io_uring_cqe_get_data(cqe)), cqe->res});
      io_uring_cqe_seen(&ring_, cqe);
    }
  }

 private:
  // Submits what is prepared; a refused submission fails those pieces.
  void flush() {
    int rc;
    while ((rc = io_uring_submit(&ring_)) == -EINTR || rc == -EAGAIN) {
    }
    REMAT_CHECK(rc >= 0, "io_uring_submit: ", errno_text(-rc));
  }

  io_uring ring_{};
  bool ready_ = false;
  std::vector<IoCompletion> refused_;
};

class LibaioQueue : public IoQueue {
 public:
  LibaioQueue(io_context_t context, int depth)
      : context_(context), iocbs_(depth), events_(depth) {
    for (int i = depth - 1; i >= 0; --i) free_.push_back(i);
  }
  ~LibaioQueue() override { io_destroy(context_); }

  void submit(const std::vector<IoPiece*>& pieces, bool single_submit) override {
    std::vector<iocb*> batch;
    for (IoPiece* piece : pieces) {
      REMAT_CHECK(!free_.empty(), "libaio queue: more pieces than its depth");
      iocb* cb = &iocbs_[free_.back()];
      free_.pop_back();
      if (piece->write) {
        io_prep_pwrite(cb, piece->fd, piece->buffer, piece->bytes, piece->offset);
      } else {
        io_prep_pread(cb, piece->fd, piece->buffer, piece->bytes, piece->offset);
      }
      cb->data = piece;
      batch.push_back(cb);
      if (single_submit) send(batch);
    }
    send(batch);
  }

  void reap(std::vector<IoCompletion>& out) override {
    const size_t before = out.size();
    out.insert(out.end(), refused_.begin(), refused_.end());
    refused_.clear();
    const long min = out.size() == before ? 1 : 0;
    long got;
    while ((got = io_getevents(context_, min, events_.size(), events_.data(), nullptr)) == -EINTR) {
    }
    REMAT_CHECK(got >= 0, "io_getevents: ", errno_text(static_cast<int>(-got)));
    for (long i = 0; i < got; ++i) {
      iocb* cb = events_[i].obj;
      free_.push_back(static_cast<size_t>(cb - iocbs_.data()));
      // res is the byte count, or -errno, in an unsigned long.
      out.push_back({static_cast<IoPiece*>(events_[i].data),
                     static_cast<int64_t>(static_cast<long>(events_[i].res))});
    }
  }

 private:
  // io_submit for `batch`, which may take fewer than all at a time; a piece the
  // kernel refuses completes with the error at the next reap.
  void send(std::vector<iocb*>& batch) {
    size_t sent = 0;
    while (sent < batch.size()) {
      const int rc = io_submit(context_, static_cast<long>(batch.size() - sent), batch.data() + sent);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) {
        iocb* cb = batch[sent++];
        free_.push_back(static_cast<size_t>(cb - iocbs_.data()));
        refused_.push_back({static_cast<IoPiece*>(cb->data), rc});
        continue;
      }
      sent += static_cast<size_t>(rc);
    }
    batch.clear();
  }

  io_context_t context_;
  std::vector<iocb> iocbs_;
  std::vector<io_event> events_;
  std::vector<size_t> free_;
  std::vector<IoCompletion> refused_;
};

// Blocking calls on the lane's thread: submit does the work, reap hands it back.
class ThreadQueue : public IoQueue {
 public:
  void submit(const std::vector<IoPiece*>& pieces, bool) override {
    for (IoPiece* piece : pieces) {
      ssize_t rc;
      do {
        rc = piece->write ? ::pwrite(piece->fd, piece->buffer, piece->bytes, piece->offset)
                          : ::pread(piece->fd, piece->buffer, piece->bytes, piece->offset);
      } while (rc < 0 && errno == EINTR);
      done_.push_back({piece, rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc)});
    }
  }

  void reap(std::vector<IoCompletion>& out) override {
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
  }

 private:
  std::vector<IoCompletion> done_;
};

}  // namespace

std::unique_ptr<IoQueue> make_uring_queue(int depth, std::string& reason) {
  auto queue = std::make_unique<UringQueue>();
  const int rc = knobs::get_bool(knobs::kFaultNoIoUring) ? -EPERM : queue->init(depth);
  if (rc < 0) {
    reason = str("io_uring_queue_init: ", errno_text(-rc));
    return nullptr;
  }
  return queue;
}

std::unique_ptr<IoQueue> make_libaio_queue(int depth, std::string& reason) {
  io_context_t context = nullptr;
  const int rc = io_setup(depth, &context);
  if (rc < 0) {
    reason = str("io_setup: ", errno_text(-rc), rc == -EAGAIN ? " (fs.aio-max-nr used up)" : "");
    return nullptr;
  }
  return std::make_unique<LibaioQueue>(context, depth);
}

std::unique_ptr<IoQueue> make_thread_queue() { return std::make_unique<ThreadQueue>(); }

bool uring_available(std::string& reason) { return make_uring_queue(1, reason) != nullptr; }
bool libaio_available(std::string& reason) { return make_libaio_queue(1, reason) != nullptr; }

}  // namespace internal
}  // namespace remat
