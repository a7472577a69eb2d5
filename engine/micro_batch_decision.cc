// The engine's decisions that are not the config's alone: an "auto"
// micro-batch measured through the wiring at initialize
// (EngineOptions::micro_batch), and a resumed run's values taken from its
// save (keep_saved_decisions).
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>

#include <chrono>

#include "engine/engine.h"
#include "engine/internal/decisions.h"
#include "engine/internal/engine_impl.h"
#include "checkpointing/policy.h"
#include "engine/save/manifest.h"
#include "rng/rng_tracker.h"
#include "runtime/agreement.h"
#include "runtime/communicator.h"
#include "runtime/device_memory.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"

namespace remat {

// Every candidate's passes run through the sharding and the checkpointing
// hooks as a training step's do (variant auto, which plans at the first
// step: every block checkpointed in full, the least memory a plan takes);
// the gradients are dropped before each, and once the search ends the
// gradients, the RNG (dropout's streams), the model's buffers, the blocks'
// hooks and a CUDA device's cached blocks are as they were before it.
MicroBatchSearch Engine::Impl::measure_micro_batches(torch::nn::Module& model, const Config& config, int64_t fit,
                                                     int64_t divides) {
  const MicroBatchProbe& probe = options.micro_batch;
  const RngSnapshot rng = capture_rng();
  // The model's buffers (a batch norm's running statistics) as they were:
  // the passes run in training mode and would move them.
  std::vector<at::Tensor> buffers;
  for (const at::Tensor& b : model.buffers()) buffers.push_back(b.clone());
  if (auto_plan) {
    PolicyOptions full;  // the policy's blocks, no budget
    full.blocks = policy.blocks;
    full.variant = CheckpointVariant::kFull;
    apply_activation_checkpointing(model, full);
  }
  auto put_back = [&] {
    if (auto_plan) remove_activation_checkpointing(model);
    restore_rng(rng);
    at::NoGradGuard no_grad;
    size_t i = 0;
    for (at::Tensor& b : model.buffers()) b.copy_(buffers[i++]);
  };
  auto pass = [&](int64_t micro) {
    zero->zero_grad();
    const auto start = std::chrono::steady_clock::now();
    forward_backward(model, config, [&] { return probe.loss(micro); }, 1.0);
    if (placed.is_cuda()) torch::cuda::synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // The slowest rank's figures: every rank decides alike.
  auto slowest = [&](std::vector<double> values) {
    if (world->size() == 1) return values;
    at::Tensor t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(placed);
    world->allReduce(t, {ReduceOp::kMax})->wait();
    t = t.cpu();
    return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  };
  MicroBatchSearch found;
  try {
    found = search_micro_batch(micro_batch_candidates(fit, divides), probe.tokens_per_sample, pass, slowest,
                               probe.search);
  } catch (...) {
    zero->abandon_backward();
    put_back();
    throw;
  }
  zero->zero_grad();
  zero->take_gradient_arrivals();
  put_back();
  release_cached_device_memory(placed);
  return found;
}

// The largest micro-batch that fits every rank (the smallest of the ranks'
// fits), the candidates up to it measured, the knee decided; then the
// accumulation and train_batch_size from it.
void Engine::Impl::decide_micro_batch(torch::nn::Module& model, Config& config) {
  const MicroBatchProbe& probe = options.micro_batch;
  if (!probe.fit) {
    throw ConfigError("remat::initialize: EngineOptions::micro_batch.loss is set but micro_batch.fit is not: give "
                      "the largest micro-batch that fits (the model's memory estimate), which bounds the "
                      "candidates the search measures");
  }
  const int dp = layout->dims().dp;
  decide_batch_autos(config, dp, [&](int64_t limit) -> MicroBatchChoice {
    MicroBatchChoice fit = probe.fit(limit);
    if (world->size() > 1) {
      at::Tensor least = at::tensor(std::vector<double>{static_cast<double>(fit.micro)},
                                    at::TensorOptions().dtype(at::kDouble)).to(placed);
      world->allReduce(least, {ReduceOp::kMin})->wait();
      const auto agreed = static_cast<int64_t>(least.cpu().item<double>());
      if (agreed < fit.micro) fit = {agreed, str("the smallest of the ranks' largest fitting micro-batches")};
    }
    if (fit.micro < 1) return fit;  // refused by decide_batch_autos with why
    search = measure_micro_batches(model, config, std::min(fit.micro, limit),
                                   config.train_batch_size ? limit : 0);
    log_rank0().info("{}", search->line());
    return {search->chosen_micro(), str(search->why(), "; ", fit.micro, ": ", fit.why)};
  });
  batch = config.resolve_batch(dp);
  // Decided from the same figures on every rank; a rank that differs stops every rank, named.
  require_same_settings(*world, {{"train_micro_batch_size_per_gpu (measured)", str(batch.micro_batch_per_gpu)}},
                        "\"auto\" micro-batches");
}

void keep_saved_decisions(Config& config, const std::string& resume, int dp) {
  const std::string folder = save::resolve_save(resume);
  const save::Manifest manifest = save::read_manifest(folder + "/manifest.json");
  const std::string line = internal::take_decisions(config, manifest.decisions, folder, manifest.step, dp);
  if (!line.empty()) {
    log_rank0().info("{}", line);
  } else if (manifest.decisions.empty() && !undecided_autos(config).empty()) {
    log_rank0().info("resume: the save in '{}' records no decided values (an earlier remat's): each \"auto\" is "
                     "decided afresh", folder);
  }
}

}  // namespace remat
