#include "engine/internal/deepspeed_keys.h"

#include <algorithm>
#include <string>

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
      deepspeed_only("nebula", "remat has no Nebula checkpoint service",
                     "set train.async_save to true: saves are then written in the background while training "
                     "goes on"),
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

}  // namespace remat::deepspeed_keys
