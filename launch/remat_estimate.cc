// remat-estimate: will remat-train's configuration fit, before running it?
// Per rank, for every ZeRO stage x checkpointing policy x offloading: the
// parameters, gradients, optimizer state, gathered units, activations, host
// bytes and the peak (engine/memory_estimate.h), the configured row marked.
//
//   remat-estimate [--config ds_config.json] [--set key=value ...] [-np N] [--live] [--device cpu|cuda|auto]
//                  [--host-memory BYTES] [--json FILE]
//
// cold (the default): from the config's sizes, nothing built; --live builds
// the GPT on this process and profiles one step under every block choice.
// --device cuda: the model on a GPU, one per rank: offloaded bytes are host
// rows apart from the device's peak, and the capacity is the GPU's. Without
// --device, the config's train.device (auto: a GPU where this process sees
// one, else the CPU). What remat-train refuses before it trains (fp16 where
// this LibTorch cannot compute it) is refused alike, in the same words.
// Keys the config gives "auto" are decided first as remat-train would decide
// them here (engine/auto_values.h), and printed above the table with why
// (--json: its "auto" object). An "auto" micro-batch, which remat-train
// measures at start, is cold the largest that fits (the most remat-train may
// choose, the candidates listed); with --live the same search runs here, on
// this process alone, and the table is at its choice.
// Exits 2 when the configuration does not fit the memory a rank has here
// (REMAT_MEMORY_PER_RANK_BYTES, else on the CPU the host's over its ranks,
// on a GPU the first GPU's capacity). With --device cuda a verdict line
// answers "does this GPT (its parameters counted) fit on this device with
// this host": the device's peak against its capacity and what offloading
// keeps on the host (the optimizer's masters, gradients and state under
// zero_optimization.offload_optimizer, stage 3's parameter shards under
// offload_param, offloaded activations) against
// --host-memory (bytes per rank; default this host's physical memory over
// the ranks); it exits 2 too when the host part does not fit. With
// offload_optimizer or offload_param on "nvme", a disk line per nvme_path:
// the bytes the ranks keep there against its free space here (exit 2 when
// they do not fit, or the path is not a folder; a path not on this machine
// is said and not checked).
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "data/dataset.h"
#include "engine/auto_values.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/memory_estimate.h"
#include "engine/micro_batch_search.h"
#include "launch/train_tools.h"
#include "models/gpt.h"
#include "runtime/device_memory.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/process_env.h"
#include "runtime/output_file.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

// What stays on the host under `row`: the offloaded optimizer, offload_param's shards, offloaded activations.
int64_t host_need(const MemoryEstimateRow& row) {
  return (row.offload_optimizer ? row.host_optimizer_bytes : 0) + row.host_parameter_bytes + row.host_bytes;
}

// The configured offloading (zero_optimization's offload_optimizer and
// offload_param) as keys to set: a change of where the optimizer or the
// parameter shards live.
struct OffloadChange {
  parallel::OffloadDevice optimizer, param;
  std::string keys;
};
using Reestimate = std::function<MemoryEstimate(const OffloadChange&)>;

// The changes of offloading that bring what the host keeps back to the
// device, one key first, then both.
std::vector<OffloadChange> offload_backs(const MemoryEstimate& e) {
  using D = parallel::OffloadDevice;
  const D opt = e.offload_optimizer ? D::kCpu : D::kNone, param = e.offload_param ? D::kCpu : D::kNone;
  std::vector<OffloadChange> out;
  if (e.offload_optimizer) out.push_back({D::kNone, param, "zero_optimization.offload_optimizer.device=none"});
  if (e.offload_param) out.push_back({opt, D::kNone, "zero_optimization.offload_param.device=none"});
  if (e.offload_optimizer && e.offload_param) {
    out.push_back({D::kNone, D::kNone, "zero_optimization.offload_optimizer.device=none "
                                       "zero_optimization.offload_param.device=none"});
  }
  return out;
}

