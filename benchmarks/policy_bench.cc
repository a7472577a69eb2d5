// Peak activation bytes and step time of the 8-block stack under each
// checkpointing policy, measured side by side in one run.
//
//   bazel-bin/benchmarks/policy_bench [--steps 20] [--warmup 3] [--batch 4] [--seq 64]
//                                     [--d_model 128] [--layers 8] [--threads 1]
//
// Variants are interleaved (none, full, every_k=2, selective_op, none, ...) so
// machine noise hits all alike. Peak activation bytes = peak live tensor bytes
// during a step minus those at its start (c10's allocator reports, parameter
// gradients allocated beforehand); time is the median step with min and max.
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "checkpointing/policy.h"
#include "models/stack.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace {

struct Variant {
  std::string label;
  remat::PolicyOptions options;
  std::vector<double> ms;
  int64_t peak = 0;
};

int bench(int argc, char** argv) {
  CLI::App app{"policy_bench: checkpointing policies on the 8-block stack"};
  int steps = 20, warmup = 3, threads = 1;
  remat::models::StackOptions o;
  int64_t batch = 4, seq = 64;
  o.shape.n_layer = 8;
  o.shape.d_model = 128;
  o.shape.n_head = 4;
  o.shape.dropout = 0.1;
  app.add_option("--steps", steps, "measured steps per variant")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "discarded steps per variant")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--seq", seq)->check(CLI::PositiveNumber);
  app.add_option("--d_model", o.shape.d_model)->check(CLI::PositiveNumber);
  app.add_option("--layers", o.shape.n_layer)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.shape.d_ff = 4 * o.shape.d_model;
  at::set_num_threads(threads);
  torch::manual_seed(0);
  remat::models::Stack model(o);
  at::Tensor x = torch::randn({batch, seq, o.shape.d_model}, torch::requires_grad());
  model->forward(x).pow(2).mean().backward();  // parameter gradients exist from here on

  std::vector<Variant> variants(4);
  variants[0].label = "none";
  variants[0].options.variant = remat::CheckpointVariant::kNone;
  variants[1].label = "full";
  variants[1].options.variant = remat::CheckpointVariant::kFull;
  variants[2].label = "every_k=2";
  variants[2].options.variant = remat::CheckpointVariant::kSelectiveLayer;
  variants[2].options.every_k = 2;
  variants[3].label = "selective_op";
  variants[3].options.variant = remat::CheckpointVariant::kSelectiveOp;

  for (int i = 0; i < warmup + steps; ++i) {
    for (auto& v : variants) {
      remat::apply_activation_checkpointing(*model, v.options);
      model->zero_grad(/*set_to_none=*/false);
      x.mutable_grad().zero_();
      remat::MemoryTracker mem;
      auto start = std::chrono::steady_clock::now();
      model->forward(x).pow(2).mean().backward();
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (i >= warmup) {
        v.ms.push_back(ms);
        v.peak = std::max(v.peak, mem.peak());
      }
    }
  }
  remat::remove_activation_checkpointing(*model);

  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  double none_ms = median(variants[0].ms);
  double none_peak = static_cast<double>(variants[0].peak);
  std::printf("# 8-block stack: batch %lld, seq %lld, d_model %lld, d_ff %lld, %lld layers, fp32, "
              "%d thread(s); %d warm-up + %d measured steps per variant, interleaved\n",
              static_cast<long long>(batch), static_cast<long long>(seq),
              static_cast<long long>(o.shape.d_model), static_cast<long long>(o.shape.d_ff),
              static_cast<long long>(o.shape.n_layer), threads, warmup, steps);
  std::printf("| variant | peak activation (MiB) | vs none | step ms (median) | min | max | vs none |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  for (auto& v : variants) {
    double med = median(v.ms);
    std::printf("| %s | %.2f | %.3f | %.1f | %.1f | %.1f | %.3f |\n", v.label.c_str(),
                v.peak / 1048576.0, v.peak / none_peak, med,
                *std::min_element(v.ms.begin(), v.ms.end()),
                *std::max_element(v.ms.begin(), v.ms.end()), med / none_ms);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return remat::run_main([&] { return bench(argc, argv); });
}
