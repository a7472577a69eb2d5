// Float32 host tensors that live in a file on a local disk, one per rank,
// mapped into memory: offload_param.device "nvme" keeps stage 3's parameter
// shards there, offload_optimizer.device "nvme" the optimizer's float32
// masters (the Adam moments are parallel/nvme_optimizer.h's).
//
//   auto file = std::make_shared<remat::parallel::NvmeTensorFile>(
//       remat::parallel::NvmeTensorFileOptions{"/local_nvme", world_rank, max_in_cpu, "offload_param"});
//   remat::parallel::ZeroModel zero(model, blocks, dp, options, mixed, {}, {file, nullptr});
//
// ZeroModel places each tensor here as it makes it (place()): the first
// max_in_cpu elements stay in host memory, the rest live in the file
// `nvme_path`/remat-<kind>/rank<R>/rank<R>.<kind> (kind "parameters" or
// "masters"), reserved on the disk as they are placed (a disk too small is
// known then, at start) and mapped, so that the optimizer, saves, loads and
// exports read and write them as any host tensor. The stage reads a unit's
// shards ahead of its gather (prefetch: the kernel reads them while the unit
// before computes) and drops tensors from this process's memory once used
// (release: written back to the file by the kernel), so that what they hold
// in memory is what is in use, not the model. The folder is locked while the
// file lives (internal/nvme_folder.h); the file is removed when the object
// is destroyed, and one a crashed run left is removed at start.
//
// A disk error while a mapped tensor is read or written (the kernel's SIGBUS)
// ends the process with exit 1 and a message naming the file, not a crash.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace remat {
class Communicator;
}

namespace remat::parallel {

namespace internal {
class NvmeFolder;
}

struct NvmeTensorFileOptions {
  std::string nvme_path;    // the section's nvme_path
  int rank = 0;             // the world rank: names the folder and file
  int64_t max_in_cpu = 0;   // elements kept in host memory (offload_param.max_in_cpu)
  // "offload_param" (the parameter shards, kind "parameters") or
  // "offload_optimizer" (the float32 masters, kind "masters").
  std::string section = "offload_param";
  int world_size = 0;       // the job's ranks: rank 0 sweeps a larger crashed run's files (0: not)
};

class NvmeTensorFile {
 public:
  // Opens and locks the folder (a ConfigError naming nvme_path where it is
  // missing, not a folder, not writable or in use by another job) and makes
  // the file.
  explicit NvmeTensorFile(const NvmeTensorFileOptions& options);
  ~NvmeTensorFile();
  NvmeTensorFile(const NvmeTensorFile&) = delete;
  NvmeTensorFile& operator=(const NvmeTensorFile&) = delete;

  // A float32 host tensor of its own in the file holding `values` (any
  // device and floating dtype, flattened), laid after the last one (64-byte
  // aligned: tensors share pages, none padded to one); undefined while the
  // elements placed so far are within max_in_cpu, and where the disk cannot
  // hold it: the caller then keeps that one in host memory. The first such
  // disk problem is kept for check(), so that a rank whose disk is full does
  // not leave the others waiting in a collective.
  at::Tensor place(const at::Tensor& values);
  // A ConfigError naming the file, the bytes reserved when the disk refused
  // and the bytes the tensors past max_in_cpu need there in all, when a
  // place() could not reserve its tensor (ZeroModel asks on every rank of
  // NvmeFiles::ranks at once).
  void check() const;
  // Whether `t` (a tensor place() returned) lives in the file.
  bool on_disk(const at::Tensor& t) const;
  // The kernel asked to read `t`'s pages ahead (nothing for one in memory).
  void prefetch(const at::Tensor& t) const;
  // `t`'s pages dropped from this process's memory (written back to the file
  // by the kernel; read again when next used; a neighbour sharing its first
  // or last page is read again too).
  void release(const at::Tensor& t) const;
  void release_all() const;

  // Bytes of the file (the tensors in it, up to the page), and in memory.
  int64_t file_bytes() const { return file_bytes_; }
  int64_t in_cpu_bytes() const { return 4 * in_cpu_elements_; }
  const std::string& path() const { return path_; }

 private:
  struct Mapping;  // the address range the file is mapped into, shared with the tensors in it
  // [begin, end) of `t`'s pages when `t` lies in the file, else {0, 0}.
  std::pair<char*, size_t> pages_of(const at::Tensor& t) const;

  NvmeTensorFileOptions options_;
  std::unique_ptr<internal::NvmeFolder> folder_;
  std::string path_;
  int fd_ = -1;
  std::shared_ptr<Mapping> mapping_;
  int64_t end_ = 0;  // bytes placed
  int64_t file_bytes_ = 0, in_cpu_elements_ = 0;
  // Where the tensors past max_in_cpu end in the file, counted on after a
  // problem so that check() says the whole; why the disk refused.
  int64_t needed_end_ = 0;
  std::string reserve_error_;
};

// The files of ZeRO-Infinity's NVMe offload (above),
// opened by the caller so that a folder problem is known on every rank
// before any collective: offload_param "nvme"'s parameter shards (stage 3),
// and offload_optimizer "nvme"'s float32 masters (stages 1-3; none are made
// where offload_param's shards are the masters already).
struct NvmeFiles {
  std::shared_ptr<NvmeTensorFile> parameters, masters;
  // The ranks that stop together when one cannot place its tensors
  // (ZeroModel agrees on check() over them): every rank of the job, which
  // tensor parallelism makes more than the data-parallel group; null:
  // ZeroModel's data-parallel group.
  std::shared_ptr<Communicator> ranks;
};

}  // namespace remat::parallel
