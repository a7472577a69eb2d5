#include "parallel/nvme_parameters.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "parallel/internal/nvme_folder.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel {

namespace {

// The mapped shards' address ranges, for the SIGBUS handler (which may read
// only what is lock-free): a shard's slot is cleared when it is unmapped.
constexpr int kMaxRegions = 1 << 14;
struct MappedRange {
  std::atomic<uintptr_t> begin{0}, end{0};
};
MappedRange g_ranges[kMaxRegions];
std::atomic<int> g_range_count{0};
char g_message[4608];
std::atomic<size_t> g_message_size{0};

void on_sigbus(int, siginfo_t* info, void*) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  const int n = std::min(g_range_count.load(), kMaxRegions);
  for (int i = 0; i < n; ++i) {
    if (address >= g_ranges[i].begin.load() && address < g_ranges[i].end.load()) {
      const ssize_t written = ::write(STDERR_FILENO, g_message, g_message_size.load());
      (void)written;
      ::_exit(1);
    }
  }
  ::signal(SIGBUS, SIG_DFL);  // not a shard: the access faults again, as it would without remat
}

int register_range(void* address, size_t bytes, const std::string& path) {
  static const bool installed = [] {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    return ::sigaction(SIGBUS, &action, nullptr) == 0;
  }();
  (void)installed;
  const std::string message =
      str("remat error: offload_param nvme: a parameter shard mapped from '", path, "' could not be read or "
          "written (SIGBUS: a disk error under nvme_path, or the file was cut short or removed by something else); "
          "the shards on disk are no longer whole: check the disk, then resume from the last save\n");
  const size_t size = std::min(message.size(), sizeof g_message);
  std::memcpy(g_message, message.data(), size);
  g_message_size.store(size);
  const int slot = g_range_count.fetch_add(1);
  if (slot >= kMaxRegions) return -1;
  g_ranges[slot].begin.store(reinterpret_cast<uintptr_t>(address));
  g_ranges[slot].end.store(reinterpret_cast<uintptr_t>(address) + bytes);
  return slot;
}

size_t page_bytes() {
  static const size_t bytes = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return bytes;
}

}  // namespace

NvmeParameterFile::NvmeParameterFile(const NvmeParameterOptions& options)
    : options_(options),
      folder_(std::make_unique<internal::NvmeFolder>(options.nvme_path, options.rank, "offload_param", "parameters",
                                                     "its parameter shards")) {
  path_ = (std::filesystem::path(folder_->path()) / folder_->file_name()).string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0) {
    throw ConfigError(str("zero_optimization.offload_param.nvme_path '", options.nvme_path, "': rank ", options.rank,
                          " cannot make its parameter file '", path_, "' (", std::strerror(errno),
                          "): give a folder this job can write"));
  }
}

NvmeParameterFile::~NvmeParameterFile() {
  // The mappings stay valid while tensors hold them; the file's name goes now.
  ::unlink(path_.c_str());
  if (fd_ >= 0) ::close(fd_);
}

at::Tensor NvmeParameterFile::place(const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  const int64_t n = values.numel();
  if (n == 0 || in_cpu_elements_ + n <= options_.max_in_cpu || !problem_.empty()) {
    in_cpu_elements_ += n;
    return at::Tensor();
  }
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  const size_t padded = (bytes + page_bytes() - 1) / page_bytes() * page_bytes();
  const off_t offset = static_cast<off_t>(file_bytes_);
  if (const int err = ::posix_fallocate(fd_, offset, static_cast<off_t>(padded)); err != 0) {
    problem_ = (str("zero_optimization.offload_param.nvme_path '", options_.nvme_path, "': rank ",
                          options_.rank, " cannot reserve ", offset + static_cast<off_t>(padded), " bytes for its "
                          "parameter shards in '", path_, "' (", std::strerror(err), "): free space on that disk, "
                          "give nvme_path a larger one, or raise offload_param.max_in_cpu to keep more of the "
                          "shards in host memory"));
    return at::Tensor();
  }
  void* address = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, offset);
  if (address == MAP_FAILED) {
    problem_ = (str("offload_param nvme: rank ", options_.rank, " cannot map its parameter file '", path_,
                          "' (", std::strerror(errno), "): give nvme_path a folder on a local disk"));
    return at::Tensor();
  }
  file_bytes_ += static_cast<int64_t>(padded);
  const int slot = register_range(address, padded, path_);
  at::Tensor shard = at::from_blob(
      address, {n},
      [padded, slot](void* p) {
        if (slot >= 0) g_ranges[slot].end.store(0);
        ::munmap(p, padded);
      },
      at::TensorOptions().dtype(at::kFloat));
  shard.copy_(values.detach().reshape({-1}));
  regions_[address] = Region{address, padded};
  return shard;
}

void NvmeParameterFile::check() const {
  if (!problem_.empty()) throw ConfigError(problem_);
}

const NvmeParameterFile::Region* NvmeParameterFile::region_of(const at::Tensor& t) const {
  if (!t.defined()) return nullptr;
  const auto it = regions_.find(t.data_ptr());
  return it == regions_.end() ? nullptr : &it->second;
}

bool NvmeParameterFile::on_disk(const at::Tensor& t) const { return region_of(t) != nullptr; }

void NvmeParameterFile::prefetch(const at::Tensor& t) const {
  if (const Region* r = region_of(t)) ::madvise(r->address, r->bytes, MADV_WILLNEED);
}

void NvmeParameterFile::release(const at::Tensor& t) const {
  const Region* r = region_of(t);
  if (r == nullptr) return;
  // Dirty pages of a shared mapping stay in the page cache and reach the
  // file; the writeback starts now rather than when the kernel gets to it.
  ::msync(r->address, r->bytes, MS_ASYNC);
  ::madvise(r->address, r->bytes, MADV_DONTNEED);
}

void NvmeParameterFile::release_all() const {
  for (const auto& [address, region] : regions_) {
    ::msync(region.address, region.bytes, MS_ASYNC);
    ::madvise(region.address, region.bytes, MADV_DONTNEED);
  }
}

}  // namespace remat::parallel
