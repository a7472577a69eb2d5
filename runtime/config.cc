#include "runtime/config.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <type_traits>

#include "runtime/error.h"

namespace remat {

using nlohmann::json;

std::vector<std::string> default_save_ops() {
  return {"aten::mm",
          "aten::addmm",
          "aten::bmm",
          "aten::_scaled_dot_product_attention",
          "aten::_scaled_dot_product_flash_attention",
          "aten::_scaled_dot_product_efficient_attention",
          "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::max"};
}

namespace {

// ---------------------------------------------------------------------------
// The schema: one table of fields per section, each bound to a struct member.
// The same table validates the JSON, fills the structs and dumps them back.

enum class Kind { kBool, kInt, kNumber, kString, kStringList, kNumberPair, kObject };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kBool: return "boolean";
    case Kind::kInt: return "integer";
    case Kind::kNumber: return "number";
    case Kind::kString: return "string";
    case Kind::kStringList: return "array of strings";
    case Kind::kNumberPair: return "array of 2 numbers";
    case Kind::kObject: return "object";
  }
  return "?";
}

std::string json_type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    default: return "value";
  }
}

struct Field {
  std::string name;
  Kind kind;
  bool nullable = false;
  std::vector<std::string> choices;  // allowed strings, when not empty
  std::vector<Field> children;       // kObject
  // Leaves: store a validated value into / read it from the enclosing struct.
  std::function<void(const json&, void*)> assign;
  std::function<json(const void*)> dump;
  // Objects: the member struct inside the enclosing struct.
  std::function<void*(void*)> member;
  std::function<const void*(const void*)> member_const;
};

template <typename T>
struct KindOf;
template <> struct KindOf<bool> { static constexpr Kind value = Kind::kBool; };
template <> struct KindOf<int> { static constexpr Kind value = Kind::kInt; };
template <> struct KindOf<int64_t> { static constexpr Kind value = Kind::kInt; };
template <> struct KindOf<double> { static constexpr Kind value = Kind::kNumber; };
template <> struct KindOf<std::string> { static constexpr Kind value = Kind::kString; };
template <> struct KindOf<std::vector<std::string>> { static constexpr Kind value = Kind::kStringList; };
template <> struct KindOf<std::array<double, 2>> { static constexpr Kind value = Kind::kNumberPair; };

template <typename T>
T convert(const json& value) {
  if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
    // DeepSpeed configs write sizes as 5e8: integral floats count as integers.
    return static_cast<T>(value.get<double>());
  } else {
    return value.get<T>();
  }
}

template <typename S, typename T>
Field leaf(const char* name, T S::*member, std::vector<std::string> choices = {}) {
  Field field;
  field.name = name;
  field.choices = std::move(choices);
  field.assign = [member](const json& value, void* target) {
    static_cast<S*>(target)->*member = convert<T>(value);
  };
  field.dump = [member](const void* target) {
    return json(static_cast<const S*>(target)->*member);
  };
  field.kind = KindOf<T>::value;
  return field;
}

template <typename S, typename T>
Field optional_leaf(const char* name, std::optional<T> S::*member) {
  Field field;
  field.name = name;
  field.kind = KindOf<T>::value;
  field.nullable = true;
  field.assign = [member](const json& value, void* target) {
    auto& slot = static_cast<S*>(target)->*member;
    if (value.is_null()) {
      slot.reset();
    } else {
      slot = convert<T>(value);
    }
  };
  field.dump = [member](const void* target) {
    const auto& slot = static_cast<const S*>(target)->*member;
    return slot ? json(*slot) : json(nullptr);
  };
  return field;
}

template <typename S, typename M>
Field object(const char* name, M S::*member, std::vector<Field> children) {
  Field field;
  field.name = name;
  field.kind = Kind::kObject;
  field.children = std::move(children);
  field.member = [member](void* target) -> void* {
    return &(static_cast<S*>(target)->*member);
  };
  field.member_const = [member](const void* target) -> const void* {
    return &(static_cast<const S*>(target)->*member);
  };
  return field;
}

