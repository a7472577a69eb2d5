// remat-train: a GPT trained on the embedded corpus (or data.path), data
// parallel across ranks, with the activation checkpointing the config asks for.
//
//   remat-run -np 2 -- remat-train --config configs/default.json [--set key=value ...]
//       [--steps N] [--seed S] [--metrics FILE] [--save-dir DIR [--overwrite-saves]] [--resume DIR]
//       [--export FILE]
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/types.h>  // clip_grad.h needs torch::Tensor declared first
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "checkpointing/policy.h"
#include "nn/saved_tensors_hooks.h"
#include "data/dataset.h"
#include "engine/export.h"
#include "engine/optim.h"
#include "engine/step_counters.h"
#include "engine/train_state.h"
#include "models/gpt.h"
#include "parallel/layers.h"
#include "parallel/zero.h"
#include "rng/rng_tracker.h"
#include "runtime/agreement.h"
#include "engine/config.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Settings that would have no effect are pointed out.
void warn_ineffective(const Config& c) {
  const auto& ac = c.activation_checkpointing;
  if (ac.variant == CheckpointVariant::kNone &&
      (ac.partition_activations || ac.cpu_checkpointing || ac.contiguous_memory_optimization)) {
    log_rank0().warn("activation_checkpointing.variant is none, so partition_activations, "
                     "cpu_checkpointing and contiguous_memory_optimization have no region to "
                     "act on; set variant to full, selective_layer or selective_op");
  }
  if (ac.variant == CheckpointVariant::kAuto &&
      (ac.save_ops || ac.every_k != 1 || ac.every_k_from != EveryKFrom::kFirst)) {
    log_rank0().warn("activation_checkpointing.variant is auto: save_ops, every_k and every_k_from are not "
                     "used (the planner chooses per block between the default and the matmul op lists, "
                     "full checkpoints and keeping)");
  }
  if (ac.partition_activations && c.tensor_parallel.size == 1) {
    log_rank0().warn("activation_checkpointing.partition_activations with tensor_parallel.size 1 "
                     "keeps whole inputs (there is no group to split them across)");
  }
}

bool gradients_finite(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> checks;
  for (const auto& p : parameters) {
    if (p.grad().defined() && p.grad().numel() > 0) checks.push_back(at::isfinite(p.grad()).all());
  }
  return checks.empty() || at::stack(checks).all().item<bool>();
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  return str(std::round(b * 10) / 10, " ", units[u]);
}

// Host memory available to this process: MemAvailable shared by the ranks on
// this host; 0 when unknown.
double available_bytes_per_rank() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key) {
    if (key == "MemAvailable:") {
      meminfo >> kib;
      break;
    }
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  int local_ranks = 1;
  if (auto v = knobs::get("OMPI_COMM_WORLD_LOCAL_SIZE")) local_ranks = std::max(1, std::atoi(v->c_str()));
  return kib * 1024 / local_ranks;
}

// A lower bound of what one rank needs, from the config alone (computed in
// double, so absurd sizes cannot overflow): fp32 parameters, gradients and
// AdamW's two moments (16 bytes a parameter: 4 + 4 + 8 / N at ZeRO stage 1,
// 4 + 12 / N at stage 2, 16 / N at stage 3 over N sharding ranks; all divided
// by the tensor-parallel size), each block's input kept for backward, and the logits. A run
// whose lower bound exceeds the memory there is refused before anything is
// built, naming the keys to change.
void check_memory_estimate(const Config& c, const BatchSizes& batch, int64_t vocab, int dp) {
  const auto& m = c.model;
  const double d = m.d_model, L = m.n_layer, T = m.seq_len, B = static_cast<double>(batch.micro_batch_per_gpu);
  const double params = (vocab + T) * d + L * (4 * d * d + 2 * d * m.d_ff) + vocab * d;
  const int hybrid = c.zero_optimization.hybrid_shard_size;
  const double n = hybrid > 0 && hybrid < dp ? hybrid : dp;
  const double per_param[] = {16, 8 + 8 / n, 4 + 12 / n, 16 / n};
  const double model_bytes = per_param[std::clamp(c.zero_optimization.stage, 0, 3)] * params /
                             static_cast<double>(c.tensor_parallel.size);
  const double activation_bytes = 4 * B * T * (L * d + vocab);
  const double need = model_bytes + activation_bytes;
  const double have = available_bytes_per_rank();
  if (have > 0 && need > have) {
    throw ConfigError(str("this config needs at least ", human_bytes(need), " per rank (model state ",
                          human_bytes(model_bytes), ", one step's activations ", human_bytes(activation_bytes),
                          " at train_micro_batch_size_per_gpu ", batch.micro_batch_per_gpu,
                          ") but about ", human_bytes(have),
                          " is available to each rank on this host: lower train_micro_batch_size_per_gpu, "
                          "model.seq_len or the model's size (model.n_layer, model.d_model, model.d_ff)"));
  }
}

