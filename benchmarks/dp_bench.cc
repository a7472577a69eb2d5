// The GPT of models/gpt.cc trained data parallel through remat's Engine at one
// ZeRO stage, for the side-by-side with PyTorch's DDP and
// ZeroRedundancyOptimizer (benchmarks/torch_ddp.py writes the same fields;
// benchmarks/dp_bench.sh runs both, benchmarks/dp_report.py tabulates).
//
//   bazel-bin/launch/remat-run -np 2 -- bazel-bin/benchmarks/dp_bench --stage 1 --overlap-comm true
//       --bucket 250000 --steps 5 --warmup 2 --out rows.jsonl   (one command line)
//
// Each rank runs three phases, one after the other, every step started after a
// barrier so the ranks enter it together:
//   1. the engine's steps (forward, backward, optimizer step; wall time) with
//      the peak RSS growth over them (VmHWM after the steps minus VmRSS before,
//      the high-water mark reset through /proc/self/clear_refs);
//   2. the same step on a second copy of the model with no communication at
//      all (forward, backward, LibTorch's AdamW, gradients zeroed): local_step_ms;
//   3. one blocking all-reduce of a flat buffer as large as all gradients, in
//      buckets of --bucket elements one after the other: reduce_ms.
// Rank 0 writes one JSON line per measured step of phase 1; local_step_ms is
// the same-numbered step of phase 2, reduce_ms the median over phase 3's
// repetitions.
//
// --engine-only runs phase 1 alone, for the engine's own configurations
// (benchmarks/bf16_bench.sh on the CPU, benchmarks/gpu_bench.sh's MFU rows on
// a GPU): --bf16 (bf16.enabled: float32 masters, bf16 compute copies),
// --checkpointing (activation_checkpointing.variant), --device cuda (the
// engine places the model on the first GPU; the device synchronised before
// each clock read). fwd_bwd_ms is the forward and backward, step_ms adds the
// optimizer step; mem_peak_bytes counts every byte allocated since before the
// model was built (parameters, masters and bf16 copies, gradients, optimizer
// state, activations), the step's peak.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "models/gpt.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A field of /proc/self/status in bytes (VmRSS, VmHWM; the kernel writes kB).
int64_t proc_status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  throw Error(str("dp_bench: no ", field, " in /proc/self/status"));
}

// Resets VmHWM to the current RSS (Linux 4.0 and later).
void reset_rss_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// dp_bench's flags as given, the model's shape among them.
struct DpFlags {
  models::GptOptions model = default_model();
  int64_t batch = 4, seed = 1234, bucket = 250000;
  int stage = 0, steps = 5, warmup = 2, reduce_reps = 5;
  bool overlap = false, bf16 = false, engine_only = false;
  std::string out_path = "-", checkpointing = "none", device_name = "cpu";

  static models::GptOptions default_model() {
    models::GptOptions o;
    o.vocab_size = 128;
    o.shape.n_layer = 8;
    o.shape.seq_len = 64;
    o.shape.d_model = 128;
    o.shape.n_head = 4;
    o.shape.d_ff = 512;
    o.shape.dropout = 0.1;
    return o;
  }
};

