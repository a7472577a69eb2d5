#include "engine/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <set>
#include <sstream>
#include <type_traits>

#include "engine/auto_values.h"
#include "engine/deepspeed_keys.h"
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

// DeepSpeed's tuning keys of zero_optimization that remat reads (the others
// are in deepspeed_keys.cc): stage3_max_live_parameters is ZeRO's, the rest
// the engine's (config.h: DeepSpeedTuningConfig), each in every spelling.
std::vector<Field> zero_tuning_fields() {
  using T = DeepSpeedTuningConfig;
  auto tuning = [](Field f) { return stored_in(std::move(f), &Config::deepspeed_tuning); };
  auto zero = [](Field f) { return stored_in(std::move(f), &Config::zero_optimization); };
  std::vector<Field> out;
  for (const char* name : {"stage3_max_live_parameters", "max_live_parameters"}) {
    out.push_back(zero(leaf(name, &parallel::ZeroOptions::stage3_max_live_parameters)));
  }
  for (const char* name : {"stage3_max_reuse_distance", "max_reuse_distance"}) {
    out.push_back(tuning(optional_leaf(name, &T::max_reuse_distance)));
  }
  for (const char* name : {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                           "gather_16bit_weights_on_model_save"}) {
    out.push_back(tuning(leaf(name, &T::gather_16bit_weights_on_model_save)));
  }
  out.push_back(tuning(optional_leaf("sub_group_size", &T::sub_group_size)));
  out.push_back(tuning(optional_leaf("memory_efficient_linear", &T::memory_efficient_linear)));
  out.push_back(tuning(optional_leaf("cpu_offload", &T::cpu_offload)));
  out.push_back(tuning(optional_leaf("cpu_offload_param", &T::cpu_offload_param)));
  out.push_back(tuning(optional_leaf("cpu_offload_use_pin_memory", &T::cpu_offload_use_pin_memory)));
  return out;
}

// remat's schema: one table of fields per section, each bound to a struct
// member (the sections and their defaults are declared in config.h and, for a
// library's options, in that library), and the DeepSpeed keys remat
// recognises but refuses.
using AC = ActivationCheckpointingOptions;

// zero_optimization.offload_optimizer: DeepSpeed's NVMe keys refused (the
// device "nvme" itself by check_zero_options), its pipeline tuning accepted.
std::vector<Field> offload_optimizer_fields() {
  using O = parallel::OffloadOptimizerOptions;
  const char* nvme = "it configures offload to NVMe, and remat offloads the optimizer to host memory only";
  return {enum_leaf("device", &O::device, parallel::offload_device_names()),
          leaf("pin_memory", &O::pin_memory),
          leaf("buffer_count", &O::buffer_count),
          leaf("fast_init", &O::fast_init),
          leaf("ratio", &O::ratio),
          deepspeed_only("nvme_path", nvme, "set device to \"cpu\""),
          deepspeed_only("pipeline", nvme, "set device to \"cpu\""),
          deepspeed_only("pipeline_read", nvme, "set device to \"cpu\""),
          deepspeed_only("pipeline_write", nvme, "set device to \"cpu\"")};
}

