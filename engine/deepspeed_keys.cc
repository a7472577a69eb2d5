#include "engine/deepspeed_keys.h"

#include <string>

#include "engine/config.h"
#include "runtime/error.h"

namespace remat::deepspeed_keys {

using json_schema::Field;

// A DeepSpeed key remat recognises but does not implement: named with the
// reason, and what to do instead when remat has another way.
Field deepspeed_only(const char* name, const char* reason, const char* instead) {
  return json_schema::refused(name, [why = std::string(reason), alternative = std::string(instead)](
                                        const std::string& path) {
    return str("recognised DeepSpeed key, not supported by remat: '", path, "', because ", why, "; remove it",
               alternative.empty() ? std::string() : " (or " + alternative + ")");
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
      deepspeed_only("zero_force_ds_cpu_optimizer", "remat has no CPU optimizer"),
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
      deepspeed_only("aio", "it configures NVMe offload, and remat offloads nothing to NVMe"),
      deepspeed_only("nebula", "remat has no Nebula checkpoint service"),
      deepspeed_only("sparse_attention", "remat's attention is dense"),
      deepspeed_only("pipeline", "remat has no pipeline parallelism",
                     "split the model with tensor_parallel.size and zero_optimization.stage"),
      // DeepSpeed-Ulysses' long-sequence keys, in the spellings of its versions
      // (seq_parallel_comm_data_type until the key took its documented name).
      deepspeed_only("seq_parallel_comm_data_type", ulysses_dtype, megatron_sp),
      deepspeed_only("seq_parallel_communication_data_type", ulysses_dtype, megatron_sp),
      deepspeed_only("sequence_parallel_size", ulysses_group, megatron_sp),
      deepspeed_only("data_parallel_size",
                     "remat derives the data-parallel size: the world size / tensor_parallel.size",
                     "launch data-parallel size x tensor_parallel.size ranks"),
      deepspeed_only("sparse_gradients", "remat reduces dense gradients only"),
      deepspeed_only("disable_allgather", "remat's ZeRO chooses its all-gathers itself",
                     "set zero_optimization.allgather_partitions to false to broadcast the updated "
                     "parameters instead"),
      deepspeed_only("dump_state", "remat does not print its engine's state",
                     "remat-train prints the effective configuration at start"),
      deepspeed_only("memory_breakdown", "remat does not log its allocator's state per step", metrics),
      deepspeed_only("timers", "remat has no timer settings", "set wall_clock_breakdown to true"),
      deepspeed_only("checkpoint", "remat-train saves and resumes its own format",
                     "give remat-train --save-dir and --resume, and set train.save_interval"),
      deepspeed_only("dataloader_drop_last", "remat-train draws full batches only"),
      deepspeed_only("vocabulary_size", "the model's vocabulary is what its data holds"),
      deepspeed_only("eigenvalue", "remat does not estimate Hessian eigenvalues"),
      deepspeed_only("progressive_layer_drop", "remat does not drop layers"),
      deepspeed_only("hybrid_engine", "remat has no inference engine"),
      deepspeed_only("compile", "LibTorch's C++ frontend has no torch.compile"),
      deepspeed_only("graph_harvesting", "remat does not capture CUDA graphs"),
      deepspeed_only("use_data_before_expert_parallelism", "remat has no expert parallelism"),
  };
}

// DeepSpeed's zero_optimization keys that remat does not implement.
std::vector<Field> deepspeed_only_zero() {
  const char* no_quantized = "remat's collectives carry unquantized values";
  const char* no_trace = "remat's stage 3 gathers each unit around its remat::forward call, with no trace";
  return {
      deepspeed_only("prefetch_bucket_size", "it is DeepSpeed's other name of stage3_prefetch_bucket_size",
                     "write stage3_prefetch_bucket_size"),
      deepspeed_only("param_persistence_threshold",
                     "it is DeepSpeed's other name of stage3_param_persistence_threshold",
                     "write stage3_param_persistence_threshold"),
      deepspeed_only("stage3_model_persistence_threshold",
                     "remat bounds persistence per parameter only",
                     "use zero_optimization.stage3_param_persistence_threshold"),
      deepspeed_only("stage3_module_granularity_threshold",
                     "remat's stage 3 units are the modules called through remat::forward"),
      deepspeed_only("stage3_use_all_reduce_for_fetch_params", "remat's stage 3 gathers by all-gather"),
      deepspeed_only("round_robin_gradients", "it orders gradient copies to the host for optimizer offload, "
                                              "which remat does not do"),
      deepspeed_only("zero_hpz_partition_size", "remat has no secondary parameter partition (ZeRO++ hpZ)",
                     "set zero_optimization.hybrid_shard_size to shard within groups of ranks"),
      deepspeed_only("mics_shard_size", "remat has no MiCS",
                     "set zero_optimization.hybrid_shard_size: shards within groups of that many ranks, "
                     "replicated across them"),
      deepspeed_only("mics_hierarchical_params_gather", "remat has no MiCS"),
      deepspeed_only("zero_quantized_weights", no_quantized),
      deepspeed_only("zero_quantized_nontrainable_weights", no_quantized),
      deepspeed_only("zero_quantized_gradients", no_quantized),
      deepspeed_only("zeropp_loco_param", no_quantized),
      deepspeed_only("elastic_checkpoint", "remat's saves are re-sliced when loaded at another data-parallel "
                                           "size or stage, whatever this says"),
      deepspeed_only("load_from_fp32_weights", "remat's saves hold fp32 master shards, and it always loads them"),
      deepspeed_only("ignore_unused_parameters", "remat has no check of unused parameters to turn off"),
      deepspeed_only("use_multi_rank_bucket_allreduce", "remat reduces each gradient bucket with one collective"),
      deepspeed_only("legacy_stage1", "remat has one stage 1"),
      deepspeed_only("override_module_apply", no_trace),
      deepspeed_only("pipeline_loading_checkpoint", "remat has no pipeline parallelism"),
      deepspeed_only("log_trace_cache_warnings", no_trace),
  };
}

// The old offload switches: false asks for nothing, true for an offload,
// which only the current key can ask for.
struct OldOffloadKey {
  const char* name;
  std::optional<bool> DeepSpeedTuningConfig::*value;
  const char* current;
  const char* asks;  // what true asks for
};
constexpr OldOffloadKey kOldOffloadKeys[] = {
    {"cpu_offload", &DeepSpeedTuningConfig::cpu_offload, "zero_optimization.offload_optimizer", "an offload"},
    {"cpu_offload_param", &DeepSpeedTuningConfig::cpu_offload_param, "zero_optimization.offload_param",
     "an offload"},
    {"cpu_offload_use_pin_memory", &DeepSpeedTuningConfig::cpu_offload_use_pin_memory,
     "pin_memory in zero_optimization.offload_optimizer or offload_param", "pinned host memory"},
};

std::vector<std::string> tuning_without_effect(const Config& c) {
  const DeepSpeedTuningConfig& t = c.deepspeed_tuning;
  std::vector<std::string> out;
  if (t.sub_group_size) {
    out.push_back(str("zero_optimization.sub_group_size = ", *t.sub_group_size, " has no effect in remat: remat "
                      "steps each optimizer shard in one piece (DeepSpeed tiles its optimizer step into groups of "
                      "that many elements); what is computed does not depend on it"));
  }
  if (t.max_reuse_distance) {
    out.push_back(str("zero_optimization.stage3_max_reuse_distance = ", *t.max_reuse_distance, " has no effect "
                      "in remat: remat's stage 3 frees a unit's parameters when its call returns and gathers them "
                      "again for its backward, keeping none for reuse; zero_optimization.stage3_max_live_parameters "
                      "bounds what is gathered at once"));
  }
  if (t.allow_untested_optimizer) {
    out.push_back(str("zero_allow_untested_optimizer = ", *t.allow_untested_optimizer ? "true" : "false",
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
    out.push_back(str("zero_optimization.memory_efficient_linear = ", *t.memory_efficient_linear ? "true" : "false",
                      " has no effect in remat: it chooses how DeepSpeed's traced stage 3 saves a linear layer's "
                      "input; remat's stage 3 gathers each unit around its remat::forward call, and what a layer "
                      "saves is the activation checkpointing's choice"));
  }
  if (t.gather_16bit_weights_on_model_save && !c.bf16.enabled && !c.fp16.enabled) {
    out.push_back("zero_optimization.stage3_gather_16bit_weights_on_model_save is true, but the training dtype is "
                  "float32 (bf16 and fp16 are off), so the export is float32 as without it; it writes bf16 or fp16 "
                  "with bf16.enabled or fp16.enabled");
  }
  return out;
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
    if (!value || !*value) continue;
    const std::string path = str("zero_optimization.", key.name);
    out.emplace_back(path, str("'", path, "' is true: it is DeepSpeed's old spelling of ", key.current,
                               ", and remat reads only the current key: write ", key.current,
                               " instead, or set '", path, "' to false"));
  }
  return out;
}

}  // namespace remat::deepspeed_keys
