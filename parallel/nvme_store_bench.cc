// The NVMe optimizer store's step bandwidth (parallel/internal/
// nvme_optimizer_store.h): bytes read and written per second of an AdamW
// step over STATE_MIB of Adam moments on disk (the masters in memory), beside the host Adam
// alone over the same elements in memory (the compute the I/O overlaps).
// docs/benchmarks.md, "Disk: fio and remat's asynchronous I/O".
//
//   bazel build //parallel:nvme_store_bench
//   bazel-bin/parallel/nvme_store_bench FOLDER [STATE_MIB=384] [SUB_GROUP=4194304] [BUFFERS=4] [STEPS=5] [BACKEND=auto]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "optim/host_adam.h"
#include "parallel/internal/nvme_optimizer_store.h"

using remat::parallel::internal::NvmeOptimizerStore;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FOLDER [STATE_MIB] [SUB_GROUP] [BUFFERS] [STEPS] [BACKEND]\n", argv[0]);
    return 2;
  }
  const int64_t state_mib = argc > 2 ? std::atoll(argv[2]) : 384;
  remat::parallel::internal::NvmeStoreOptions options;
  options.folder = argv[1];
  const int64_t numel = state_mib * (1 << 20) / 8;  // 8 bytes per element on disk: exp_avg, exp_avg_sq
  options.sizes = {numel};
  options.sub_group_size = argc > 3 ? std::atoll(argv[3]) : 4194304;
  options.buffer_count = argc > 4 ? std::atoi(argv[4]) : 4;
  const int steps = argc > 5 ? std::atoi(argv[5]) : 5;
  const std::string backend = argc > 6 ? argv[6] : "auto";
  for (auto b : {remat::IoBackend::kAuto, remat::IoBackend::kIoUring, remat::IoBackend::kLibaio,
                 remat::IoBackend::kThreads}) {
    if (backend == remat::io_backend_name(b)) options.io.backend = b;
  }
  at::Tensor masters = at::randn({numel});
  const at::Tensor grads = at::randn({numel});
  masters.mutable_grad() = grads;
  const at::Tensor start_masters = masters.clone();
  NvmeOptimizerStore store(options);
  store.initialize();
  std::printf("state %lld MiB (%lld elements, file %llu bytes), sub-group %lld, %zu buffers (%llu bytes), %s\n",
              static_cast<long long>(state_mib), static_cast<long long>(numel),
              static_cast<unsigned long long>(store.file_bytes()), static_cast<long long>(options.sub_group_size),
              static_cast<size_t>(options.buffer_count), static_cast<unsigned long long>(store.host_buffer_bytes()),
              remat::io_backend_name(store.backend()));
  std::vector<double> rates;
  for (int k = 0; k < steps; ++k) {
    store.step({masters}, {});
    const auto& s = store.last_step();
    rates.push_back(s.bytes_per_second() / 1e6);
    std::printf("step %d: %.3f s, %llu B read + %llu B written, %.0f MB/s\n", k + 1, s.seconds,
                static_cast<unsigned long long>(s.bytes_read), static_cast<unsigned long long>(s.bytes_written),
                rates.back());
  }
  // The compute alone: the fused host Adam over the same elements in memory.
  at::Tensor p = start_masters.clone(), m = at::zeros_like(p), v = at::zeros_like(p);
  const auto start = std::chrono::steady_clock::now();
  for (int k = 0; k < steps; ++k) {
    remat::optim::HostAdamStep adam;
    adam.step = k + 1;
    remat::optim::host_adam_update(p.data_ptr<float>(), grads.data_ptr<float>(), m.data_ptr<float>(),
                                   v.data_ptr<float>(), p.numel(), adam);
  }
  const double adam_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  std::sort(rates.begin(), rates.end());
  std::printf("step I/O bandwidth: median %.0f MB/s (min %.0f, max %.0f); host Adam alone in memory %.3f s a step\n",
              rates[rates.size() / 2], rates.front(), rates.back(), adam_s);
  return 0;
}
