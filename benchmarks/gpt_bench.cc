// The GPT of models/gpt.cc under each checkpointing variant: peak activation
// bytes (one step per variant and depth, c10's allocator reports through
// MemoryTracker) and step time (variants interleaved step by step, warm-up
// dropped; each step's wall and thread CPU time). One JSON object per line,
// the same fields as benchmarks/torch_gpt.py writes for PyTorch. bench.sh
// runs both. autoNN variants plan with the memory planner (its measured
// costs and each plan's table go to stderr). --device cuda runs the same on
// the first GPU (benchmarks/gpu_bench.sh): the device is synchronised before
// each clock read, memory is the device's (c10's CUDA caching allocator
// reports through MemoryTracker), and act_offload copies to pinned host
// memory on side streams (OffloadActivationsOptions' defaults).
//
//   bazel-bin/benchmarks/gpt_bench --layers 2,4,8 --variants none,full,every_k2,selective_op,offload
//       [--steps 20] [--warmup 3] [--memory-only] [--plan-rounds 2] [--device cpu|cuda] [--out FILE]
//   remat-run -np 2 -- bazel-bin/benchmarks/gpt_bench --tp 2 --variants full,partitioned ...
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "checkpointing/selective_op.h"
#include "engine/step_counters.h"
#include "models/gpt.h"
#include "rng/rng_tracker.h"
#include "engine/config.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

// This thread's CPU time (the steps run on one thread).
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

// The activation_checkpointing section of a variant; a "_reentrant" suffix
// (full_reentrant, every_k2_reentrant, ...) selects reentrant regions.
ActivationCheckpointingOptions config_of(const std::string& name) {
  ActivationCheckpointingOptions c;
  const std::string suffix = "_reentrant";
  std::string variant = name;
  if (variant.size() > suffix.size() &&
      variant.compare(variant.size() - suffix.size(), suffix.size(), suffix) == 0) {
    variant.resize(variant.size() - suffix.size());
    c.reentrant = true;
  }
  if (variant == "none" || variant == "act_offload") {
    c.variant = CheckpointVariant::kNone;
  } else if (variant == "full") {
    c.variant = CheckpointVariant::kFull;
  } else if (variant.rfind("every_k", 0) == 0 && variant.size() > 7 &&
             variant.find_first_not_of("0123456789", 7) == std::string::npos) {
    c.variant = CheckpointVariant::kSelectiveLayer;
    c.every_k = std::stoi(variant.substr(7));
  } else if (variant.rfind("auto", 0) == 0 && variant.size() > 4 &&
             variant.find_first_not_of("0123456789", 4) == std::string::npos) {
    // autoNN: the memory planner with a budget of NN % of the peak without checkpointing.
    c.variant = CheckpointVariant::kAuto;
    c.memory_budget_fraction = std::stoi(variant.substr(4)) / 100.0;
  } else if (variant == "selective_op") {
    c.variant = CheckpointVariant::kSelectiveOp;
  } else if (variant == "selective_op_matmuls") {
    c.variant = CheckpointVariant::kSelectiveOp;
    c.save_ops = matmul_save_ops();
  } else if (variant == "offload") {
    c.variant = CheckpointVariant::kFull;
    c.cpu_checkpointing = true;
  } else if (variant == "partitioned") {
    c.variant = CheckpointVariant::kFull;
    c.partition_activations = true;
  } else {
    throw ConfigError(str("gpt_bench: unknown variant '", name,
                          "' (none, full, every_kN, selective_op, selective_op_matmuls, offload, "
                          "partitioned, each but none also with the suffix _reentrant; act_offload: "
                          "activation offloading without checkpointing; autoNN: the memory planner "
                          "with a budget of NN % of the peak without checkpointing)"));
  }
  return c;
}

