#include "parallel/nvme_tensor_file.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "parallel/internal/nvme_folder.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel {

namespace {

// The files' reserved address ranges, for the SIGBUS handler (which may read
// only what is lock-free): a range's slot is cleared when it is unmapped, and
// taken again by a later file (a process may make any number in turn).
constexpr int kMaxRanges = 256;
struct MappedRange {
  std::atomic<uintptr_t> begin{0}, end{0};
  char message[4608];
  std::atomic<size_t> message_size{0};
  std::atomic<bool> taken{false};
};
MappedRange g_ranges[kMaxRanges];
struct sigaction g_previous_sigbus;  // the process's SIGBUS handler before remat's

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (int i = 0; i < kMaxRanges; ++i) {
    if (address >= g_ranges[i].begin.load() && address < g_ranges[i].end.load()) {
      const ssize_t written = ::write(STDERR_FILENO, g_ranges[i].message, g_ranges[i].message_size.load());
      (void)written;
      internal::remove_on_exit_now();
      ::_exit(1);
    }
  }
  // Not a file of remat's: what handled SIGBUS before remat does (a
  // program's or a library's handler, Open MPI's backtrace); without one the
  // access faults again and ends the process, as it would without remat.
  const struct sigaction& previous = g_previous_sigbus;
  if ((previous.sa_flags & SA_SIGINFO) != 0) {
    previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  } else {
    ::signal(SIGBUS, SIG_DFL);
  }
}

int register_range(void* address, size_t bytes, const std::string& message) {
  static const bool installed = [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    return ::sigaction(SIGBUS, &action, &g_previous_sigbus) == 0;
  }();
  (void)installed;
  int slot = 0;
  for (bool expected = false; slot < kMaxRanges; ++slot, expected = false) {
    if (g_ranges[slot].taken.compare_exchange_strong(expected, true)) break;
  }
  if (slot == kMaxRanges) return -1;
  MappedRange& r = g_ranges[slot];
  const size_t size = std::min(message.size(), sizeof r.message);
  std::memcpy(r.message, message.data(), size);
  r.message_size.store(size);
  r.begin.store(reinterpret_cast<uintptr_t>(address));
  r.end.store(reinterpret_cast<uintptr_t>(address) + bytes);
  return slot;
}

size_t page_bytes() {
  static const size_t bytes = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return bytes;
}

}  // namespace

namespace {
bool of_params(const NvmeTensorFileOptions& o) { return o.section == "offload_param"; }

// The address range a file may grow into: its disk's size (it cannot grow
// past that), at least 1 GiB, at most 1 TiB; reserved, not committed.
size_t reserve_bytes(const std::string& folder) {
  struct statvfs fs {};
  const size_t disk = ::statvfs(folder.c_str(), &fs) == 0 ? static_cast<size_t>(fs.f_blocks) * fs.f_frsize : 0;
  const size_t bytes = std::clamp<size_t>(disk, size_t{1} << 30, size_t{1} << 40);
  return (bytes + page_bytes() - 1) / page_bytes() * page_bytes();
}
}  // namespace

struct NvmeTensorFile::Mapping {
  char* base = nullptr;
  size_t reserved = 0;
  int slot = -1;
  ~Mapping() {
    if (slot >= 0) {
      g_ranges[slot].end.store(0);
      g_ranges[slot].taken.store(false);
    }
    if (base != nullptr) ::munmap(base, reserved);
  }
};

NvmeTensorFile::NvmeTensorFile(const NvmeTensorFileOptions& options)
    : options_(options),
      folder_(std::make_unique<internal::NvmeFolder>(options.nvme_path, options.rank, options.section,
                                                     of_params(options) ? "parameters" : "masters",
                                                     of_params(options) ? "its parameter shards"
                                                                        : "its optimizer's float32 masters",
                                                     options.world_size)) {
  REMAT_CHECK(options.section == "offload_param" || options.section == "offload_optimizer",
              "NvmeTensorFile: section '", options.section, "' is neither offload_param nor offload_optimizer");
  path_ = (std::filesystem::path(folder_->path()) / folder_->file_name()).string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0) {
    throw ConfigError(str("zero_optimization.", options.section, ".nvme_path '", options.nvme_path, "': rank ",
                          options.rank, " cannot make its file '", path_, "' (", std::strerror(errno),
                          "): give a folder this job can write"));
  }
  mapping_ = std::make_shared<Mapping>();
  mapping_->reserved = reserve_bytes(folder_->path());
  void* base = ::mmap(nullptr, mapping_->reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    throw ConfigError(str(options.section, " nvme: rank ", options.rank, " cannot reserve ", mapping_->reserved,
                          " bytes of address space for its file '", path_, "' (", std::strerror(errno),
                          "): raise the process's address-space limit (ulimit -v)"));
  }
  mapping_->base = static_cast<char*>(base);
  mapping_->slot = register_range(
      base, mapping_->reserved,
      str("remat error: ", options.section, " nvme: ", of_params(options) ? "a parameter shard" : "a float32 master",
          " mapped from '", path_, "' could not be read or written (SIGBUS: a disk error under nvme_path, or the "
          "file was cut short or removed by something else); what is on disk is no longer whole: check the disk, "
          "then resume from the last save\n"));
}

