// What remat-train adds around the engine: its progress line, its --metrics
// file kept consistent on resume, and the GPT's fit-before-run check.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "engine/auto_values.h"
#include "engine/config.h"
#include "engine/memory_estimate.h"
#include "engine/step_metrics.h"

namespace remat {

std::string human_bytes(double bytes);
// Two amounts compared in one message, with enough digits that they differ
// where they do ("1.72 MiB" and "1.74 MiB", not "1.7 MiB" twice).
std::pair<std::string, std::string> human_bytes_apart(double a, double b);

// Host memory this process may count on: REMAT_MEMORY_PER_RANK_BYTES, else
// the physical memory (capped by a cgroup v2 limit) shared by the ranks on
// this host (Open MPI's local size); 0 when unknown. A capacity, the same
// at every launch (runtime/device_memory.h, rank_memory).
double host_bytes_per_rank();

// What each rank has to train in: REMAT_MEMORY_PER_RANK_BYTES when set;
// else on a CUDA `device` its capacity over the ranks sharing it, on the CPU
// host_bytes_per_rank(). 0 when unknown.
double memory_per_rank(c10::Device device);

// What remat-train's and remat-estimate's "auto" (engine/auto_values.h) are
// decided from: the run's layout, the GPT's data and the device.
struct GptAutoFacts {
  int dp = 1, world_size = 1;
  int64_t vocab = 0;
  int64_t train_tokens = 0;  // the training split's tokens: at most train_tokens / seq_len sequences per micro-batch
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  bool computes_bf16 = false;  // the CUDA device has bf16 (cuda_computes_bf16)
  double have = 0;             // bytes per rank (memory_per_rank); 0: unknown
  std::string have_what;       // where `have` comes from, for the reason
  bool assumed_gpu = false;    // no GPU here to ask: computes_bf16 is assumed, and the reasons say so
  // Where not even one sequence per rank fits: null, the refusal remat-train
  // gives; else (remat-estimate, which shows the table all the same) the
  // micro-batch becomes 1 and why none fits is written here.
  std::string* none_fits = nullptr;
};
// The "auto" values decided without measuring: bf16/fp16 from the device,
// and the batch sizes when train_batch_size and gradient_accumulation_steps
// give the micro-batch (or none is "auto"). Whether an "auto" micro-batch is
// left to measure (remat-train: initialize with EngineOptions::micro_batch,
// gpt_micro_batch_fit bounding the candidates; remat-estimate --live).
bool decide_gpt_autos(Config& c, const GptAutoFacts& facts);

// The largest micro-batch up to `limit` whose cold estimate of the GPT (its
// configured row) fits nine tenths of `facts.have` (a tenth kept for what no
// estimate counts: the allocator's fragmentation, the CUDA context, the
// process's own heap), at most the training split's sequences, and why: the
// bound of an "auto" micro-batch's candidates.
MicroBatchChooser gpt_micro_batch_fit(const Config& c, const GptAutoFacts& facts);

// The cold estimate of the GPT of `c` at `world_size` ranks
// (engine/memory_estimate.h), its line logged; a ConfigError naming the
// cheapest change that fits when its peak exceeds the memory available to
// each rank: the host's on the CPU; on a CUDA `device`, the device's
// capacity over the ranks sharing it (REMAT_MEMORY_PER_RANK_BYTES either way
// when set), with offloaded bytes in host memory apart.
MemoryEstimate check_memory_estimate(const Config& c, const BatchSizes& batch, int64_t vocab, int world_size,
                                     c10::Device device = c10::Device(c10::DeviceType::CPU));

// A resumed run's --metrics file keeps only the lines of the steps up to the
// one it resumed at (rewritten beside it, then renamed over it; a device or
// fifo is left as it is).
void keep_metrics_through(const std::string& path, int64_t step);

// The plot written beside a memory trace: its path with .png for .json (or
// .png added).
std::string memory_plot_path(const std::string& trace);
// Where the plotting script goes when the plot cannot be drawn: the plot's
// path with .plot.py for .png.
std::string memory_plot_script_path(const std::string& trace);
// The plot script's path beside `trace` checked at start like every output
// (runtime/output_file.h); and a file there that is not remat's plotting
// script (written when the plot cannot be drawn) is refused, not replaced.
void check_plot_script_path(const std::string& trace);
// Plots a memory trace (Engine::trace_memory) into `png` with
// tools/plot_memory_trace.py, compiled in, when a python3 with matplotlib is
// found. Empty when written; else what is missing and the command to run,
// with the script written beside the trace (memory_plot_script_path), so the
// command works wherever remat is installed.
std::string plot_memory_trace(const std::string& trace, const std::string& png);

// A bar on a terminal, else a line every `every` steps (REMAT_PROGRESS=bar|lines).
class Progress {
 public:
  Progress(int64_t first, int64_t total, int64_t every, bool enabled);
  void step(int64_t step, double loss, double tokens_per_s, int64_t peak);
  // The step's loss and peak from its metrics: on the CPU the peak above the
  // step's start, as above; on a CUDA device also the caching allocator's
  // peaks, allocated / reserved ("peak 1.2 GiB  cuda 3.4 / 4 GiB"); with
  // fp16, the loss scale.
  void step(int64_t step, double tokens_per_s, const StepMetrics& m);
  void line(const std::string& text);

 private:
  static bool use_bar();
  void show(int64_t step, double loss, double tokens_per_s, const std::string& peak, double loss_scale = 0);
  int64_t first_, total_, every_;
  bool enabled_, terminal_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace remat