// A host too small for what the configuration keeps there: the cheapest
// change of offloading whose device and host parts both fit, else more host
// memory or more ranks.
std::string host_advice(const MemoryEstimate& e, double have, double host, const Reestimate& reestimate) {
  for (const OffloadChange& change : offload_backs(e)) {
    const MemoryEstimate back = reestimate(change);
    const MemoryEstimateRow& b = back.configured();
    if (b.feasible && b.peak_bytes <= have && host_need(b) <= host) {
      return str("; the cheapest change that fits: ", change.keys, " (estimated device peak ",
                 human_bytes(static_cast<double>(b.peak_bytes)), ", the host keeping ",
                 human_bytes(static_cast<double>(host_need(b))), ")");
    }
  }
  return "; give each rank more host memory (fewer ranks per host), or shard over more ranks (stage 3 divides the "
         "host's share among them)";
}

// The line saying whether the configuration fits: its device peak against
// `have` bytes per rank (`who` has them) and, beside a GPU, what it keeps on
// the host against `host` (0: unknown, not checked); where it does not, the
// cheapest change that fits both (`reestimate`: the config's estimate with
// its offloading changed). Whether it fits.
bool fit_line(const MemoryEstimate& e, double have, double host, const std::string& who,
              const std::string& host_source, const Reestimate& reestimate) {
  const MemoryEstimateRow& r = e.configured();
  const bool device_fits = r.peak_bytes <= have;
  const bool host_fits = host <= 0 || host_need(r) <= host;
  std::cout << who << human_bytes(have) << ": the configuration " << (device_fits && host_fits ? "fits" : "does not fit");
  if (!device_fits) {
    const std::string change =
        cheapest_fitting_change(e, static_cast<int64_t>(have), static_cast<int64_t>(std::max(host, 0.0)));
    std::cout << (change.empty() ? "; no row of the table fits: lower the batch size or the model's size"
                                 : "; the cheapest change that fits: " + change);
  } else if (!host_fits) {
    const auto [need, has] = human_bytes_apart(static_cast<double>(host_need(r)), host);
    std::cout << ": its device part fits, but what it keeps on the host, " << need << ", is more than the " << has
              << " each rank has there (" << host_source << ")"
              << host_advice(e, have, host, reestimate);
  }
  std::cout << "\n";
  return device_fits && host_fits;
}

// Where the configured row keeps the optimizer and the parameters, in words.
std::string placement(const MemoryEstimate& e, const MemoryEstimateRow& r) {
  const bool params = r.stage == 3 && e.offload_param;
  if (params && r.offload_optimizer) {
    return "the parameter shards (the optimizer's masters), their gradients and the optimizer's state on the host, "
           "the persistent parameters on the device";
  }
  if (params) {
    return "the parameter shards, their gradients and their optimizer state on the host (offload_param), the "
           "persistent parameters and theirs on the device";
  }
  return r.offload_optimizer ? "the optimizer on the host" : "the optimizer on the device";
}

// The verdict line of a GPU run (see the top): the device and the host, the
// configured row and, where the optimizer could move to the host, that row
// too (`offloaded`: the configured row of the config with it there). Whether
// the host part fits (`host` 0: unknown, not checked).
bool host_verdict(const MemoryEstimate& e, const MemoryEstimateRow* offloaded, const MemoryEstimateInputs& in,
                  double device, double host, const std::string& host_source) {
  const MemoryEstimateRow& r = e.configured();
  int64_t params = 0;
  for (const auto& p : in.parameters) params += p.numel;
  auto part = [&](const char* what, int64_t bytes, double have) {
    if (have <= 0) return str(what, " ", human_bytes(static_cast<double>(bytes)), " (its capacity unknown)");
    return str(what, " ", human_bytes(static_cast<double>(bytes)), " of ", human_bytes(have),
               bytes <= have ? ": fits" : ": does not fit");
  };
  const int64_t on_host = host_need(r);
  std::cout << "verdict: the GPT of the config, " << params << " parameters"
            << (e.tp > 1 ? " per tensor-parallel rank" : "") << ", ZeRO stage " << r.stage << ", "
            << placement(e, r) << ": " << part("device", r.peak_bytes, device) << "; "
            << part("host", on_host, host) << (host > 0 ? str(" (", host_source, ")") : "") << "\n";
  if (offloaded != nullptr) {
    std::cout << "  with zero_optimization.offload_optimizer.device=cpu: "
              << part("device", r.offload_optimizer_peak_bytes, device) << "; "
              << part("host", host_need(*offloaded), host) << "\n";
  }
  return host <= 0 || on_host <= host;
}

