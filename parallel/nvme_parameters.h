// zero_optimization.offload_param.device "nvme": stage 3's float32 parameter
// shards in one file per rank on a local disk, mapped into host memory.
//
//   auto file = std::make_shared<remat::parallel::NvmeParameterFile>(
//       remat::parallel::NvmeParameterOptions{"/local_nvme", world_rank, max_in_cpu});
//   remat::parallel::ZeroModel zero(model, blocks, dp, options, mixed, {}, file);
//
// The stage places each shard here as it flattens its units (place()): the
// first max_in_cpu elements stay in host memory, the rest live in the file
// `nvme_path`/remat-parameters/rank<R>/rank<R>.parameters, reserved on the
// disk as they are placed (a disk too small is said then, at start) and
// mapped, so that the optimizer, saves, loads and exports read and write
// them as any host tensor. The stage reads a unit's shards ahead of its
// gather (prefetch: the kernel reads them while the unit before computes) and
// drops them from this process's memory once gathered and after each step
// (release: written back to the file by the kernel), so that what the shards
// hold in memory is the units gathered, not the model. The folder is locked
// while the file lives (internal/nvme_folder.h); the file is removed when the
// object is destroyed, and one a crashed run left is removed at start.
//
// A disk error while a mapped shard is read or written (the kernel's SIGBUS)
// ends the process with a message naming the file, not a crash.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace remat::parallel {

namespace internal {
class NvmeFolder;
}

struct NvmeParameterOptions {
  std::string nvme_path;             // offload_param.nvme_path
  int rank = 0;                      // the world rank: names the folder and file
  int64_t max_in_cpu = 1000000000;   // offload_param.max_in_cpu: elements kept in host memory
};

class NvmeParameterFile {
 public:
  // Opens and locks the folder (a ConfigError naming nvme_path where it is
  // missing, not a folder, not writable or in use by another job) and makes
  // the file.
  explicit NvmeParameterFile(const NvmeParameterOptions& options);
  ~NvmeParameterFile();
  NvmeParameterFile(const NvmeParameterFile&) = delete;
  NvmeParameterFile& operator=(const NvmeParameterFile&) = delete;

  // A float32 host tensor of its own in the file holding `values` (any
  // device and floating dtype, flattened); undefined while the elements
  // placed so far are within max_in_cpu (the caller keeps that shard in host
  // memory), and where the disk cannot hold it: the first such problem is
  // kept for check(), so that a rank whose disk is full does not leave the
  // others waiting in a collective.
  at::Tensor place(const at::Tensor& values);
  // A ConfigError naming the file and the bytes when a place() could not
  // reserve its shard (ZeroModel asks on every data-parallel rank at once).
  void check() const;
  // Whether `t` (a tensor place() returned) lives in the file.
  bool on_disk(const at::Tensor& t) const;
  // The kernel asked to read `t`'s pages ahead (nothing for one in memory).
  void prefetch(const at::Tensor& t) const;
  // `t`'s pages dropped from this process's memory (written back to the file
  // by the kernel; read again when next used).
  void release(const at::Tensor& t) const;
  void release_all() const;

  // Bytes of the shards in the file (each padded to a page), and in memory.
  int64_t file_bytes() const { return file_bytes_; }
  int64_t in_cpu_bytes() const { return 4 * in_cpu_elements_; }
  const std::string& path() const { return path_; }

 private:
  struct Region {
    void* address;
    size_t bytes;
  };
  const Region* region_of(const at::Tensor& t) const;

  NvmeParameterOptions options_;
  std::unique_ptr<internal::NvmeFolder> folder_;
  std::string path_;
  int fd_ = -1;
  int64_t file_bytes_ = 0, in_cpu_elements_ = 0;
  std::string problem_;
  std::map<const void*, Region> regions_;  // by the data pointer of each shard in the file
};

}  // namespace remat::parallel