// A nested section whose keys belong to the enclosing struct (DeepSpeed's
// optimizer.params and scheduler.params).
Field inline_section(const char* name, std::vector<Field> children) {
  Field field;
  field.name = name;
  field.kind = Kind::kObject;
  field.children = std::move(children);
  field.member = [](void* target) { return target; };
  field.member_const = [](const void* target) { return target; };
  return field;
}

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      optional_leaf("train_batch_size", &Config::train_batch_size),
      optional_leaf("train_micro_batch_size_per_gpu",
                    &Config::train_micro_batch_size_per_gpu),
      optional_leaf("gradient_accumulation_steps",
                    &Config::gradient_accumulation_steps),
      leaf("gradient_clipping", &Config::gradient_clipping),
      leaf("steps_per_print", &Config::steps_per_print),
      object("optimizer", &Config::optimizer,
             {leaf("type", &OptimizerConfig::type, {"AdamW", "Adam", "SGD"}),
              inline_section(
                  "params",
                  {leaf("lr", &OptimizerConfig::lr),
                   leaf("betas", &OptimizerConfig::betas),
                   leaf("eps", &OptimizerConfig::eps),
                   leaf("weight_decay", &OptimizerConfig::weight_decay),
                   leaf("momentum", &OptimizerConfig::momentum),
                   leaf("nesterov", &OptimizerConfig::nesterov)})}),
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
                   leaf("total_num_steps", &SchedulerConfig::total_num_steps)})}),
      object("bf16", &Config::bf16, {leaf("enabled", &Bf16Config::enabled)}),
      object("zero_optimization", &Config::zero_optimization,
             {leaf("stage", &ZeroConfig::stage),
              leaf("reduce_bucket_size", &ZeroConfig::reduce_bucket_size),
              leaf("stage3_prefetch_bucket_size",
                   &ZeroConfig::stage3_prefetch_bucket_size),
              leaf("stage3_param_persistence_threshold",
                   &ZeroConfig::stage3_param_persistence_threshold),
              leaf("overlap_comm", &ZeroConfig::overlap_comm),
              leaf("contiguous_gradients", &ZeroConfig::contiguous_gradients)}),
      object("activation_checkpointing", &Config::activation_checkpointing,
             {leaf("partition_activations",
                   &ActivationCheckpointingConfig::partition_activations),
              leaf("cpu_checkpointing",
                   &ActivationCheckpointingConfig::cpu_checkpointing),
              leaf("contiguous_memory_optimization",
                   &ActivationCheckpointingConfig::contiguous_memory_optimization),
              optional_leaf("number_checkpoints",
                            &ActivationCheckpointingConfig::number_checkpoints),
              leaf("synchronize_checkpoint_boundary",
                   &ActivationCheckpointingConfig::synchronize_checkpoint_boundary),
              leaf("profile", &ActivationCheckpointingConfig::profile),
              leaf("offload_min_bytes", &ActivationCheckpointingConfig::offload_min_bytes),
              leaf("offload_max_in_flight",
                   &ActivationCheckpointingConfig::offload_max_in_flight),
              leaf("offload_keep_last", &ActivationCheckpointingConfig::offload_keep_last),
              leaf("variant", &ActivationCheckpointingConfig::variant,
                   {"none", "full", "selective_layer", "selective_op"}),
              leaf("every_k", &ActivationCheckpointingConfig::every_k),
              leaf("save_ops", &ActivationCheckpointingConfig::save_ops)}),
      object("tensor_parallel", &Config::tensor_parallel,
             {leaf("size", &TensorParallelConfig::size)}),
      object("model", &Config::model,
             {leaf("n_layer", &ModelConfig::n_layer),
              leaf("n_head", &ModelConfig::n_head),
              leaf("d_model", &ModelConfig::d_model),
              leaf("d_ff", &ModelConfig::d_ff),
              leaf("seq_len", &ModelConfig::seq_len),
              leaf("dropout", &ModelConfig::dropout)}),
      object("data", &Config::data,
             {leaf("path", &DataConfig::path),
              leaf("train_fraction", &DataConfig::train_fraction)}),
      object("train", &Config::train,
             {leaf("steps", &TrainConfig::steps),
              leaf("seed", &TrainConfig::seed),
              leaf("eval_interval", &TrainConfig::eval_interval),
              leaf("eval_batches", &TrainConfig::eval_batches),
              leaf("save_interval", &TrainConfig::save_interval),
              leaf("sample_chars", &TrainConfig::sample_chars)}),
  };
  return fields;
}