// --live's micro-batch search at the candidates up to `fit` (a divisor of
// `divides` when > 0): the GPT's forward and backward alone on this process
// (no sharding, no communication), with a rank's share of the cores as
// remat-run gives it (OMP_NUM_THREADS when set), under the same rule as
// remat-train's (engine/micro_batch_search.h); the model's gradients and
// the RNG left as found.
MicroBatchSearch search_here(models::Gpt& model, const Config& config, const data::Dataset& data,
                             c10::DeviceType device, int ranks, int64_t fit, int64_t divides) {
  const int threads = at::get_num_threads();
  if (!knobs::get(knobs::kOmpNumThreads)) {
    at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(ranks, 1)));
  }
  const at::Generator generator = at::detail::getDefaultCPUGenerator();
  const at::Tensor rng = generator.get_state();
  auto pass = [&](int64_t micro) {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    auto [x, y] = data.train_batch(static_cast<uint64_t>(config.train.seed), 0, 0, micro);
    const auto start = std::chrono::steady_clock::now();
    model->loss(x.to(at::Device(device)), y.to(at::Device(device))).backward();
    if (device == c10::DeviceType::CUDA) torch::cuda::synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const MicroBatchSearch s = search_micro_batch(micro_batch_candidates(fit, divides), config.model.seq_len, pass,
                                                [](std::vector<double> v) { return v; });
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  at::Generator(generator).set_state(rng);
  at::set_num_threads(threads);
  return s;
}

// The config's "auto" values decided for the run `facts` describe (a CUDA
// device here tells whether it has bf16; with none here, one that has it is
// assumed, and the reasons say so), as the lines printed above the table.
// An "auto" micro-batch: with `measure` (--live), the search's choice and
// its line; else the largest that fits, the most remat-train may choose.
std::string decide_autos(Config& config, GptAutoFacts facts, std::string& none_fits,
                         const std::function<MicroBatchSearch(int64_t fit, int64_t divides)>& measure) {
  if (config.auto_values.empty()) return "";
  facts.none_fits = &none_fits;  // the table at micro-batch 1 all the same
  facts.assumed_gpu = facts.device.is_cuda() && cuda_device_count() == 0;
  if (facts.device.is_cuda()) facts.computes_bf16 = facts.assumed_gpu || cuda_computes_bf16(0);
  std::string search_line;
  if (decide_gpt_autos(config, facts)) {
    const MicroBatchChooser fit = gpt_micro_batch_fit(config, facts);
    decide_batch_autos(config, facts.dp, [&](int64_t limit) -> MicroBatchChoice {
      const MicroBatchChoice f = fit(limit);
      const int64_t divides = config.train_batch_size ? limit : 0;
      if (f.micro < 1 || !none_fits.empty()) return f;  // remat-train refuses it: nothing to measure
      if (measure) {
        const MicroBatchSearch s = measure(f.micro, divides);
        search_line = "  " + s.line() + " (--live: on this process alone, without the sharding's communication)\n";
        return {s.chosen_micro(), str(s.why(), "; ", f.micro, ": ", f.why)};
      }
      std::string candidates;
      for (int64_t m : micro_batch_candidates(f.micro, divides)) candidates += (candidates.empty() ? "" : ", ") + str(m);
      return {f.micro, str(f.why, "; the most remat-train may choose: at start it measures the candidates ", candidates,
                           " and takes the smallest within ", MicroBatchSearchOptions{}.tolerance * 100,
                           " % of the best tokens/s (remat-estimate --live measures them here)")};
    });
  }
  std::string out = "\"auto\" values, as remat-train would decide them here:\n";
  for (const auto& line : auto_lines(config)) out += "  " + line + "\n";
  return out + search_line + "\n";
}

