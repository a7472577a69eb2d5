// remat-train: a GPT trained on the embedded corpus (or data.path), data
// parallel across ranks, with the activation checkpointing the config asks for.
//
//   remat-run -np 2 -- remat-train --config configs/default.json [--set key=value ...]
//       [--steps N] [--seed S] [--metrics FILE] [--save-dir DIR] [--resume DIR]
#include <unistd.h>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/types.h>  // clip_grad.h needs torch::Tensor declared first
#include <torch/nn/utils/clip_grad.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpointing/checkpoint.h"
#include "checkpointing/policy.h"
#include "data/dataset.h"
#include "launch/optim.h"
#include "launch/step_counters.h"
#include "launch/train_state.h"
#include "models/gpt.h"
#include "parallel/layers.h"
#include "parallel/zero.h"
#include "rng/rng_tracker.h"
#include "runtime/config.h"
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
  if (ac.variant == "none" &&
      (ac.partition_activations || ac.cpu_checkpointing || ac.contiguous_memory_optimization)) {
    log_rank0().warn("activation_checkpointing.variant is none, so partition_activations, "
                     "cpu_checkpointing and contiguous_memory_optimization have no region to "
                     "act on; set variant to full, selective_layer or selective_op");
  }
  if (ac.partition_activations && c.tensor_parallel.size == 1) {
    log_rank0().warn("activation_checkpointing.partition_activations with tensor_parallel.size 1 "
                     "keeps whole inputs (there is no group to split them across)");
  }
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  return str(std::round(b * 10) / 10, " ", units[u]);
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

