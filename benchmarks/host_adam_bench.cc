// The fused host AdamW (optim/host_adam.h) against LibTorch's AdamW on the
// same host tensors: one float32 parameter of each size with its gradient,
// both optimizers stepped alternately (interleaved repetitions, so drift in
// the machine's load hits both), after warm-up steps that create the state.
//
//   host_adam_bench [--sizes 1M,10M,50M] [-w 2] [-n 9] [--threads 0] [--markdown]
//
// libtorch_ms and host_ms are the medians of the timed steps, spread the
// (max - min) / median of each; speedup = libtorch_ms / host_ms; host_GB/s
// counts the 28 bytes per element the fused loop moves (p, g, m, v read;
// p, m, v written). #wrong counts parameter elements whose bits differ
// between the two optimizers after every step (0: the same numbers).
// --markdown prints the same table as docs/benchmarks.md shows it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "optim/host_adam.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace {

int64_t parse_count(const std::string& text) {
  size_t used = 0;
  const double value = std::stod(text, &used);
  const std::string unit = text.substr(used);
  const double scale = unit.empty() ? 1 : unit == "K" ? 1e3 : unit == "M" ? 1e6 : -1;
  if (scale < 0 || value <= 0) {
    throw remat::ConfigError("size '" + text + "': use a positive number with K or M (1M = 10^6)");
  }
  return static_cast<int64_t>(value * scale);
}

struct Stats {
  double median_ms, spread;
};

Stats stats(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  return {median, (ms.back() - ms.front()) / median};
}

template <typename Fn>
double time_ms(Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

const char* kColumns[] = {"params", "libtorch_ms", "spread", "host_ms", "spread", "speedup",
                          "host_GB/s", "#wrong"};

void print_header(bool markdown) {
  if (markdown) {
    for (const char* column : kColumns) std::printf("| %s ", column);
    std::printf("|\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  } else {
    std::printf("%12s %12s %8s %10s %8s %8s %9s %7s\n", kColumns[0], kColumns[1], kColumns[2],
                kColumns[3], kColumns[4], kColumns[5], kColumns[6], kColumns[7]);
  }
}

// One parameter of `n` elements stepped by LibTorch's AdamW and by HostAdamW.
void bench_size(int64_t n, int warmup, int iters, bool markdown) {
  const auto options = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  at::Tensor ref = at::randn({n}), host = ref.clone();
  ref.mutable_grad() = at::randn({n});
  host.mutable_grad() = ref.grad().clone();
  torch::optim::AdamW libtorch({ref}, options);
  remat::optim::HostAdamW fused({host}, options);
  for (int i = 0; i < warmup; ++i) {
    libtorch.step();
    fused.step();
  }
  std::vector<double> libtorch_ms, host_ms;
  for (int i = 0; i < iters; ++i) {
    libtorch_ms.push_back(time_ms([&] { libtorch.step(); }));
    host_ms.push_back(time_ms([&] { fused.step(); }));
  }
  const int64_t wrong = ref.ne(host).sum().item<int64_t>();
  const Stats l = stats(libtorch_ms), h = stats(host_ms);
  const double gbps = 28.0 * n / (h.median_ms * 1e-3) / 1e9;
  const char* format = markdown ? "| %lld | %.3f | %.1f%% | %.3f | %.1f%% | %.2fx | %.1f | %lld |\n"
                                : "%12lld %12.3f %7.1f%% %10.3f %7.1f%% %7.2fx %9.1f %7lld\n";
  std::printf(format, static_cast<long long>(n), l.median_ms, 100 * l.spread, h.median_ms,
              100 * h.spread, l.median_ms / h.median_ms, gbps, static_cast<long long>(wrong));
}

int bench(int argc, char** argv) {
  CLI::App app{"host_adam_bench: the fused host AdamW against LibTorch's AdamW"};
  std::string sizes = "1M,10M,50M";
  int warmup = 2, iters = 9, threads = 0;
  bool markdown = false;
  app.add_option("--sizes", sizes, "parameter elements, comma-separated (K, M)");
  app.add_option("-w,--warmup_iters", warmup, "untimed steps of each")->check(CLI::PositiveNumber);
  app.add_option("-n,--iters", iters, "timed steps of each, interleaved")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--markdown", markdown, "print the table in Markdown");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (threads > 0) at::set_num_threads(threads);

  std::printf("# LibTorch %s, %d threads, host kernel %s; median of %d interleaved steps each\n",
              remat::compat::torch_version(), at::get_num_threads(),
              remat::optim::kernel_name(remat::optim::auto_kernel()), iters);
  print_header(markdown);
  std::stringstream list(sizes);
  for (std::string item; std::getline(list, item, ',');) {
    bench_size(parse_count(item), warmup, iters, markdown);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return bench(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "host_adam_bench: %s\n", e.what());
    return 1;
  }
}