// gpt_bench's flags as given, the model's shape among them (its depth from --layers).
struct GptFlags {
  std::string layers = "4", variants = "none,full,every_k2,selective_op,offload", out_path = "-";
  std::string device_name = "cpu";
  int steps = 20, warmup = 3, tp = 1, plan_rounds = 2;
  bool memory_only = false;
  models::GptOptions model = default_model();
  int64_t batch = 4, seed = 1234;

  static models::GptOptions default_model() {
    models::GptOptions o;
    o.vocab_size = 128;
    o.shape.seq_len = 64;
    o.shape.d_model = 128;
    o.shape.n_head = 4;
    o.shape.d_ff = 512;
    o.shape.dropout = 0.1;
    return o;
  }
};

void add_flags(CLI::App& app, GptFlags& f) {
  models::GptOptions& o = f.model;
  app.add_option("--layers", f.layers, "comma-separated depths");
  app.add_option("--variants", f.variants, "none, full, every_k2, selective_op, offload, partitioned (+ _reentrant)");
  app.add_option("--steps", f.steps, "measured steps per variant and depth")->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", f.warmup)->check(CLI::NonNegativeNumber);
  app.add_flag("--memory-only", f.memory_only, "one measured step per variant");
  app.add_option("--tp", f.tp, "tensor-parallel size (run under remat-run with that many ranks)");
  app.add_flag("--sequence-parallel", o.sequence_parallel,
               "sequence parallelism over the tensor-parallel group (tensor_parallel.sequence_parallel)");
  app.add_option("--batch", f.batch)->check(CLI::PositiveNumber);
  app.add_option("--seq", o.shape.seq_len)->check(CLI::PositiveNumber);
  app.add_option("--d-model", o.shape.d_model)->check(CLI::PositiveNumber);
  app.add_option("--heads", o.shape.n_head)->check(CLI::PositiveNumber);
  app.add_option("--d-ff", o.shape.d_ff)->check(CLI::PositiveNumber);
  app.add_option("--vocab", o.vocab_size)->check(CLI::PositiveNumber);
  app.add_option("--dropout", o.shape.dropout);
  app.add_option("--seed", f.seed);
  app.add_option("--plan-rounds", f.plan_rounds, "autoNN: the planner's profiling rounds per choice")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", f.device_name, "cpu, or cuda: the first GPU")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--out", f.out_path, "JSON lines (appended); - for stdout");
}

at::Device bench_device(const GptFlags& f) {
  const at::Device device = f.device_name == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    throw ConfigError("gpt_bench --device cuda: no CUDA device visible to this LibTorch (a CPU-only build, or "
                      "no GPU); run with --device cpu");
  }
  return device;
}

// What every depth shares: the flags, the device, the memory counts, the
// layout and where rank 0 writes.
struct GptBench {
  const GptFlags& flags;
  at::Device device;
  MemoryTracker& memory;
  ParallelLayout& layout;
  std::ostream& out;
  bool print;  // rank 0

  // Kernels run asynchronously on a GPU: every clock read waits for them.
  void sync() const {
    if (device.is_cuda()) torch::cuda::synchronize();
  }
};

// One depth: its model and batch, each variant's configuration and, for
// variant auto, one profile and one plan per budget.
struct Depth {
  models::GptOptions o;
  models::Gpt model{nullptr};
  at::Tensor idx, targets;
  std::map<std::string, ActivationCheckpointingOptions> configs;
  std::map<std::string, ActivationPlan> plans;
  PlannerOptions planner;
  std::optional<BlockCosts> costs;
};

struct Result {
  double fwd_ms, step_ms, step_cpu_ms, loss;
  int64_t peak, saved, held, offloaded;
};

