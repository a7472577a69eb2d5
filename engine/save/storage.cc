#include "engine/save/storage.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "runtime/env_knobs.h"
#include "runtime/error.h"

namespace remat::save {
namespace fs = std::filesystem;

namespace {

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

namespace {

// An open file taking pieces through a buffer (small pieces are gathered,
// large ones written directly), with the CRC-32 of all it took. A failed
// write is kept and raised by close(), never from take(): the producer (a
// LibTorch writer) may call again while it unwinds.
class FileSink {
 public:
  explicit FileSink(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw Error(str("save: cannot write '", path, "': check that the save directory is writable"));
  }
  ~FileSink() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  void take(const void* data, size_t size) {
    written_.crc32 = static_cast<int64_t>(
        ::crc32_z(static_cast<uLong>(written_.crc32), static_cast<const Bytef*>(data), size));
    written_.bytes += static_cast<int64_t>(size);
    if (buffer_.size() + size > kBuffer) flush();
    if (size >= kBuffer) {
      put(static_cast<const char*>(data), size);
    } else {
      buffer_.append(static_cast<const char*>(data), size);
    }
  }

  // Everything on disk (fsync), the file closed.
  WrittenBytes close() {
    flush();
    if (error_ == 0 && ::fsync(fd_) != 0 && errno != EINVAL) error_ = errno;
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && error_ == 0) error_ = errno;
    if (error_ != 0) {
      throw Error(str("save: writing '", path_, "' failed (", std::strerror(error_), "; disk full?)"));
    }
    return written_;
  }

 private:
  static constexpr size_t kBuffer = size_t{1} << 20;

  void flush() {
    put(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void put(const char* data, size_t size) {
    while (size > 0 && error_ == 0) {
      const ssize_t n = ::write(fd_, data, size);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error_ = n < 0 ? errno : ENOSPC;
        return;
      }
      data += n;
      size -= static_cast<size_t>(n);
    }
  }

  std::string path_;
  int fd_ = -1;
  int error_ = 0;  // the first failed write's errno
  std::string buffer_;
  WrittenBytes written_;
};

}  // namespace

WrittenBytes write_atomically_streamed(const std::string& path, const std::function<void(const Sink&)>& produce) {
  const std::string tmp = path + ".tmp";
  WrittenBytes written;
  {
    FileSink file(tmp);
    produce([&](const void* data, size_t size) { file.take(data, size); });
    written = file.close();
  }
  fault_pause(path);
  fs::rename(tmp, path);
  fsync_path(fs::path(path).parent_path().string(), true);
  return written;
}

void write_atomically(const std::string& path, const std::string& bytes) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(str("save: cannot write '", tmp, "': check that the save directory is writable"));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw Error(str("save: writing '", tmp, "' failed (disk full?)"));
  }
  fsync_path(tmp, false);
  fault_pause(path);
  fs::rename(tmp, path);
  fsync_path(fs::path(path).parent_path().string(), true);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(str("resume: cannot read '", path, "' (", std::strerror(errno), ")"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int64_t crc32_of(const std::string& bytes) {
  return static_cast<int64_t>(
      ::crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

std::string step_folder(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

int64_t step_of(const std::string& name) {
  if (name.size() <= 5 || name.rfind("step_", 0) != 0) return -1;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos || name.size() > 5 + 18) return -1;
  return std::stoll(name.substr(5));
}

std::vector<std::pair<int64_t, fs::path>> step_folders(const std::string& root) {
  std::vector<std::pair<int64_t, fs::path>> folders;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && entry.is_directory(ec)) folders.emplace_back(step, entry.path());
  }
  std::sort(folders.begin(), folders.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return folders;
}

std::string root_of(const std::string& folder) {
  fs::path p(folder);
  if (p.filename().empty()) p = p.parent_path();  // "root/step_00000004/"
  return p.parent_path().string();
}

std::string staging_folder(int64_t step) { return ".staging_" + step_folder(step); }

std::string removed_folder(const std::string& step_folder) {
  fs::path p(step_folder);
  if (p.filename().empty()) p = p.parent_path();
  return (p.parent_path() / (".removed_" + p.filename().string())).string();
}

namespace {

// The hidden name an old save waits under while a new one takes its place
// (where the file system cannot exchange two folders).
fs::path replaced_name(const fs::path& final) {
  return final.parent_path() / (".replaced_" + final.filename().string());
}

}  // namespace

bool install_save(const std::string& staging, const std::string& final) {
  fault_pause(final);
  std::error_code ec;
  const bool old = fs::exists(final, ec);
  if (!old) {
    fs::rename(staging, final);
  } else if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
      throw Error(str("save: cannot put '", staging, "' in place of '", final, "' (", std::strerror(errno), ")"));
    }
    const fs::path aside = replaced_name(final);
    fs::remove_all(aside, ec);
    fs::rename(final, aside);
    fs::rename(staging, final);
    fs::rename(aside, staging);
  }
  fsync_path(fs::path(final).parent_path().string(), true);
  return old;
}

std::vector<std::string> remove_save_leftovers(const std::string& root) {
  std::error_code ec;
  std::vector<std::string> names;  // read first: the folder changes below
  for (const auto& entry : fs::directory_iterator(root, ec)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  std::vector<std::string> removed;
  for (const std::string& name : names) {
    const fs::path path = fs::path(root) / name;
    if (name.rfind(".replaced_", 0) == 0 && step_of(name.substr(10)) >= 0) {
      const fs::path final = fs::path(root) / name.substr(10);
      if (!fs::exists(final, ec)) {
        fs::rename(path, final, ec);  // the new save never took its place: the old one is it
        if (!ec) continue;
      }
    } else if (!(name.rfind(".staging_", 0) == 0 && step_of(name.substr(9)) >= 0) &&
               !(name.rfind(".removed_", 0) == 0 && step_of(name.substr(9)) >= 0) && name != "latest.tmp") {
      continue;
    }
    fs::remove_all(path, ec);
    if (!ec) removed.push_back(name);
  }
  return removed;
}

void fault_pause(const std::string& what) {
  const auto pause = knobs::fault_save_pause();
  if (!pause) return;
  std::fprintf(stderr, "remat fault seam: pausing %lld ms before '%s' is put in place\n",
               static_cast<long long>(pause->count()), what.c_str());
  std::fflush(stderr);
  std::this_thread::sleep_for(*pause);
}

bool fault_fail(int rank) {
  const auto failing = knobs::fault_save_fail();
  return failing && *failing == rank;
}

namespace {
std::atomic<int64_t> snapshot_bytes{0};
}  // namespace

int64_t snapshot_host_bytes() { return snapshot_bytes.load(); }
void count_snapshot_host_bytes(int64_t delta) { snapshot_bytes.fetch_add(delta); }

}  // namespace remat::save
