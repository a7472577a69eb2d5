// One rank's Adam moments in a file on NVMe, stepped in sub-groups through a
// few aligned host buffers: the optimizer state of offload_optimizer.device
// "nvme" (parallel/nvme_optimizer.h's optimizers step their parameters with it).
//
//   NvmeOptimizerStore store({"/nvme/job/rank0", 0, {4096, 64}, sub_group, buffers, aio});
//   store.initialize();                                // moments zero, no step taken
//   store.step(masters, {lr, b1, b2, eps, wd, true});  // masters[i].grad() read, masters[i] written
//
// The store steps a list of float32 host tensors (the masters the stage hands
// the optimizer, which stay in host memory: the stage copies them to the
// device and saves, loads and GatheredParameters read and write them there),
// laid end to end as one range. The file (`folder`/rank<R>.optimizer) holds,
// for each sub-group of `sub_group_size` elements of that range in turn, its
// exp_avg and exp_avg_sq, each padded to the I/O alignment: one record per
// sub-group, read and written with one request each. It is created at its
// full size at construction (its blocks reserved, so that a disk too small
// fails then, not mid-run) and removed at destruction.
//
// A step streams the records through `buffer_count` (>= 2) buffers of one
// record each: while the host Adam (optim/host_adam.h, the fused loop the cpu
// offload runs) steps sub-group i in its buffer, sub-group i+1 is being read
// into the next and the earlier ones written back. Each tensor keeps its own
// step count, and one without a gradient is not stepped, as LibTorch's Adam
// skips it: the result is bitwise the in-memory host Adam's.
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
  std::string folder;          // this rank's folder under nvme_path
  int rank = 0;                // names the file
  std::vector<int64_t> sizes;  // elements of each tensor stepped, in order
  int64_t sub_group_size = 1000000000;  // elements stepped at once (DeepSpeed's default 1e9)
  int buffer_count = 4;        // records in host memory at once (DeepSpeed's default 4)
  AsyncIoOptions io;           // the aio section (engine/config.h: AioConfig::options)
  // Test seams (runtime/env_knobs.h, REMAT_FAULT_NVME_*): the step (from 1)
  // killed with SIGKILL after its first sub-group's write, or whose I/O fails
  // with EIO; 0: none.
  int64_t kill_at_step = 0, fail_at_step = 0;
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
  explicit NvmeOptimizerStore(NvmeStoreOptions options);
  ~NvmeOptimizerStore();  // waits for its I/O, removes the file
  NvmeOptimizerStore(const NvmeOptimizerStore&) = delete;
  NvmeOptimizerStore& operator=(const NvmeOptimizerStore&) = delete;

  // Zero moments on disk, every tensor's step count 0.
  void initialize();
  // One Adam step over `params` (float32, contiguous, on the host, of
  // `sizes`): each with a gradient (the same) is stepped at its own step
  // number + 1; `adam.step` is ignored.
  void step(const std::vector<at::Tensor>& params, optim::HostAdamStep adam);

  // Tensor i's moments as they are on disk, into float32 host tensors of its
  // elements, and its step count (0: not stepped yet, the moments zero).
  void read_state(size_t i, at::Tensor exp_avg, at::Tensor exp_avg_sq) const;
  int64_t steps(size_t i) const { return steps_.at(i); }
  // Sets tensor i's moments and step count (a load); undefined moments and
  // step 0 clear it.
  void write_state(size_t i, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t step);

  const std::string& path() const { return path_; }
  size_t tensors() const { return options_.sizes.size(); }
  uint64_t file_bytes() const;
  // The moments' bytes (8 per element), without the alignment's padding.
  uint64_t state_bytes() const { return 8 * static_cast<uint64_t>(numel_); }
  uint64_t host_buffer_bytes() const { return buffers_.size() * record_bytes_; }
  size_t buffer_count() const { return buffers_.size(); }
  IoBackend backend() const { return file_->backend(); }
  bool direct() const { return file_->direct(); }
  const NvmeStepStats& last_step() const { return last_; }
  // Bytes read and written since the store was made.
  AsyncIoStats io_stats() const { return file_->stats(); }
  void set_kernel(optim::HostAdamKernel kernel) { kernel_ = kernel; }

 private:
  struct Group {
    int64_t begin = 0, numel = 0;
    uint64_t offset = 0;  // of its record in the file
    size_t piece = 0;     // bytes of each of its two arrays, padded
  };
  float* array(size_t buffer, const Group& g, int which) const;
  void check_tensor(const at::Tensor& t, size_t i, const char* what) const;
  // Runs `body` for sub-groups [first, last) each in its buffer, its record
  // read first when `read`, written back after body when `write_back`.
  void stream(size_t first, size_t last, const std::function<void(size_t buffer, const Group& g)>& body, bool read,
              bool write_back, const char* what) const;
  // The sub-groups tensor i's elements lie in: [first, last).
  std::pair<size_t, size_t> groups_of(size_t i) const;

  NvmeStoreOptions options_;
  std::string path_;
  std::vector<int64_t> offsets_;  // of each tensor in the range; offsets_.back() = numel_
  int64_t numel_ = 0;
  std::vector<Group> groups_;
  size_t record_bytes_ = 0;
  std::vector<AlignedBuffer> buffers_;
  std::unique_ptr<AsyncFile> file_;  // after buffers_: destroyed first, its I/O waited for
  std::vector<int64_t> steps_;
  mutable bool failed_ = false;
  optim::HostAdamKernel kernel_ = optim::HostAdamKernel::kAuto;
  NvmeStepStats last_;
};

}  // namespace remat::parallel::internal
