#include "engine/auto_values.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "engine/deepspeed_keys.h"
#include "runtime/error.h"

namespace remat {

using nlohmann::json;

const std::vector<std::string>& auto_keys() {
  static const std::vector<std::string> keys = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
      "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
      "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
      "scheduler.params.total_num_steps", "bf16.enabled", "fp16.enabled", "zero_optimization.reduce_bucket_size",
      "zero_optimization.allgather_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.stage3_param_persistence_threshold",
      // DeepSpeed reads "auto" on these as the key left out: its default.
      "zero_optimization.stage3_max_live_parameters", "zero_optimization.max_live_parameters",
      "zero_optimization.stage3_max_reuse_distance", "zero_optimization.max_reuse_distance",
      "zero_optimization.sub_group_size"};
  return keys;
}

bool Config::is_auto(const std::string& key) const {
  return std::any_of(auto_values.begin(), auto_values.end(), [&](const AutoValue& a) { return a.key == key; });
}

bool Config::is_undecided_auto(const std::string& key) const {
  return std::any_of(auto_values.begin(), auto_values.end(),
                     [&](const AutoValue& a) { return a.key == key && a.value.empty(); });
}

namespace {

// Records `key`'s decision, when it was given "auto" and is not decided yet.
void decided(Config& c, const std::string& key, const json& value, const std::string& why) {
  for (auto& a : c.auto_values) {
    if (a.key == key && a.value.empty()) a = {key, value.dump(), why};
  }
}

void decide_optimizer_and_clipping(Config& c) {
  const std::string of = str("remat's default for optimizer.type ", c.optimizer.type,
                             ", as when the key is left out");
  // The members still hold their defaults: "auto" stored nothing.
  decided(c, "gradient_clipping", c.gradient_clipping,
          "remat's default, no clipping (give a number, such as 1.0, to clip the gradients' norm)");
  decided(c, "optimizer.params.lr", c.optimizer.lr, of);
  // SGD reads neither: the default stands, said to be unused.
  const std::string adam_only = c.optimizer.type == "SGD"
                                    ? std::string("remat's default, unused: optimizer.type SGD has no betas or eps")
                                    : of;
  decided(c, "optimizer.params.betas", c.optimizer.betas, adam_only);
  decided(c, "optimizer.params.eps", c.optimizer.eps, adam_only);
  decided(c, "optimizer.params.weight_decay", c.optimizer.weight_decay, of);
}

// As Hugging Face's Trainer fills them (transformers' integrations/deepspeed.py).
void decide_scheduler(Config& c) {
  auto& s = c.scheduler;
  if (c.is_undecided_auto("scheduler.params.warmup_min_lr")) {
    s.warmup_min_lr = 0.0;
    decided(c, "scheduler.params.warmup_min_lr", 0.0, "0, as Hugging Face's Trainer fills it (DeepSpeed's default)");
  }
  if (c.is_undecided_auto("scheduler.params.warmup_max_lr")) {
    s.warmup_max_lr = c.optimizer.lr;
    decided(c, "scheduler.params.warmup_max_lr", c.optimizer.lr,
            "optimizer.params.lr, the rate the optimizer was given (as Hugging Face's Trainer fills it)");
  }
  if (c.is_undecided_auto("scheduler.params.total_num_steps")) {
    s.total_num_steps = c.train.steps;
    decided(c, "scheduler.params.total_num_steps", c.train.steps,
            "train.steps, the run's optimizer steps (as Hugging Face's Trainer fills it)");
  }
  if (c.is_undecided_auto("scheduler.params.warmup_num_steps")) {
    s.warmup_num_steps = 2;
    decided(c, "scheduler.params.warmup_num_steps", 2,
            "Hugging Face's Trainer fills its warmup_steps, 0 unless set, and DeepSpeed warms up over at least "
            "2 steps");
  }
}

// DeepSpeed's default of sub_group_size and stage3_max_reuse_distance, which
// have no effect in remat (deepspeed_keys.cc).
constexpr int64_t kDeepSpeedTilingDefault = 1000000000;

void decide_zero_sizes(Config& c) {
  const auto& z = c.zero_optimization;
  const std::string why = "remat's default, as when the key is left out";
  decided(c, "zero_optimization.reduce_bucket_size", z.reduce_bucket_size, why);
  decided(c, "zero_optimization.allgather_bucket_size", z.allgather_bucket_size, why);
  decided(c, "zero_optimization.stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, why);
  decided(c, "zero_optimization.stage3_param_persistence_threshold", z.stage3_param_persistence_threshold, why);
  for (const char* key : {"zero_optimization.stage3_max_live_parameters", "zero_optimization.max_live_parameters"}) {
    decided(c, key, z.stage3_max_live_parameters, "remat's default (DeepSpeed's), as when the key is left out");
  }
  // Unset, as left out: their values would only be said to change nothing.
  for (const char* key : {"zero_optimization.stage3_max_reuse_distance", "zero_optimization.max_reuse_distance"}) {
    decided(c, key, kDeepSpeedTilingDefault,
            str("DeepSpeed's default, as when the key is left out; it has no effect in remat: ",
                deepspeed_keys::kMaxReuseDistanceWhy));
  }
  decided(c, "zero_optimization.sub_group_size", kDeepSpeedTilingDefault,
          str("DeepSpeed's default, as when the key is left out; it has no effect in remat: ",
              deepspeed_keys::kSubGroupSizeWhy));
}

// stage3_param_persistence_threshold "auto", once the precision is known: at
// stage 3 under bf16 or fp16 the threshold stage 3 uses, 0, with why (one
// line says what was decided, what is used and why: no other line repeats it).
void decide_persistence_threshold(Config& c) {
  const std::string key = "zero_optimization.stage3_param_persistence_threshold";
  if (!c.is_auto(key) || c.is_undecided_auto("bf16.enabled") || c.is_undecided_auto("fp16.enabled")) return;
  auto& z = c.zero_optimization;
  const auto mixed = parallel::mixed_precision(c.bf16, c.fp16.enabled);
  const int64_t used = parallel::stage3_persistence_threshold(z, mixed);
  if (z.stage != 3 || used == z.stage3_param_persistence_threshold) return;
  z.stage3_param_persistence_threshold = used;
  for (auto& a : c.auto_values) {
    if (a.key != key) continue;
    a.value = json(used).dump();
    a.why = str(deepspeed_keys::persistence_threshold_why(mixed), " (remat's default, ",
                parallel::ZeroOptions{}.stage3_param_persistence_threshold, ", keeps smaller parameters whole in "
                "float32 runs)");
  }
}

}  // namespace

void decide_config_autos(Config& config) {
  decide_optimizer_and_clipping(config);
  decide_scheduler(config);
  decide_zero_sizes(config);
  decide_persistence_threshold(config);  // where bf16 and fp16 are given, not "auto"
}

void decide_precision_autos(Config& c, const std::string& device, bool cuda, bool computes_bf16, bool assumed) {
  const bool precision_auto = c.is_undecided_auto("bf16.enabled") || c.is_undecided_auto("fp16.enabled");
  // What the GPU computes, as known or as assumed where there is none to ask.
  const std::string gpu = str("the training device, ", device, ", ");
  const std::string has_bf16 = str(assumed ? "is assumed to compute" : "computes", " bf16 (compute capability 8.0 or "
                                   "higher", assumed ? "; no GPU here to ask" : "", ")");
  const std::string no_bf16 = str(assumed ? "is assumed to have" : "has", " no bf16 (compute capability below 8.0",
                                  assumed ? "; no GPU here to ask" : "", ")");
  if (c.is_undecided_auto("bf16.enabled")) {
    const bool fp16_given = c.fp16.enabled && !c.is_auto("fp16.enabled");
    c.bf16.enabled = !fp16_given && cuda && computes_bf16;
    decided(c, "bf16.enabled", c.bf16.enabled,
            fp16_given    ? std::string("fp16.enabled is true: one compute dtype")
            : !cuda       ? str("the training device, ", device, ", is a CPU: float32, which CPUs compute without "
                                "rounding (set bf16.enabled true where the CPU has AVX512-BF16 or AMX and its bf16 "
                                "matmuls measure faster: benchmarks/bf16_bench.sh)")
            : c.bf16.enabled ? str(gpu, has_bf16, ": bf16 compute from float32 masters, no loss scaling needed")
                             : str(gpu, no_bf16));
  }
  if (c.is_undecided_auto("fp16.enabled")) {
    c.fp16.enabled = !c.bf16.enabled && cuda && !computes_bf16;
    decided(c, "fp16.enabled", c.fp16.enabled,
            c.bf16.enabled ? std::string("bf16.enabled is true: one compute dtype")
            : !cuda        ? str("the training device, ", device, ", is a CPU: float32 (CPU kernels compute "
                                 "fp16 no faster, and it needs loss scaling)")
            : c.fp16.enabled ? str(gpu, no_bf16, ": fp16 with the dynamic loss scaler")
                             : str(gpu, has_bf16, ", which needs no loss scaling: set bf16.enabled for it"));
  }
  decide_persistence_threshold(c);
  // The precision's rules, which parse_config left for these decisions.
  if (precision_auto) check_config_rules(c, str("the config with bf16/fp16 \"auto\" decided for ", device));
}

namespace {

// train_micro_batch_size_per_gpu "auto" that train_batch_size and
// gradient_accumulation_steps do not give: the chooser's, within train_batch_size.
void choose_micro_batch(Config& c, int dp, const MicroBatchChooser& choose) {
  const auto& tbs = c.train_batch_size;
  if (!choose) {
    throw ConfigError(
        "config error: train_micro_batch_size_per_gpu is \"auto\", which remat measures for the GPT that "
        "remat-train builds, bounded by its memory estimate; a model given to remat::initialize cannot be "
        "estimated before it runs: give train_micro_batch_size_per_gpu a number (or train_batch_size and "
        "gradient_accumulation_steps as numbers, to derive it), or give EngineOptions::micro_batch its bound "
        "and a micro-batch's loss, for initialize to measure it");
  }
  if (tbs && *tbs % dp != 0) {
    throw ConfigError(str("config error: train_batch_size (", *tbs, ") is not divisible by the data-parallel size (",
                          dp, "), so no train_micro_batch_size_per_gpu gives it: change train_batch_size"));
  }
  const int64_t per_rank = tbs ? *tbs / dp : kMaxAutoMicroBatch;
  const MicroBatchChoice fit = choose(per_rank);
  if (fit.micro < 1) {
    throw ConfigError(str("config error: train_micro_batch_size_per_gpu is \"auto\" and not even a micro-batch of "
                          "1 fits: ", fit.why, ". remat-estimate prints what each configuration needs"));
  }
  int64_t micro = std::min(fit.micro, per_rank);
  while (tbs && per_rank % micro != 0) --micro;  // ends at 1 at the latest
  c.train_micro_batch_size_per_gpu = micro;
  decided(c, "train_micro_batch_size_per_gpu", micro,
          micro == fit.micro ? fit.why
                             : str(fit.why, "; ", micro, ", the largest micro-batch up to ", fit.micro,
                                   " that divides train_batch_size / data-parallel size = ", per_rank));
}

}  // namespace

void decide_batch_autos(Config& c, int dp, const MicroBatchChooser& choose) {
  REMAT_CHECK_GE(dp, 1, "data-parallel size");
  if (!c.is_undecided_auto("train_micro_batch_size_per_gpu") && !c.is_undecided_auto("gradient_accumulation_steps") &&
      !c.is_undecided_auto("train_batch_size")) {
    return;  // nothing to decide: resolve_batch's errors stay where its callers ask
  }
  // Both others numbers: resolve_batch derives it.
  const bool derived = c.is_undecided_auto("train_micro_batch_size_per_gpu") && c.train_batch_size &&
                       c.gradient_accumulation_steps;
  if (c.is_undecided_auto("train_micro_batch_size_per_gpu") && !derived) choose_micro_batch(c, dp, choose);
  const BatchSizes b = c.resolve_batch(dp);  // the rule, its errors showing the arithmetic
  if (derived) {
    c.train_micro_batch_size_per_gpu = b.micro_batch_per_gpu;
    decided(c, "train_micro_batch_size_per_gpu", b.micro_batch_per_gpu,
            str("train_batch_size / (gradient_accumulation_steps x data-parallel size) = ", b.train_batch_size,
                " / (", b.gradient_accumulation_steps, " x ", dp, ")"));
  }
  if (c.is_undecided_auto("gradient_accumulation_steps")) {
    c.gradient_accumulation_steps = b.gradient_accumulation_steps;
    decided(c, "gradient_accumulation_steps", b.gradient_accumulation_steps,
            c.train_batch_size ? str("train_batch_size / (train_micro_batch_size_per_gpu x data-parallel size) = ",
                                     b.train_batch_size, " / (", b.micro_batch_per_gpu, " x ", dp, ")")
                               : std::string("train_batch_size is not given either: one micro-batch per step"));
  }
  if (c.is_undecided_auto("train_batch_size")) {
    c.train_batch_size = b.train_batch_size;
    decided(c, "train_batch_size", b.train_batch_size,
            str("train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size = ",
                b.micro_batch_per_gpu, " x ", b.gradient_accumulation_steps, " x ", dp));
  }
}

std::vector<std::string> undecided_autos(const Config& config) {
  std::vector<std::string> out;
  for (const auto& a : config.auto_values) {
    if (a.value.empty()) out.push_back(a.key);
  }
  return out;
}

std::vector<std::string> auto_lines(const Config& config) {
  std::vector<std::string> out;
  for (const auto& a : config.auto_values) {
    if (!a.value.empty()) out.push_back(str(a.key, " \"auto\" -> ", a.value, ": ", a.why));
  }
  return out;
}

}  // namespace remat