int train(int argc, char** argv) {
  CLI::App app{"remat-train: train a GPT with remat's activation checkpointing"};
  std::string config_path, metrics_path, save_dir, resume_dir, backend = "auto";
  std::vector<std::string> overrides;
  std::optional<int64_t> steps_flag, seed_flag;
  app.add_option("--config", config_path, "JSON configuration (default: the embedded one)");
  app.add_option("--set", overrides, "override a key: --set model.n_layer=8 (repeatable)");
  app.add_option("--steps", steps_flag, "optimizer steps (train.steps)");
  app.add_option("--seed", seed_flag, "seed (train.seed)");
  app.add_option("--metrics", metrics_path, "write one JSON object per step (rank 0)");
  app.add_option("--save-dir", save_dir, "save the training state here");
  app.add_option("--resume", resume_dir, "resume from a save (a step folder or the save root)");
  app.add_option("--backend", backend, "communication backend: auto, mpi or nccl");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  MemoryTracker memory;  // first: everything allocated from here on is counted
  auto& runtime = Runtime::init();
  Config config = config_path.empty()
                      ? parse_config(default_config_text(), "<embedded default>", overrides)
                      : load_config(config_path, overrides);
  warn_ineffective(config);
  if (steps_flag) config.train.steps = *steps_flag;
  if (seed_flag) config.train.seed = *seed_flag;
  const auto& tc = config.train;

  auto world = runtime.world(parse_backend(backend));
  ParallelLayout layout(world, ParallelDims::from_world(world->size(), config.tensor_parallel.size));
  const BatchSizes batch = config.resolve_batch(layout.dims().dp);
  data::Dataset data = data::Dataset::load(config.data.path, config.data.train_fraction,
                                           config.model.seq_len);
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
  ActivationCheckpointingConfig checkpointing = config.activation_checkpointing;
  checkpointing.profile = true;
  configure_checkpointing(checkpointing, &layout);
  PolicyOptions policy = PolicyOptions(config.activation_checkpointing);
  int regions = apply_activation_checkpointing(*model, policy);
  // Sharding over the data-parallel group (stage 3) or plain data parallel
  // (stage 0); the optimizer steps what the sharding hands it.
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& block : *model->blocks) units.push_back(block);
  parallel::ZeroModel zero(*model, units, layout.dp_group(), config.zero_optimization, config.bf16,
                 sharded);
  auto optimizer = make_optimizer(config.optimizer, zero.parameters());
  TrainPosition position;
  if (!resume_dir.empty()) {
    position = load_train_state(resume_dir, zero.state(), *optimizer, signature, *world);
    log_rank0().info("resumed from '{}' at step {}", resume_dir, position.step);
  }
  log_rank0().info("data {} ({} bytes, vocabulary {}), model {} ({} parameters on this rank), "
                   "checkpointing {} ({} regions), batch {} = micro {} x accumulation {} x dp {}",
                   data.source(), data.train_size() + data.val_size(), data.vocab_size(), signature,
                   model->num_parameters(), config.activation_checkpointing.variant, regions,
                   batch.train_batch_size, batch.micro_batch_per_gpu,
                   batch.gradient_accumulation_steps, layout.dims().dp);

  std::ofstream metrics;
  if (rank0 && !metrics_path.empty()) {
    metrics.open(metrics_path, position.step > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) throw ConfigError(str("cannot write --metrics file '", metrics_path, "'"));
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
    const int64_t base = memory.current();
    memory.reset_peak();
    zero.reset_peak();
    const Counters before = Counters::read(&zero);
    auto start = Clock::now();
    optimizer->zero_grad();
    double fwd_ms = 0, bwd_ms = 0, loss_sum = 0;
    int64_t saved = 0, comm_bytes = 0;
    for (int64_t micro = 0; micro < batch.gradient_accumulation_steps; ++micro) {
      auto [x, y] = data.train_batch(static_cast<uint64_t>(tc.seed), layout.dp_rank(),
                                     position.window, batch.micro_batch_per_gpu);
      position.window += batch.micro_batch_per_gpu;
      auto t0 = Clock::now();
      zero.begin_forward();
      at::Tensor loss = zero.finish_forward(
          model->loss(x, y) / static_cast<double>(batch.gradient_accumulation_steps));
      saved = std::max(saved, Counters::read().checkpoint_saved_bytes);
      auto t1 = Clock::now();
      loss.backward();
      zero.finish_backward(/*synchronize=*/micro + 1 == batch.gradient_accumulation_steps);
      auto t2 = Clock::now();
      fwd_ms += ms_between(t0, t1);
      bwd_ms += ms_between(t1, t2);
      loss_sum += loss.item<double>();
    }
    if (config.gradient_clipping > 0) zero.clip_grad_norm(config.gradient_clipping, tp_group);
    optimizer->step();
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
    max_peak = std::max(max_peak, memory.peak() - base);
    if (step == first_step) first_loss = loss;
    last_loss = loss;

    if (metrics.is_open()) {
      nlohmann::json m = {{"step", step},           {"loss", loss},
                          {"lr", lr},               {"tokens_per_s", tokens_per_s},
                          {"step_ms", step_ms},     {"fwd_ms", fwd_ms},
                          {"bwd_ms", bwd_ms},       {"recompute_ms", counters.recompute_ms},
                          {"mem_base_bytes", base}, {"mem_peak_bytes", memory.peak()},
                          {"ckpt_saved_bytes", saved},
                          {"ckpt_offloaded_bytes", counters.stored.offloaded_bytes},
                          {"ckpt_gathered_bytes", counters.stored.gathered_bytes},
                          {"comm_bytes", comm_bytes},
                          {"zero_comm_bytes", counters.zero.collective_bytes()},
                          {"param_bytes", counters.zero.param_bytes},
                          {"grad_bytes", counters.zero.grad_bytes},
                          {"optimizer_state_bytes", optimizer_state_bytes(*optimizer)},
                          {"peak_gathered_param_bytes", counters.zero.peak_gathered_bytes}};
      metrics << m.dump() << "\n" << std::flush;
    }
    progress.step(step, loss, tokens_per_s, memory.peak() - base);

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
      save_train_state(save_dir, position, zero.state(), *optimizer, signature, *world);
      progress.line(str("saved step ", step, " to ", save_dir));
    }
  }

  if (rank0) {
    std::printf("loss: first %.4f, last %.4f; peak activation memory per step %s\n", first_loss,
                last_loss, human_bytes(static_cast<double>(max_peak)).c_str());
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