void add_flags(CLI::App& app, DpFlags& f) {
  models::GptOptions& o = f.model;
  app.add_option("--layers", o.shape.n_layer)->check(CLI::PositiveNumber);
  app.add_option("--batch", f.batch, "sequences per rank")->check(CLI::PositiveNumber);
  app.add_option("--seq", o.shape.seq_len)->check(CLI::PositiveNumber);
  app.add_option("--d-model", o.shape.d_model)->check(CLI::PositiveNumber);
  app.add_option("--heads", o.shape.n_head)->check(CLI::PositiveNumber);
  app.add_option("--d-ff", o.shape.d_ff)->check(CLI::PositiveNumber);
  app.add_option("--vocab", o.vocab_size)->check(CLI::PositiveNumber);
  app.add_option("--dropout", o.shape.dropout);
  app.add_option("--seed", f.seed);
  app.add_option("--stage", f.stage, "zero_optimization.stage")->check(CLI::Range(0, 3));
  app.add_option("--overlap-comm", f.overlap, "zero_optimization.overlap_comm (true/false)");
  app.add_option("--bucket", f.bucket, "zero_optimization.reduce_bucket_size (elements)")->check(CLI::PositiveNumber);
  app.add_option("--steps", f.steps, "measured steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", f.warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--reduce-reps", f.reduce_reps, "repetitions of the blocking all-reduce")->check(CLI::PositiveNumber);
  app.add_option("--out", f.out_path, "JSON lines (appended); - for stdout");
  app.add_flag("--bf16", f.bf16, "bf16.enabled: float32 masters, bf16 compute");
  app.add_option("--checkpointing", f.checkpointing, "activation_checkpointing.variant (none, full, ...)");
  app.add_option("--device", f.device_name, "cpu, or cuda: the first GPU (with --engine-only)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--engine-only", f.engine_only,
               "the engine's steps alone (no local step, no blocking all-reduce); memory counted from the model's "
               "construction on");
}

void check_device(const DpFlags& f) {
  if (f.device_name == "cuda" && !f.engine_only) {
    throw ConfigError(
        "dp_bench --device cuda: the local step and the all-reduce phases run on the CPU; add --engine-only");
  }
  if (f.device_name == "cuda" && !torch::cuda::is_available()) {
    throw ConfigError("dp_bench --device cuda: no CUDA device visible to this LibTorch (a CPU-only build, or no GPU); "
                      "run with --device cpu");
  }
}

// The engine's configuration (the same keys as benchmarks/torch_ddp.py's settings).
nlohmann::json engine_config(const DpFlags& f) {
  nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", f.batch},
      {"gradient_accumulation_steps", 1},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
      {"zero_optimization",
       {{"stage", f.stage},
        {"overlap_comm", f.overlap},
        {"reduce_bucket_size", f.bucket},
        {"allgather_bucket_size", f.bucket},
        // Stage 3 shards every parameter: at the default threshold (1e5
        // elements) this model's would all stay whole and be all-reduced.
        {"stage3_param_persistence_threshold", 0}}},
      {"activation_checkpointing", {{"variant", f.checkpointing}}},
      {"train", {{"seed", f.seed}}}};
  if (f.bf16) config["bf16"] = {{"enabled", true}};
  return config;
}

// What the three phases share: the layout, the two models, one batch, the engine.
struct DpRun {
  DpFlags flags;
  std::shared_ptr<ParallelLayout> layout;
  models::Gpt model{nullptr}, local{nullptr};
  int64_t numel = 0;
  at::Tensor idx, targets;
  std::unique_ptr<Engine> engine;

  void barrier() const { layout->dp_group()->barrier()->wait(); }
  // Kernels run asynchronously on a GPU: every clock read waits for them.
  void sync() const {
    if (flags.device_name == "cuda") torch::cuda::synchronize();
  }
};

// Two models with the same weights (torch_gpt.py's Gpt after
// torch.manual_seed(seed) too): the engine's, and a plain copy for phase 2
// (none with --engine-only); this rank's batch; the engine.
void set_up(DpRun& run, std::optional<MemoryTracker>& memory) {
  const DpFlags& f = run.flags;
  at::manual_seed(static_cast<uint64_t>(f.seed));
  run.model = models::Gpt(f.model);
  at::manual_seed(static_cast<uint64_t>(f.seed));
  run.local = f.engine_only ? models::Gpt(nullptr) : models::Gpt(f.model);
  run.model->train();
  if (!f.engine_only) run.local->train();
  for (const auto& p : run.model->parameters()) run.numel += p.numel();
  at::Generator data = at::detail::createCPUGenerator(static_cast<uint64_t>(f.seed + 1 + run.layout->dp_rank()));
  run.idx = at::randint(f.model.vocab_size, {f.batch, f.model.shape.seq_len}, data, at::kLong);
  run.targets = run.idx.roll(-1, 1);

  const nlohmann::json config = engine_config(f);
  EngineOptions options;
  options.layout = run.layout;
  options.device = f.device_name;
  if (memory) options.memory = &*memory;
  run.engine = initialize(run.model, config, options);
  run.idx = run.engine->to_device(run.idx);
  run.targets = run.engine->to_device(run.targets);
}