class Progress {
 public:
  Progress(int64_t first, int64_t total, int64_t every, bool enabled)
      : first_(first), total_(total), every_(every), enabled_(enabled),
        terminal_(use_bar()), start_(Clock::now()) {}

  // REMAT_PROGRESS=bar|lines; unset: a bar when stdout is a terminal and no
  // launcher is in between (Open MPI hands ranks a pty, so remat-run decides).
  static bool use_bar() {
    auto mode = knobs::get(knobs::kProgress);
    if (mode) {
      if (*mode != "bar" && *mode != "lines") {
        throw ConfigError(str(knobs::kProgress, "='", *mode, "' must be bar or lines"));
      }
      return *mode == "bar";
    }
    return ::isatty(::fileno(stdout)) != 0 && !knobs::get("OMPI_COMM_WORLD_SIZE");
  }

  void step(int64_t step, double loss, double tokens_per_s, int64_t peak) {
    if (!enabled_) return;
    double elapsed = ms_between(start_, Clock::now()) / 1000;
    double eta = (step > first_) ? elapsed / (step - first_) * (total_ - step) : 0;
    if (terminal_) {
      int width = 30, filled = static_cast<int>(width * step / std::max<int64_t>(total_, 1));
      std::printf("\r[%s%s] %lld/%lld loss %.4f  %.0f tok/s  peak %s  ETA %02d:%02d ",
                  std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(),
                  static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s,
                  human_bytes(static_cast<double>(peak)).c_str(), static_cast<int>(eta) / 60,
                  static_cast<int>(eta) % 60);
      if (step == total_) std::printf("\n");
    } else if (step % every_ == 0 || step == first_ + 1 || step == total_) {
      std::printf("step %lld/%lld  loss %.4f  %.0f tok/s  peak %s  eta %.0fs\n",
                  static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s,
                  human_bytes(static_cast<double>(peak)).c_str(), eta);
    }
    std::fflush(stdout);
  }

  void line(const std::string& text) {
    if (!enabled_) return;
    std::printf("%s%s\n", terminal_ ? "\n" : "", text.c_str());
    std::fflush(stdout);
  }

 private:
  int64_t first_, total_, every_;
  bool enabled_, terminal_;
  Clock::time_point start_;
};

// A resumed run's --metrics file keeps only the lines of the steps up to the
// one it resumed at: a run resumed from an earlier step writes the later ones
// again. Rewritten to a temporary file beside it, then renamed over it; a
// device or fifo is left as it is.
void keep_metrics_through(const std::string& path, int64_t step) {
  std::error_code ec;
  const std::string real = std::filesystem::canonical(path, ec).string();  // through a symbolic link
  struct stat st {};
  if (ec || ::stat(real.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  std::ifstream in(real);
  std::string line, kept;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    // A line cut short by a killed run is not a step: dropped too.
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step) {
      kept += line + "\n";
    } else {
      ++dropped;
    }
  }
  if (dropped == 0) return;
  auto failed = [&](const std::string& what) {
    return ConfigError(str("cannot rewrite the --metrics file '", path, "' to keep its steps up to ", step,
                           ": ", what, " (", std::strerror(errno), "); give a file path in a writable folder"));
  };
  std::string tmp = real + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) throw failed("cannot create a file beside it");
  ::fchmod(fd, st.st_mode & 07777);
  const bool written = ::write(fd, kept.data(), kept.size()) == static_cast<ssize_t>(kept.size()) && ::fsync(fd) == 0;
  if (::close(fd) != 0 || !written || ::rename(tmp.c_str(), real.c_str()) != 0) {
    const ConfigError error = failed(str("writing '", tmp, "' failed"));
    ::unlink(tmp.c_str());
    throw error;
  }
  log().info("--metrics '{}': kept the lines of steps up to {}, dropped {} later or incomplete ones", path, step,
             dropped);
}

