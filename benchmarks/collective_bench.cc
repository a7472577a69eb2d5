// Collective benchmark with nccl-tests' columns, over the MPI backend (and
// NCCL when built with CUDA and run on GPUs).
//
//   mpirun -np 4 collective_bench [--op all|allreduce|allgather|reducescatter]
//                                 [-b 8] [-e 64M] [-f 2] [-w 5] [-n 20] [--backend mpi]
//
// size is the bytes of the larger buffer (nccl-tests' convention), time_us the
// mean over the timed iterations (the slowest rank), algbw = size / time,
// busbw = algbw x 2(n-1)/n for all-reduce and (n-1)/n for all-gather and
// reduce-scatter. #wrong counts elements that differ from the closed-form result.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/runtime.h"

namespace {

int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double value = std::stod(text, &used);
  std::string unit = text.substr(used);
  double scale = unit.empty() ? 1 : unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20
                                  : unit == "G" ? 1 << 30 : -1;
  if (scale < 0) throw remat::ConfigError("size '" + text + "': use a number with K, M or G");
  return static_cast<int64_t>(value * scale);
}

struct Result {
  double time_us;
  int64_t wrong;
};

// collective_bench's flags as given (nccl-tests' short names).
struct CollectiveFlags {
  std::string op = "all", min_size = "8", max_size = "64M", backend = "auto";
  int factor = 2, warmup = 5, iters = 20;
};

void add_flags(CLI::App& app, CollectiveFlags& f) {
  app.add_option("--op", f.op, "allreduce, allgather, reducescatter or all")
      ->check(CLI::IsMember({"all", "allreduce", "allgather", "reducescatter"}));
  app.add_option("-b,--minbytes", f.min_size, "smallest size (bytes, K, M, G)");
  app.add_option("-e,--maxbytes", f.max_size, "largest size");
  app.add_option("-f,--stepfactor", f.factor, "size multiplier")->check(CLI::Range(2, 1024));
  app.add_option("-w,--warmup_iters", f.warmup, "untimed iterations")->check(CLI::NonNegativeNumber);
  app.add_option("-n,--iters", f.iters, "timed iterations")->check(CLI::PositiveNumber);
  app.add_option("--backend", f.backend, "auto, mpi or nccl");
}

// The communicator measured and its tensors' place.
struct Bench {
  const CollectiveFlags& flags;
  remat::Communicator& world;
  at::TensorOptions options;
  int n, r;
};

constexpr int64_t kElem = 4;  // bytes of a float32

// Elements of the larger buffer for `bytes`: divisible by n, at least n.
int64_t count_of(const Bench& b, int64_t bytes) {
  return std::max<int64_t>(bytes / kElem / b.n, 1) * b.n;
}

// One collective at one size: checked once against its closed form, then
// timed (the slowest rank's mean, and the wrong elements of any rank).
Result run(const Bench& b, const std::string& name, int64_t bytes) {
  const int n = b.n, r = b.r;
  remat::Communicator& world = b.world;
  int64_t count = count_of(b, bytes);
  at::Tensor big = at::empty({count}, b.options), small = at::empty({count / n}, b.options);
  auto fill = [&] {
    if (name == "allreduce") big.fill_(r + 1);
    if (name == "allgather") small.fill_(r + 1);
    if (name == "reducescatter") big.fill_(r + 1);
  };
  auto once = [&] {
    if (name == "allreduce") world.allReduce(big)->wait();
    if (name == "allgather") world.allGather(big, small)->wait();
    if (name == "reducescatter") world.reduceScatter(small, big)->wait();
  };
  fill();
  once();
  int64_t wrong = 0;
  if (name == "allreduce") wrong = big.ne(n * (n + 1) / 2.0).sum().item<int64_t>();
  if (name == "reducescatter") wrong = small.ne(n * (n + 1) / 2.0).sum().item<int64_t>();
  if (name == "allgather") {
    at::Tensor expected = at::arange(1, n + 1, b.options).repeat_interleave(count / n);
    wrong = big.ne(expected).sum().item<int64_t>();
  }
  for (int i = 0; i < b.flags.warmup; ++i) once();
  world.barrier()->wait();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < b.flags.iters; ++i) once();
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                  .count() / b.flags.iters;
  at::Tensor stats = at::tensor({us, static_cast<double>(wrong)}, at::kDouble).to(b.options.device());
  world.allReduce(stats, {remat::ReduceOp::kMax})->wait();
  stats = stats.cpu();
  return {stats[0].item<double>(), stats[1].item<int64_t>()};
}

// Rank 0's header of one collective's table.
void print_header(const std::string& name) {
  std::printf("#\n# %s\n# %12s %12s %8s %6s %12s %10s %10s %8s\n", name.c_str(), "size(B)",
              "count", "type", "redop", "time_us", "algbw", "busbw", "#wrong");
  std::printf("# %12s %12s %8s %6s %12s %10s %10s %8s\n", "", "(elements)", "", "", "",
              "(GB/s)", "(GB/s)", "");
}

// Rank 0's row of one size.
void print_row(const Bench& b, const std::string& name, int64_t bytes, const Result& res) {
  double bus = name == "allreduce" ? 2.0 * (b.n - 1) / b.n : static_cast<double>(b.n - 1) / b.n;
  int64_t count = count_of(b, bytes);
  double size = static_cast<double>(count * kElem);
  double algbw = size / (res.time_us * 1e-6) / 1e9;
  std::printf("  %12.0f %12lld %8s %6s %12.2f %10.3f %10.3f %8lld\n", size,
              static_cast<long long>(count), "float",
              name == "allgather" ? "none" : "sum", res.time_us, algbw, algbw * bus,
              static_cast<long long>(res.wrong));
}

int bench(int argc, char** argv) {
  CLI::App app{"collective_bench: nccl-tests style timings of remat's communicators"};
  CollectiveFlags flags;
  add_flags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto world = remat::Runtime::init().world(remat::parse_backend(flags.backend));
  const Bench b{flags, *world,
                at::TensorOptions().dtype(at::kFloat).device(world->backendName() == "nccl" ? at::kCUDA : at::kCPU),
                world->size(), world->rank()};
  std::vector<std::string> ops = flags.op == "all"
      ? std::vector<std::string>{"allreduce", "allgather", "reducescatter"}
      : std::vector<std::string>{flags.op};
  if (b.r == 0) {
    std::printf("# remat collective_bench: backend %s, %d ranks, float32, %d warm-up + %d timed "
                "iterations\n", world->backendName().c_str(), b.n, flags.warmup, flags.iters);
  }
  for (const auto& name : ops) {
    if (b.r == 0) print_header(name);
    for (int64_t bytes = parse_size(flags.min_size); bytes <= parse_size(flags.max_size); bytes *= flags.factor) {
      Result res = run(b, name, bytes);
      if (b.r == 0) print_row(b, name, bytes, res);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return remat::run_main([&] { return bench(argc, argv); });
}