// zero_optimization.offload_param (stage 3): NVMe refused (the device "nvme"
// by check_zero_options), DeepSpeed's buffer tuning accepted (logged).
std::vector<Field> offload_param_fields() {
  using O = parallel::OffloadParamOptions;
  return {enum_leaf("device", &O::device, parallel::offload_device_names()),
          leaf("pin_memory", &O::pin_memory),
          leaf("buffer_count", &O::buffer_count),
          leaf("buffer_size", &O::buffer_size),
          leaf("max_in_cpu", &O::max_in_cpu),
          deepspeed_only("nvme_path", "it configures offload to NVMe, and remat offloads parameters to host memory only",
                         "set device to \"cpu\"")};
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
             {leaf("type", &OptimizerConfig::type, {"AdamW", "Adam", "SGD"}),
              inline_section(
                  "params",
                  {leaf("lr", &OptimizerConfig::lr),
                   leaf("betas", &OptimizerConfig::betas),
                   leaf("eps", &OptimizerConfig::eps),
                   leaf("weight_decay", &OptimizerConfig::weight_decay),
                   leaf("momentum", &OptimizerConfig::momentum),
                   leaf("nesterov", &OptimizerConfig::nesterov),
                   deepspeed_only("adam_w_mode", "remat chooses decoupled weight decay by optimizer.type",
                                  "set optimizer.type to AdamW (true) or Adam (false)"),
                   deepspeed_only("bias_correction", "remat's Adam and AdamW always correct the bias"),
                   deepspeed_only("torch_adam", "remat's optimizers are LibTorch's own")}),
              deepspeed_only("legacy_fusion", "remat's optimizers are LibTorch's own")}),
      object("scheduler", &Config::scheduler,
             {leaf("type", &SchedulerConfig::type,
                   {"none", "WarmupLR", "WarmupDecayLR"}),
              inline_section(
                  "params",
                  {leaf("warmup_min_lr", &SchedulerConfig::warmup_min_lr),
                   leaf("warmup_max_lr", &SchedulerConfig::warmup_max_lr),
                   leaf("warmup_num_steps", &SchedulerConfig::warmup_num_steps),
                   leaf("warmup_type", &SchedulerConfig::warmup_type,
                        {"log", "linear"}),
                   leaf("total_num_steps", &SchedulerConfig::total_num_steps),
                   leaf("last_batch_iteration", &SchedulerConfig::last_batch_iteration)})}),
      // Stored with the bf16 options (parallel/zero_options.h).
      stored_in(enum_leaf("communication_data_type", &parallel::Bf16Options::reduce_dtype,
                          parallel::reduce_dtype_names()),
                &Config::bf16),
      inline_section("data_types",
                     {stored_in(enum_leaf("grad_accum_dtype", &parallel::Bf16Options::grad_accum_dtype,
                                          parallel::grad_accum_dtype_names()),
                                &Config::bf16)}),
      object("bf16", &Config::bf16,
             {leaf("enabled", &parallel::Bf16Options::enabled),
              deepspeed_only("immediate_grad_update",
                             "remat's bf16 updates the fp32 master shards once per optimizer step")}),
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
              leaf("stage3_param_persistence_threshold",
                   &parallel::ZeroOptions::stage3_param_persistence_threshold),
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
              leaf("device", &TrainConfig::device)}),
  }, with(deepspeed_only_top_level(), {stored_in(optional_leaf("zero_allow_untested_optimizer",
                                                                &DeepSpeedTuningConfig::allow_untested_optimizer),
                                                  &Config::deepspeed_tuning),
                                        stored_in(optional_leaf("prescale_gradients",
                                                                &DeepSpeedTuningConfig::prescale_gradients),
                                                  &Config::deepspeed_tuning),
                                        stored_in(optional_leaf("gradient_predivide_factor",
                                                                &DeepSpeedTuningConfig::gradient_predivide_factor),
                                                  &Config::deepspeed_tuning)}));
  return fields;
}

// The schema, the keys of engine/auto_values.h taking "auto".
const std::vector<Field>& schema() {
  static const std::vector<Field> fields = [] {
    std::vector<Field> all = base_schema();
    for (const auto& key : auto_keys()) json_schema::allow_auto(all, key);
    return all;
  }();
  return fields;
}

// Where the values a rule reads came from, for its error: the --set
// overrides that set one of its keys (or a section holding one, or, for a
// rule on a whole section, a key inside it), else the file.
class Origin {
 public:
  Origin(std::string source, const std::vector<std::string>& overrides) : source_(std::move(source)) {
    for (const auto& o : overrides) overrides_.emplace_back(o.substr(0, o.find('=')), o);
  }