int train(int argc, char** argv) {
  CLI::App app{"remat-train: train a GPT with remat's activation checkpointing"};
  std::string config_path, metrics_path, save_dir, resume_dir, export_path, backend = "auto";
  std::vector<std::string> overrides;
  std::optional<std::string> steps_flag, seed_flag;
  app.add_option("--config", config_path, "JSON configuration (default: the embedded one)");
  app.add_option("--set", overrides, "override a key: --set model.n_layer=8 (repeatable)");
  app.add_option("--steps", steps_flag, "optimizer steps (train.steps)");
  app.add_option("--seed", seed_flag, "seed (train.seed)");
  app.add_option("--metrics", metrics_path, "write one JSON object per step (rank 0)");
  app.add_option("--save-dir", save_dir, "save the training state here (a folder holding another run's "
                 "saves is refused unless --resume continues them or --overwrite-saves is given)");
  bool overwrite_saves = false;
  app.add_flag("--overwrite-saves", overwrite_saves, "let this run replace the saves in --save-dir: those "
               "after the step it starts from (all of them without --resume) are removed once it has started");
  app.add_option("--resume", resume_dir, "resume from a save (a step folder or the save root), at any "
                 "data-parallel size and ZeRO stage");
  app.add_option("--export", export_path, "after training (and the final save), write the whole model (full "
                 "parameters by state-dict name) to this file, for torch::pickle_load or Python's torch.load; "
                 "checked at start: a regular file or a new one, in a folder with room for it");
  app.add_option("--backend", backend, "communication backend: auto, mpi or nccl");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  MemoryTracker memory;  // first: everything allocated from here on is counted
  auto& runtime = Runtime::init();
  // The flags are overrides like any other: validated the same way.
  if (steps_flag) overrides.push_back("train.steps=" + *steps_flag);
  if (seed_flag) overrides.push_back("train.seed=" + *seed_flag);
  Config config = config_path.empty()
                      ? parse_config(default_config_text(), "<embedded default>", overrides)
                      : load_config(config_path, overrides);
  warn_ineffective(config);
  knobs::fault_save_pause();  // a bad value stops the run now, not at its first save
  const auto& tc = config.train;

  auto world = runtime.world(parse_backend(backend));
  // Every rank runs what the others run: ranks configured differently would
  // hang in a collective only some of them make, or train diverging replicas.
  {
    std::map<std::string, std::string> settings;
    const nlohmann::json flat = nlohmann::json::parse(config.to_json()).flatten();
    for (const auto& item : flat.items()) {
      std::string key = item.key().substr(1);
      std::replace(key.begin(), key.end(), '/', '.');
      settings[key] = item.value().dump();
    }
    settings["--backend"] = backend;
    for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--save-dir", &save_dir},
                                      {"--resume", &resume_dir}, {"--export", &export_path}}) {
      settings[flag] = value->empty() ? "not given" : "given";
    }
    require_same_settings(*world, settings, "configurations or flags");
  }
  // Checked, created and locked before anything is trained: a run must not
  // find out at its first save that it cannot keep its work.
  const std::string run_id = new_run_id(*world);
  std::unique_ptr<SaveDirLock> save_lock;
  if (!save_dir.empty()) {
    SaveDirOptions options;
    options.resuming = !resume_dir.empty();
    options.overwrite = overwrite_saves;
    save_lock = std::make_unique<SaveDirLock>(save_dir, run_id, *world, options);
  } else if (overwrite_saves) {
    throw ConfigError("--overwrite-saves without --save-dir: give the --save-dir whose saves this run may replace");
  }
  // The export is written after training: a path it cannot be written to
  // stops the run now (its size is checked once the model is built).
  if (!export_path.empty() && world->rank() == 0) check_export_path(export_path);
  ParallelLayout layout(world, ParallelDims::from_world(world->size(), config.tensor_parallel.size));
  const BatchSizes batch = config.resolve_batch(layout.dims().dp);
  data::Dataset data = data::Dataset::load(config.data.path, config.data.train_fraction,
                                           config.model.seq_len);
  check_memory_estimate(config, batch, data.vocab_size(), layout.dims().dp);
  const bool rank0 = world->rank() == 0;

  at::manual_seed(tc.seed);
  models::GptOptions model_options;
  model_options.shape = config.model;
  model_options.vocab_size = data.vocab_size();
  const auto& tp_group = layout.tp_group();
  if (layout.dims().tp_enabled()) model_options.tensor_parallel = tp_group;
  models::Gpt model(model_options);
  const std::string signature = model->options().to_string();
  model_parallel_manual_seed(static_cast<uint64_t>(tc.seed), layout);
  const auto sharded = parallel::sharded_parameters(*model);

  // The JSON section takes effect by itself: partitioning, offload and
  // contiguous buffers become the defaults every region starts from.
  // Regions are timed whatever the profile key says: recompute time goes into the metrics.
  // Non-reentrant regions (and activation offloading) answer autograd's
  // saved-tensor hooks query through remat's engine: installed before any backward.
  install_saved_tensors_hooks_engine();
  ActivationCheckpointingConfig checkpointing = config.activation_checkpointing;
  checkpointing.profile = true;
  configure_checkpointing(checkpointing, &layout);
  PolicyOptions policy = PolicyOptions(config.activation_checkpointing);
  // variant auto: planned from a profiling step at the first step (and again
  // whenever the batch shape changes).
  const bool auto_plan = policy.variant == CheckpointVariant::kAuto;
  int regions = auto_plan ? 0 : apply_activation_checkpointing(*model, policy);
  PlannerOptions planner_options;
  planner_options.blocks = policy.blocks;
  planner_options.memory_budget_bytes = config.activation_checkpointing.memory_budget_bytes;
  planner_options.memory_budget_fraction = config.activation_checkpointing.memory_budget_fraction;
  planner_options.offload = config.activation_offloading;
  ActivationPlanner planner(*model, planner_options, world.get());
  double plan_ms = 0;
  // Activation offloading: each forward runs inside a scope; the head stays.
  const ActivationOffloadingConfig& offloading = config.activation_offloading;
  prepare_output_head(*model, offloading);  // offloading off: only checks a named head exists
  const auto& number_checkpoints = config.activation_checkpointing.number_checkpoints;
  // The planner profiles every block as a region: each may need a slot.
  if (auto_plan && number_checkpoints && *number_checkpoints < config.model.n_layer) {
    throw ConfigError(str("activation_checkpointing.variant is auto, which may checkpoint every block, but "
                          "number_checkpoints is ", *number_checkpoints, ": set number_checkpoints to model.n_layer (",
                          config.model.n_layer, ")",
                          config.activation_checkpointing.contiguous_memory_optimization
                              ? ""
                              : " or leave it out"));
  }
  if (number_checkpoints && regions > *number_checkpoints) {
    throw ConfigError(str("activation_checkpointing.number_checkpoints is ", *number_checkpoints,
                          " but the policy marks ", regions, " regions per forward: set it to ",
                          regions, " (or leave it out)"));
  }
  // Sharding over the data-parallel group (stage 3) or plain data parallel
  // (stage 0); the optimizer steps what the sharding hands it.
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& block : *model->blocks) units.push_back(block);
  parallel::ZeroModel zero(*model, units, layout.dp_group(), config.zero_optimization, config.bf16,
                 sharded);
  auto optimizer = make_optimizer(config.optimizer, zero.parameters());
  // Every setting the saved state's layout or meaning depends on: a resume
  // with another value is refused naming it.
  SaveIdentity identity;
  identity.model_signature = signature;
  identity.run_id = run_id;
  // train.seed: the data order of every step comes from it (the random state
  // from the save), so another seed would silently change the data stream.
  identity.settings = {
      {"tensor_parallel.size", std::to_string(config.tensor_parallel.size)},
      {"optimizer.type", config.optimizer.type},
      {"train.seed", std::to_string(tc.seed)}};
  // The export's size is known now: a disk without room for it stops the run
  // before training, not after.
  if (!export_path.empty() && rank0) check_export_space(export_path, estimated_export_bytes(*model));
  // What this rank saves and resumes: its optimizer's tensors and their layout
  // (any data-parallel size and ZeRO stage resumes any other).
  auto train_shards = [&] {
    TrainShards shards;
    shards.tensors = zero.parameters();
    shards.layout = zero.layout();
    shards.tp_rank = layout.tp_rank();
    shards.tp_size = layout.dims().tp;
    shards.dp_rank = layout.dp_rank();
    shards.dp_size = layout.dims().dp;
    return shards;
  };
  TrainPosition position;
  if (!resume_dir.empty()) {
    position = load_train_state(resume_dir, train_shards(), *optimizer, identity, *world);
    log_rank0().info("resumed from '{}' at step {}", resume_dir, position.step);
  }
  // Saves of an earlier run later than where this one starts: replaced when
  // asked, else kept (`latest` stays on them until this run passes them).
  if (!save_dir.empty() && overwrite_saves) {
    discard_saves_after(save_dir, position.step, *world);
  } else if (!save_dir.empty() && rank0 && latest_step(save_dir) > position.step) {
    log_rank0().warn("--save-dir '{}' holds saves up to step {} and this run starts at step {}: its saves "
                     "replace those of the same steps, and 'latest' stays on step {} until this run passes "
                     "it; pass --overwrite-saves to remove the later saves instead",
                     save_dir, latest_step(save_dir), position.step, latest_step(save_dir));
  }
  log_rank0().info("data {} ({} bytes, vocabulary {}), model {} ({} parameters on this rank), "
                   "checkpointing {} ({}), batch {} = micro {} x accumulation {} x dp {}",
                   data.source(), data.train_size() + data.val_size(), data.vocab_size(), signature,
                   model->num_parameters(), checkpoint_variant_name(config.activation_checkpointing.variant),
                   auto_plan ? std::string("planned at the first step") : str(regions, " regions"),
                   batch.train_batch_size, batch.micro_batch_per_gpu,
                   batch.gradient_accumulation_steps, layout.dims().dp);

  std::ofstream metrics;
  if (rank0 && !metrics_path.empty()) {
    if (position.step > 0) keep_metrics_through(metrics_path, position.step);
    metrics.open(metrics_path, position.step > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) {
      throw ConfigError(str("cannot write --metrics file '", metrics_path, "' (", std::strerror(errno),
                            "): give a writable file path"));
    }
  }
  if (position.step >= tc.steps && rank0) {
    std::printf("nothing to train: train.steps is %lld and the run %s\n",
                static_cast<long long>(tc.steps),
                position.step > 0 ? str("resumed at step ", position.step).c_str() : "starts at step 0");
  }
  const auto& dp_group = layout.dp_group();
  Progress progress(position.step, tc.steps, config.steps_per_print, rank0);
  const int64_t tokens_per_step = batch.train_batch_size * config.model.seq_len;
  const int64_t first_step = position.step + 1;
  double first_loss = 0, last_loss = 0;
  int64_t max_peak = 0;

  for (int64_t step = position.step + 1; step <= tc.steps; ++step) {
    const double lr = learning_rate(config.optimizer, config.scheduler, step);
    set_learning_rate(*optimizer, lr);
    model->train();
    bool planned = false;
    if (auto_plan) {
      auto [x, y] = data.train_batch(static_cast<uint64_t>(tc.seed), layout.dp_rank(), position.window,
                                     batch.micro_batch_per_gpu);
      // One forward and backward of this step's first micro-batch per
      // profiling run; the planner puts the RNG back, the gradients are
      // zeroed below.
      auto profile_step = [&, x = x, y = y] {
        zero.begin_forward();
        std::unique_ptr<OffloadActivations> offload;
        if (offloading.enabled) offload = std::make_unique<OffloadActivations>(offloading, model.get());
        at::Tensor loss = zero.finish_forward(model->loss(x, y));
        offload.reset();
        loss.backward();
        zero.finish_backward(/*synchronize=*/true);
      };
      const auto t0 = Clock::now();
      planned = planner.ensure(x.sizes().vec(), profile_step);
      if (planned) {
        plan_ms = ms_between(t0, Clock::now());
        const auto& choices = planner.plan()->choices;
        regions = static_cast<int>(std::count_if(choices.begin(), choices.end(), [](BlockChoice c) {
          return c != BlockChoice::kKeep && c != BlockChoice::kOffloadActivations;
        }));
      }
    }
    // Gradients set to none, as LibTorch 2.x's zero_grad does (1.13's zeroes
    // them in place: ZeRO stage 1 would hold its shards' gradients through the
    // backward). Before the base is read: the last step's gradients are not
    // this step's memory.
    for (auto& p : zero.parameters()) p.mutable_grad() = at::Tensor();
    const int64_t base = memory.current();
    memory.reset_peak();
    zero.reset_peak();
    const Counters before = Counters::read(&zero);
    auto start = Clock::now();
    double fwd_ms = 0, bwd_ms = 0, opt_ms = 0, loss_sum = 0;
    int64_t saved = 0, comm_bytes = 0;
    // At the end of a forward: host copies of offloaded activations, saved
    // tensors offloading left on the device, and all the device holds for backward.
    int64_t act_host = 0, act_kept = 0, fwd_held = 0;
    // What the activation budget bounds: each micro-step's forward and
    // backward above what was held when it began (parameters, optimizer
    // state, earlier micro-steps' gradients); the optimizer's step is not in it.
    int64_t act_peak = 0, step_peak = 0;
    for (int64_t micro = 0; micro < batch.gradient_accumulation_steps; ++micro) {
      auto [x, y] = data.train_batch(static_cast<uint64_t>(tc.seed), layout.dp_rank(),
                                     position.window, batch.micro_batch_per_gpu);
      position.window += batch.micro_batch_per_gpu;
      step_peak = std::max(step_peak, memory.peak());
      const int64_t micro_base = memory.current();
      memory.reset_peak();
      auto t0 = Clock::now();
      zero.begin_forward();
      std::unique_ptr<OffloadActivations> offload;
      if (offloading.enabled) offload = std::make_unique<OffloadActivations>(offloading, model.get());
      at::Tensor loss = zero.finish_forward(
          model->loss(x, y) / static_cast<double>(batch.gradient_accumulation_steps));
      offload.reset();
      const Counters held = Counters::read();
      saved = std::max(saved, held.checkpoint_saved_bytes);
      act_host = std::max(act_host, held.offload.host_bytes);
      act_kept = std::max(act_kept, held.offload.kept_bytes);
      fwd_held = std::max(fwd_held, memory.current() - micro_base);
      auto t1 = Clock::now();
      loss.backward();
      zero.finish_backward(/*synchronize=*/micro + 1 == batch.gradient_accumulation_steps);
      act_peak = std::max(act_peak, memory.peak() - micro_base);
      auto t2 = Clock::now();
      fwd_ms += ms_between(t0, t1);
      bwd_ms += ms_between(t1, t2);
      loss_sum += loss.item<double>();
    }
    // A non-finite loss or gradient (DeepSpeed's overflow check): every rank
    // sees the same verdict, so all stop or all skip together.
    at::Tensor nonfinite = at::zeros({2}, at::kDouble);
    nonfinite[0] = std::isfinite(loss_sum) ? 0.0 : 1.0;
    nonfinite[1] = gradients_finite(zero.parameters()) ? 0.0 : 1.0;
    if (world->size() > 1) {
      world->allReduce(nonfinite, {ReduceOp::kMax})->wait();
      comm_bytes += nonfinite.nbytes();
    }
    const bool bad_loss = nonfinite[0].item<double>() > 0, bad_grads = nonfinite[1].item<double>() > 0;
    const bool skipped = bad_loss || bad_grads;
    if (skipped) {
      const std::string what = str(bad_loss ? "the loss" : "", bad_loss && bad_grads ? " and " : "",
                                   bad_grads ? "the gradients" : "");
      if (tc.on_nonfinite == "stop") {
        throw Error(str("step ", step, ": ", what, " went non-finite (nan or inf; local loss ", loss_sum,
                        "). Stopped before updating or saving anything of this step. "
                        "Lower optimizer.params.lr, set gradient_clipping, or set "
                        "train.on_nonfinite=skip to drop such steps"));
      }
      log_rank0().warn("step {}: {} went non-finite: this step's update is skipped "
                       "(train.on_nonfinite=skip)", step, what);
      optimizer->zero_grad();
    } else {
      const auto t_opt = Clock::now();
      if (config.gradient_clipping > 0) zero.clip_grad_norm(config.gradient_clipping, tp_group);
      optimizer->step();
      opt_ms = ms_between(t_opt, Clock::now());
    }
    at::Tensor loss_t = at::full({1}, loss_sum, at::kDouble);
    if (dp_group->size() > 1) {
      dp_group->allReduce(loss_t, {ReduceOp::kAvg})->wait();
      comm_bytes += loss_t.nbytes();
    }
    const double loss = loss_t.item<double>();
    const Counters counters = Counters::read(&zero).since(before);
    comm_bytes += counters.comm_bytes();
    const double step_ms = ms_between(start, Clock::now());
    const double tokens_per_s = tokens_per_step / (step_ms / 1000.0);
    step_peak = std::max(step_peak, memory.peak());
    max_peak = std::max(max_peak, step_peak - base);
    if (step == first_step) first_loss = loss;
    last_loss = loss;

    if (metrics.is_open()) {
      nlohmann::json m = {{"step", step},           {"loss", loss},
                          {"lr", lr},               {"tokens_per_s", tokens_per_s},
                          {"step_ms", step_ms},     {"fwd_ms", fwd_ms},
                          {"bwd_ms", bwd_ms},       {"opt_ms", opt_ms},
                          {"recompute_ms", counters.recompute_ms},
                          {"mem_base_bytes", base}, {"mem_peak_bytes", step_peak},
                          {"mem_act_peak_bytes", act_peak},
                          {"ckpt_saved_bytes", saved},
                          {"act_offloaded_bytes", counters.offload.offloaded_bytes},
                          {"act_restored_bytes", counters.offload.restored_bytes},
                          {"act_host_bytes", act_host},
                          {"act_kept_bytes", act_kept},
                          {"mem_fwd_held_bytes", fwd_held},
                          {"ckpt_offloaded_bytes", counters.stored.offloaded_bytes},
                          {"ckpt_gathered_bytes", counters.stored.gathered_bytes},
                          {"comm_bytes", comm_bytes},
                          {"zero_comm_bytes", counters.zero.collective_bytes()},
                          {"param_bytes", counters.zero.param_bytes},
                          {"grad_bytes", counters.zero.grad_bytes},
                          {"grad_peak_bytes", counters.zero.peak_grad_bytes},
                          {"optimizer_state_bytes", optimizer_state_bytes(*optimizer)},
                          {"peak_gathered_param_bytes", counters.zero.peak_gathered_bytes}};
      if (skipped) m["skipped"] = true;
      if (const auto& plan = planner.plan()) {
        m["act_plan"] = plan->summary();
        m["act_plan_budget_bytes"] = plan->budget_bytes;
        m["act_plan_predicted_peak_bytes"] = plan->predicted_peak;
        m["act_plan_extra_cpu_ms"] = plan->predicted_extra_cpu_ms;
        m["act_plan_extra_wall_ms"] = plan->predicted_extra_wall_ms;
        m["act_planned"] = planned;
        if (planned) m["act_plan_ms"] = plan_ms;
      }
      metrics << m.dump() << "\n" << std::flush;
      if (!metrics) {
        throw Error(str("writing the --metrics file '", metrics_path, "' failed at step ", step, " (",
                        std::strerror(errno), "; disk full?): the metrics would be incomplete. "
                        "Free space or give another path"));
      }
    }
    progress.step(step, loss, tokens_per_s, step_peak - base);
    if (config.wall_clock_breakdown && (step % config.steps_per_print == 0 || step == first_step)) {
      log_rank0().info("step {} wall clock: forward {:.1f} ms, backward {:.1f} ms (recompute {:.1f}), "
                       "optimizer {:.1f} ms, whole step {:.1f} ms", step, fwd_ms, bwd_ms,
                       counters.recompute_ms, opt_ms, step_ms);
    }

    if (tc.eval_interval > 0 && (step % tc.eval_interval == 0 || step == tc.steps)) {
      model->eval();
      at::NoGradGuard no_grad;
      double val = 0;
      for (int64_t i = 0; i < tc.eval_batches; ++i) {
        auto [x, y] = data.val_batch(i, batch.micro_batch_per_gpu);
        zero.begin_forward();
        val += model->loss(x, y).item<double>();
        zero.end_evaluation();
      }
      progress.line(str("step ", step, ": held-out loss ", val / std::max<int64_t>(tc.eval_batches, 1)));
    }
    position.step = step;
    if (!save_dir.empty() && ((tc.save_interval > 0 && step % tc.save_interval == 0) || step == tc.steps)) {
      save_train_state(save_dir, position, train_shards(), *optimizer, identity, *world);
      progress.line(str("saved step ", step, " to ", save_dir));
    }
  }

  if (rank0 && tc.steps >= first_step) {
    std::printf("loss: first %.4f, last %.4f; peak activation memory per step %s\n", first_loss,
                last_loss, human_bytes(static_cast<double>(max_peak)).c_str());
  }
  // The export comes after the final save (in the loop above): a failed
  // export loses no trained state a save could keep.
  if (!export_path.empty()) {
    int64_t bytes = 0;
    try {
      bytes = export_model(export_path, zero, *model, *world);
    } catch (const Error& e) {
      const bool trained = first_step <= tc.steps;
      const std::string kept_in = trained ? save_dir : resume_dir;
      throw Error(str(e.what(), ". ",
                      kept_in.empty()
                          ? str("The model of step ", position.step, " is not kept anywhere (no --save-dir was "
                                "given): run again with --save-dir to keep the trained state")
                          : str("The trained state of step ", position.step, " is in the save in '", kept_in,
                                "': once the export can be written, run again with the same settings, --resume ",
                                kept_in, " and --export (there is nothing left to train)")));
    }
    progress.line(str("exported the model at step ", position.step, " to ", export_path, " (",
                      human_bytes(static_cast<double>(bytes)), ")"));
  }
  // Every rank samples (tensor-parallel ranks compute the logits together,
  // sharded ones gather parameters together); rank 0 prints.
  if (tc.sample_chars > 0) {
    at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(tc.seed));
    at::Tensor prompt = data.encode("The ").unsqueeze(0);
    zero.begin_forward();
    at::Tensor text = model->generate(prompt, tc.sample_chars, 0.8, gen);
    zero.end_evaluation();
    if (rank0) std::printf("--- sample ---\n%s\n--------------\n", data.decode(text).c_str());
  }
  std::fflush(stdout);
  world->barrier()->wait();
  return 0;
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::train(argc, argv); });
}
