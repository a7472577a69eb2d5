// DeepSpeed's tuning keys that remat reads (config.h: DeepSpeedTuningConfig):
// the values refused (check_config_rules' part) and the lines said of those
// that change nothing (ineffective_settings' part).
#include "engine/internal/config_tuning.h"

#include <string>

#include "runtime/error.h"

namespace remat::deepspeed_keys {

// The old offload switches: false asks for nothing, true for an offload,
// which only the current key can ask for. Given beside the current key's
// section switched on, the two say different things (or the same thing
// twice): DeepSpeed refuses the pair, and so does remat, naming both.
struct OldOffloadKey {
  const char* name;
  std::optional<bool> DeepSpeedTuningConfig::*value;
  const char* current;
  const char* asks;  // what true asks for
  // The current key's device; null where DeepSpeed reads the old key into no current one.
  parallel::OffloadDevice (*current_device)(const Config&);
};
constexpr OldOffloadKey kOldOffloadKeys[] = {
    {"cpu_offload", &DeepSpeedTuningConfig::cpu_offload, "zero_optimization.offload_optimizer", "an offload",
     [](const Config& c) { return c.zero_optimization.offload_optimizer.device; }},
    {"cpu_offload_param", &DeepSpeedTuningConfig::cpu_offload_param, "zero_optimization.offload_param",
     "an offload", [](const Config& c) { return c.zero_optimization.offload_param.device; }},
    {"cpu_offload_use_pin_memory", &DeepSpeedTuningConfig::cpu_offload_use_pin_memory,
     "pin_memory in zero_optimization.offload_optimizer or offload_param", "pinned host memory", nullptr},
};

const char* const kSubGroupSizeWhy =
    "remat steps each optimizer shard in one piece (DeepSpeed tiles its optimizer step into groups of that many "
    "elements); what is computed does not depend on it. It sizes the sub-groups of offload_optimizer.device "
    "\"nvme\", where it is used";
const char* const kMaxReuseDistanceWhy =
    "remat's stage 3 frees a unit's parameters when its call returns and gathers them again for its backward, "
    "keeping none for reuse; zero_optimization.stage3_max_live_parameters bounds what is gathered at once";

namespace {

const char* yes_no(bool b) { return b ? "true" : "false"; }

// The keys that change nothing whatever their value (the sizes of
// DeepSpeed's own tiling and caching, the old offload switches off, the
// averaging remat always does), in the order of the lines they log.
void tuning_lines(const Config& c, std::vector<std::string>& out) {
  const DeepSpeedTuningConfig& t = c.deepspeed_tuning;
  if (t.sub_group_size && !c.zero_optimization.offload_optimizer.on_nvme()) {
    out.push_back(str("zero_optimization.sub_group_size = ", *t.sub_group_size, " has no effect in remat: ",
                      kSubGroupSizeWhy));
  }
  if (t.max_reuse_distance) {
    out.push_back(str("zero_optimization.stage3_max_reuse_distance = ", *t.max_reuse_distance,
                      " has no effect in remat: ", kMaxReuseDistanceWhy));
  }
  if (t.allow_untested_optimizer) {
    out.push_back(str("zero_allow_untested_optimizer = ", yes_no(*t.allow_untested_optimizer),
                      " has no effect in remat: remat's ZeRO runs remat's own optimizers (optimizer.type AdamW, "
                      "Adam or SGD), each supported at every stage, so there is nothing to allow"));
  }
  for (const auto& key : kOldOffloadKeys) {
    if (t.*key.value) {
      out.push_back(str("zero_optimization.", key.name, " = false has no effect: it is DeepSpeed's old spelling of ",
                        key.current, " and asks for no ", key.asks + 3 * (key.asks[0] == 'a' && key.asks[1] == 'n'),
                        "; write ", key.current, " to ask for ", key.asks));
    }
  }
  // The aio section away from DeepSpeed's defaults: read for offload to NVMe,
  // said where no offload device is "nvme".
  const AioConfig& aio = c.aio;
  const AioConfig defaults;
  const bool tuned = aio.block_size != defaults.block_size || aio.queue_depth != defaults.queue_depth ||
                     aio.thread_count != defaults.thread_count || aio.single_submit != defaults.single_submit ||
                     aio.overlap_events != defaults.overlap_events;
  if (tuned && !c.zero_optimization.offload_optimizer.on_nvme()) {
    const bool params = c.zero_optimization.offload_param.on_nvme();
    out.push_back(str("aio (block_size ", aio.block_size, ", queue_depth ", aio.queue_depth, ", thread_count ",
                      aio.thread_count, ", single_submit ", yes_no(aio.single_submit), ", overlap_events ",
                      yes_no(aio.overlap_events), ") has no effect in this run: it tunes the I/O of offload to "
                      "NVMe, ", params ? "which remat streams for offload_optimizer \"nvme\"'s moments only "
                                         "(offload_param's shards are mapped: the kernel reads and writes them)"
                                       : "and no offload device is \"nvme\""));
  }
  if (t.prescale_gradients && !*t.prescale_gradients) {
    out.push_back("prescale_gradients = false has no effect in remat: remat averages gradients as it asks, one sum "
                  "across the data-parallel ranks, then one division");
  }
  if (t.gradient_predivide_factor && *t.gradient_predivide_factor == 1.0) {
    out.push_back("gradient_predivide_factor = 1.0 has no effect in remat: gradients are divided by nothing before "
                  "their sum, as remat always does");
  }
  if (t.memory_efficient_linear) {
    out.push_back(str("zero_optimization.memory_efficient_linear = ", yes_no(*t.memory_efficient_linear),
                      " has no effect in remat: it chooses how DeepSpeed's traced stage 3 saves a linear layer's "
                      "input; remat's stage 3 gathers each unit around its remat::forward call, and what a layer "
                      "saves is the activation checkpointing's choice"));
  }
}

// The keys whose line depends on the value or on the run: true asks for
// something that makes no difference here (false asks for nothing), or
// something whose use depends on the precision or the offload.
void value_lines(const Config& c, std::vector<std::string>& out) {
  const DeepSpeedTuningConfig& t = c.deepspeed_tuning;
  if (t.round_robin_gradients.value_or(false)) {
    out.push_back("zero_optimization.round_robin_gradients = true has no effect in remat: it reorders which rank's "
                  "partition each gradient falls in, so that DeepSpeed's copies of gradients to the host under "
                  "offload_optimizer spread across the ranks; remat splits each gradient bucket evenly across the "
                  "ranks and each rank copies its own shard to the host as the bucket's reduction ends. What is "
                  "computed does not depend on it");
  }
  if (t.gather_16bit_weights_on_model_save && !c.bf16.enabled && !c.fp16.enabled) {
    out.push_back("zero_optimization.stage3_gather_16bit_weights_on_model_save is true, but the training dtype is "
                  "float32 (bf16 and fp16 are off), so the export is float32 as without it; it writes bf16 or fp16 "
                  "with bf16.enabled or fp16.enabled");
  }
  // Asks that an offloaded optimizer be the CPU-optimised Adam: said only
  // where the optimizer is offloaded (false allows any, as remat does).
  if (t.force_ds_cpu_optimizer.value_or(false) && c.zero_optimization.offload_optimizer.enabled()) {
    const bool adam = optim::optimizer_kind(c.optimizer) != optim::OptimizerKind::kSGD;
    out.push_back(str("zero_force_ds_cpu_optimizer = true: offload_optimizer steps optimizer.type ", c.optimizer.type,
                      adam ? " with remat's host Adam (optim/host_adam.h: one fused pass in host memory, as "
                             "DeepSpeed's CPU Adam)"
                           : " with LibTorch's SGD in host memory (remat's host optimizer is Adam or AdamW)",
                      "; remat refuses no optimizer under offload, and what is computed does not depend on it"));
  }
  if (!c.bf16.enabled) return;  // bf16's keys ask for nothing while it is off
  if (t.immediate_grad_update.value_or(false)) {
    out.push_back("bf16.immediate_grad_update = true has no effect in remat: it chooses when DeepSpeed adds each "
                  "bf16 gradient into its float32 accumulation (during the backward or after it); remat "
                  "accumulates gradients in float32 (data_types.grad_accum_dtype), and the sums are the same");
  }
  if (t.check_overflow.value_or(false)) {
    out.push_back(str("bf16.check_overflow = true: remat checks every step's loss and gradients for inf and nan "
                      "whatever it says, and train.on_nonfinite decides what follows: it is \"",
                      c.train.on_nonfinite, "\"",
                      c.train.on_nonfinite == "skip" ? ", which skips the step, as DeepSpeed does"
                                                     : ", which stops the run naming the step (\"skip\" skips it, "
                                                       "as DeepSpeed does)"));
  }
}

}  // namespace

std::vector<std::string> tuning_without_effect(const Config& c) {
  std::vector<std::string> out;
  tuning_lines(c, out);
  value_lines(c, out);
  if (const std::string line = persistence_threshold_note(c); !line.empty()) out.push_back(line);
  return out;
}

std::string persistence_threshold_why(const parallel::MixedPrecision& mixed) {
  return str("under ", parallel::dtype_name(mixed.compute_dtype), " stage 3 shards every parameter, since the "
             "float32 masters live in the shards and a parameter kept whole would have none beside its ",
             parallel::dtype_name(mixed.compute_dtype), " copy");
}

std::string persistence_threshold_note(const Config& c) {
  const auto& given = c.deepspeed_tuning.param_persistence_threshold;  // "auto" says what it became itself
  const auto& z = c.zero_optimization;
  const auto mixed = parallel::mixed_precision(c.bf16, c.fp16.enabled);
  const int64_t used = parallel::stage3_persistence_threshold(z, mixed);
  if (z.stage != 3 || !given || used == *given) return "";
  return str("zero_optimization.stage3_param_persistence_threshold = ", *given, " is not used: the threshold is ",
             used, ", because ", persistence_threshold_why(mixed),
             " (the threshold keeps small parameters whole in float32 runs)");
}

std::vector<std::pair<std::string, std::string>> tuning_problems(const Config& c) {
  std::vector<std::pair<std::string, std::string>> out;
  const DeepSpeedTuningConfig& t = c.deepspeed_tuning;
  if (t.prescale_gradients && *t.prescale_gradients) {
    out.emplace_back("prescale_gradients",
                     "'prescale_gradients' is true, which divides gradients before their sum: remat sums them "
                     "across the data-parallel ranks, then divides once (the same average, rounded once); set it to "
                     "false or remove it");
  }
  if (t.gradient_predivide_factor && *t.gradient_predivide_factor != 1.0) {
    out.emplace_back("gradient_predivide_factor",
                     str("'gradient_predivide_factor' = ", *t.gradient_predivide_factor, " divides gradients by it "
                         "before their sum: remat sums them, then divides once by the data-parallel size; set it to "
                         "1.0 or remove it"));
  }
  if (t.sub_group_size && *t.sub_group_size < 1 && c.zero_optimization.offload_optimizer.on_nvme()) {
    out.emplace_back("zero_optimization.sub_group_size",
                     str("'zero_optimization.sub_group_size' = ", *t.sub_group_size, " with offload_optimizer "
                         "device \"nvme\": the optimizer state is stepped in sub-groups of that many elements; set "
                         "1024 or more (e.g. 1e6; DeepSpeed's default 1e9), or remove it"));
  }
  for (const auto& key : kOldOffloadKeys) {
    const auto& value = t.*key.value;
    if (!value) continue;
    const std::string path = str("zero_optimization.", key.name);
    const auto device = key.current_device ? key.current_device(c) : parallel::OffloadDevice::kNone;
    if (device != parallel::OffloadDevice::kNone) {
      const std::string& name = parallel::offload_device_names().at(static_cast<size_t>(device));
      out.emplace_back(path, str("'", path, "' (", yes_no(*value), ") and '", key.current, "' (device \"", name,
                                 "\") are both given: ", key.name, " is DeepSpeed's old spelling of ", key.current,
                                 ", and only one of them can say whether to offload (DeepSpeed refuses the two "
                                 "together too): remove '", path, "'"));
    } else if (*value) {
      out.emplace_back(path, str("'", path, "' is true: it is DeepSpeed's old spelling of ", key.current,
                                 ", and remat reads only the current key: write ", key.current,
                                 " instead, or set '", path, "' to false"));
    }
  }
  return out;
}

}  // namespace remat::deepspeed_keys
