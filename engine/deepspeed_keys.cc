#include "engine/deepspeed_keys.h"

#include <algorithm>
#include <string>

#include "engine/config.h"
#include "runtime/error.h"

namespace remat::deepspeed_keys {

using json_schema::Field;
using json_schema::json;

namespace {

// "recognised DeepSpeed key, not supported by remat: 'path' [= value], because
// why; remove it [or set it to off] [(or instead)]".
std::string refusal_text(const std::string& path, const json& value, const std::string& why,
                         const std::string& off, const std::string& instead) {
  const bool shown = !value.is_discarded() && !off.empty();
  return str("recognised DeepSpeed key, not supported by remat: '", path, "'",
             shown ? " = " + json_schema::preview(value) : std::string(), ", because ", why, "; remove it",
             off.empty() ? std::string() : " or set it to " + off + ", which asks for nothing",
             instead.empty() ? std::string() : " (or " + instead + ")");
}

bool asks_nvme(const json& section) {
  auto device = section.find("device");
  return device != section.end() && *device == "nvme";
}

// Whether `root` offloads anything to NVMe (an offload section's device "nvme").
bool nvme_anywhere(const json& root) {
  auto zero = root.find("zero_optimization");
  if (zero == root.end() || !zero->is_object()) return false;
  for (const char* section : {"offload_optimizer", "offload_param"}) {
    auto s = zero->find(section);
    if (s != zero->end() && s->is_object() && asks_nvme(*s)) return true;
  }
  return false;
}

// DeepSpeed's aio section tunes the I/O of offload to NVMe: read only when
// an offload device is "nvme" (then refused with it, in one error).
Field aio_key() {
  return json_schema::refused(
      "aio",
      [](const std::string& path, const json& value) {
        return refusal_text(path, value, "it configures the I/O of offload to NVMe, and remat offloads to host "
                            "memory only", "", "set the offload devices to \"cpu\", with which it is ignored");
      },
      [](const json&, const json& root) { return !nvme_anywhere(root); });
}

}  // namespace

// A DeepSpeed key remat recognises but does not implement: named with the
// reason, and what to do instead when remat has another way.
Field deepspeed_only(const char* name, const char* reason, const char* instead) {
  return json_schema::refused(name, [why = std::string(reason), alternative = std::string(instead)](
                                        const std::string& path, const json& value) {
    return refusal_text(path, value, why, "", alternative);
  });
}

Field deepspeed_only_unless(const char* name, std::vector<json> off, const char* reason, const char* instead) {
  const std::string first = off.front().dump();
  auto message = [why = std::string(reason), alternative = std::string(instead), first](const std::string& path,
                                                                                        const json& value) {
    return refusal_text(path, value, why, first, alternative);
  };
  return json_schema::refused(name, message, [off = std::move(off)](const json& value, const json&) {
    return std::find(off.begin(), off.end(), value) != off.end();
  });
}

Field nvme_key(const char* name, json off, const std::string& reason) {
  auto message = [why = reason, first = off.dump()](const std::string& path, const json& value) {
    return refusal_text(path, value, why, first, "set device to \"cpu\", with which it is ignored");
  };
  return json_schema::refused(name, message, [off = std::move(off)](const json& value, const json& section) {
    return value == off || !asks_nvme(section);
  });
}

// DeepSpeed's top-level sections and keys that remat does not implement.
std::vector<Field> deepspeed_only_top_level() {
  const char* no_monitor = "remat writes no monitoring output of its own";
  const char* metrics = "give remat-train --metrics FILE: one JSON object per step";
  const char* no_data_schedule = "remat-train has no data sampling or curriculum schedules";
  const char* no_quantization = "remat does not compress or quantize models";
  const char* ulysses_group = "it sizes DeepSpeed-Ulysses' sequence-parallel group, and remat's sequence "
                              "parallelism is Megatron's: it splits each sequence across the tensor-parallel group";
  const char* ulysses_dtype = "it sets the dtype of DeepSpeed-Ulysses' collectives, and remat's sequence "
                              "parallelism (Megatron's, over the tensor-parallel group) runs its collectives "
                              "in the dtype of what they carry";
  const char* megatron_sp = "set tensor_parallel.size to the ranks that split a sequence and "
                            "tensor_parallel.sequence_parallel to true";
  return {
      deepspeed_only("bfloat16", "it is DeepSpeed's old name of the bf16 section", "write bf16"),
      deepspeed_only("amp", "remat does not use NVIDIA Apex", "set bf16.enabled for mixed precision"),
      deepspeed_only("torch_autocast", "remat has no autocast", "set bf16.enabled for mixed precision"),
      deepspeed_only("flops_profiler", "remat has no FLOPs profiler", metrics),
      deepspeed_only("tensorboard", no_monitor, metrics),
      deepspeed_only("wandb", no_monitor, metrics),
      deepspeed_only("csv_monitor", no_monitor, metrics),
      deepspeed_only("comet", no_monitor, metrics),
      deepspeed_only("comms_logger", "remat does not log each collective's size and time",
                     "run benchmarks/collective_bench to measure collectives, or REMAT_DEBUG_COLLECTIVES=1 "
                     "to check them across ranks"),
      deepspeed_only("autotuning", "remat does not search for configurations",
                     "set activation_checkpointing.variant to \"auto\" with a memory budget: the planner "
                     "chooses checkpointing per block"),
      deepspeed_only("elasticity", "remat runs a fixed number of ranks",
                     "save (Engine::save_checkpoint; remat-train --save-dir) and load it with another number of ranks "
                     "(Engine::load_checkpoint; remat-train --resume): the save is re-sliced"),
      deepspeed_only("data_efficiency", no_data_schedule),
      deepspeed_only("curriculum_learning", no_data_schedule),
      deepspeed_only("compression_training", no_quantization),
      deepspeed_only("quantize_training", no_quantization),
      deepspeed_only("weight_quantization", no_quantization),
      aio_key(),
      deepspeed_only("nebula", "remat has no Nebula checkpoint service"),
      deepspeed_only("sparse_attention", "remat's attention is dense"),
      deepspeed_only("pipeline", "remat has no pipeline parallelism",
                     "split the model with tensor_parallel.size and zero_optimization.stage"),
      // DeepSpeed-Ulysses' long-sequence keys, in the spellings of its versions
      // (seq_parallel_comm_data_type until the key took its documented name).
      deepspeed_only("seq_parallel_comm_data_type", ulysses_dtype, megatron_sp),
      deepspeed_only("seq_parallel_communication_data_type", ulysses_dtype, megatron_sp),
      deepspeed_only_unless("sequence_parallel_size", {1}, ulysses_group, megatron_sp),
      deepspeed_only("data_parallel_size",
                     "remat derives the data-parallel size: the world size / tensor_parallel.size",
                     "launch data-parallel size x tensor_parallel.size ranks"),
      deepspeed_only_unless("sparse_gradients", {false}, "remat reduces dense gradients only"),
      deepspeed_only_unless("disable_allgather", {false}, "remat's ZeRO chooses its all-gathers itself",
                            "set zero_optimization.allgather_partitions to false to broadcast the updated "
                            "parameters instead"),
      deepspeed_only_unless("dump_state", {false}, "remat does not print its engine's state",
                            "remat-train --print-config prints the configuration a run trains with, every "
                            "\"auto\" decided"),
      deepspeed_only_unless("memory_breakdown", {false}, "remat does not log its allocator's state per step",
                            metrics),
      deepspeed_only("timers", "remat has no timer settings", "set wall_clock_breakdown to true"),
      deepspeed_only("checkpoint", "remat-train saves and resumes its own format",
                     "give remat-train --save-dir and --resume, and set train.save_interval"),
      deepspeed_only("dataloader_drop_last", "remat-train draws full batches only"),
      deepspeed_only("vocabulary_size", "the model's vocabulary is what its data holds"),
      deepspeed_only("eigenvalue", "remat does not estimate Hessian eigenvalues"),
      deepspeed_only("progressive_layer_drop", "remat does not drop layers"),
      deepspeed_only("hybrid_engine", "remat has no inference engine"),
      deepspeed_only("compile", "LibTorch's C++ frontend has no torch.compile"),
      deepspeed_only_unless("graph_harvesting", {false}, "remat does not capture CUDA graphs"),
      deepspeed_only_unless("use_data_before_expert_parallelism", {false}, "remat has no expert parallelism"),
  };
}

// DeepSpeed's zero_optimization keys that remat does not implement. Where
// DeepSpeed's default asks for nothing (a feature off), that value is
// accepted.
std::vector<Field> deepspeed_only_zero() {
  const char* no_quantized = "remat's collectives carry unquantized values";
  const char* no_trace = "remat's stage 3 gathers each unit around its remat::forward call, with no trace";
  const char* mics = "set zero_optimization.hybrid_shard_size: shards within groups of that many ranks, "
                     "replicated across them";
  return {
      deepspeed_only("prefetch_bucket_size", "it is DeepSpeed's other name of stage3_prefetch_bucket_size",
                     "write stage3_prefetch_bucket_size"),
      deepspeed_only("param_persistence_threshold",
                     "it is DeepSpeed's other name of stage3_param_persistence_threshold",
                     "write stage3_param_persistence_threshold"),
      deepspeed_only("stage3_model_persistence_threshold",
                     "remat bounds persistence per parameter only",
                     "use zero_optimization.stage3_param_persistence_threshold"),
      deepspeed_only_unless("stage3_module_granularity_threshold", {0},
                            "remat's stage 3 units are the modules called through remat::forward"),
      deepspeed_only_unless("stage3_use_all_reduce_for_fetch_params", {false}, "remat's stage 3 gathers by all-gather"),
      // 0 and 1 (DeepSpeed's default): no secondary partition.
      deepspeed_only_unless("zero_hpz_partition_size", {1, 0},
                            "remat has no secondary parameter partition (ZeRO++ hpZ)",
                            "set zero_optimization.hybrid_shard_size to shard within groups of ranks"),
      // -1 (DeepSpeed's default) and 0: no MiCS.
      deepspeed_only_unless("mics_shard_size", {-1, 0}, "remat has no MiCS", mics),
      deepspeed_only_unless("mics_hierarchical_params_gather", {false}, "remat has no MiCS"),
      deepspeed_only_unless("zero_quantized_weights", {false}, no_quantized),
      deepspeed_only_unless("zero_quantized_nontrainable_weights", {false}, no_quantized),
      deepspeed_only_unless("zero_quantized_gradients", {false}, no_quantized),
      deepspeed_only_unless("zeropp_loco_param", {nullptr}, no_quantized),
      deepspeed_only_unless("elastic_checkpoint", {false},
                            "remat's saves are re-sliced when loaded at another data-parallel size or stage, "
                            "whatever this says"),
      // true (DeepSpeed's default) is what remat does.
      deepspeed_only_unless("load_from_fp32_weights", {true},
                            "remat's saves hold fp32 master shards, and it always loads them"),
      deepspeed_only_unless("ignore_unused_parameters", {true},
                            "remat has no check of unused parameters to turn on: it ignores them, as true does"),
      deepspeed_only("use_multi_rank_bucket_allreduce", "remat reduces each gradient bucket with one collective"),
      deepspeed_only_unless("legacy_stage1", {false}, "remat has one stage 1"),
      deepspeed_only("override_module_apply", no_trace),
      deepspeed_only_unless("pipeline_loading_checkpoint", {false}, "remat has no pipeline parallelism"),
      deepspeed_only_unless("log_trace_cache_warnings", {false}, no_trace),
  };
}

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
    "elements); what is computed does not depend on it";
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
  if (t.sub_group_size) {
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
    const bool adam = c.optimizer.type != "SGD";
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
