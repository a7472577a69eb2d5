// "auto" in a config means "remat decides" (docs/config.md, "auto"), for the
// keys Hugging Face's Trainer writes it into. Each decision is recorded in
// Config::auto_values with its reason; the engine logs one line per key on
// rank 0, remat-estimate prints them.
//
//   Config c = parse_config(text, "ds_config.json");  // decides what the config alone decides
//   decide_precision_autos(c, "cuda:0", /*cuda=*/true, /*computes_bf16=*/true);  // bf16.enabled: true
//   decide_batch_autos(c, dp, [&](int64_t limit) { return MicroBatchChoice{...}; });
//
// When each is decided:
// - parse_config, from the config alone: gradient_clipping, the optimizer's
//   lr, betas, eps and weight_decay, the scheduler's warmup_min_lr,
//   warmup_max_lr, warmup_num_steps and total_num_steps, the ZeRO bucket and
//   threshold sizes and stage3_max_live_parameters, and DeepSpeed's
//   sub_group_size and stage3_max_reuse_distance (its default, said to have
//   no effect);
// - where the training device is known (remat-train, remat-estimate, the
//   engine): bf16.enabled and fp16.enabled, and with them
//   stage3_param_persistence_threshold at stage 3 (0 under bf16 or fp16,
//   what stage 3 uses there);
// - where the data-parallel size and the model's memory are known:
//   train_micro_batch_size_per_gpu (the chooser's: remat::initialize's is a
//   measurement, bounded by a memory estimate, engine/micro_batch_search.h
//   and EngineOptions::micro_batch; a model given to it without one cannot
//   be estimated before it runs), then gradient_accumulation_steps and
//   train_batch_size.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/config.h"

namespace remat {

// bf16.enabled / fp16.enabled "auto": the fastest precision the training
// device `device` (its name, for the reason) computes well. bf16 on a CUDA
// device that computes it (`computes_bf16`: compute capability 8.0 or
// higher); on a CUDA device without bf16, fp16 with its loss scaler; on the
// CPU float32 (both false). A precision set true explicitly wins: the other
// "auto" becomes false. `assumed`: no such device here to ask (an estimate
// for a GPU elsewhere): `computes_bf16` is an assumption, and the reasons
// say so.
void decide_precision_autos(Config& config, const std::string& device, bool cuda, bool computes_bf16,
                            bool assumed = false);

// What a caller's memory allows for train_micro_batch_size_per_gpu "auto":
// the largest micro-batch from 1 to `limit` that fits (0: not even 1), and why.
struct MicroBatchChoice {
  int64_t micro = 0;
  std::string why;
};
using MicroBatchChooser = std::function<MicroBatchChoice(int64_t limit)>;
// The most a chooser is asked for when train_batch_size does not bound it.
constexpr int64_t kMaxAutoMicroBatch = int64_t{1} << 16;

// The batch sizes given "auto", at data-parallel size `dp`, by DeepSpeed's
// rule train_batch_size = micro x accumulation x dp:
// - train_micro_batch_size_per_gpu: derived from train_batch_size and
//   gradient_accumulation_steps when both are numbers; else `choose`'s
//   micro-batch (with train_batch_size a number, the largest divisor of
//   train_batch_size / dp at most that); without a chooser a ConfigError
//   asking for a number;
// - gradient_accumulation_steps: train_batch_size / (micro x dp) when
//   train_batch_size is a number, else 1;
// - train_batch_size: micro x accumulation x dp.
// The decided values are stored in the config; resolve_batch(dp) then gives
// them. Nothing happens when none of the three is an undecided "auto".
void decide_batch_autos(Config& config, int dp, const MicroBatchChooser& choose = {});

// The keys still undecided (empty once every "auto" is decided).
std::vector<std::string> undecided_autos(const Config& config);

// One line per decided key: `key "auto" -> value: why`.
std::vector<std::string> auto_lines(const Config& config);

}  // namespace remat