NvmeTensorFile::~NvmeTensorFile() {
  // The mappings stay valid while tensors hold them; the file's name goes now.
  ::unlink(path_.c_str());
  if (fd_ >= 0) ::close(fd_);
}

at::Tensor NvmeTensorFile::place(const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  const int64_t n = values.numel();
  if (n == 0 || in_cpu_elements_ + n <= options_.max_in_cpu) {
    in_cpu_elements_ += n;
    return at::Tensor();
  }
  needed_end_ = (needed_end_ + 63) / 64 * 64 + n * static_cast<int64_t>(sizeof(float));
  if (!reserve_error_.empty()) return at::Tensor();  // nothing is placed after a problem
  const int64_t offset = (end_ + 63) / 64 * 64;
  const int64_t end = offset + n * static_cast<int64_t>(sizeof(float));
  const auto page = static_cast<int64_t>(page_bytes());
  const int64_t mapped = (end + page - 1) / page * page;
  if (mapped > file_bytes_) {
    // The file grows by the pages the tensor needs, reserved on the disk and
    // mapped at their place in the range.
    const int64_t grow = mapped - file_bytes_;
    int err = static_cast<size_t>(mapped) > mapping_->reserved ? EFBIG
                                                               : ::posix_fallocate(fd_, file_bytes_, grow);
    void* at = mapping_->base + file_bytes_;
    if (err == 0 &&
        ::mmap(at, static_cast<size_t>(grow), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, file_bytes_) ==
            MAP_FAILED) {
      err = errno;
    }
    if (err != 0) {
      reserve_error_ = std::strerror(err);
      return at::Tensor();
    }
    file_bytes_ = mapped;
  }
  end_ = end;
  // Each tensor holds the range, which outlives the file's name and this object.
  at::Tensor t = at::from_blob(mapping_->base + offset, {n}, [keep = mapping_](void*) {}, at::TensorOptions().dtype(at::kFloat));
  t.copy_(values.detach().reshape({-1}));
  return t;
}

void NvmeTensorFile::check() const {
  if (reserve_error_.empty()) return;
  const auto page = static_cast<int64_t>(page_bytes());
  throw ConfigError(str("zero_optimization.", options_.section, ".nvme_path '", options_.nvme_path, "': rank ",
                        options_.rank, " cannot reserve ", (needed_end_ + page - 1) / page * page, " bytes for its ",
                        of_params(options_) ? "parameter shards" : "optimizer's float32 masters", " in '", path_,
                        "' (", reserve_error_, " after ", file_bytes_, " bytes): free space on that disk, give "
                        "nvme_path a larger one",
                        of_params(options_) ? ", or raise offload_param.max_in_cpu to keep more of the shards in host "
                                              "memory"
                                            : ""));
}

std::pair<char*, size_t> NvmeTensorFile::pages_of(const at::Tensor& t) const {
  if (!t.defined() || t.nbytes() == 0) return {nullptr, 0};
  const auto begin = static_cast<char*>(t.data_ptr());
  if (begin < mapping_->base || begin >= mapping_->base + file_bytes_) return {nullptr, 0};
  const auto page = page_bytes();
  const size_t from = static_cast<size_t>(begin - mapping_->base) / page * page;
  const size_t to = std::min(static_cast<size_t>(file_bytes_),
                             (static_cast<size_t>(begin - mapping_->base) + t.nbytes() + page - 1) / page * page);
  return {mapping_->base + from, to - from};
}

bool NvmeTensorFile::on_disk(const at::Tensor& t) const { return pages_of(t).first != nullptr; }

void NvmeTensorFile::prefetch(const at::Tensor& t) const {
  if (const auto [at, bytes] = pages_of(t); at != nullptr) ::madvise(at, bytes, MADV_WILLNEED);
}

// Dirty pages of a shared mapping stay in the page cache and reach the file;
// the writeback starts now rather than when the kernel gets to it.
void NvmeTensorFile::release(const at::Tensor& t) const {
  const auto [at, bytes] = pages_of(t);
  if (at == nullptr) return;
  ::msync(at, bytes, MS_ASYNC);
  ::madvise(at, bytes, MADV_DONTNEED);
}

void NvmeTensorFile::release_all() const {
  if (file_bytes_ == 0) return;
  ::msync(mapping_->base, static_cast<size_t>(file_bytes_), MS_ASYNC);
  ::madvise(mapping_->base, static_cast<size_t>(file_bytes_), MADV_DONTNEED);
}

}  // namespace remat::parallel
