// Sequential write and read bandwidth of one file through remat's AsyncFile
// (runtime/async_io.h), for each backend and block size: what
// benchmarks/disk_bandwidth.sh puts beside fio's on the same folder.
//
//   aio_bench --dir /var/tmp [--size-mib 1024] [--block-kib 1024,256]
//             [--backends io_uring,libaio,threads] [--queue-depth 8] [--buffer-mib 64] [-n 3]
//
// The file is reserved first (posix_fallocate, as fio's default
// fallocate=native), then written and read whole, front to back, through a pool
// of 4 aligned buffers of --buffer-mib (DeepSpeed's buffer_count and
// buffer_size), up to 4 requests in flight, each split into block-size pieces
// with queue_depth in flight: how the optimizer step will stream its state.
// Prints one row per backend, block size and direction: MB/s (10^6 bytes/s,
// fio's unit) as the median of -n runs, and the spread (max - min) / median.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/async_io.h"
#include "runtime/error.h"

namespace {

using remat::IoBackend;

IoBackend backend_named(const std::string& name) {
  for (IoBackend b : {IoBackend::kIoUring, IoBackend::kLibaio, IoBackend::kThreads}) {
    if (name == remat::io_backend_name(b)) return b;
  }
  throw remat::ConfigError("--backends: '" + name + "' is not io_uring, libaio or threads");
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part);
  return parts;
}

struct Run {
  std::string dir;
  uint64_t size = 1ull << 30;
  size_t buffer = 64 << 20;
  int queue_depth = 8;
  int repeats = 3;
};

// Seconds to move the whole file one way, `in_flight` buffer-sized requests at a time.
double stream(remat::AsyncFile& file, remat::BufferPool& pool, bool write) {
  const auto start = std::chrono::steady_clock::now();
  std::deque<std::pair<remat::IoRequest, remat::BufferPool::Lease>> flying;
  for (uint64_t offset = 0; offset < file.size(); offset += pool.buffer_size()) {
    if (flying.size() == pool.count()) {
      flying.front().first.wait();
      flying.pop_front();
    }
    remat::BufferPool::Lease lease = pool.acquire();
    const size_t bytes = static_cast<size_t>(std::min<uint64_t>(pool.buffer_size(), file.size() - offset));
    remat::IoRequest request = write ? file.write(offset, lease.data(), bytes) : file.read(offset, lease.data(), bytes);
    flying.emplace_back(std::move(request), std::move(lease));
  }
  while (!flying.empty()) {
    flying.front().first.wait();
    flying.pop_front();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void measure(const Run& run, IoBackend backend, size_t block, remat::BufferPool& pool) {
  remat::AsyncIoOptions options;
  options.backend = backend;
  options.direct = remat::DirectIo::kRequired;
  options.block_size = block;
  options.queue_depth = run.queue_depth;
  options.preallocate = true;
  const std::string path = run.dir + "/remat_aio_bench.bin";
  for (bool write : {true, false}) {
    std::vector<double> rates;
    for (int r = 0; r < run.repeats; ++r) {
      remat::AsyncFile file(path, run.size, options);
      rates.push_back(static_cast<double>(run.size) / 1e6 / stream(file, pool, write));
    }
    std::sort(rates.begin(), rates.end());
    const double median = rates[rates.size() / 2];
    std::printf("%-9s %10zu %-6s %10.0f %7.3f\n", remat::io_backend_name(backend), block,
                write ? "write" : "read", median, (rates.back() - rates.front()) / median);
    std::fflush(stdout);
  }
  std::remove(path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Sequential bandwidth through remat's AsyncFile"};
  Run run;
  uint64_t size_mib = 1024, buffer_mib = 64;
  std::string blocks = "1024,256", backends = "io_uring,libaio,threads";
  app.add_option("--dir", run.dir, "folder to write the test file in")->required();
  app.add_option("--size-mib", size_mib, "file size in MiB");
  app.add_option("--block-kib", blocks, "block sizes in KiB, comma-separated");
  app.add_option("--backends", backends, "backends, comma-separated");
  app.add_option("--queue-depth", run.queue_depth, "aio.queue_depth");
  app.add_option("--buffer-mib", buffer_mib, "each of the 4 pool buffers, MiB");
  app.add_option("-n", run.repeats, "runs per row (the median is shown)");
  CLI11_PARSE(app, argc, argv);
  try {
    run.size = size_mib << 20;
    run.buffer = buffer_mib << 20;
    const remat::DirectIoSupport direct = remat::probe_direct_io(run.dir);
    if (!direct.supported) throw remat::ConfigError("aio_bench measures direct I/O: " + direct.reason);
    remat::BufferPool pool(4, run.buffer);
    std::memset(pool.acquire().data(), 0x5a, run.buffer);  // touched, so the first run pays no page faults
    {
      remat::AsyncFile probe(run.dir + "/remat_aio_bench.bin", 4096);
      std::printf("# direct I/O in %s: works; auto backend: %s\n", run.dir.c_str(), probe.backend_reason().c_str());
    }
    std::printf("%-9s %10s %-6s %10s %7s\n", "backend", "block", "op", "MB/s", "spread");
    for (const std::string& name : split(backends)) {
      for (const std::string& kib : split(blocks)) measure(run, backend_named(name), std::stoul(kib) << 10, pool);
    }
  } catch (const remat::Error& e) {
    std::fprintf(stderr, "aio_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