// The GPT of `config` on this process, for --live: seeded as remat-train
// seeds it, in the precision it computes in, on `device`, in training mode.
models::Gpt live_model(const Config& config, const data::Dataset& data, c10::DeviceType device) {
  at::manual_seed(static_cast<uint64_t>(config.train.seed));
  models::GptOptions options;
  options.shape = config.model;
  options.vocab_size = data.vocab_size();
  models::Gpt model(options);
  // bf16 and fp16 compute in 16 bits: profiled so.
  if (config.bf16.enabled) model->to(at::kBFloat16);
  if (config.fp16.enabled) model->to(at::kHalf);
  if (device == c10::DeviceType::CUDA) model->to(at::Device(device));
  model->train();
  return model;
}

// Where the estimated run computes: --device when given, else the config's
// train.device. auto is a GPU where this process sees one, else the CPU (as
// remat-train resolves it); cuda and cuda:N are a GPU, here or not.
c10::DeviceType estimated_device(const std::string& flag, const Config& config) {
  const std::string spec = flag.empty() ? config.train.device : flag;
  if (spec == "cpu") return c10::DeviceType::CPU;
  if (spec == "auto") return cuda_device_count() > 0 ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  return c10::DeviceType::CUDA;
}

// fp16 where the estimated device cannot compute it: remat-train's refusal.
// A GPU that is not here cannot be asked (every CUDA GPU computes fp16).
void check_fp16(const Config& config, c10::DeviceType device) {
  if (device == c10::DeviceType::CUDA && cuda_device_count() == 0) return;
  check_fp16_device(config, c10::Device(device, device == c10::DeviceType::CUDA ? 0 : -1));
}

// What --live needs: one process without tensor parallelism, and a GPU for --device cuda.
void check_live(const Config& config, bool cuda) {
  if (config.tensor_parallel.size != 1) {
    throw ConfigError(str("--live builds the model on this one process, without tensor parallelism, but "
                          "tensor_parallel.size is ", config.tensor_parallel.size,
                          ": estimate it cold (without --live), or with --set tensor_parallel.size=1"));
  }
  if (cuda && !at::hasCUDA()) {
    throw ConfigError("--live --device cuda profiles the model on a GPU, but this process has none (or LibTorch "
                      "is built without CUDA): estimate it cold (without --live)");
  }
}

// remat-estimate's flags as given.
struct EstimateFlags {
  std::string config_path, json_path, device_name;
  std::vector<std::string> overrides;
  int ranks = 1;
  bool live = false;
  std::optional<std::string> steps;  // as remat-train takes it: what "auto" scheduler values follow
  int64_t host_memory = 0;
};

