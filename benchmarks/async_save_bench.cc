// How long a save stops the training loop, blocking vs in the background
// (train.async_save), on one GPT trained through the engine, side by side:
// rounds alternate a blocking save and a background one, each between steps
// without a save. Per save it measures the save_checkpoint call (the time the
// loop is blocked), and for a background save every step while its files are
// written and the wait (if any) to complete it, beside the median step
// without a save. Times are the slowest rank's (each rank's wall time,
// reduced by max). One JSON object per save on --out, a table on stdout.
//
//   remat-run -np 2 -- bazel-bin/benchmarks/async_save_bench --d-model 768 --layers 6 [--rounds 3]
//       [--dir /tmp/remat_async_save_bench] [--out FILE]
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/step_counters.h"
#include "models/gpt.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Flags {
  int64_t d_model = 768, layers = 6, vocab = 256, seq = 64, batch = 2, d_ff = 0;
  int rounds = 3, quiet_steps = 3, warmup = 2, stage = 2;
  std::string dir = "/tmp/remat_async_save_bench", out = "-";
};

struct Bench {
  Flags f;
  std::shared_ptr<ParallelLayout> layout;
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;
  int64_t steps = 0;

  Communicator& world() const { return *layout->world(); }

  // The slowest rank's value.
  double slowest(double ms) const {
    at::Tensor t = at::full({1}, ms, at::kDouble);
    if (world().size() > 1) world().allReduce(t, {ReduceOp::kMax})->wait();
    return t.item<double>();
  }

  // `fn`'s wall time (the slowest rank's); `cpu_ms` gets this process's CPU
  // time over it, every thread's (the background writer's included), the
  // ranks' mean.
  template <class F>
  double timed(F&& fn, double* cpu_ms = nullptr) {
    world().barrier()->wait();
    const double cpu = process_cpu_ms();
    const auto start = Clock::now();
    fn();
    const double wall = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (cpu_ms != nullptr) {
      at::Tensor t = at::full({1}, process_cpu_ms() - cpu, at::kDouble);
      if (world().size() > 1) world().allReduce(t, {ReduceOp::kAvg})->wait();
      *cpu_ms = t.item<double>();
    }
    return slowest(wall);
  }