  std::string operator()(const std::vector<std::string>& keys) const {
    auto within = [](const std::string& inner, const std::string& outer) {
      return inner == outer || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                                inner[outer.size()] == '.');
    };
    std::string named;
    for (const auto& [key, text] : overrides_) {
      for (const auto& k : keys) {
        if (within(k, key) || within(key, k)) {
          named += (named.empty() ? "" : " and ") + json_schema::override_source(text);
          break;
        }
      }
    }
    return named.empty() ? source_ : named;
  }

 private:
  std::string source_;
  std::vector<std::pair<std::string, std::string>> overrides_;  // key, whole override
};

// The keys inside `section` that `line` quotes ('model.n_head').
std::vector<std::string> quoted_keys(const std::string& line, const std::string& section) {
  std::vector<std::string> keys;
  for (size_t open = line.find('\''); open != std::string::npos;) {
    const size_t close = line.find('\'', open + 1);
    if (close == std::string::npos) break;
    std::string key = line.substr(open + 1, close - open - 1);
    if (key.rfind(section + ".", 0) == 0) keys.push_back(std::move(key));
    open = line.find('\'', close + 1);
  }
  return keys;
}

// Every broken rule of a configuration, each with where its values came
// from; one ConfigError lists them all, so that a file is mended in one pass.
class Problems {
 public:
  explicit Problems(const Origin& origin) : origin_(origin) {}

  // A rule over `keys` is broken. A library's check of a section may report
  // several, one per line: each is traced to the keys of the section it quotes.
  void add(const std::vector<std::string>& keys, const std::string& message) {
    std::stringstream lines(message);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty()) continue;
      const std::vector<std::string> quoted = keys.size() == 1 ? quoted_keys(line, keys[0]) : keys;
      found_.emplace_back(origin_(quoted.empty() ? keys : quoted), line);
    }
  }

  // One problem as "config error in <origin>: <problem>"; several as a list.
  void throw_if_any() const {
    if (found_.empty()) return;
    if (found_.size() == 1) fail(found_[0].first, found_[0].second);
    const bool one_origin = std::all_of(found_.begin(), found_.end(),
                                        [&](const auto& p) { return p.first == found_[0].first; });
    std::string message = str(found_.size(), " problems (nothing was applied):");
    for (const auto& [origin, problem] : found_) {
      message += "\n  - " + (one_origin ? problem : "in " + origin + ": " + problem);
    }
    if (one_origin) fail(found_[0].first, message);
    throw ConfigError("config error: " + message);
  }

 private:
  const Origin& origin_;
  std::vector<std::pair<std::string, std::string>> found_;  // origin, problem
};

