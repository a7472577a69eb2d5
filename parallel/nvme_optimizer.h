// zero_optimization.offload_optimizer.device "nvme": AdamW and Adam whose
// moments live in a file on a local disk, one per rank, streamed through a
// few host buffers at each step (parallel/internal/nvme_optimizer_store.h).
// The float32 masters it steps are ZeroModel's, mapped from a file of their
// own (parallel/nvme_tensor_file.h, given to ZeroModel as NvmeFiles::masters),
// and their gradients stay in host memory: of the 16 bytes per parameter the
// host holds with "cpu", 12 go to disk (masters 4, moments 8). Steps, saves
// and loads are bitwise those of device "cpu".
//
//   auto optimizer = remat::parallel::make_nvme_optimizer(config.optimizer, zero.parameters(),
//                                                         {"/local_nvme", rank, sub_group, 4, aio});
//
// Each rank works in `nvme_path`/remat-optimizer/rank<R>/, holding an
// exclusive lock on its `lock` file while the optimizer lives: a second job
// given the same nvme_path is refused at start (naming the folder), and a
// file a crashed run left there is removed (its lock died with it) and said.
// The state file is removed when the optimizer is destroyed.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optim/options.h"
#include "runtime/async_io_options.h"

namespace remat::parallel {

struct NvmeOptimizerOptions {
  std::string nvme_path;                // offload_optimizer.nvme_path
  int rank = 0;                         // the world rank: names the folder and file
  int world_size = 0;                   // the job's ranks: rank 0 sweeps a larger crashed run's files (0: not)
  int64_t sub_group_size = 1000000000;  // zero_optimization.sub_group_size
  int buffer_count = 4;                 // offload_optimizer.buffer_count
  AsyncIoOptions io;                    // the aio section
};

// What the NVMe state took in its last step, for the meter.
struct NvmeOptimizerStats {
  int64_t file_bytes = 0;    // on disk (the moments, padded to the I/O alignment)
  int64_t buffer_bytes = 0;  // host buffers the state streams through
  int64_t bytes_read = 0, bytes_written = 0;  // by the last step
  double seconds = 0;                         // of the last step
};

// AdamW or Adam (options.type) over `params` (offload_optimizer's float32
// host masters; frozen ones are handed through and never stepped) with the
// moments on disk. SGD, and amsgrad, are a ConfigError saying what to change.
std::unique_ptr<torch::optim::Optimizer> make_nvme_optimizer(const optim::OptimizerOptions& options,
                                                             std::vector<at::Tensor> params,
                                                             const NvmeOptimizerOptions& nvme);

// The optimizer's NVMe figures; none for another optimizer.
std::optional<NvmeOptimizerStats> nvme_optimizer_stats(const torch::optim::Optimizer& optimizer);

}  // namespace remat::parallel