void add_flags(CLI::App& app, EstimateFlags& f) {
  app.add_option("--config", f.config_path, "JSON configuration (default: the embedded one)");
  app.add_option("--set", f.overrides, "override a key: --set model.n_layer=8 (repeatable)");
  app.add_option("-n,--np,--ranks", f.ranks, "the number of ranks the run would have (data x tensor parallel)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_flag("--live", f.live, "build the model on this process and profile one step (else: from the sizes alone)");
  app.add_option("--json", f.json_path, "also write the rows as JSON to this file");
  app.add_option("--steps", f.steps, "optimizer steps (train.steps), as remat-train's --steps");
  app.add_option("--device", f.device_name,
                 "where the model computes: cpu, cuda (a GPU per rank) or auto (a GPU where this process sees one, "
                 "else the CPU); default: the config's train.device")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--host-memory", f.host_memory,
                 "with --device cuda: the host memory each rank has, in bytes, for what offloading keeps there "
                 "(default: this host's physical memory over the ranks)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 60));
}

// One process estimates every rank: started by a launcher as one of
// several, each would print the same table for 1 rank over a divided host.
void refuse_launcher_ranks() {
  if (const ProcessEnv env = detect_process_env(); env.world_size > 1) {
    throw ConfigError(str("remat-estimate runs as one process and estimates the ranks it is given with -np; it was "
                          "started as rank ", env.rank, " of ", env.world_size, " (", env.source,
                          " variables): run it without mpirun, as remat-estimate -np ", env.world_size, " ..."));
  }
}

Config load_estimate_config(EstimateFlags& f) {
  if (f.steps) f.overrides.push_back("train.steps=" + *f.steps);
  Config config = f.config_path.empty() ? parse_config(default_config_text(), "<embedded default>", f.overrides)
                                        : load_config(f.config_path, f.overrides);
  if (f.ranks % config.tensor_parallel.size != 0) {
    throw ConfigError(str("-np ", f.ranks, " is not a multiple of tensor_parallel.size ", config.tensor_parallel.size,
                          ": give a number of ranks that is"));
  }
  return config;
}

// What the estimate is for and judged by.
struct EstimateTarget {
  c10::DeviceType device = c10::DeviceType::CPU;
  bool cuda = false;
  bool given = false;  // REMAT_MEMORY_PER_RANK_BYTES set
  double have = 0;     // what each rank has: given, else its GPU, else its share of this host
};

EstimateTarget estimate_target(const EstimateFlags& f, const Config& config) {
  EstimateTarget t;
  t.device = estimated_device(f.device_name, config);
  t.cuda = t.device == c10::DeviceType::CUDA;
  if (f.host_memory > 0 && !t.cuda) {
    throw ConfigError(str("--host-memory is the host's memory beside a GPU (--device cuda); the estimate is for ",
                          f.device_name.empty() ? str("train.device ", config.train.device) : "--device " + f.device_name,
                          ", the CPU, where the host is the device: give its memory per rank as "
                          "REMAT_MEMORY_PER_RANK_BYTES"));
  }
  t.given = knobs::get(knobs::kMemoryPerRankBytes).has_value();
  t.have = t.given ? host_bytes_per_rank()
           : t.cuda ? static_cast<double>(device_memory(c10::Device(t.device, 0)).capacity)
                    : host_bytes_per_rank() / f.ranks;
  return t;
}

// The estimator's inputs: the live model's profile of one step, or the
// config's sizes.
MemoryEstimateInputs estimate_inputs(const EstimateFlags& f, const Config& config, const data::Dataset& data,
                                     const EstimateTarget& t, std::optional<models::Gpt>& model) {
  const BatchSizes batch = config.resolve_batch(f.ranks / config.tensor_parallel.size);
  MemoryEstimateInputs inputs;
  if (f.live) {
    if (!model) model = live_model(config, data, t.device);
    auto [x, y] = data.train_batch(static_cast<uint64_t>(config.train.seed), 0, 0, batch.micro_batch_per_gpu);
    x = x.to(at::Device(t.device)), y = y.to(at::Device(t.device));
    inputs = live_inputs(**model, "blocks", [&, x = x, y = y] { (*model)->loss(x, y).backward(); });
  } else {
    inputs = cold_gpt_inputs(config, data.vocab_size(), batch.micro_batch_per_gpu, t.device);
  }
  // The capacity beside the peak on a GPU; on the CPU only for "auto" (its
  // figures otherwise as they were). Either way what each rank has, the
  // figure the fit is judged by.
  if (t.cuda || config.activation_checkpointing.device_memory_budget_auto) {
    inputs.device_capacity_bytes = static_cast<int64_t>(t.have);
    inputs.device_capacity_given = t.given;
  }
  return inputs;
}

// The disk line of each nvme_path the configured row writes to: what this
// machine's `ranks` ranks keep there against the free space it has (a path
// not on this machine is said, not checked). Whether each fits.
bool disk_verdicts(const Config& config, const MemoryEstimateRow& r, int ranks) {
  std::map<std::string, std::pair<int64_t, std::string>> needs;  // path -> bytes per rank, what
  const auto& z = config.zero_optimization;
  if (r.disk_bytes > 0) {
    auto& [bytes, what] = needs[z.offload_optimizer.nvme_path.value_or("")];
    bytes += r.disk_bytes + r.disk_master_bytes;
    what = str("the Adam moments ", human_bytes(static_cast<double>(r.disk_bytes)),
               r.disk_master_bytes > 0 ? " + the masters " + human_bytes(static_cast<double>(r.disk_master_bytes))
                                       : std::string());
  }
  if (r.disk_parameter_bytes > 0) {
    auto& [bytes, what] = needs[z.offload_param.nvme_path.value_or("")];
    bytes += r.disk_parameter_bytes;
    what += str(what.empty() ? "" : " + ", "the parameter shards ", human_bytes(static_cast<double>(r.disk_parameter_bytes)));
  }
  bool fits = true;
  for (const auto& [path, need] : needs) {
    const double total = static_cast<double>(need.first) * ranks;
    std::cout << "disk: nvme_path '" << path << "' holds " << need.second << " per rank, "
              << human_bytes(total) << " for " << ranks << (ranks == 1 ? " rank" : " ranks");
    struct statvfs fs {};
    if (::statvfs(path.c_str(), &fs) != 0) {
      std::cout << "; it is not on this machine (" << std::strerror(errno) << "), so its free space is not checked\n";
      continue;
    }
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
      fits = false;  // remat-train refuses it at start
      std::cout << "; it is not a folder: give nvme_path a folder on a fast local disk\n";
      continue;
    }
    const double free = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
    const bool here = total <= free;
    fits &= here;
    std::cout << "; it has " << human_bytes(free) << " free: "
              << (here ? "fits" : "does not fit: free space there, or give nvme_path a larger disk") << "\n";
  }
  return fits;
}