// The batch sizes and the clipping, printing and optimizer ranges.
void check_top_level_and_optimizer(const Config& c, Problems& problems) {
  auto positive = [&](const std::string& path, std::optional<int64_t> v) {
    if (v && *v < 1) problems.add({path}, str("'", path, "' = ", *v, " must be at least 1"));
  };
  positive("train_batch_size", c.train_batch_size);
  positive("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  positive("gradient_accumulation_steps", c.gradient_accumulation_steps);
  if (c.gradient_clipping < 0) {
    problems.add({"gradient_clipping"}, str("'gradient_clipping' = ", c.gradient_clipping,
                                            " must be >= 0 (0 turns clipping off)"));
  }
  if (c.steps_per_print < 1) {
    problems.add({"steps_per_print"}, str("'steps_per_print' = ", c.steps_per_print, " must be at least 1"));
  }
  // The optimizer's own ranges, named by key (LibTorch would stop with a backtrace).
  const auto& o = c.optimizer;
  if (o.lr <= 0) problems.add({"optimizer.params.lr"}, str("'optimizer.params.lr' = ", o.lr, " must be > 0"));
  for (int i = 0; i < 2; ++i) {
    if (o.betas[i] < 0 || o.betas[i] >= 1) {
      problems.add({"optimizer.params.betas"}, str("'optimizer.params.betas' [", o.betas[0], ", ", o.betas[1],
                                                   "]: beta", i + 1, " must be in [0, 1)"));
    }
  }
  if (o.eps <= 0) problems.add({"optimizer.params.eps"}, str("'optimizer.params.eps' = ", o.eps, " must be > 0"));
  if (o.weight_decay < 0) {
    problems.add({"optimizer.params.weight_decay"},
                 str("'optimizer.params.weight_decay' = ", o.weight_decay, " must be >= 0"));
  }
  if (o.momentum < 0) {
    problems.add({"optimizer.params.momentum"}, str("'optimizer.params.momentum' = ", o.momentum, " must be >= 0"));
  }
  if (o.nesterov && (o.type != "SGD" || o.momentum <= 0)) {
    problems.add({"optimizer.params.nesterov", "optimizer.type", "optimizer.params.momentum"},
                 o.type != "SGD" ? str("'optimizer.params.nesterov' applies to SGD only (optimizer.type is ", o.type,
                                       "): remove it")
                                 : std::string("'optimizer.params.nesterov' needs 'optimizer.params.momentum' > 0"));
  }
}

// What a scheduler value decided from "auto" came from, for its errors.
std::string from_auto(const Config& c, const std::string& key) {
  if (!c.is_auto(key)) return "";
  return key == "scheduler.params.total_num_steps"
             ? str(" (\"auto\": train.steps, ", c.train.steps, "; raise the steps, or give total_num_steps a number)")
             : std::string(" (decided from \"auto\"; give it a number)");
}

void check_scheduler(const Config& c, Problems& problems) {
  const SchedulerConfig& sc = c.scheduler;
  if (sc.type == "none") return;
  if (sc.warmup_min_lr < 0) {
    problems.add({"scheduler.params.warmup_min_lr", "scheduler.type"},
                 str("'scheduler.params.warmup_min_lr' = ", sc.warmup_min_lr, " must be >= 0"));
  }
  if (sc.warmup_max_lr <= 0) {
    problems.add({"scheduler.params.warmup_max_lr", "scheduler.type"},
                 str("'scheduler.params.warmup_max_lr' = ", sc.warmup_max_lr,
                     " must be > 0 (a negative rate climbs the loss)"));
  }
  if (sc.warmup_num_steps < 0) {
    problems.add({"scheduler.params.warmup_num_steps", "scheduler.type"},
                 str("'scheduler.params.warmup_num_steps' = ", sc.warmup_num_steps, " must be >= 0"));
  }
  if (sc.last_batch_iteration < -1) {
    problems.add({"scheduler.params.last_batch_iteration"},
                 str("'scheduler.params.last_batch_iteration' = ", sc.last_batch_iteration,
                     " must be -1 (a fresh run) or the index of the last batch trained on (>= 0)"));
  }
  if (sc.type == "WarmupDecayLR" && sc.total_num_steps <= sc.warmup_num_steps) {
    problems.add({"scheduler.type", "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"},
                 str("scheduler WarmupDecayLR needs 'scheduler.params.total_num_steps' (", sc.total_num_steps,
                     from_auto(c, "scheduler.params.total_num_steps"), ") greater than "
                     "'scheduler.params.warmup_num_steps' (", sc.warmup_num_steps,
                     from_auto(c, "scheduler.params.warmup_num_steps"), ")"));
  } else if (sc.type == "WarmupDecayLR" && sc.last_batch_iteration + 1 >= sc.total_num_steps) {
    // The first step would take the rate of step last_batch_iteration + 2,
    // past the schedule's end: warmup_min_lr for the whole run.
    problems.add({"scheduler.params.last_batch_iteration", "scheduler.params.total_num_steps"},
                 str("'scheduler.params.last_batch_iteration' = ", sc.last_batch_iteration,
                     " starts the run past the end of WarmupDecayLR's schedule ('scheduler.params.total_num_steps' = ",
                     sc.total_num_steps, from_auto(c, "scheduler.params.total_num_steps"), "): every step would train at warmup_min_lr; raise total_num_steps above ",
                     sc.last_batch_iteration + 1, " plus the steps to train, or set last_batch_iteration to -1"));
  }
}

// fp16: the loss scaler's rules (optim/loss_scaler.h), and what remat does not do.
void check_fp16(const Config& c, Problems& problems) {
  problems.add({"fp16"}, optim::check_loss_scaler_options(c.fp16));
  if (c.fp16.fp16_master_weights_and_grads) {
    problems.add({"fp16.fp16_master_weights_and_grads"},
                 "'fp16.fp16_master_weights_and_grads' is true, which keeps master weights and gradients in fp16 "
                 "(DeepSpeed allows it with its CPU Adam under ZeRO-Offload only), and remat keeps float32 master "
                 "weights and gradients: set it to false or remove it");
  }
  if (c.fp16.enabled && c.bf16.enabled) {
    problems.add({"fp16.enabled", "bf16.enabled"},
                 "'fp16.enabled' and 'bf16.enabled' are both true: choose one compute dtype (as DeepSpeed does)");
  }
}

// The libraries' sections (each rule is the library's, written once there)
// and the tensor-parallel layout over the model.
void check_sections(const Config& c, Problems& problems) {
  problems.add({"zero_optimization"}, parallel::check_zero_options(c.zero_optimization));
  // The precision's rules wait for bf16/fp16 "auto" to be decided (decide_precision_autos checks again).
  if (!c.is_undecided_auto("bf16.enabled") && !c.is_undecided_auto("fp16.enabled")) {
    problems.add({"bf16.enabled", "fp16.enabled", "communication_data_type"},
                 parallel::check_mixed_precision(parallel::mixed_precision(c.bf16, c.fp16.enabled)));
  }
  check_fp16(c, problems);
  problems.add({"activation_checkpointing"}, check_activation_checkpointing(c.activation_checkpointing));
  problems.add({"activation_offloading"}, check_offload_activations(c.activation_offloading));
  if (c.tensor_parallel.size < 1) {
    problems.add({"tensor_parallel.size"},
                 str("'tensor_parallel.size' = ", c.tensor_parallel.size, " must be at least 1"));
  }
  problems.add({"model"}, models::check_model_shape(c.model));
  if (const int tp = c.tensor_parallel.size;
      c.tensor_parallel.sequence_parallel_active() && c.model.seq_len >= 1 && c.model.seq_len % tp != 0) {
    const int below = c.model.seq_len / tp * tp;
    problems.add({"tensor_parallel.sequence_parallel", "model.seq_len", "tensor_parallel.size"},
                 str("tensor_parallel.sequence_parallel splits each sequence evenly across the tensor_parallel.size=",
                     tp, " ranks, and model.seq_len=", c.model.seq_len, " is not a multiple of ", tp,
                     ": set model.seq_len to ", below > 0 ? str(below, " or ") : std::string(), below + tp,
                     " (any multiple of ", tp, "), or turn sequence_parallel off"));
  }
}

void check_train_and_data(const Config& c, Problems& problems) {
  const auto& t = c.train;
  for (auto [path, v] : {std::pair{"train.steps", t.steps}, {"train.seed", t.seed},
                         {"train.eval_interval", t.eval_interval},
                         {"train.eval_batches", t.eval_batches},
                         {"train.save_interval", t.save_interval},
                         {"train.sample_chars", t.sample_chars}}) {
    if (v < 0) problems.add({path}, str("'", path, "' = ", v, " must be >= 0"));
  }
  if (const std::string why = device_spec_problem(t.device); !why.empty()) problems.add({"train.device"}, why);
  if (c.data.train_fraction <= 0 || c.data.train_fraction >= 1) {
    problems.add({"data.train_fraction"},
                 str("'data.train_fraction' = ", c.data.train_fraction, " must be in (0, 1)"));
  }
}

// Checks that span several keys or need ranges: every broken rule in one error.
void check_values(const Config& c, const Origin& at) {
  Problems problems(at);
  check_top_level_and_optimizer(c, problems);
  check_scheduler(c, problems);
  for (const auto& [key, problem] : deepspeed_keys::tuning_problems(c)) problems.add({key}, problem);
  check_sections(c, problems);
  check_train_and_data(c, problems);
  problems.throw_if_any();
}

}  // namespace