// ---------------------------------------------------------------------------
// Validation.

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                         diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string closest(const std::string& name, const std::vector<std::string>& options) {
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const auto& option : options) {
    size_t d = edit_distance(name, option);
    if (d < best_distance) {
      best_distance = d;
      best = option;
    }
  }
  return best;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

std::vector<std::string> names_of(const std::vector<Field>& fields) {
  std::vector<std::string> names;
  for (const auto& f : fields) names.push_back(f.name);
  return names;
}

[[noreturn]] void fail(const std::string& source, const std::string& message) {
  throw ConfigError("config error in " + source + ": " + message);
}

std::string unknown_key_message(const std::string& path, const std::string& name,
                                const std::vector<Field>& fields) {
  auto names = names_of(fields);
  std::string prefix = path.empty() ? "" : path + ".";
  return str("unknown key '", prefix, name, "'; did you mean '", prefix,
             closest(name, names), "'? Valid keys ",
             path.empty() ? "at the top level" : "in '" + path + "'", ": ",
             join(names));
}

void check_type(const std::string& source, const std::string& path,
                const Field& field, const json& value) {
  if (value.is_null() && field.nullable) return;
  bool ok = false;
  switch (field.kind) {
    case Kind::kBool: ok = value.is_boolean(); break;
    case Kind::kInt:
      ok = value.is_number_integer() ||
           (value.is_number_float() &&
            value.get<double>() == static_cast<double>(static_cast<int64_t>(value.get<double>())));
      break;
    case Kind::kNumber: ok = value.is_number(); break;
    case Kind::kString: ok = value.is_string(); break;
    case Kind::kStringList:
      ok = value.is_array() &&
           std::all_of(value.begin(), value.end(),
                       [](const json& v) { return v.is_string(); });
      break;
    case Kind::kNumberPair:
      ok = value.is_array() && value.size() == 2 && value[0].is_number() &&
           value[1].is_number();
      break;
    case Kind::kObject: ok = value.is_object(); break;
  }
  if (!ok) {
    fail(source, str("'", path, "' must be ", kind_name(field.kind),
                     field.nullable ? " or null" : "", ", got ",
                     json_type_name(value), " ", value.dump()));
  }
  if (field.kind == Kind::kInt &&
      std::abs(value.get<double>()) > 9.0e15) {
    fail(source, str("'", path, "' = ", value.dump(), " is out of range"));
  }
  if (!field.choices.empty()) {
    const auto& s = value.get_ref<const std::string&>();
    if (std::find(field.choices.begin(), field.choices.end(), s) == field.choices.end()) {
      fail(source, str("'", path, "' = \"", s, "\" is not one of ",
                       join(field.choices), "; did you mean \"",
                       closest(s, field.choices), "\"?"));
    }
  }
}

// Validates `object` against `fields` and stores every present value.
void apply(const std::string& source, const std::string& path,
           const std::vector<Field>& fields, const json& object, void* target) {
  for (const auto& [name, value] : object.items()) {
    auto it = std::find_if(fields.begin(), fields.end(),
                           [&](const Field& f) { return f.name == name; });
    if (it == fields.end()) fail(source, unknown_key_message(path, name, fields));
    std::string child_path = join_path(path, name);
    check_type(source, child_path, *it, value);
    if (it->kind == Kind::kObject) {
      apply(source, child_path, it->children, value, it->member(target));
    } else {
      it->assign(value, target);
    }
  }
}

json dump(const std::string& path, const std::vector<Field>& fields, const void* target) {
  json out = json::object();
  for (const auto& field : fields) {
    std::string child_path = join_path(path, field.name);
    if (field.kind == Kind::kObject) {
      out[field.name] = dump(child_path, field.children, field.member_const(target));
    } else {
      out[field.name] = field.dump(target);
    }
  }
  return out;
}