// The fit lines under the table; false: the configuration does not fit.
bool fit_verdicts(const EstimateFlags& f, const Config& config, const MemoryEstimate& e,
                  const MemoryEstimateInputs& inputs, const EstimateTarget& t) {
  const int ranks = f.ranks;
  // Beside a GPU: the host memory each rank has for what offloading keeps there (0: unknown).
  const double host = !t.cuda                                       ? 0.0
                      : f.host_memory > 0                           ? static_cast<double>(f.host_memory)
                      : knobs::get(knobs::kMemoryPerRankBytes)      ? 0.0
                                                                    : host_bytes_per_rank() / ranks;
  const std::string host_source =
      f.host_memory > 0 ? "--host-memory" : str("this host's physical memory over ", ranks, " ranks");
  // The same config with the optimizer or the parameter shards moved.
  auto reestimate = [&](const OffloadChange& change) {
    Config changed = config;
    changed.zero_optimization.offload_optimizer.device = change.optimizer;
    changed.zero_optimization.offload_param.device = change.param;
    return estimate_memory(changed, ranks, inputs);
  };
  bool fits = true;
  if (t.have > 0) {
    const std::string who = t.given ? "each rank has "
                            : t.cuda ? "each rank's GPU has "
                                     : str("with ", ranks, " ranks on this host, each has about ");
    fits = fit_line(e, t.have, host, who, host_source, reestimate);
  } else if (t.cuda) {
    std::cout << "no GPU here to read its capacity: set REMAT_MEMORY_PER_RANK_BYTES to the bytes of a rank's GPU "
                 "to check the fit\n";
  }
  if (t.cuda) {
    // The optimizer moved to the host: its row, offload_param's shards then without their state.
    std::optional<MemoryEstimate> offloaded;
    if (!e.configured().offload_optimizer && e.configured().offload_optimizer_peak_bytes > 0) {
      offloaded = reestimate({parallel::OffloadDevice::kCpu, config.zero_optimization.offload_param.device, ""});
    }
    fits &= host_verdict(e, offloaded ? &offloaded->configured() : nullptr, inputs, t.have, host, host_source);
  }
  fits &= disk_verdicts(config, e.configured(), ranks);
  return fits;
}