void check_config_rules(const Config& config, const std::string& source) { check_values(config, Origin(source, {})); }

// Whether the machine has that device is the engine's to check: a config may
// be read where it does not run.
namespace {

// " (did you mean \"cuda:1\"?)" for "CUDA:1", "cuda1", "gpu:1"; "" when no device is close.
std::string closest_device(const std::string& spec) {
  std::string low = spec;
  std::transform(low.begin(), low.end(), low.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (low.rfind("gpu", 0) == 0) low = "cuda" + low.substr(3);
  if (low.size() > 4 && low.rfind("cuda", 0) == 0 && low[4] != ':') low = "cuda:" + low.substr(4);
  std::string near = low != spec && device_spec_problem(low).empty()
                         ? low
                         : json_schema::closest_choice(spec, {"auto", "cpu", "cuda"});
  return near.empty() ? std::string() : str(" (did you mean \"", near, "\"?)");
}

}  // namespace

std::string device_spec_problem(const std::string& spec, const std::string& key) {
  if (spec == "auto" || spec == "cpu" || spec == "cuda") return {};
  const std::string index = spec.rfind("cuda:", 0) == 0 ? spec.substr(5) : std::string();
  if (!index.empty() && index.size() <= 4 &&
      std::all_of(index.begin(), index.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return {};
  }
  return str("'", key, "' = \"", spec, "\" is not a device", closest_device(spec),
             ": give auto (the local rank's CUDA device where CUDA is "
             "available, else the CPU), cpu, cuda (the local rank's CUDA device) or cuda:N (CUDA device N)");
}

BatchSizes Config::resolve_batch(int dp) const {
  REMAT_CHECK_GE(dp, 1, "data-parallel size");
  const auto& tbs = train_batch_size;
  const auto& micro = train_micro_batch_size_per_gpu;
  const auto& gas = gradient_accumulation_steps;
  BatchSizes out;
  auto fail_batch = [&](const std::string& message) -> void {
    throw ConfigError("config error: " + message);
  };
  if (tbs && micro && gas) {
    if (*tbs != *micro * *gas * dp) {
      fail_batch(str("train_batch_size (", *tbs,
                     ") must equal train_micro_batch_size_per_gpu (", *micro,
                     ") x gradient_accumulation_steps (", *gas,
                     ") x data-parallel size (", dp, ") = ", *micro * *gas * dp,
                     "; change one of them or leave one out to have it derived"));
    }
    out = {*tbs, *micro, *gas};
  } else if (tbs && micro) {
    int64_t denom = *micro * dp;
    if (*tbs % denom != 0) {
      fail_batch(str("train_batch_size (", *tbs, ") is not divisible by train_micro_batch_size_per_gpu (",
                     *micro, ") x data-parallel size (", dp, ") = ", denom,
                     ", so gradient_accumulation_steps cannot be derived"));
    }
    out = {*tbs, *micro, *tbs / denom};
  } else if (tbs && gas) {
    int64_t denom = *gas * dp;
    if (*tbs % denom != 0) {
      fail_batch(str("train_batch_size (", *tbs, ") is not divisible by gradient_accumulation_steps (",
                     *gas, ") x data-parallel size (", dp, ") = ", denom,
                     ", so train_micro_batch_size_per_gpu cannot be derived"));
    }
    out = {*tbs, *tbs / denom, *gas};
  } else if (micro && gas) {
    out = {*micro * *gas * dp, *micro, *gas};
  } else if (tbs) {
    if (*tbs % dp != 0) {
      fail_batch(str("train_batch_size (", *tbs, ") is not divisible by the data-parallel size (",
                     dp, "); set train_micro_batch_size_per_gpu instead"));
    }
    out = {*tbs, *tbs / dp, 1};
  } else if (micro) {
    out = {*micro * dp, *micro, 1};
  } else if (is_undecided_auto("train_micro_batch_size_per_gpu")) {
    fail_batch("train_micro_batch_size_per_gpu is \"auto\" and not decided yet: remat-train and remat-estimate "
               "decide it from their model's memory estimate (engine/auto_values.h); elsewhere give it a number");
  } else if (is_auto("train_batch_size") || is_auto("gradient_accumulation_steps")) {
    fail_batch(str(is_auto("train_batch_size") ? "train_batch_size" : "gradient_accumulation_steps",
                   " is \"auto\", which remat derives from train_micro_batch_size_per_gpu, and that is not set: give "
                   "train_micro_batch_size_per_gpu a number (or \"auto\", sized by remat-train from the memory "
                   "each rank has)"));
  } else {
    fail_batch("set train_batch_size or train_micro_batch_size_per_gpu (or both)");
  }
  return out;
}

std::vector<std::string> ineffective_settings(const Config& c) {
  std::vector<std::string> out;
  const auto& ac = c.activation_checkpointing;
  if (ac.variant == CheckpointVariant::kNone &&
      (ac.partition_activations || ac.cpu_checkpointing || ac.contiguous_memory_optimization)) {
    out.push_back("activation_checkpointing.variant is none, so partition_activations, "
                  "cpu_checkpointing and contiguous_memory_optimization have no region to "
                  "act on; set variant to full, selective_layer or selective_op");
  }
  if (ac.variant == CheckpointVariant::kAuto &&
      (ac.save_ops || ac.every_k != 1 || ac.every_k_from != EveryKFrom::kFirst)) {
    out.push_back("activation_checkpointing.variant is auto: save_ops, every_k and every_k_from are not "
                  "used (the planner chooses per block between the default and the matmul op lists, "
                  "full checkpoints and keeping)");
  }
  const auto& tp = c.tensor_parallel;
  if (tp.sequence_parallel && tp.size == 1) {
    out.push_back("tensor_parallel.sequence_parallel with tensor_parallel.size 1 has nothing to split: "
                  "every rank keeps the whole sequence; set tensor_parallel.size > 1 or leave "
                  "sequence_parallel out");
  }
  // (per_rank is the default: only a value other than it was surely asked for.)
  if (tp.sequence_parallel_dropout != models::SequenceParallelDropout::kPerRank) {
    const std::string name = models::sequence_parallel_dropout_names().at(
        static_cast<size_t>(tp.sequence_parallel_dropout));
    if (!tp.sequence_parallel_active()) {
      out.push_back(str("tensor_parallel.sequence_parallel_dropout is \"", name, "\" but sequence parallelism is ",
                        tp.sequence_parallel ? "over one rank (tensor_parallel.size 1)" : "off",
                        ": it only chooses where the dropouts of a split sequence draw; set "
                        "tensor_parallel.sequence_parallel to true with tensor_parallel.size > 1, or leave "
                        "sequence_parallel_dropout out"));
    } else if (c.model.dropout == 0) {
      out.push_back(str("tensor_parallel.sequence_parallel_dropout is \"", name, "\" but model.dropout is 0: "
                        "there are no dropout masks to draw; set model.dropout > 0, or leave "
                        "sequence_parallel_dropout out"));
    }
  }
  if (ac.save_collectives && tp.size == 1) {
    out.push_back("activation_checkpointing.save_collectives with tensor_parallel.size 1: there are no "
                  "tensor-parallel collectives to keep");
  }
  if (ac.partition_activations && tp.size == 1) {
    out.push_back("activation_checkpointing.partition_activations with tensor_parallel.size 1 "
                  "keeps whole inputs (there is no group to split them across)");
  }
  for (auto& line : deepspeed_keys::tuning_without_effect(c)) out.push_back(std::move(line));
  return out;
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
  decide_config_autos(config);  // before the rules: they see the decided values
  check_values(config, Origin(source, overrides));
  return config;
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
