// The config's schema: one table of fields per section binding each JSON key
// onto a struct member, once (the sections are declared in config.h and, for
// a library's options, in that library), and the parse and load that apply
// it. The rules over the values are config_rules.cc's.
#include "engine/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <set>
#include <sstream>
#include <type_traits>

#include "engine/internal/config_autos.h"
#include "engine/internal/deepspeed_keys.h"
#include "runtime/error.h"
#include "runtime/json_schema.h"

namespace remat {

using nlohmann::json;

namespace {

using json_schema::enum_leaf;
using json_schema::Field;
using json_schema::fail;
using json_schema::inline_section;
using json_schema::leaf;
using json_schema::object;
using json_schema::optional_leaf;
using deepspeed_keys::deepspeed_only;
using deepspeed_keys::deepspeed_only_top_level;
using deepspeed_keys::deepspeed_only_zero;


// `fields` followed by `more`.
std::vector<Field> with(std::vector<Field> fields, std::vector<Field> more) {
  for (auto& f : more) fields.push_back(std::move(f));
  return fields;
}

// `field` of the section `section` (a library's options), written elsewhere
// in the JSON: DeepSpeed's top-level keys that configure bf16.
template <typename S>
Field stored_in(Field field, S Config::*section) {
  auto assign = std::move(field.assign);
  auto dump = std::move(field.dump);
  field.assign = [assign, section](const json& value, void* target) {
    assign(value, &(static_cast<Config*>(target)->*section));
  };
  field.dump = [dump, section](const void* target) { return dump(&(static_cast<const Config*>(target)->*section)); };
  return field;
}

// `fields`, bound to the section `section` of Config, bound to Config itself:
// so that keys of the engine's own can sit beside them in the same JSON object.
template <typename S>
std::vector<Field> within(S Config::*section, std::vector<Field> fields) {
  for (auto& f : fields) {
    if (f.refusal) continue;
    if (f.kind != json_schema::Kind::kObject) {
      f = stored_in(std::move(f), section);
      continue;
    }
    auto member = std::move(f.member);
    auto member_const = std::move(f.member_const);
    f.member = [member, section](void* t) { return member(&(static_cast<Config*>(t)->*section)); };
    f.member_const = [member_const, section](const void* t) {
      return member_const(&(static_cast<const Config*>(t)->*section));
    };
  }
  return fields;
}

// `fields`: one key's spellings, the first the preferred one (json_schema
// refuses two of them given together, naming both: only one value could be read).
std::vector<Field> spellings(std::vector<Field> fields) {
  for (size_t i = 1; i < fields.size(); ++i) fields[i].spelling_of = fields[0].name;
  return fields;
}

// stage3_param_persistence_threshold, ZeRO's, also recorded as given (a
// number: "auto" stores nothing), for the line that says when stage 3 uses
// another value (internal/config_tuning.cc: persistence_threshold_note).
Field persistence_threshold_field() {
  Field f = stored_in(leaf("stage3_param_persistence_threshold",
                           &parallel::ZeroOptions::stage3_param_persistence_threshold),
                      &Config::zero_optimization);
  f.assign = [assign = std::move(f.assign)](const json& value, void* target) {
    assign(value, target);
    auto& c = *static_cast<Config*>(target);
    c.deepspeed_tuning.param_persistence_threshold = c.zero_optimization.stage3_param_persistence_threshold;
  };
  return f;
}

// DeepSpeed's tuning keys of zero_optimization that remat reads (the others
// are in internal/deepspeed_keys.cc): stage3_max_live_parameters is ZeRO's, the rest
// the engine's (config.h: DeepSpeedTuningConfig), each in every spelling.
std::vector<Field> zero_tuning_fields() {
  using T = DeepSpeedTuningConfig;
  auto tuning = [](Field f) { return stored_in(std::move(f), &Config::deepspeed_tuning); };
  auto zero = [](Field f) { return stored_in(std::move(f), &Config::zero_optimization); };
  std::vector<Field> out = with(
      spellings({zero(leaf("stage3_max_live_parameters", &parallel::ZeroOptions::stage3_max_live_parameters)),
                 zero(leaf("max_live_parameters", &parallel::ZeroOptions::stage3_max_live_parameters))}),
      spellings({tuning(optional_leaf("stage3_max_reuse_distance", &T::max_reuse_distance)),
                 tuning(optional_leaf("max_reuse_distance", &T::max_reuse_distance))}));
  // stage3_gather_fp16_weights_on_model_save: DeepSpeed's deprecated spelling.
  out = with(out, spellings({tuning(leaf("stage3_gather_16bit_weights_on_model_save",
                                         &T::gather_16bit_weights_on_model_save)),
                             tuning(leaf("stage3_gather_fp16_weights_on_model_save",
                                         &T::gather_16bit_weights_on_model_save)),
                             tuning(leaf("gather_16bit_weights_on_model_save",
                                         &T::gather_16bit_weights_on_model_save))}));
  out.push_back(persistence_threshold_field());
  out.push_back(tuning(optional_leaf("sub_group_size", &T::sub_group_size)));
  out.push_back(tuning(optional_leaf("memory_efficient_linear", &T::memory_efficient_linear)));
  out.push_back(tuning(optional_leaf("round_robin_gradients", &T::round_robin_gradients)));
  // DeepSpeed's old offload switches: given beside their current key's
  // section, refused naming both (internal/config_tuning.cc: tuning_problems).
  out.push_back(tuning(optional_leaf("cpu_offload", &T::cpu_offload)));
  out.push_back(tuning(optional_leaf("cpu_offload_param", &T::cpu_offload_param)));
  out.push_back(tuning(optional_leaf("cpu_offload_use_pin_memory", &T::cpu_offload_use_pin_memory)));
  return out;
}

// bf16 (parallel/zero_options.h) beside DeepSpeed's bf16 keys: its tuning
// accepted (the engine's), 16-bit masters and optimizer state refused
// (false, DeepSpeed's default, asks for nothing).
std::vector<Field> bf16_fields() {
  using T = DeepSpeedTuningConfig;
  auto tuning = [](Field f) { return stored_in(std::move(f), &Config::deepspeed_tuning); };
  std::vector<Field> out = within(&Config::bf16, {leaf("enabled", &parallel::Bf16Options::enabled)});
  out.push_back(tuning(optional_leaf("immediate_grad_update", &T::immediate_grad_update)));
  // check_grad_overflow: the key's name in DeepSpeed versions after check_overflow.
  out = with(out, spellings({tuning(optional_leaf("check_overflow", &T::check_overflow)),
                             tuning(optional_leaf("check_grad_overflow", &T::check_overflow))}));
  out.push_back(deepspeed_keys::deepspeed_only_unless("bf16_master_weights_and_grads", {false},
                                                      "remat keeps float32 master weights and gradients"));
  out.push_back(deepspeed_keys::deepspeed_only_unless("bf16_optimizer_states", {false},
                                                      "remat keeps the optimizer state in float32"));
  return out;
}

// remat's schema: one table of fields per section, each bound to a struct
// member (the sections and their defaults are declared in config.h and, for a
// library's options, in that library), and the DeepSpeed keys remat
// recognises but refuses.
using AC = ActivationCheckpointingOptions;

// zero_optimization.offload_optimizer: DeepSpeed's pipeline tuning accepted,
// nvme_path and the pipeline switches read (they matter with device "nvme").
std::vector<Field> offload_optimizer_fields() {
  using O = parallel::OffloadOptimizerOptions;
  return {enum_leaf("device", &O::device, parallel::offload_device_names()),
          leaf("pin_memory", &O::pin_memory),
          leaf("buffer_count", &O::buffer_count),
          leaf("fast_init", &O::fast_init),
          leaf("ratio", &O::ratio),
          optional_leaf("nvme_path", &O::nvme_path),
          leaf("pipeline", &O::pipeline),
          leaf("pipeline_read", &O::pipeline_read),
          leaf("pipeline_write", &O::pipeline_write)};
}

// zero_optimization.offload_param (stage 3): DeepSpeed's buffer tuning
// accepted (logged), max_in_cpu and nvme_path read (they matter with device "nvme").
std::vector<Field> offload_param_fields() {
  using O = parallel::OffloadParamOptions;
  return {enum_leaf("device", &O::device, parallel::offload_device_names()),
          leaf("pin_memory", &O::pin_memory),
          leaf("buffer_count", &O::buffer_count),
          leaf("buffer_size", &O::buffer_size),
          leaf("max_in_cpu", &O::max_in_cpu),
          optional_leaf("nvme_path", &O::nvme_path)};
}

const std::vector<Field>& base_schema() {
  static const std::vector<Field> fields = with({
      optional_leaf("train_batch_size", &Config::train_batch_size),
      optional_leaf("train_micro_batch_size_per_gpu",
                    &Config::train_micro_batch_size_per_gpu),
      optional_leaf("gradient_accumulation_steps",
                    &Config::gradient_accumulation_steps),
      leaf("gradient_clipping", &Config::gradient_clipping),
      leaf("steps_per_print", &Config::steps_per_print),
      leaf("wall_clock_breakdown", &Config::wall_clock_breakdown),
      object("optimizer", &Config::optimizer,
             {leaf("type", &optim::OptimizerOptions::type, optim::optimizer_kind_names()),
              inline_section(
                  "params",
                  {leaf("lr", &optim::OptimizerOptions::lr),
                   leaf("betas", &optim::OptimizerOptions::betas),
                   leaf("eps", &optim::OptimizerOptions::eps),
                   leaf("weight_decay", &optim::OptimizerOptions::weight_decay),
                   leaf("momentum", &optim::OptimizerOptions::momentum),
                   leaf("nesterov", &optim::OptimizerOptions::nesterov),
                   deepspeed_only("adam_w_mode", "remat chooses decoupled weight decay by optimizer.type",
                                  "set optimizer.type to AdamW (true) or Adam (false)"),
                   deepspeed_only("bias_correction", "remat's Adam and AdamW always correct the bias"),
                   deepspeed_only("torch_adam", "remat's optimizers are LibTorch's own")}),
              deepspeed_only("legacy_fusion", "remat's optimizers are LibTorch's own")}),
      object("scheduler", &Config::scheduler,
             {leaf("type", &optim::SchedulerOptions::type, optim::scheduler_type_names()),
              inline_section(
                  "params",
                  {optional_leaf("warmup_min_lr", &optim::SchedulerOptions::warmup_min_lr),
                   optional_leaf("warmup_max_lr", &optim::SchedulerOptions::warmup_max_lr),
                   leaf("warmup_num_steps", &optim::SchedulerOptions::warmup_num_steps),
                   leaf("warmup_type", &optim::SchedulerOptions::warmup_type,
                        {"log", "linear"}),
                   optional_leaf("total_num_steps", &optim::SchedulerOptions::total_num_steps),
                   optional_leaf("warmup_min_ratio", &optim::SchedulerOptions::warmup_min_ratio),
                   optional_leaf("cos_min_ratio", &optim::SchedulerOptions::cos_min_ratio),
                   leaf("last_batch_iteration", &optim::SchedulerOptions::last_batch_iteration)})}),
      // Stored with the bf16 options (parallel/zero_options.h).
      stored_in(enum_leaf("communication_data_type", &parallel::Bf16Options::reduce_dtype,
                          parallel::reduce_dtype_names()),
                &Config::bf16),
      inline_section("data_types",
                     {stored_in(enum_leaf("grad_accum_dtype", &parallel::Bf16Options::grad_accum_dtype,
                                          parallel::grad_accum_dtype_names()),
                                &Config::bf16)}),
      inline_section("bf16", bf16_fields()),
      object("fp16", &Config::fp16,
             {leaf("enabled", &Fp16Config::enabled),
              leaf("auto_cast", &Fp16Config::auto_cast),
              leaf<Fp16Config, double>("loss_scale", &Fp16Config::loss_scale),
              leaf<Fp16Config, int>("initial_scale_power", &Fp16Config::initial_scale_power),
              leaf<Fp16Config, int64_t>("loss_scale_window", &Fp16Config::loss_scale_window),
              leaf<Fp16Config, int>("hysteresis", &Fp16Config::hysteresis),
              leaf<Fp16Config, bool>("consecutive_hysteresis", &Fp16Config::consecutive_hysteresis),
              leaf<Fp16Config, double>("min_loss_scale", &Fp16Config::min_loss_scale),
              leaf("fp16_master_weights_and_grads", &Fp16Config::fp16_master_weights_and_grads)}),
      // ZeRO's keys (parallel/zero_options.h) beside the engine's own.
      inline_section("zero_optimization", with(within(&Config::zero_optimization,
             with({leaf("stage", &parallel::ZeroOptions::stage),
              leaf("reduce_bucket_size", &parallel::ZeroOptions::reduce_bucket_size),
              leaf("reduce_scatter", &parallel::ZeroOptions::reduce_scatter),
              leaf("allgather_bucket_size", &parallel::ZeroOptions::allgather_bucket_size),
              leaf("allgather_partitions", &parallel::ZeroOptions::allgather_partitions),
              leaf("hybrid_shard_size", &parallel::ZeroOptions::hybrid_shard_size),
              leaf("stage3_prefetch_bucket_size",
                   &parallel::ZeroOptions::stage3_prefetch_bucket_size),
              leaf("overlap_comm", &parallel::ZeroOptions::overlap_comm),
              leaf("contiguous_gradients", &parallel::ZeroOptions::contiguous_gradients),
              object("offload_optimizer", &parallel::ZeroOptions::offload_optimizer, offload_optimizer_fields()),
              object("offload_param", &parallel::ZeroOptions::offload_param, offload_param_fields())},
                  deepspeed_only_zero())), zero_tuning_fields())),
      object("activation_checkpointing", &Config::activation_checkpointing,
             {leaf("partition_activations", &AC::partition_activations),
              leaf("cpu_checkpointing", &AC::cpu_checkpointing),
              leaf("contiguous_memory_optimization", &AC::contiguous_memory_optimization),
              optional_leaf("number_checkpoints", &AC::number_checkpoints),
              leaf("synchronize_checkpoint_boundary", &AC::synchronize_checkpoint_boundary),
              leaf("profile", &AC::profile),
              leaf("reentrant", &AC::reentrant),
              leaf("save_collectives", &AC::save_collectives),
              leaf<AC, int64_t>("offload_min_bytes", &AC::offload_min_bytes),
              leaf<AC, int>("offload_max_in_flight", &AC::offload_max_in_flight),
              leaf<AC, bool>("offload_keep_last", &AC::offload_keep_last),
              enum_leaf<AC, CheckpointVariant>("variant", &AC::variant, checkpoint_variant_names()),
              leaf<AC, int>("every_k", &AC::every_k),
              enum_leaf<AC, EveryKFrom>("every_k_from", &AC::every_k_from, every_k_from_names()),
              optional_leaf<AC, std::vector<std::string>>("save_ops", &AC::save_ops),
              optional_leaf<AC, int64_t>("memory_budget_bytes", &AC::memory_budget_bytes),
              json_schema::number_or_word<AC>("memory_budget_fraction", &AC::memory_budget_fraction,
                                              &AC::memory_budget_knee, "knee"),
              json_schema::number_or_word<AC, int64_t>("device_memory_budget_bytes", &AC::device_memory_budget_bytes,
                                                       &AC::device_memory_budget_auto, "auto")}),
      object("activation_offloading", &Config::activation_offloading,
             {leaf("enabled", &OffloadActivationsOptions::enabled),
              leaf("use_pin_memory", &OffloadActivationsOptions::use_pin_memory),
              leaf("use_streams", &OffloadActivationsOptions::use_streams),
              leaf("min_offload_size", &OffloadActivationsOptions::min_offload_size),
              leaf("max_fwd_stash_size", &OffloadActivationsOptions::max_fwd_stash_size),
              leaf("warn_if_no_head", &OffloadActivationsOptions::warn_if_no_head),
              leaf("head", &OffloadActivationsOptions::head)}),
      object("tensor_parallel", &Config::tensor_parallel,
             {leaf("size", &TensorParallelConfig::size),
              leaf("sequence_parallel", &TensorParallelConfig::sequence_parallel),
              enum_leaf<TensorParallelConfig, models::SequenceParallelDropout>(
                  "sequence_parallel_dropout", &TensorParallelConfig::sequence_parallel_dropout,
                  models::sequence_parallel_dropout_names()),
              deepspeed_only("autotp_size",
                             "remat's tensor parallelism is built into its model's layers, not applied to "
                             "any model automatically",
                             "set tensor_parallel.size")}),
      object("aio", &Config::aio,
             with({leaf("block_size", &AioConfig::block_size),
                   leaf("queue_depth", &AioConfig::queue_depth)},
                  with(spellings({leaf("thread_count", &AioConfig::thread_count),
                                  leaf("intra_op_parallelism", &AioConfig::thread_count)}),
                       {leaf("single_submit", &AioConfig::single_submit),
                        leaf("overlap_events", &AioConfig::overlap_events),
                        deepspeed_keys::deepspeed_only_unless(
                            "use_gds", {false}, "remat reads and writes NVMe through host memory, without "
                            "GPUDirect Storage")}))),
      object("model", &Config::model,
             {leaf("n_layer", &models::ModelShape::n_layer),
              leaf("n_head", &models::ModelShape::n_head),
              leaf("d_model", &models::ModelShape::d_model),
              leaf("d_ff", &models::ModelShape::d_ff),
              leaf("seq_len", &models::ModelShape::seq_len),
              leaf("dropout", &models::ModelShape::dropout)}),
      object("data", &Config::data,
             {leaf("path", &DataConfig::path),
              leaf("train_fraction", &DataConfig::train_fraction)}),
      object("train", &Config::train,
             {leaf("steps", &TrainConfig::steps),
              leaf("seed", &TrainConfig::seed),
              leaf("eval_interval", &TrainConfig::eval_interval),
              leaf("eval_batches", &TrainConfig::eval_batches),
              leaf("save_interval", &TrainConfig::save_interval),
              leaf("sample_chars", &TrainConfig::sample_chars),
              leaf("on_nonfinite", &TrainConfig::on_nonfinite, {"stop", "skip"}),
              leaf("device", &TrainConfig::device),
              leaf("async_save", &TrainConfig::async_save)}),
  }, with(deepspeed_only_top_level(), {stored_in(optional_leaf("zero_allow_untested_optimizer",
                                                                &DeepSpeedTuningConfig::allow_untested_optimizer),
                                                  &Config::deepspeed_tuning),
                                        stored_in(optional_leaf("zero_force_ds_cpu_optimizer",
                                                                &DeepSpeedTuningConfig::force_ds_cpu_optimizer),
                                                  &Config::deepspeed_tuning),
                                        stored_in(optional_leaf("prescale_gradients",
                                                                &DeepSpeedTuningConfig::prescale_gradients),
                                                  &Config::deepspeed_tuning),
                                        stored_in(optional_leaf("gradient_predivide_factor",
                                                                &DeepSpeedTuningConfig::gradient_predivide_factor),
                                                  &Config::deepspeed_tuning)}));
  return fields;
}

// The schema, the keys of auto_keys() taking "auto".
const std::vector<Field>& schema() {
  static const std::vector<Field> fields = [] {
    std::vector<Field> all = base_schema();
    for (const auto& key : auto_keys()) json_schema::allow_auto(all, key);
    return all;
  }();
  return fields;
}

}  // namespace

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

std::string Config::to_json() const { return json_schema::dump("", schema(), this).dump(2); }

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  json root = json_schema::parse_strict(text, source);
  Config config;
  std::vector<std::string> autos;  // the keys given "auto"
  json_schema::apply(source, "", schema(), root, &config, &autos);  // The file alone, errors name it.
  if (!overrides.empty()) {
    // Each override is checked on its own; every one that fails is listed.
    std::vector<std::string> failed;
    for (const auto& o : overrides) {
      try {
        json_schema::apply_override(root, schema(), o);
      } catch (const ConfigError& e) {
        failed.emplace_back(e.what());
      }
    }
    if (failed.size() == 1) throw ConfigError(failed[0]);
    if (!failed.empty()) {
      const std::string prefix = "config error ";  // each reads "config error in --set ...: ..."
      std::string message = str("config error: ", failed.size(), " problems (nothing was applied):");
      for (const auto& f : failed) message += "\n  - " + (f.rfind(prefix, 0) == 0 ? f.substr(prefix.size()) : f);
      throw ConfigError(message);
    }
    config = Config{};
    autos.clear();
    json_schema::apply(source + " with --set overrides", "", schema(), root, &config, &autos);
  }
  for (auto& key : autos) config.auto_values.push_back({std::move(key), "", ""});
  internal::decide_config_autos(config);  // before the rules: they see the decided values
  check_config_rules(config, source, overrides);
  // The defaults of the keys the scheduler's type takes, written in: the
  // dumped config shows the rates the run trains with.
  config.scheduler = optim::with_defaults(config.scheduler, config.optimizer.lr);
  return config;
}

void set_config_value(Config& config, const std::string& key, const std::string& value, const std::string& source) {
  json object = json::object();
  json* at = &object;
  size_t begin = 0;
  for (size_t dot = key.find('.'); dot != std::string::npos; begin = dot + 1, dot = key.find('.', begin)) {
    at = &(*at)[key.substr(begin, dot - begin)];
  }
  const json parsed = json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) throw ConfigError(str("config error in ", source, ": '", key, "' = ", value, " is not JSON"));
  (*at)[key.substr(begin)] = parsed;
  json_schema::apply(source, "", schema(), object, &config, nullptr);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw ConfigError(str("config error: '", path, "' is a directory; give --config a JSON file"));
  }
  std::ifstream in(path);
  if (!in) {
    throw ConfigError(str("config error: cannot read '", path,
                          "': check the path given to --config"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_config(buffer.str(), path, overrides);
}

}  // namespace remat