// --json: the rows, and the keys given "auto": what each became, and why.
void write_json(const std::string& path, const MemoryEstimate& e, const Config& config) {
  nlohmann::json rows = e.to_json();
  rows["auto"] = nlohmann::json::object();
  for (const auto& a : config.auto_values) {
    rows["auto"][a.key] = {{"value", nlohmann::json::parse(a.value)}, {"why", a.why}};
  }
  std::ofstream out(path);
  out << rows.dump(1) << "\n";
  if (!out) {
    throw ConfigError(str("cannot write --json file '", path, "' (", std::strerror(errno), "): give a writable path"));
  }
}

int estimate(int argc, char** argv) {
  CLI::App app{"remat-estimate: the memory remat-train's configuration needs per rank, before running it"};
  EstimateFlags f;
  add_flags(app, f);
  // -np N, as mpirun spells it.
  std::vector<std::string> args;
  for (int i = argc - 1; i > 0; --i) args.push_back(std::string(argv[i]) == "-np" ? "--np" : argv[i]);
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  refuse_launcher_ranks();
  // Checked before the estimate, by the rule of remat-train's outputs.
  if (app.count("--json") > 0) check_output_file({"--json", f.json_path, "estimate.json"});
  Config config = load_estimate_config(f);
  const int ranks = f.ranks, dp = ranks / config.tensor_parallel.size;
  data::Dataset data = data::Dataset::load(config.data.path, config.data.train_fraction, config.model.seq_len);
  const EstimateTarget t = estimate_target(f, config);
  if (f.live) check_live(config, t.cuda);
  // --live: the model, built once the precision is decided (its search and its profile).
  std::optional<models::Gpt> model;
  std::function<MicroBatchSearch(int64_t, int64_t)> measure;
  if (f.live) {
    measure = [&](int64_t fit, int64_t divides) {
      model = live_model(config, data, t.device);
      return search_here(*model, config, data, t.device, ranks, fit, divides);
    };
  }
  std::string none_fits;  // not even a micro-batch of 1 fits "auto": why
  const std::string auto_table = decide_autos(config, {dp, ranks, data.vocab_size(), data.train_size(),
                                                       c10::Device(t.device), false, t.have,
                                                       t.given ? "REMAT_MEMORY_PER_RANK_BYTES"
                                                       : t.cuda ? "the first GPU's capacity"
                                                                : str("this host's physical memory over ", ranks,
                                                                      " ranks")},
                                              none_fits, measure);
  std::cout << auto_table << std::flush;  // what was decided, before a refusal as after it
  check_fp16(config, t.device);
  const MemoryEstimateInputs inputs = estimate_inputs(f, config, data, t, model);
  const MemoryEstimate e = estimate_memory(config, ranks, inputs);
  std::cout << e.table() << e.line() << "\n";
  const bool fits = fit_verdicts(f, config, e, inputs, t);
  if (!f.json_path.empty()) write_json(f.json_path, e, config);
  if (!none_fits.empty()) {
    // remat-train's refusal, after the table that shows what each configuration needs.
    std::cout << "remat-train refuses this config: train_micro_batch_size_per_gpu is \"auto\" and not even a "
                 "micro-batch of 1 fits (" << none_fits << "); the rows above are at micro-batch 1: pick the "
                 "row or change that fits, or give each rank more memory\n";
    return 2;
  }
  return fits ? 0 : 2;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::estimate(argc, argv); });
}
