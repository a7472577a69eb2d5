// Engine::load_pretrained's time against the file's size, beside a plain
// read of the same file: rank 0 exports a model of --mb megabytes as one
// safetensors file, the file's pages are dropped from the page cache
// (posix_fadvise DONTNEED on the fsynced file: no root needed; the residency
// before each read is measured with mincore and printed), then each rank
// times load_pretrained cold and warm, and rank 0 a read() of the whole file
// cold and warm (what cat or dd do). One JSON line per measurement (rank 0).
//
//   remat-run -np 1 -- pretrained_load_bench --mb 400 --file /var/tmp/bench.safetensors
//   remat-run -np 2 -- pretrained_load_bench --stage 3 ...      # each rank reads its half
//   pretrained_load_bench --evict /var/tmp/bench.safetensors    # drop it from the cache, then exit
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"

namespace {

using remat::str;

// Blocks of square bias-free linears: about `mb` megabytes of float32.
struct WideImpl : torch::nn::Module {
  explicit WideImpl(int64_t mb) {
    constexpr int64_t kWidth = 2048;  // 16 MiB per block
    blocks = register_module("blocks", torch::nn::ModuleList());
    const int64_t n = std::max<int64_t>(1, mb * 1000 * 1000 / (kWidth * kWidth * 4));
    for (int64_t i = 0; i < n; ++i) blocks->push_back(torch::nn::Linear(torch::nn::LinearOptions(kWidth, kWidth).bias(false)));
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Wide);

// The fraction of `path`'s pages in the page cache (mincore over a mapping).
double resident(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw remat::Error(str("cannot open '", path, "'"));
  struct stat st{};
  ::fstat(fd, &st);
  void* map = ::mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) throw remat::Error(str("cannot map '", path, "'"));
  const long page = ::sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> in((st.st_size + page - 1) / page);
  ::mincore(map, st.st_size, in.data());
  ::munmap(map, st.st_size);
  int64_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return in.empty() ? 0.0 : static_cast<double>(n) / in.size();
}

// Drops the (clean, fsynced) file's pages from the page cache.
void evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw remat::Error(str("cannot open '", path, "'"));
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// What cat does: read() the whole file through a 16 MiB buffer. Seconds.
double read_all(const std::string& path) {
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY);
  std::vector<char> buffer(16 << 20);
  while (::read(fd, buffer.data(), buffer.size()) > 0) {
  }
  ::close(fd);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(int64_t mb, int stage, const std::string& file) {
  auto world = remat::Runtime::init().world(remat::Backend::kMpi);
  const bool rank0 = world->rank() == 0;
  auto layout = std::make_shared<remat::ParallelLayout>(world, remat::ParallelDims::from_world(world->size(), 1));
  Wide model(mb);
  remat::EngineOptions options;
  options.layout = layout;
  const std::string config = str(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW",
      "params": {"lr": 0.001}}, "zero_optimization": {"stage": )", stage, "}}");
  auto engine = remat::initialize(model, nlohmann::json::parse(config), options);
  engine->export_model(file);
  const int64_t bytes = static_cast<int64_t>(std::filesystem::file_size(file));
  auto report = [&](const std::string& what, double seconds, double cached, int64_t read) {
    if (!rank0) return;
    nlohmann::json line = {{"what", what}, {"ranks", world->size()}, {"stage", stage}, {"file_bytes", bytes},
                           {"rank0_bytes_read", read}, {"seconds", seconds}, {"page_cache_before", cached},
                           {"file_mb_per_s", bytes / seconds / 1e6}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  };
  for (const bool cold : {true, false}) {
    if (cold && rank0) evict(file);
    world->barrier()->wait();
    const double cached = resident(file);
    const remat::PretrainedReport r = engine->load_pretrained(file);
    report(cold ? "load_pretrained cold" : "load_pretrained warm", r.seconds, cached, r.bytes_read);
  }
  if (rank0) {
    for (const bool cold : {true, false}) {
      if (cold) evict(file);
      const double cached = resident(file);
      report(cold ? "read() cold" : "read() warm", read_all(file), cached, bytes);
    }
  }
  world->barrier()->wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Engine::load_pretrained's time against a plain read of the same safetensors file");
  int64_t mb = 400;
  int stage = 0;
  std::string file = "/var/tmp/remat_pretrained_bench.safetensors", evict_only;
  app.add_option("--mb", mb, "the model's float32 megabytes")->capture_default_str();
  app.add_option("--stage", stage, "zero_optimization.stage")->capture_default_str();
  app.add_option("--file", file, "where the export is written")->capture_default_str();
  app.add_option("--evict", evict_only, "drop this file from the page cache and exit");
  CLI11_PARSE(app, argc, argv);
  if (!evict_only.empty()) {
    evict(evict_only);
    std::printf("%s: %.1f %% in the page cache\n", evict_only.c_str(), 100 * resident(evict_only));
    return 0;
  }
  return run(mb, stage, file);
}
