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

int bench(int argc, char** argv) {
  CLI::App app{"dp_bench: the GPT trained data parallel through remat's Engine"};
  models::GptOptions o;
  o.vocab_size = 128;
  o.shape.n_layer = 8;
  o.shape.seq_len = 64;
  o.shape.d_model = 128;
  o.shape.n_head = 4;
  o.shape.d_ff = 512;
  o.shape.dropout = 0.1;
  int64_t batch = 4, seed = 1234, bucket = 250000;
  int stage = 0, steps = 5, warmup = 2, reduce_reps = 5;
  bool overlap = false, bf16 = false, engine_only = false;
  std::string out_path = "-", checkpointing = "none", device_name = "cpu";
  app.add_option("--layers", o.shape.n_layer)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "sequences per rank")->check(CLI::PositiveNumber);
  app.add_option("--seq", o.shape.seq_len)->check(CLI::PositiveNumber);
  app.add_option("--d-model", o.shape.d_model)->check(CLI::PositiveNumber);
  app.add_option("--heads", o.shape.n_head)->check(CLI::PositiveNumber);
  app.add_option("--d-ff", o.shape.d_ff)->check(CLI::PositiveNumber);
  app.add_option("--vocab", o.vocab_size)->check(CLI::PositiveNumber);
  app.add_option("--dropout", o.shape.dropout);
  app.add_option("--seed", seed);
  app.add_option("--stage", stage, "zero_optimization.stage")->check(CLI::Range(0, 3));
  app.add_option("--overlap-comm", overlap, "zero_optimization.overlap_comm (true/false)");
  app.add_option("--bucket", bucket, "zero_optimization.reduce_bucket_size (elements)")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "measured steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--reduce-reps", reduce_reps, "repetitions of the blocking all-reduce")->check(CLI::PositiveNumber);
  app.add_option("--out", out_path, "JSON lines (appended); - for stdout");
  app.add_flag("--bf16", bf16, "bf16.enabled: float32 masters, bf16 compute");
  app.add_option("--checkpointing", checkpointing, "activation_checkpointing.variant (none, full, ...)");
  app.add_option("--device", device_name, "cpu, or cuda: the first GPU (with --engine-only)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--engine-only", engine_only,
               "the engine's steps alone (no local step, no blocking all-reduce); memory counted from the model's "
               "construction on");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (device_name == "cuda" && !engine_only) {
    throw ConfigError(
        "dp_bench --device cuda: the local step and the all-reduce phases run on the CPU; add --engine-only");
  }
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    throw ConfigError("dp_bench --device cuda: no CUDA device visible to this LibTorch (a CPU-only build, or no GPU); "
                      "run with --device cpu");
  }
  // Kernels run asynchronously on a GPU: every clock read waits for them.
  auto sync = [&] {
    if (device_name == "cuda") torch::cuda::synchronize();
  };
  // --engine-only: every byte from the model's construction on.
  std::optional<MemoryTracker> memory;
  if (engine_only) memory.emplace();
  auto& runtime = Runtime::init();
  // One intra-op thread per CPU rank; on a GPU the host's threads initialise the model.
  if (device_name == "cpu") at::set_num_threads(1);
  auto world = runtime.world();
  auto layout = std::make_shared<ParallelLayout>(world, ParallelDims::from_world(world->size(), 1));
  const auto& dp = layout->dp_group();
  const int n = dp->size();
  auto barrier = [&] { dp->barrier()->wait(); };

  // Two models with the same weights (torch_gpt.py's Gpt after
  // torch.manual_seed(seed) too): the engine's, and a plain copy for phase 2
  // (none with --engine-only).
  at::manual_seed(static_cast<uint64_t>(seed));
  models::Gpt model(o);
  at::manual_seed(static_cast<uint64_t>(seed));
  models::Gpt local = engine_only ? models::Gpt(nullptr) : models::Gpt(o);
  model->train();
  if (!engine_only) local->train();
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  at::Generator data = at::detail::createCPUGenerator(static_cast<uint64_t>(seed + 1 + layout->dp_rank()));
  at::Tensor idx = at::randint(o.vocab_size, {batch, o.shape.seq_len}, data, at::kLong);
  at::Tensor targets = idx.roll(-1, 1);

  nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", batch},
      {"gradient_accumulation_steps", 1},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
      {"zero_optimization",
       {{"stage", stage},
        {"overlap_comm", overlap},
        {"reduce_bucket_size", bucket},
        {"allgather_bucket_size", bucket},
        // Stage 3 shards every parameter: at the default threshold (1e5
        // elements) this model's would all stay whole and be all-reduced.
        {"stage3_param_persistence_threshold", 0}}},
      {"activation_checkpointing", {{"variant", checkpointing}}},
      {"train", {{"seed", seed}}}};
  if (bf16) config["bf16"] = {{"enabled", true}};
  EngineOptions options;
  options.layout = layout;
  options.device = device_name;
  if (memory) options.memory = &*memory;
  auto engine = initialize(model, config, options);
  idx = engine->to_device(idx);
  targets = engine->to_device(targets);

  // Phase 1: the engine's steps.
  struct Step {
    double ms, fwd_bwd_ms, loss;
    StepMetrics metrics;
  };
  std::vector<Step> measured;
  barrier();
  reset_rss_peak();
  const int64_t rss_before = proc_status_bytes("VmRSS");
  for (int s = 0; s < warmup + steps; ++s) {
    barrier();
    sync();
    const auto t0 = Clock::now();
    at::Tensor loss = engine->forward([&] { return model->loss(idx, targets); });
    engine->backward(loss);
    sync();
    const double fwd_bwd_ms = ms_since(t0);
    engine->step();
    sync();
    const double ms = ms_since(t0);
    if (s >= warmup) measured.push_back({ms, fwd_bwd_ms, loss.item<double>(), engine->last_metrics()});
  }
  const int64_t rss_peak = proc_status_bytes("VmHWM");

  // Phase 2: the same step with no data-parallel communication.
  std::vector<double> local_ms;
  if (!engine_only) {
    torch::optim::AdamW adamw(local->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    for (int s = 0; s < warmup + steps; ++s) {
      barrier();
      const auto t0 = Clock::now();
      at::Tensor loss = local->loss(idx, targets);
      loss.backward();
      adamw.step();
      for (auto& p : local->parameters()) {
        if (p.grad().defined()) p.mutable_grad().zero_();
      }
      if (s >= warmup) local_ms.push_back(ms_since(t0));
    }
  }

  // Phase 3: every gradient all-reduced once, bucket after bucket, blocking.
  std::vector<double> reduce_ms;
  if (!engine_only) {
    at::Tensor flat = at::ones({numel}, at::kFloat);
    for (int r = 0; r < 1 + reduce_reps; ++r) {
      barrier();
      const auto t0 = Clock::now();
      for (int64_t off = 0; off < numel; off += bucket) {
        at::Tensor b = flat.narrow(0, off, std::min(bucket, numel - off));
        dp->allReduce(b)->wait();
      }
      if (r > 0) reduce_ms.push_back(ms_since(t0));
    }
  }

  if (world->rank() != 0) return 0;
  std::ofstream file;
  if (out_path != "-") file.open(out_path, std::ios::app);
  std::ostream& out = out_path == "-" ? std::cout : file;
  for (size_t s = 0; s < measured.size(); ++s) {
    const StepMetrics& m = measured[s].metrics;
    nlohmann::json j = {{"framework", "remat"},
                        {"mode", str("stage", stage, overlap ? "_overlap" : "")},
                        {"world", n},
                        {"stage", stage},
                        {"overlap", overlap},
                        {"bucket", bucket},
                        {"layers", o.shape.n_layer},
                        {"dropout", o.shape.dropout},
                        {"step", s},
                        {"step_ms", measured[s].ms},
                        {"loss", measured[s].loss},
                        {"params", numel},
                        // The ZeRO collectives' bytes as the engine counts them
                        // (parallel/zero.h: all-reduce 2x its bytes, reduce-scatter
                        // its input, all-gather its output), and what a ring
                        // sends of those per rank: (N-1)/N of each count.
                        {"zero_comm_bytes", m.zero_comm_bytes},
                        {"comm_bytes", m.comm_bytes},
                        {"bytes_sent", static_cast<int64_t>(static_cast<double>(m.zero_comm_bytes) * (n - 1) / n)},
                        {"peak_rss_growth_bytes", rss_peak - rss_before},
                        {"peak_rss_bytes", rss_peak},
                        {"mem_peak_bytes", m.mem_peak_bytes},
                        {"fwd_ms", m.fwd_ms},
                        {"bwd_ms", m.bwd_ms},
                        {"opt_ms", m.opt_ms}};
    if (!engine_only) {
      j["local_step_ms"] = local_ms[s];
      j["reduce_ms"] = median(reduce_ms);
    } else {
      // The engine's configuration and the shape (MFU needs it), the forward
      // and backward alone, and the activations' peak above the forward's start.
      j["engine_only"] = true;
      j["precision"] = bf16 ? "bf16" : "float32";
      j["checkpointing"] = checkpointing;
      j["device"] = device_name;
      j["fwd_bwd_ms"] = measured[s].fwd_bwd_ms;
      j["mem_act_peak_bytes"] = m.mem_act_peak_bytes;
      j["shape"] = {{"batch", batch},          {"seq", o.shape.seq_len}, {"d_model", o.shape.d_model},
                    {"heads", o.shape.n_head}, {"d_ff", o.shape.d_ff},   {"vocab", o.vocab_size}};
      if (m.cuda_allocator) j["cuda_peak_allocated_bytes"] = m.cuda_peak_allocated_bytes;
    }
    // Emitted when the engine reports it (the time the backward's end waited
    // on reductions in flight).
    const nlohmann::json mj = m.to_json();
    if (mj.contains("reduce_wait_ms")) j["reduce_wait_ms"] = mj["reduce_wait_ms"];
    out << j.dump() << "\n";
  }
  out.flush();
  return 0;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::bench(argc, argv); });
}