// Rejects duplicate keys, which JSON parsers otherwise resolve silently.
json parse_strict(const std::string& text, const std::string& source) {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  json::parser_callback_t callback = [&](int depth, json::parse_event_t event,
                                         json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty()) {
      auto key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json value;
  try {
    value = json::parse(text, callback);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    auto bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    fail(source, "malformed JSON: " + what);
  }
  if (!duplicate.empty()) {
    fail(source, str("key '", duplicate,
                     "' appears twice in one object; keep one of them"));
  }
  if (!value.is_object()) {
    fail(source, str("the top level must be a JSON object, got ", json_type_name(value)));
  }
  return value;
}

// Finds the field a dotted path names, or fails with the closest valid key.
const Field& find_field(const std::string& source, const std::string& dotted) {
  const std::vector<Field>* fields = &schema();
  const Field* found = nullptr;
  std::string path;
  std::stringstream parts(dotted);
  std::string part;
  while (std::getline(parts, part, '.')) {
    if (found != nullptr && found->kind != Kind::kObject) {
      fail(source, str("'", path, "' is a ", kind_name(found->kind),
                       ", not a section: '", dotted, "' cannot be set"));
    }
    if (found != nullptr) fields = &found->children;
    auto it = std::find_if(fields->begin(), fields->end(),
                           [&](const Field& f) { return f.name == part; });
    if (it == fields->end()) fail(source, unknown_key_message(path, part, *fields));
    found = &*it;
    path = join_path(path, part);
  }
  if (found == nullptr) fail(source, "an empty key cannot be set");
  return *found;
}

void apply_override(json& root, const std::string& text) {
  std::string source = "--set " + text;
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    fail(source, "overrides are written key.path=value, e.g. model.n_layer=8");
  }
  std::string dotted = text.substr(0, eq);
  std::string raw = text.substr(eq + 1);
  const Field& field = find_field(source, dotted);
  json value;
  try {
    value = json::parse(raw);
  } catch (const json::parse_error&) {
    value = raw;  // A bare word is a string: optimizer.type=SGD.
  }
  // A string field keeps what was typed even when it parses as JSON (data.path=1).
  if (field.kind == Kind::kString && !value.is_string()) value = raw;
  json* node = &root;
  std::stringstream parts(dotted);
  std::string part;
  std::vector<std::string> keys;
  while (std::getline(parts, part, '.')) keys.push_back(part);
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    json& next = (*node)[keys[i]];
    if (next.is_null()) next = json::object();
    node = &next;
  }
  (*node)[keys.back()] = value;
}