struct Step {
  double ms, fwd_bwd_ms, loss;
  StepMetrics metrics;
};

// Phase 1's measured steps and the peak RSS over all its steps.
struct EnginePhase {
  std::vector<Step> measured;
  int64_t rss_before = 0, rss_peak = 0;
};

// Phase 1: the engine's steps.
EnginePhase engine_steps(DpRun& run) {
  const DpFlags& f = run.flags;
  Engine& engine = *run.engine;
  EnginePhase phase;
  run.barrier();
  reset_rss_peak();
  phase.rss_before = proc_status_bytes("VmRSS");
  for (int s = 0; s < f.warmup + f.steps; ++s) {
    run.barrier();
    run.sync();
    const auto t0 = Clock::now();
    at::Tensor loss = engine.forward([&] { return run.model->loss(run.idx, run.targets); });
    engine.backward(loss);
    run.sync();
    const double fwd_bwd_ms = ms_since(t0);
    engine.step();
    run.sync();
    const double ms = ms_since(t0);
    if (s >= f.warmup) phase.measured.push_back({ms, fwd_bwd_ms, loss.item<double>(), engine.last_metrics()});
  }
  phase.rss_peak = proc_status_bytes("VmHWM");
  return phase;
}

// Phase 2: the same step with no data-parallel communication.
std::vector<double> local_steps(DpRun& run) {
  const DpFlags& f = run.flags;
  std::vector<double> local_ms;
  torch::optim::AdamW adamw(run.local->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  for (int s = 0; s < f.warmup + f.steps; ++s) {
    run.barrier();
    const auto t0 = Clock::now();
    at::Tensor loss = run.local->loss(run.idx, run.targets);
    loss.backward();
    adamw.step();
    for (auto& p : run.local->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    if (s >= f.warmup) local_ms.push_back(ms_since(t0));
  }
  return local_ms;
}

// Phase 3: every gradient all-reduced once, bucket after bucket, blocking.
std::vector<double> blocking_reduces(DpRun& run) {
  const DpFlags& f = run.flags;
  const auto& dp = run.layout->dp_group();
  std::vector<double> reduce_ms;
  at::Tensor flat = at::ones({run.numel}, at::kFloat);
  for (int r = 0; r < 1 + f.reduce_reps; ++r) {
    run.barrier();
    const auto t0 = Clock::now();
    for (int64_t off = 0; off < run.numel; off += f.bucket) {
      at::Tensor b = flat.narrow(0, off, std::min(f.bucket, run.numel - off));
      dp->allReduce(b)->wait();
    }
    if (r > 0) reduce_ms.push_back(ms_since(t0));
  }
  return reduce_ms;
}

// Rank 0's line for measured step `s`.
nlohmann::json step_row(const DpRun& run, const EnginePhase& phase, const std::vector<double>& local_ms,
                        const std::vector<double>& reduce_ms, size_t s) {
  const DpFlags& f = run.flags;
  const models::GptOptions& o = f.model;
  const int n = run.layout->dp_group()->size();
  const StepMetrics& m = phase.measured[s].metrics;
  nlohmann::json j = {{"framework", "remat"},
                      {"mode", str("stage", f.stage, f.overlap ? "_overlap" : "")},
                      {"world", n},
                      {"stage", f.stage},
                      {"overlap", f.overlap},
                      {"bucket", f.bucket},
                      {"layers", o.shape.n_layer},
                      {"dropout", o.shape.dropout},
                      {"step", s},
                      {"step_ms", phase.measured[s].ms},
                      {"loss", phase.measured[s].loss},
                      {"params", run.numel},
                      // The ZeRO collectives' bytes as the engine counts them
                      // (parallel/zero.h: all-reduce 2x its bytes, reduce-scatter
                      // its input, all-gather its output), and what a ring
                      // sends of those per rank: (N-1)/N of each count.
                      {"zero_comm_bytes", m.zero_comm_bytes},
                      {"comm_bytes", m.comm_bytes},
                      {"bytes_sent", static_cast<int64_t>(static_cast<double>(m.zero_comm_bytes) * (n - 1) / n)},
                      {"peak_rss_growth_bytes", phase.rss_peak - phase.rss_before},
                      {"peak_rss_bytes", phase.rss_peak},
                      {"mem_peak_bytes", m.mem_peak_bytes},
                      {"fwd_ms", m.fwd_ms},
                      {"bwd_ms", m.bwd_ms},
                      {"opt_ms", m.opt_ms}};
  if (!f.engine_only) {
    j["local_step_ms"] = local_ms[s];
    j["reduce_ms"] = median(reduce_ms);
  } else {
    // The engine's configuration and the shape (MFU needs it), the forward
    // and backward alone, and the activations' peak above the forward's start.
    j["engine_only"] = true;
    j["precision"] = f.bf16 ? "bf16" : "float32";
    j["checkpointing"] = f.checkpointing;
    j["device"] = f.device_name;
    j["fwd_bwd_ms"] = phase.measured[s].fwd_bwd_ms;
    j["mem_act_peak_bytes"] = m.mem_act_peak_bytes;
    j["shape"] = {{"batch", f.batch},        {"seq", o.shape.seq_len}, {"d_model", o.shape.d_model},
                  {"heads", o.shape.n_head}, {"d_ff", o.shape.d_ff},   {"vocab", o.vocab_size}};
    if (m.cuda_allocator) j["cuda_peak_allocated_bytes"] = m.cuda_peak_allocated_bytes;
  }
  // Emitted when the engine reports it (the time the backward's end waited
  // on reductions in flight).
  const nlohmann::json mj = m.to_json();
  if (mj.contains("reduce_wait_ms")) j["reduce_wait_ms"] = mj["reduce_wait_ms"];
  return j;
}

// Rank 0 writes one JSON line per measured step of phase 1.
void write_rows(const DpRun& run, const EnginePhase& phase, const std::vector<double>& local_ms,
                const std::vector<double>& reduce_ms) {
  const std::string& out_path = run.flags.out_path;
  std::ofstream file;
  if (out_path != "-") file.open(out_path, std::ios::app);
  std::ostream& out = out_path == "-" ? std::cout : file;
  for (size_t s = 0; s < phase.measured.size(); ++s) out << step_row(run, phase, local_ms, reduce_ms, s).dump() << "\n";
  out.flush();
}

int bench(int argc, char** argv) {
  CLI::App app{"dp_bench: the GPT trained data parallel through remat's Engine"};
  DpFlags flags;
  add_flags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_device(flags);
  // --engine-only: every byte from the model's construction on.
  std::optional<MemoryTracker> memory;
  if (flags.engine_only) memory.emplace();
  auto& runtime = Runtime::init();
  // One intra-op thread per CPU rank; on a GPU the host's threads initialise the model.
  if (flags.device_name == "cpu") at::set_num_threads(1);
  auto world = runtime.world();
  DpRun run;
  run.flags = flags;
  run.layout = std::make_shared<ParallelLayout>(world, ParallelDims::from_world(world->size(), 1));
  set_up(run, memory);
  const EnginePhase phase = engine_steps(run);
  const std::vector<double> local_ms = flags.engine_only ? std::vector<double>{} : local_steps(run);
  const std::vector<double> reduce_ms = flags.engine_only ? std::vector<double>{} : blocking_reduces(run);
  if (world->rank() != 0) return 0;
  write_rows(run, phase, local_ms, reduce_ms);
  return 0;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::bench(argc, argv); });
}
