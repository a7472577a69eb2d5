#include "runtime/async_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "runtime/error.h"
#include "runtime/internal/io_engine.h"
#include "runtime/internal/io_queue.h"
#include "runtime/logging.h"

namespace remat {

using internal::errno_text;

namespace {

bool power_of_two(size_t value) { return value != 0 && (value & (value - 1)) == 0; }

uint64_t round_up(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

// --- buffers ---

AlignedBuffer::AlignedBuffer(size_t bytes, size_t alignment) : alignment_(alignment) {
  REMAT_CHECK(power_of_two(alignment) && alignment >= sizeof(void*),
              "AlignedBuffer: alignment ", alignment, " is not a power of two >= ", sizeof(void*));
  size_ = static_cast<size_t>(round_up(bytes, alignment));
  if (size_ == 0) return;
  const int rc = posix_memalign(&data_, alignment, size_);
  if (rc != 0) {
    data_ = nullptr;
    throw Error(str("AlignedBuffer: cannot allocate ", size_, " bytes aligned to ", alignment, ": ",
                    errno_text(rc)));
  }
  std::memset(data_, 0, size_);
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(other.data_), size_(other.size_), alignment_(other.alignment_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = other.data_;
    size_ = other.size_;
    alignment_ = other.alignment_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

BufferPool::BufferPool(size_t count, size_t bytes, size_t alignment) : bytes_(bytes) {
  REMAT_CHECK(count > 0 && bytes > 0, "BufferPool: buffer_count (", count, ") and buffer_size (", bytes,
              ") must both be > 0");
  buffers_.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    buffers_.emplace_back(bytes, alignment);
    free_.push_back(count - 1 - i);
  }
}

BufferPool::Lease BufferPool::acquire(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!returned_.wait_for(lock, timeout, [&] { return !free_.empty(); })) {
    throw TimeoutError(str("BufferPool: all ", buffers_.size(), " buffers of ", bytes_,
                           " bytes still lent after ", timeout.count(), " ms: a lease was never "
                           "released, or buffer_count is too small for the reads kept in flight"));
  }
  const size_t index = free_.back();
  free_.pop_back();
  return Lease(this, index);
}

size_t BufferPool::available() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_.size();
}

void BufferPool::give_back(size_t index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(index);
  }
  returned_.notify_one();
}

BufferPool::Lease::Lease(Lease&& other) noexcept : pool_(other.pool_), index_(other.index_) {
  other.pool_ = nullptr;
}

BufferPool::Lease& BufferPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = other.pool_;
    index_ = other.index_;
    other.pool_ = nullptr;
  }
  return *this;
}

BufferPool::Lease::~Lease() { release(); }

void BufferPool::Lease::release() {
  if (pool_ != nullptr) pool_->give_back(index_);
  pool_ = nullptr;
}

// --- requests ---

void IoRequest::wait() {
  if (state_ != nullptr) wait(state_->timeout);
}

void IoRequest::wait(std::chrono::milliseconds timeout) {
  if (state_ == nullptr) return;
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (!state_->finished.wait_for(lock, timeout, [&] { return state_->pieces_left == 0; })) {
    throw TimeoutError(str(state_->what, ": not done after ", timeout.count(), " ms, ",
                           state_->pieces - state_->pieces_left, " of ", state_->pieces,
                           " pieces complete: the disk or the I/O backend is stuck (check dmesg "
                           "and the disk's health); the buffer stays in use until it completes"));
  }
  if (!state_->error.empty()) throw Error(state_->error);
}

bool IoRequest::done() const {
  if (state_ == nullptr) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->pieces_left == 0;
}

// --- the file ---

namespace {

// The open flags' failure as a message naming the path.
std::string cannot(const std::string& what, const std::string& path, int error) {
  return str("cannot ", what, " '", path, "': ", errno_text(error));
}

}  // namespace

