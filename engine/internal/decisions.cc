#include "engine/internal/decisions.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "runtime/error.h"

namespace remat::internal {
namespace {

using nlohmann::json;

const char* const kBudgetKey = "activation_checkpointing.device_memory_budget_bytes";

bool is_batch_key(const std::string& key) {
  return key == "train_batch_size" || key == "train_micro_batch_size_per_gpu" || key == "gradient_accumulation_steps";
}

// "32 (micro 16 x accumulation 1 x dp 2)"
std::string batch_text(int64_t global, int64_t micro, int64_t accumulation, int64_t dp) {
  return str(global, " (micro ", micro, " x accumulation ", accumulation, " x dp ", dp, ")");
}

// The saved decisions, or an empty object where none are (or they are not an object).
json parsed(const std::string& decisions) {
  if (decisions.empty()) return json::object();
  json d = json::parse(decisions, nullptr, /*allow_exceptions=*/false);
  return d.is_object() ? d : json::object();
}

int64_t integer(const json& object, const char* key) {
  return object.contains(key) && object[key].is_number_integer() ? object[key].get<int64_t>() : 0;
}

}  // namespace

std::string decisions_json(const Config& config, const BatchSizes& batch, int dp,
                           std::optional<int64_t> device_budget, const MicroBatchSearch* search) {
  json autos = json::object();
  for (const auto& a : config.auto_values) {
    if (!a.value.empty()) autos[a.key] = {{"value", json::parse(a.value)}, {"why", a.why}};
  }
  json out = {{"auto", autos},
              {"batch",
               {{"train_batch_size", batch.train_batch_size},
                {"train_micro_batch_size_per_gpu", batch.micro_batch_per_gpu},
                {"gradient_accumulation_steps", batch.gradient_accumulation_steps},
                {"data_parallel_size", dp}}}};
  if (device_budget && config.activation_checkpointing.device_memory_budget_auto) {
    out["device_memory_budget_bytes"] = *device_budget;
  }
  if (search != nullptr) out["micro_batch_search"] = search->to_json();
  return out.dump();
}

namespace {

// Whether the config gives one of the batch sizes a number: the batch is
// then the one given now, not the save's.
bool batch_given(const Config& c) {
  return (c.train_batch_size && !c.is_auto("train_batch_size")) ||
         (c.train_micro_batch_size_per_gpu && !c.is_auto("train_micro_batch_size_per_gpu")) ||
         (c.gradient_accumulation_steps && !c.is_auto("gradient_accumulation_steps"));
}

// The save's "auto" values for the keys `c` leaves undecided, each recorded
// as kept; the keys taken.
std::vector<std::string> take_autos(Config& c, const json& saved, const std::string& from, int saved_dp, int dp) {
  const bool own_batch = batch_given(c);
  std::vector<std::string> taken;
  for (auto& a : c.auto_values) {
    if (!a.value.empty() || !saved.contains(a.key) || !saved[a.key].is_object()) continue;
    if (is_batch_key(a.key) && own_batch) continue;
    // At another data-parallel size the global batch follows the micro-batch.
    if (a.key == "train_batch_size" && saved_dp != dp) continue;
    const json& entry = saved[a.key];
    if (!entry.contains("value")) continue;
    set_config_value(c, a.key, entry["value"].dump(), from);
    a.value = entry["value"].dump();
    a.why = str("kept from ", from, ", whose run decided it: ",
                entry.contains("why") && entry["why"].is_string() ? entry["why"].get<std::string>() : "");
    taken.push_back(a.key);
  }
  return taken;
}

}  // namespace

std::string take_decisions(Config& config, const std::string& decisions, const std::string& folder, int64_t step,
                           int dp) {
  const json d = parsed(decisions);
  const std::string from = str("the save in '", folder, "' (step ", step, ")");
  const json autos = d.contains("auto") && d["auto"].is_object() ? d["auto"] : json::object();
  const int saved_dp = d.contains("batch") ? static_cast<int>(integer(d["batch"], "data_parallel_size")) : 0;
  const bool own_batch = batch_given(config);
  std::vector<std::string> taken = take_autos(config, autos, from, saved_dp, dp);
  if (config.activation_checkpointing.device_memory_budget_auto && d.contains("device_memory_budget_bytes") &&
      d["device_memory_budget_bytes"].is_number_integer()) {
    set_config_value(config, kBudgetKey, d["device_memory_budget_bytes"].dump(), from);
    taken.push_back(str(kBudgetKey, " = ", d["device_memory_budget_bytes"].get<int64_t>()));
  }
  if (taken.empty()) return "";
  std::string keys;
  for (const auto& k : taken) keys += (keys.empty() ? "" : ", ") + k;
  std::string note;
  if (own_batch) {
    note = "; the batch sizes are this run's own (one is given a number)";
  } else if (saved_dp != 0 && saved_dp != dp && config.is_undecided_auto("train_batch_size")) {
    note = str("; train_batch_size is derived afresh: the save's run had data-parallel size ", saved_dp,
               ", this one ", dp);
  }
  return str("resume: took the values decided by the run of ", from, ", nothing measured again: ", keys, note);
}

std::string batch_change(const std::string& decisions, const BatchSizes& now, int dp) {
  const json d = parsed(decisions);
  if (!d.contains("batch") || !d["batch"].is_object()) return "";
  const json& b = d["batch"];
  const int64_t global = integer(b, "train_batch_size");
  if (global == 0 || global == now.train_batch_size) return "";
  return str("resume: the global batch changes from ",
             batch_text(global, integer(b, "train_micro_batch_size_per_gpu"), integer(b, "gradient_accumulation_steps"),
                        integer(b, "data_parallel_size")),
             ", what the save's run trained with, to ",
             batch_text(now.train_batch_size, now.micro_batch_per_gpu, now.gradient_accumulation_steps, dp),
             ": each step now averages another number of samples (and the learning-rate schedule's steps mean "
             "another amount of data); give train_batch_size ", global, " to keep the save's");
}

}  // namespace remat::internal
