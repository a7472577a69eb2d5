// One rank's float32 masters and Adam moments in a file on NVMe, stepped in
// sub-groups through a few aligned host buffers: the optimizer state of
// offload_optimizer.device "nvme" (issue 53; not yet wired into ZeroModel).
//
//   NvmeOptimizerStore store({"/nvme/job", 0, numel, sub_group, buffers, aio});
//   store.initialize(masters);                        // moments zero
//   store.step(grads, {lr, b1, b2, eps, wd, true}, [&](int64_t begin, const float* p, int64_t n) {
//     ...copy p[0, n) to the device's params at `begin`...
//   });
//
// The file (`folder`/rank<R>.optimizer) holds, for each sub-group of
// `sub_group_size` elements in turn, its masters, exp_avg and exp_avg_sq,
// each padded to the I/O alignment: one record per sub-group, read and written
// with one request each. It is created at its full size at construction (its
// blocks reserved, so that a disk too small fails then, not mid-run) and
// removed at destruction.
//
// A step streams the records through `buffer_count` (>= 2) buffers of one
// record each: while the host Adam (optim/host_adam.h, the fused loop the cpu
// offload runs) steps sub-group i in its buffer, sub-group i+1 is being read
// into the next and the earlier ones written back. The result is bitwise the
// in-memory host Adam's over the whole range.
//
// An I/O error (a full disk, EIO, a timeout) is a remat::Error naming the
// step, the sub-group and the file; the store then refuses further steps (its
// file holds some sub-groups stepped and others not).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "optim/host_adam.h"
#include "runtime/async_io.h"

namespace remat::parallel::internal {

struct NvmeStoreOptions {
  std::string folder;        // nvme_path's folder for this job
  int rank = 0;              // names the file
  int64_t numel = 0;         // elements of this rank's flat range
  int64_t sub_group_size = 1000000000;  // elements stepped at once (DeepSpeed's default 1e9)
  int buffer_count = 4;      // records in host memory at once (DeepSpeed's default 4)
  AsyncIoOptions io;         // the aio section (engine/config.h: AioConfig::options)
};

// What the last step moved and how long it took.
struct NvmeStepStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  double seconds = 0;
  double bytes_per_second() const { return seconds > 0 ? (bytes_read + bytes_written) / seconds : 0; }
};

class NvmeOptimizerStore {
 public:
  // Receives each sub-group's updated masters: `n` floats for elements
  // [begin, begin + n) of the range, valid for the call only.
  using UpdatedMasters = std::function<void(int64_t begin, const float* masters, int64_t n)>;

  explicit NvmeOptimizerStore(NvmeStoreOptions options);
  ~NvmeOptimizerStore();  // waits for its I/O, removes the file
  NvmeOptimizerStore(const NvmeOptimizerStore&) = delete;
  NvmeOptimizerStore& operator=(const NvmeOptimizerStore&) = delete;

  // Writes `masters` (float32, contiguous, on the host, numel elements) with
  // zero moments, and sets the step count to 0.
  void initialize(const at::Tensor& masters);
  // One Adam step over the range with `grads` (float32, contiguous, on the
  // host, numel elements); `adam.step` is ignored (the store counts its own).
  void step(const at::Tensor& grads, optim::HostAdamStep adam, const UpdatedMasters& updated = nullptr);
  // The state as it is on disk, into float32 host tensors of numel elements.
  void read(at::Tensor masters, at::Tensor exp_avg, at::Tensor exp_avg_sq);

  const std::string& path() const { return path_; }
  int64_t steps() const { return steps_; }
  uint64_t file_bytes() const;
  uint64_t host_buffer_bytes() const { return buffers_.size() * record_bytes_; }
  IoBackend backend() const { return file_->backend(); }
  const NvmeStepStats& last_step() const { return last_; }
  void set_kernel(optim::HostAdamKernel kernel) { kernel_ = kernel; }

 private:
  struct Group {
    int64_t begin = 0, numel = 0;
    uint64_t offset = 0;  // of its record in the file
    size_t piece = 0;     // bytes of each of its three arrays, padded
  };
  float* array(size_t buffer, const Group& g, int which) const;
  void check_host(const at::Tensor& t, const char* what) const;
  // Runs `body` for each sub-group in its buffer, its record read first when
  // `read`, written back after body when `write_back`.
  void stream(const std::function<void(size_t buffer, const Group& g)>& body, bool read, bool write_back,
              const char* what);

  NvmeStoreOptions options_;
  std::string path_;
  std::vector<Group> groups_;
  size_t record_bytes_ = 0;
  std::vector<AlignedBuffer> buffers_;
  std::unique_ptr<AsyncFile> file_;  // after buffers_: destroyed first, its I/O waited for
  int64_t steps_ = 0;
  bool failed_ = false;
  optim::HostAdamKernel kernel_ = optim::HostAdamKernel::kAuto;
  NvmeStepStats last_;
};

}  // namespace remat::parallel::internal
