// The export's extra host memory on rank 0, streamed (export_model: one unit
// at a time) or gathered whole first (consolidated_parameters +
// write_model_file), for a GPT of a few hundred MB at ZeRO stage 3.
//
//   remat-run -np 2 -- export_bench --mode streamed --path /tmp/m.safetensors
//
// Rank 0 resets its peak resident set (/proc/self/clear_refs "5": VmHWM
// becomes VmRSS) just before the export and reads VmHWM after it: the extra
// is the peak minus the resident set before. So that the resident set counts
// what is allocated, glibc maps every allocation of 128 KiB or more on its
// own and unmaps it when freed (a fixed M_MMAP_THRESHOLD: by default the
// threshold grows to 32 MiB after the model's first frees, and a unit's
// buffer then reuses heap pages already resident), and the heap is trimmed
// before the reset. Run each mode in its own process. Prints one
// table row: mode, format, model and largest-unit bytes, the extra and the
// export's time.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/export.h"
#include "models/gpt.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/pickle_at_once.h"

namespace remat {
namespace {

// A /proc/self/status field in bytes ("VmRSS", "VmHWM").
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  throw Error(str("export_bench: no ", field, " in /proc/self/status"));
}

// The export before it streamed: the parameters gathered whole, then the
// archive made in memory and written at once (what write_model_file did).
void write_archive_at_once(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& params) {
  const std::string bytes = remat::testing::pickle_archive_at_once(params, /*copy=*/false);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void reset_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  if (!out.flush()) throw Error("export_bench: cannot reset the peak resident set (/proc/self/clear_refs)");
}

int bench(int argc, char** argv) {
  CLI::App app("the export's extra host memory on rank 0, streamed or whole");
  std::string mode = "streamed", path;
  int layers = 12, d_model = 768, stage = 3;
  app.add_option("--mode", mode, "streamed (export_model), whole (consolidated_parameters + write_model_file) or "
                 "at-once (gathered whole, the archive made in memory: the export before it streamed)")
      ->check(CLI::IsMember({"streamed", "whole", "at-once"}));
  app.add_option("--path", path, "where to export (.safetensors, a folder/ or a pickle)")->required();
  app.add_option("--layers", layers, "GPT blocks");
  app.add_option("--d-model", d_model, "GPT width (d_ff 4x)");
  app.add_option("--stage", stage, "ZeRO stage");
  CLI11_PARSE(app, argc, argv);
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  auto world = Runtime::init().world();
  auto layout = std::make_shared<ParallelLayout>(world, ParallelDims::from_world(world->size(), 1));
  models::GptOptions o;
  o.vocab_size = 256;
  o.shape.seq_len = 128;
  o.shape.n_layer = layers;
  o.shape.n_head = 12;
  o.shape.d_model = d_model;
  o.shape.d_ff = 4 * d_model;
  at::manual_seed(1);
  models::Gpt model(o);
  const Config config = parse_config(str(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
      "zero_optimization": {"stage": )", stage, "}}"), "<export_bench>");
  EngineOptions options;
  options.layout = layout;
  auto engine = initialize(model, config, options);
  int64_t model_bytes = 0, unit_bytes = 0;
  for (const auto& p : model->parameters()) model_bytes += static_cast<int64_t>(p.numel()) * 4;
  for (const auto& [name, n] : engine->sharding().unit_padded_numels()) unit_bytes = std::max(unit_bytes, n * 4);
  world->barrier()->wait();
  int64_t before = 0;
  if (world->rank() == 0) {
    ::malloc_trim(0);
    reset_peak();
    before = status_bytes("VmRSS");
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (mode == "streamed") {
    engine->export_model(path);
  } else {
    const auto whole = consolidated_parameters(engine->sharding(), *model);
    if (world->rank() == 0) mode == "whole" ? (void)write_model_file(path, whole) : write_archive_at_once(path, whole);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (world->rank() == 0) {
    const int64_t extra = status_bytes("VmHWM") - before;
    std::printf("| %-8s | %-12s | %9.1f | %9.1f | %9.1f | %5.2f | %6.2f |\n", mode.c_str(),
                path.back() == '/' ? "shards" : export_format(path) == ExportFormat::kPickle ? "pickle" : "safetensors",
                model_bytes / 1e6, unit_bytes / 1e6, extra / 1e6, static_cast<double>(extra) / unit_bytes, seconds);
  }
  world->barrier()->wait();
  return 0;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::bench(argc, argv); });
}