  static double process_cpu_ms() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
  }

  void step() {
    at::Tensor idx = at::arange(f.batch * f.seq, at::kLong).view({f.batch, f.seq}).add(steps * 7).remainder(f.vocab);
    at::Tensor loss = engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); });
    engine->backward(loss);
    engine->step();
    ++steps;
  }

  // The median step without a save: wall and CPU time.
  std::pair<double, double> median_quiet_step() {
    std::vector<std::pair<double, double>> ms;
    for (int i = 0; i < f.quiet_steps; ++i) {
      double cpu = 0;
      const double wall = timed([&] { step(); }, &cpu);
      ms.emplace_back(wall, cpu);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  // Keeps only the newest step folder (the disk holds two saves at most).
  void prune() {
    world().barrier()->wait();
    if (world().rank() != 0) return;
    const std::string keep = str("step_", std::string(8 - std::min<size_t>(8, std::to_string(steps).size()), '0'), steps);
    for (const auto& e : fs::directory_iterator(f.dir)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step_", 0) == 0 && name != keep) fs::remove_all(e.path());
    }
  }

  nlohmann::json round(bool async) {
    nlohmann::json r;
    r["mode"] = async ? "async" : "blocking";
    const auto quiet = median_quiet_step();
    r["quiet_step_ms"] = quiet.first;
    r["quiet_step_cpu_ms"] = quiet.second;
    double cpu = 0;
    r["save_call_ms"] = timed([&] { engine->save_checkpoint(f.dir, {}, SaveOptions{async}); }, &cpu);
    r["save_call_cpu_ms"] = cpu;
    r["snapshot_bytes"] = Counters::read().save_snapshot_bytes;
    std::vector<double> during, during_cpu;
    int guard = 0;
    while (engine->save_pending() && guard++ < 1000) {
      during.push_back(timed([&] { step(); }, &cpu));
      during_cpu.push_back(cpu);
    }
    r["steps_during_write_ms"] = during;
    r["steps_during_write_cpu_ms"] = during_cpu;
    r["wait_ms"] = timed([&] { engine->wait_for_saves(); });
    prune();
    return r;
  }
};

int measure(const Flags& f);

int run(int argc, char** argv) {
  CLI::App app{"async_save_bench: the time a save blocks training, blocking vs in the background"};
  Flags f;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // the script's defaults, then the caller's
  app.add_option("--d-model", f.d_model);
  app.add_option("--layers", f.layers);
  app.add_option("--d-ff", f.d_ff, "0: 4 x d_model");
  app.add_option("--vocab", f.vocab);
  app.add_option("--seq", f.seq);
  app.add_option("--batch", f.batch);
  app.add_option("--stage", f.stage, "zero_optimization.stage");
  app.add_option("--rounds", f.rounds, "blocking and background saves, alternating");
  app.add_option("--quiet-steps", f.quiet_steps, "steps without a save before each save");
  app.add_option("--warmup", f.warmup);
  app.add_option("--dir", f.dir, "the save folder (emptied first, removed at the end)");
  app.add_option("--out", f.out, "JSON lines ('-': stdout)");
  CLI11_PARSE(app, argc, argv);
  if (f.d_ff == 0) f.d_ff = 4 * f.d_model;
  return measure(f);
}

int measure(const Flags& f) {
  Bench b;
  b.f = f;
  const Config config = parse_config(
      str(R"({"train_micro_batch_size_per_gpu": )", f.batch, R"(, "train": {"seed": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.0001}},
              "zero_optimization": {"stage": )", f.stage, R"(}})"),
      "<async_save_bench>");
  b.layout = init_distributed(config);
  at::set_num_threads(1);  // one intra-op thread per rank, as the default job runs
  models::GptOptions o;
  o.vocab_size = f.vocab;
  o.shape.seq_len = f.seq;
  o.shape.n_layer = static_cast<int>(f.layers);
  o.shape.n_head = 8;
  o.shape.d_model = f.d_model;
  o.shape.d_ff = f.d_ff;
  o.shape.dropout = 0.0;
  b.model = models::Gpt(o);
  EngineOptions options;
  options.layout = b.layout;
  b.engine = initialize(b.model, config, options);
  const bool rank0 = b.world().rank() == 0;
  if (rank0) {
    fs::remove_all(f.dir);
    fs::create_directories(f.dir);
  }
  b.world().barrier()->wait();
  for (int i = 0; i < f.warmup; ++i) b.step();

  std::ofstream file;
  std::ostream* out = &std::cout;
  if (f.out != "-" && rank0) {
    file.open(f.out);
    out = &file;
  }
  int64_t params = 0;
  for (const auto& p : b.model->parameters()) params += p.numel();
  if (rank0) {
    std::printf("GPT d_model %lld, %lld layers, %lld parameters; ZeRO stage %d at %d ranks\n",
                static_cast<long long>(f.d_model), static_cast<long long>(f.layers), static_cast<long long>(params),
                f.stage, b.world().size());
    std::printf("%-9s %12s %14s %12s %22s %10s\n", "save", "quiet step", "save call", "snapshot", "steps during write",
                "wait");
  }
  for (int i = 0; i < f.rounds; ++i) {
    for (bool async : {false, true}) {
      nlohmann::json r = b.round(async);
      r["parameters"] = params;
      r["ranks"] = b.world().size();
      if (!rank0) continue;
      *out << r.dump() << "\n";
      std::string during;
      for (const auto& ms : r["steps_during_write_ms"]) during += str(static_cast<int64_t>(ms.get<double>()), " ");
      std::printf("%-9s %9.0f ms %11.0f ms %9.1f MB %22s %7.0f ms\n", r["mode"].get<std::string>().c_str(),
                  r["quiet_step_ms"].get<double>(), r["save_call_ms"].get<double>(),
                  r["snapshot_bytes"].get<int64_t>() / 1e6, during.empty() ? "-" : during.c_str(),
                  r["wait_ms"].get<double>());
      std::fflush(stdout);
    }
  }
  b.world().barrier()->wait();
  if (rank0) fs::remove_all(f.dir);
  return 0;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::run(argc, argv); });
}
