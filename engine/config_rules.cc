// The config's rules over several keys and ranges (check_config_rules), every
// broken one listed in one error with where its values came from, and the
// settings that are valid but change nothing (ineffective_settings). The
// schema that reads the JSON is config.cc's.
#include <algorithm>
#include <cctype>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/internal/config_tuning.h"
#include "optim/lr_schedule.h"
#include "optim/options.h"
#include "runtime/error.h"
#include "runtime/json_schema.h"

namespace remat {
namespace {

using json_schema::fail;

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
  // several, one per line: each is traced to the keys of the section it
  // quotes, and to `also` (the key every rule of the section reads).
  void add(const std::vector<std::string>& keys, const std::string& message, const std::string& also = "") {
    std::stringstream lines(message);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty()) continue;
      std::vector<std::string> quoted = keys.size() == 1 ? quoted_keys(line, keys[0]) : keys;
      if (quoted.empty()) quoted = keys;
      if (!also.empty() && std::find(quoted.begin(), quoted.end(), also) == quoted.end()) quoted.push_back(also);
      found_.emplace_back(origin_(quoted), line);
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

// The batch sizes and the clipping and printing ranges.
void check_top_level(const Config& c, Problems& problems) {
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
}

// What a scheduler value decided from "auto" came from, for its errors.
std::string total_steps_note(const Config& c) {
  const std::string key = "scheduler.params.total_num_steps";
  if (!c.is_auto(key)) return "";
  return str(" (\"auto\": train.steps, ", c.train.steps, "; raise the steps, or give total_num_steps a number)");
}

// fp16: the loss scaler's rules (optim/loss_scaler.h), and what remat does
// not do. With fp16.enabled false the section is switched off: its other keys
// ask for nothing (copied configs carry them), so they are not checked.
void check_fp16(const Config& c, Problems& problems) {
  if (!c.fp16.enabled && !c.is_undecided_auto("fp16.enabled")) return;
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
  if (c.aio.block_size < 1) {
    problems.add({"aio.block_size"}, str("'aio.block_size' = ", c.aio.block_size, " must be at least 1: give the "
                                         "bytes of one request piece (DeepSpeed's default 1048576)"));
  } else {
    problems.add({"aio"}, check_async_io_options(c.aio.options()));
  }
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
  check_top_level(c, problems);
  // The optimizer's and the scheduler's rules (optim/), which every rule of
  // the scheduler reads its type for.
  problems.add({"optimizer"}, optim::check_optimizer_options(c.optimizer));
  problems.add({"scheduler"}, optim::check_scheduler_options(c.scheduler, total_steps_note(c)), "scheduler.type");
  for (const auto& [key, problem] : deepspeed_keys::tuning_problems(c)) problems.add({key}, problem);
  check_sections(c, problems);
  check_train_and_data(c, problems);
  problems.throw_if_any();
}

}  // namespace

void check_config_rules(const Config& config, const std::string& source, const std::vector<std::string>& overrides) {
  check_values(config, Origin(source, overrides));
}

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

// Whether the machine has that device is the engine's to check: a config may
// be read where it does not run.
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
  for (auto& line : optim::scheduler_settings_without_effect(c.scheduler, total_steps_note(c))) {
    out.push_back(std::move(line));
  }
  for (auto& line : deepspeed_keys::tuning_without_effect(c)) out.push_back(std::move(line));
  return out;
}

}  // namespace remat