// Checks that span several keys or need ranges.
void check_values(const Config& c, const std::string& source) {
  auto positive = [&](const char* path, std::optional<int64_t> v) {
    if (v && *v < 1) fail(source, str("'", path, "' = ", *v, " must be at least 1"));
  };
  positive("train_batch_size", c.train_batch_size);
  positive("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  positive("gradient_accumulation_steps", c.gradient_accumulation_steps);
  if (c.gradient_clipping < 0) {
    fail(source, str("'gradient_clipping' = ", c.gradient_clipping,
                     " must be >= 0 (0 turns clipping off)"));
  }
  if (c.steps_per_print < 1) fail(source, "'steps_per_print' must be at least 1");
  if (c.optimizer.lr <= 0) fail(source, str("'optimizer.params.lr' = ", c.optimizer.lr, " must be > 0"));
  const auto& z = c.zero_optimization;
  if (z.stage < 0 || z.stage > 3) {
    fail(source, str("'zero_optimization.stage' = ", z.stage, " must be 0, 1, 2 or 3"));
  }
  if (c.scheduler.type == "WarmupDecayLR" &&
      c.scheduler.total_num_steps <= c.scheduler.warmup_num_steps) {
    fail(source, str("scheduler WarmupDecayLR needs 'scheduler.params.total_num_steps' (",
                     c.scheduler.total_num_steps,
                     ") greater than 'scheduler.params.warmup_num_steps' (",
                     c.scheduler.warmup_num_steps, ")"));
  }
  const auto& ac = c.activation_checkpointing;
  if (ac.contiguous_memory_optimization && !ac.number_checkpoints) {
    fail(source,
         "'activation_checkpointing.contiguous_memory_optimization' is true but "
         "'activation_checkpointing.number_checkpoints' is not set: set it to the "
         "number of checkpointed regions per forward (e.g. model.n_layer)");
  }
  positive("activation_checkpointing.number_checkpoints", ac.number_checkpoints);
  if (ac.contiguous_memory_optimization && !ac.partition_activations && !ac.cpu_checkpointing) {
    fail(source,
         "'activation_checkpointing.contiguous_memory_optimization' lays out the partitioned or "
         "offloaded copies of checkpoint inputs: set 'partition_activations' or "
         "'cpu_checkpointing' to true as well, or set it to false");
  }
  if (ac.offload_min_bytes < 0) {
    fail(source, str("'activation_checkpointing.offload_min_bytes' = ", ac.offload_min_bytes,
                     " must be >= 0"));
  }
  if (ac.offload_max_in_flight < 1) {
    fail(source, str("'activation_checkpointing.offload_max_in_flight' = ",
                     ac.offload_max_in_flight, " must be at least 1"));
  }
  if (ac.every_k < 1) {
    fail(source, str("'activation_checkpointing.every_k' = ", ac.every_k,
                     " must be at least 1 (1 checkpoints every block)"));
  }
  for (const auto& op : ac.save_ops) {
    auto sep = op.find("::");
    if (sep == std::string::npos || sep == 0 || sep + 2 >= op.size()) {
      fail(source, str("'activation_checkpointing.save_ops' entry \"", op,
                       "\" is not an operator name like \"aten::mm\""));
    }
  }
  if (c.tensor_parallel.size < 1) {
    fail(source, str("'tensor_parallel.size' = ", c.tensor_parallel.size, " must be at least 1"));
  }
  const auto& m = c.model;
  for (auto [path, v] : {std::pair{"model.n_layer", m.n_layer}, {"model.n_head", m.n_head},
                         {"model.d_model", m.d_model}, {"model.d_ff", m.d_ff},
                         {"model.seq_len", m.seq_len}}) {
    if (v < 1) fail(source, str("'", path, "' = ", v, " must be at least 1"));
  }
  if (m.d_model % m.n_head != 0) {
    fail(source, str("'model.d_model' (", m.d_model, ") must be divisible by 'model.n_head' (",
                     m.n_head, ")"));
  }
  if (m.dropout < 0 || m.dropout >= 1) {
    fail(source, str("'model.dropout' = ", m.dropout, " must be in [0, 1)"));
  }
  const auto& t = c.train;
  for (auto [path, v] : {std::pair{"train.steps", t.steps}, {"train.seed", t.seed},
                         {"train.eval_interval", t.eval_interval},
                         {"train.eval_batches", t.eval_batches},
                         {"train.save_interval", t.save_interval},
                         {"train.sample_chars", t.sample_chars}}) {
    if (v < 0) fail(source, str("'", path, "' = ", v, " must be >= 0"));
  }
  if (c.data.train_fraction <= 0 || c.data.train_fraction >= 1) {
    fail(source, str("'data.train_fraction' = ", c.data.train_fraction, " must be in (0, 1)"));
  }
}

}  // namespace

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
  } else {
    fail_batch("set train_batch_size or train_micro_batch_size_per_gpu (or both)");
  }
  return out;
}

std::string Config::to_json() const { return dump("", schema(), this).dump(2); }

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  json root = parse_strict(text, source);
  Config config;
  apply(source, "", schema(), root, &config);  // The file alone, errors name it.
  if (!overrides.empty()) {
    for (const auto& o : overrides) apply_override(root, o);
    config = Config{};
    apply(source + " with --set overrides", "", schema(), root, &config);
  }
  check_values(config, source);
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
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