void set_up_depth(const GptBench& b, Depth& d, const std::string& depth) {
  const GptFlags& f = b.flags;
  d.o = f.model;
  d.o.shape.n_layer = std::stoi(depth);
  if (f.tp > 1) d.o.tensor_parallel = b.layout.tp_group();
  at::manual_seed(f.seed);
  d.model = models::Gpt(d.o);
  d.model->to(b.device);
  d.model->train();
  model_parallel_manual_seed(static_cast<uint64_t>(f.seed), b.layout);
  at::Generator data = at::detail::createCPUGenerator(static_cast<uint64_t>(f.seed + 1));
  d.idx = at::randint(d.o.vocab_size, {f.batch, d.o.shape.seq_len}, data, at::kLong);
  d.targets = d.idx.roll(-1, 1).to(b.device);
  d.idx = d.idx.to(b.device);
  // Each step configures its own variant: the region defaults (storage,
  // reentrant) are process-wide.
  for (const auto& v : split(f.variants)) d.configs[v] = config_of(v);
  d.planner.rounds = f.plan_rounds;
}

// One forward and backward under variant `v`, measured.
Result measure_step(const GptBench& b, Depth& d, const std::string& v) {
  models::Gpt& model = d.model;
  MemoryTracker& memory = b.memory;
  const at::DeviceType device = b.device.type();
  const auto& c = v == "none" ? config_of("none") : d.configs.at(v);
  configure_checkpointing(c, &b.layout);
  std::unique_ptr<OffloadActivations> offload;
  if (c.variant == CheckpointVariant::kNone) {
    remove_activation_checkpointing(*model);
  } else if (c.variant == CheckpointVariant::kAuto) {
    apply_activation_plan(*model, d.plans.at(v), d.planner);
  } else {
    apply_activation_checkpointing(*model, PolicyOptions(c));
  }
  for (auto& p : model->parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  b.sync();
  const int64_t base = memory.current(device);
  const int64_t offloaded0 = activation_offload_stats().offloaded_bytes;
  memory.reset_peak();
  const double cpu0 = thread_cpu_ms();
  auto t0 = Clock::now();
  if (v == "act_offload") offload = std::make_unique<OffloadActivations>(OffloadActivationsOptions{}, model.get());
  at::Tensor loss = model->loss(d.idx, d.targets);
  offload.reset();
  b.sync();
  auto t1 = Clock::now();
  const int64_t held = memory.current(device) - base;
  const int64_t saved = Counters::read().checkpoint_saved_bytes;
  loss.backward();
  b.sync();
  auto t2 = Clock::now();
  using ms = std::chrono::duration<double, std::milli>;
  return Result{ms(t1 - t0).count(), ms(t2 - t0).count(), thread_cpu_ms() - cpu0, loss.item<double>(),
                memory.peak(device) - base, saved, held, activation_offload_stats().offloaded_bytes - offloaded0};
}

// Variant auto: the choices profiled once per depth, one plan per budget
// (rank 0 writes a row for a budget no plan fits, and that variant is not run).
void plan_auto_variants(const GptBench& b, Depth& d) {
  auto& world = *b.layout.world();
  for (const auto& [v, c] : d.configs) {
    if (c.variant != CheckpointVariant::kAuto) continue;
    configure_checkpointing(c, &b.layout);
    if (!d.costs) {
      for (auto& p : d.model->parameters()) p.mutable_grad().zero_();
      d.costs = profile_activation_choices(*d.model, [&] { d.model->loss(d.idx, d.targets).backward(); }, d.planner,
                                           &world);
      if (b.print) std::fprintf(stderr, "L = %d: %s", d.o.shape.n_layer, describe_costs(*d.costs).c_str());
    }
    const BlockCosts& costs = *d.costs;
    const auto budget = static_cast<int64_t>(*c.memory_budget_fraction * static_cast<double>(costs.keep_peak));
    if (budget < smallest_feasible_budget(costs)) {
      if (b.print) {
        b.out << nlohmann::json{{"framework", "remat"}, {"variant", v}, {"layers", d.o.shape.n_layer},
                                {"kind", "memory"}, {"infeasible", true}, {"budget_bytes", budget},
                                {"smallest_feasible_bytes", smallest_feasible_budget(costs)}, {"tp", b.flags.tp}}
                     .dump()
              << "\n";
      }
      continue;
    }
    d.plans[v] = solve_activation_plan(costs, budget);
    if (b.print) {
      std::fprintf(stderr, "%s at L = %d: %s", v.c_str(), d.o.shape.n_layer, d.plans[v].table(costs).c_str());
    }
  }
}

// Rank 0's line for variant `v`: kind "memory" (the variant's one measured
// step, with its plan for variant auto) or "time" (measured step `s`).
nlohmann::json result_row(const GptBench& b, const Depth& d, const std::string& v, const char* kind, int s,
                          const Result& r) {
  nlohmann::json j = {{"framework", "remat"}, {"variant", v},      {"layers", d.o.shape.n_layer},
                      {"kind", kind},         {"loss", r.loss},    {"tp", b.flags.tp},
                      {"sequence_parallel", d.o.sequence_parallel_active()}};
  if (b.device.is_cuda()) j["device"] = "cuda";
  if (std::string(kind) == "memory") {
    j["peak_bytes"] = r.peak;
    j["held_bytes"] = r.held;
    j["offloaded_bytes"] = r.offloaded;
    j["ckpt_saved_bytes"] = r.saved;
    if (d.plans.count(v)) {
      const ActivationPlan& plan = d.plans.at(v);
      j["plan"] = plan.summary();
      j["budget_bytes"] = plan.budget_bytes;
      j["predicted_peak_bytes"] = plan.predicted_peak;
      j["predicted_extra_cpu_ms"] = plan.predicted_extra_cpu_ms;
      j["predicted_extra_wall_ms"] = plan.predicted_extra_wall_ms;
      j["keep_peak_bytes"] = d.costs->keep_peak;
    }
  } else {
    j["step"] = s;
    j["fwd_ms"] = r.fwd_ms;
    j["step_ms"] = r.step_ms;
    j["step_cpu_ms"] = r.step_cpu_ms;
  }
  return j;
}

// One depth: the memory step of each variant, then the timed steps with the
// variants interleaved step by step.
void bench_depth(const GptBench& b, const std::string& depth) {
  const GptFlags& f = b.flags;
  Depth d;
  set_up_depth(b, d, depth);
  auto emit = [&](const std::string& v, const char* kind, int s, const Result& r) {
    if (b.print) b.out << result_row(b, d, v, kind, s, r).dump() << "\n";
  };
  exclude_output_head(*d.model, OffloadActivationsOptions{});  // used by act_offload only
  measure_step(b, d, "none");  // allocates the parameter gradients
  plan_auto_variants(b, d);
  std::vector<std::string> runnable;
  for (const auto& v : split(f.variants)) {
    if (d.configs.at(v).variant != CheckpointVariant::kAuto || d.plans.count(v)) runnable.push_back(v);
  }
  for (const auto& v : runnable) emit(v, "memory", 0, measure_step(b, d, v));
  if (!f.memory_only) {
    for (int s = 0; s < f.warmup + f.steps; ++s) {
      for (const auto& v : runnable) {
        Result r = measure_step(b, d, v);
        if (s >= f.warmup) emit(v, "time", s - f.warmup, r);
      }
    }
  }
  b.out.flush();
  remove_activation_checkpointing(*d.model);
}

int bench(int argc, char** argv) {
  CLI::App app{"gpt_bench: the GPT under each checkpointing variant"};
  GptFlags flags;
  add_flags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const at::Device device = bench_device(flags);
  MemoryTracker memory;
  auto& runtime = Runtime::init();
  at::set_num_threads(1);
  auto world = runtime.world();
  ParallelLayout layout(world, ParallelDims(world->size() / flags.tp, flags.tp, world->size()));
  std::ofstream file;
  const bool print = world->rank() == 0;
  if (print && flags.out_path != "-") file.open(flags.out_path, std::ios::app);
  std::ostream& out = flags.out_path == "-" ? std::cout : file;
  const GptBench b{flags, device, memory, layout, out, print};
  for (const auto& depth : split(flags.layers)) bench_depth(b, depth);
  return 0;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::bench(argc, argv); });
}
