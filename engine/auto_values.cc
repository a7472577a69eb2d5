#include "engine/auto_values.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "engine/internal/config_autos.h"
#include "runtime/error.h"

namespace remat {

using nlohmann::json;
using internal::decide_persistence_threshold;
using internal::record_auto;

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
    record_auto(c, "bf16.enabled", c.bf16.enabled,
            fp16_given    ? std::string("fp16.enabled is true: one compute dtype")
            : !cuda       ? str("the training device, ", device, ", is a CPU: float32, which CPUs compute without "
                                "rounding (set bf16.enabled true where the CPU has AVX512-BF16 or AMX and its bf16 "
                                "matmuls measure faster: benchmarks/bf16_bench.sh)")
            : c.bf16.enabled ? str(gpu, has_bf16, ": bf16 compute from float32 masters, no loss scaling needed")
                             : str(gpu, no_bf16));
  }
  if (c.is_undecided_auto("fp16.enabled")) {
    c.fp16.enabled = !c.bf16.enabled && cuda && !computes_bf16;
    record_auto(c, "fp16.enabled", c.fp16.enabled,
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
  record_auto(c, "train_micro_batch_size_per_gpu", micro,
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
    record_auto(c, "train_micro_batch_size_per_gpu", b.micro_batch_per_gpu,
            str("train_batch_size / (gradient_accumulation_steps x data-parallel size) = ", b.train_batch_size,
                " / (", b.gradient_accumulation_steps, " x ", dp, ")"));
  }
  if (c.is_undecided_auto("gradient_accumulation_steps")) {
    c.gradient_accumulation_steps = b.gradient_accumulation_steps;
    record_auto(c, "gradient_accumulation_steps", b.gradient_accumulation_steps,
            c.train_batch_size ? str("train_batch_size / (train_micro_batch_size_per_gpu x data-parallel size) = ",
                                     b.train_batch_size, " / (", b.micro_batch_per_gpu, " x ", dp, ")")
                               : std::string("train_batch_size is not given either: one micro-batch per step"));
  }
  if (c.is_undecided_auto("train_batch_size")) {
    c.train_batch_size = b.train_batch_size;
    record_auto(c, "train_batch_size", b.train_batch_size,
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
