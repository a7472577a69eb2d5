// Asynchronous block I/O on one file of fixed size: what ZeRO-Infinity's NVMe
// offload streams optimizer state and parameters through.
//
//   AsyncFile file("/nvme/job/rank0.state", 64 << 20);       // created, 64 MiB
//   AlignedBuffer buf(8 << 20);                               // 4096-aligned host memory
//   IoRequest w = file.write(0, buf.data(), buf.size());      // returns at once
//   w.wait();                                                 // a remat::Error if it failed
//   file.read(0, buf.data(), buf.size()).wait();
//
// A request is split into `block_size` pieces; at most `queue_depth` pieces
// per lane are in flight, on `thread_count` lanes, whichever request they
// belong to; requests complete in any order, each piece in place in the
// caller's buffer. The buffer must outlive the request: wait for it (or
// destroy the file, which waits for every request) before freeing it.
//
// The file is opened with O_DIRECT where the filesystem allows it: the page
// cache is bypassed, and every buffer address, offset and size must then be a
// multiple of `alignment` (AlignedBuffer and BufferPool give such buffers; a
// request that is not is refused at once, naming the value). A filesystem that
// refuses O_DIRECT (ramfs; tmpfs before Linux 6.6; some network filesystems)
// gets buffered I/O with a warning, or a ConfigError, as `direct` says.
//
// Backends (`backend`): io_uring (liburing), Linux AIO (libaio, what DeepSpeed's
// aio op builds on) and a thread pool of blocking pread/pwrite calls. `kAuto`
// takes the first that starts: io_uring_queue_init fails in containers whose
// seccomp profile or kernel.io_uring_disabled forbids it (ENOSYS, EPERM), and
// io_setup where fs.aio-max-nr is used up; the fallback and its reason are
// logged once per process. A backend asked for by name that cannot start is
// an Error saying why.
//
// DeepSpeed's `aio` keys, and what each means for each backend: async_io_options.h.
//
// Errors are remat::Error naming the file, the operation, the offset and the
// bytes: a read or write past the file's end (at the call), EIO, ENOSPC (a
// write that fills the disk), EFBIG, a read that meets the end of a file
// truncated behind remat's back. A short transfer is resumed where it stopped.
// No wait hangs: IoRequest::wait() gives up after `timeout` with a TimeoutError
// saying what is stuck.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/async_io_options.h"

namespace remat {

// Host memory aligned for direct I/O (posix_memalign), zero-filled; its size
// rounded up to a multiple of the alignment. Movable, not copyable.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes, size_t alignment = 4096);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  size_t alignment() const { return alignment_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = 0;
};

// A fixed set of `count` AlignedBuffers of `bytes` each (DeepSpeed's
// buffer_count and buffer_size), allocated at construction. acquire() lends
// one, blocking while all are lent (a TimeoutError after `timeout`); the Lease
// gives it back when destroyed. The pool must outlive its leases.
class BufferPool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    AlignedBuffer& buffer() const { return pool_->buffers_[index_]; }
    void* data() const { return buffer().data(); }
    size_t size() const { return buffer().size(); }

   private:
    friend class BufferPool;
    Lease(BufferPool* pool, size_t index) : pool_(pool), index_(index) {}
    void release();
    BufferPool* pool_ = nullptr;
    size_t index_ = 0;
  };

  BufferPool(size_t count, size_t bytes, size_t alignment = 4096);
  Lease acquire(std::chrono::milliseconds timeout = std::chrono::minutes(5));
  size_t count() const { return buffers_.size(); }
  size_t buffer_size() const { return bytes_; }
  size_t available() const;

 private:
  void give_back(size_t index);
  std::vector<AlignedBuffer> buffers_;
  std::vector<size_t> free_;
  size_t bytes_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable returned_;
};

namespace internal {
struct IoRequestState;
class IoEngine;
}  // namespace internal

// One read or write in flight. wait() returns when every piece is done and
// throws the first piece's error; it may be called again (it returns or throws
// the same). A default-constructed request is done.
class IoRequest {
 public:
  IoRequest() = default;
  explicit IoRequest(std::shared_ptr<internal::IoRequestState> state) : state_(std::move(state)) {}
  void wait();  // with the file's timeout
  void wait(std::chrono::milliseconds timeout);
  bool done() const;

 private:
  std::shared_ptr<internal::IoRequestState> state_;
};

class AsyncFile {
 public:
  // Opens `path` (created when missing, mode 0600) and sets its size to `size`
  // bytes (what is there is kept up to that size). Throws a ConfigError for bad
  // options or a refused O_DIRECT under DirectIo::kRequired, an Error when the
  // file cannot be opened, sized or (preallocate) reserved.
  AsyncFile(std::string path, uint64_t size, AsyncIoOptions options = {});
  ~AsyncFile();  // waits for the requests in flight, then closes the file
  AsyncFile(const AsyncFile&) = delete;
  AsyncFile& operator=(const AsyncFile&) = delete;

  IoRequest read(uint64_t offset, void* buffer, size_t bytes);
  IoRequest write(uint64_t offset, const void* buffer, size_t bytes);

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  bool direct() const { return direct_; }
  IoBackend backend() const;           // the one running, never kAuto
  const std::string& backend_reason() const { return reason_; }  // why that one, for reports
  const AsyncIoOptions& options() const { return options_; }
  AsyncIoStats stats() const;

 private:
  IoRequest submit(bool write, uint64_t offset, void* buffer, size_t bytes);
  void open_file();
  std::string path_;
  uint64_t size_ = 0;
  AsyncIoOptions options_;
  int fd_ = -1;
  bool direct_ = false;
  std::string reason_;
  std::unique_ptr<internal::IoEngine> engine_;
};

// Bytes an unprivileged process may still write in `folder`'s filesystem
// (statvfs: f_bavail x f_frsize). An Error naming the folder if it cannot be read.
uint64_t free_bytes(const std::string& folder);

// A ConfigError naming `what`, the folder, both sizes and what to change when
// `folder` has less than `bytes` free.
void require_free_bytes(const std::string& folder, uint64_t bytes, const std::string& what);

// Whether files in `folder` can be opened with O_DIRECT and written and read
// back at `alignment` (a probe file is created and removed). `reason` says why
// not ("" when it works).
struct DirectIoSupport {
  bool supported = false;
  std::string reason;
};
DirectIoSupport probe_direct_io(const std::string& folder, size_t alignment = 4096);

}  // namespace remat