AsyncFile::AsyncFile(std::string path, uint64_t size, AsyncIoOptions options)
    : path_(std::move(path)), size_(size), options_(options) {
  const std::string problems = check_async_io_options(options_);
  if (!problems.empty()) throw ConfigError(str("asynchronous I/O options for '", path_, "':\n", problems));
  open_file();
  std::string reason;
  try {
    const IoBackend backend = internal::choose_io_backend(options_, reason);
    engine_ = std::make_unique<internal::IoEngine>(backend, options_);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  options_.backend = engine_->backend();
  reason_ = reason;
}

AsyncFile::~AsyncFile() {
  engine_.reset();  // every piece queued is finished first
  if (fd_ >= 0) ::close(fd_);
}

void AsyncFile::open_file() {
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC;
  direct_ = options_.direct != DirectIo::kOff;
  fd_ = direct_ ? ::open(path_.c_str(), flags | O_DIRECT, 0600) : -1;
  if (direct_ && fd_ < 0 && errno == EINVAL) {
    const std::string why = str("'", path_, "' is on a filesystem that refuses direct I/O (O_DIRECT: ",
                                errno_text(EINVAL), "; ramfs, tmpfs before Linux 6.6, some network filesystems)");
    if (options_.direct == DirectIo::kRequired) {
      throw ConfigError(why + ": give a folder on a disk filesystem (ext4, xfs), or allow buffered I/O "
                              "(direct I/O preferred or off), which goes through the page cache");
    }
    log().warn("{}: using buffered I/O, through the page cache", why);
    direct_ = false;
  }
  if (!direct_) fd_ = ::open(path_.c_str(), flags, 0600);
  if (fd_ < 0) throw Error(cannot("open", path_, errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw Error(str("'", path_, "' is not a regular file: asynchronous I/O needs one"));
  }
  int rc = static_cast<uint64_t>(st.st_size) == size_ ? 0 : ::ftruncate(fd_, static_cast<off_t>(size_));
  if (rc != 0) rc = errno;
  if (rc == 0 && options_.preallocate && size_ > 0) rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(size_));
  if (rc != 0) {
    ::close(fd_);
    throw Error(str(cannot(options_.preallocate ? "size and reserve" : "size", path_, rc), " (", size_,
                    " bytes", rc == ENOSPC ? "; the disk holding it is full: free space there or choose "
                                              "a folder on a larger disk" : "", ")"));
  }
}

IoRequest AsyncFile::read(uint64_t offset, void* buffer, size_t bytes) {
  return submit(false, offset, buffer, bytes);
}

IoRequest AsyncFile::write(uint64_t offset, const void* buffer, size_t bytes) {
  return submit(true, offset, const_cast<void*>(buffer), bytes);
}

IoRequest AsyncFile::submit(bool write, uint64_t offset, void* buffer, size_t bytes) {
  const char* op = write ? "write" : "read";
  REMAT_CHECK(offset <= size_ && bytes <= size_ - offset, op, " of ", bytes, " bytes at offset ", offset,
              " of '", path_, "' passes its end (", size_, " bytes)");
  if (direct_) {
    const uint64_t a = options_.alignment;
    const auto address = reinterpret_cast<uintptr_t>(buffer);
    REMAT_CHECK(address % a == 0 && offset % a == 0 && bytes % a == 0, "direct I/O on '", path_,
                "' needs the buffer's address, the offset and the size to be multiples of ", a, ": ", op,
                " of ", bytes, " bytes at offset ", offset, " from address ", buffer,
                " (take buffers from AlignedBuffer or BufferPool, or open the file with direct I/O off)");
  }
  REMAT_CHECK(bytes == 0 || buffer != nullptr, op, " of ", bytes, " bytes into a null buffer");
  auto state = std::make_shared<internal::IoRequestState>();
  state->what = str(op, " of '", path_, "'");
  state->timeout = options_.timeout;
  if (bytes == 0) return IoRequest(std::move(state));
  std::vector<internal::IoPiece*> pieces;
  for (uint64_t done = 0; done < bytes; done += options_.block_size) {
    auto* piece = new internal::IoPiece{state, fd_, write, offset + done, static_cast<char*>(buffer) + done,
                                        static_cast<size_t>(std::min<uint64_t>(options_.block_size, bytes - done))};
    pieces.push_back(piece);
  }
  state->pieces = state->pieces_left = pieces.size();
  engine_->count(write, bytes);
  engine_->enqueue(std::move(pieces));
  return IoRequest(std::move(state));
}

IoBackend AsyncFile::backend() const { return engine_->backend(); }

AsyncIoStats AsyncFile::stats() const { return engine_->stats(); }

// --- folders ---

uint64_t free_bytes(const std::string& folder) {
  struct statvfs vfs {};
  if (::statvfs(folder.c_str(), &vfs) != 0) throw Error(cannot("read the free space of", folder, errno));
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

void require_free_bytes(const std::string& folder, uint64_t bytes, const std::string& what) {
  const uint64_t free = free_bytes(folder);
  if (free >= bytes) return;
  throw ConfigError(str(what, " needs ", bytes, " bytes in '", folder, "' but its disk has ", free,
                        " free: free ", bytes - free, " bytes there, or give a folder on a larger disk"));
}

DirectIoSupport probe_direct_io(const std::string& folder, size_t alignment) {
  DirectIoSupport support;
  std::string name = folder + "/.remat-direct-probe.XXXXXX";
  const int plain = ::mkstemp(name.data());
  if (plain < 0) {
    support.reason = cannot("create a file in", folder, errno);
    return support;
  }
  ::close(plain);
  const int fd = ::open(name.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    support.reason = str("O_DIRECT refused in '", folder, "': ", errno_text(errno));
  } else {
    AlignedBuffer buffer(alignment, alignment);
    std::memset(buffer.data(), 0x5a, alignment);
    const ssize_t wrote = ::pwrite(fd, buffer.data(), alignment, 0);
    const int write_error = errno;
    const ssize_t got = wrote == static_cast<ssize_t>(alignment) ? ::pread(fd, buffer.data(), alignment, 0) : -1;
    if (wrote != static_cast<ssize_t>(alignment)) {
      support.reason = str("a direct write of ", alignment, " bytes in '", folder, "' failed: ",
                           wrote < 0 ? errno_text(write_error) : "short write");
    } else if (got != static_cast<ssize_t>(alignment)) {
      support.reason = str("a direct read of ", alignment, " bytes in '", folder, "' failed");
    } else {
      support.supported = true;
    }
    ::close(fd);
  }
  ::unlink(name.c_str());
  return support;
}

}  // namespace remat
