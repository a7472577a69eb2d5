// remat-smoke: a multi-rank smoke run of the runtime. It loads the
// configuration, builds the parallel layout, runs one of each collective with
// closed-form expected values, and prints what every rank saw.
//
//   remat-run -np 2 -- remat-smoke [--config FILE] [--set key=value ...] [--backend auto|mpi|nccl]
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "engine/config.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/runtime.h"

namespace {

int smoke(int argc, char** argv) {
  CLI::App app{"remat-smoke: start remat's runtime on every rank and check the collectives"};
  std::string config_path;
  std::vector<std::string> overrides;
  std::string backend_name = "auto";
  bool print_config = false;
  app.add_option("--config", config_path, "JSON configuration (default: the embedded one)");
  app.add_option("--set", overrides, "override a key: --set model.n_layer=8 (repeatable)");
  app.add_option("--backend", backend_name, "communication backend: auto, mpi or nccl");
  app.add_flag("--print-config", print_config, "print the effective configuration");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto& runtime = remat::Runtime::init();
  remat::Config config = config_path.empty()
                             ? remat::parse_config(remat::default_config_text(),
                                                   "<embedded default>", overrides)
                             : remat::load_config(config_path, overrides);
  if (print_config && runtime.rank() == 0) std::printf("%s\n", config.to_json().c_str());

  auto world = runtime.world(remat::parse_backend(backend_name));
  remat::ParallelLayout layout(
      world, remat::ParallelDims::from_world(world->size(), config.tensor_parallel.size));
  remat::BatchSizes batch = config.resolve_batch(layout.dims().dp);
  remat::log_rank0().info(
      "backend {}, {} ranks, batch: train {} = micro {} x accumulation {} x dp {}",
      world->backendName(), world->size(), batch.train_batch_size, batch.micro_batch_per_gpu,
      batch.gradient_accumulation_steps, layout.dims().dp);

  const int n = world->size(), r = world->rank();
  // Both backends carry CUDA tensors (mpi through pinned host copies): the
  // check runs where training would, on the GPU where there is one.
  auto device = torch::cuda::is_available() ? at::kCUDA : at::kCPU;
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);

  at::Tensor sum = at::full({4}, r + 1, opts);
  world->allReduce(sum)->wait();
  at::Tensor gathered = at::empty({n}, opts);
  world->allGather(gathered, at::full({1}, r, opts))->wait();
  at::Tensor tp_sum = at::full({1}, r, opts);
  layout.tp_group()->allReduce(tp_sum)->wait();
  world->barrier()->wait();

  float expected = n * (n + 1) / 2.0f;
  bool ok = at::equal(sum.cpu(), at::full({4}, expected)) &&
            at::equal(gathered.cpu(), at::arange(n, at::kFloat));
  std::printf("%s allReduce(sum of rank+1) = %.0f (expected %.0f), allGather(rank) = [",
              remat::log_prefix().c_str(), sum[0].item<float>(), expected);
  for (int q = 0; q < n; ++q) std::printf("%s%.0f", q ? ", " : "", gathered[q].item<float>());
  std::printf("], tensor-parallel group sum = %.0f: %s\n", tp_sum.item<float>(),
              ok ? "ok" : "WRONG");
  std::fflush(stdout);
  if (!ok) throw remat::CommError("collective results differ from the closed-form values");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return remat::run_main([&] { return smoke(argc, argv); });
}
