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

#include "engine/auto_values.h"
#include "engine/config.h"
#include "engine/deepspeed_keys.h"
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

// The keys of scheduler.params each type takes are its DeepSpeed constructor's
// arguments: another type's key is refused, as that constructor refuses it.
void check_scheduler_keys(const Config& c, Problems& problems) {
  const SchedulerConfig& sc = c.scheduler;
  const bool cosine = sc.type == "WarmupCosineLR";
  // `name` belongs to another type; given a value or "auto" (which stores none).
  auto refuse = [&](const std::string& name, bool foreign, bool has_value, const std::string& instead) {
    const std::string key = "scheduler.params." + name;
    if (!foreign || (!has_value && !c.is_auto(key))) return;
    problems.add({key, "scheduler.type"}, str("'", key, "' is not a parameter of ", sc.type,
                                              " (DeepSpeed's constructor refuses it): ", instead));
  };
  const std::string ratios = "WarmupCosineLR's rates are optimizer.params.lr times a ratio: remove it, and give "
                             "warmup_min_ratio and cos_min_ratio (optimizer.params.lr is the peak)";
  refuse("warmup_min_lr", cosine, sc.warmup_min_lr.has_value(), ratios);
  refuse("warmup_max_lr", cosine, sc.warmup_max_lr.has_value(), ratios);
  refuse("total_num_steps", sc.type == "WarmupLR", sc.total_num_steps.has_value(),
         "WarmupLR keeps warmup_max_lr after the warm-up; remove it, or set scheduler.type to WarmupDecayLR or "
         "WarmupCosineLR to decay over total_num_steps");
  const std::string cosine_only = "it is WarmupCosineLR's; remove it, or set scheduler.type to WarmupCosineLR";
  refuse("warmup_min_ratio", !cosine, sc.warmup_min_ratio.has_value(), cosine_only);
  refuse("cos_min_ratio", !cosine, sc.cos_min_ratio.has_value(), cosine_only);
}

// The ranges of the values, and the schedule's length against its warm-up
// and against last_batch_iteration (engine/lr_schedule.h: step s >= 2 trains
// at the rate of position last_batch_iteration + s - 1).
void check_scheduler_values(const Config& c, Problems& problems) {
  const SchedulerConfig& sc = c.scheduler;
  auto at_least = [&](const std::string& name, std::optional<double> v, const std::string& why) {
    if (v && *v < 0) {
      problems.add({"scheduler.params." + name, "scheduler.type"},
                   str("'scheduler.params.", name, "' = ", *v, " must be >= 0", why));
    }
  };
  at_least("warmup_min_lr", sc.warmup_min_lr, "");
  at_least("warmup_min_ratio", sc.warmup_min_ratio, " (the warm-up starts at that share of optimizer.params.lr)");
  at_least("cos_min_ratio", sc.cos_min_ratio,
           " (DeepSpeed stops the rate at 0, before total_num_steps): give 0 to decay to 0");
  if (sc.warmup_max_lr && *sc.warmup_max_lr <= 0) {
    problems.add({"scheduler.params.warmup_max_lr", "scheduler.type"},
                 str("'scheduler.params.warmup_max_lr' = ", *sc.warmup_max_lr,
                     " must be > 0 (a negative rate climbs the loss)"));
  }
  if (sc.warmup_num_steps < 0) {
    problems.add({"scheduler.params.warmup_num_steps", "scheduler.type"},
                 str("'scheduler.params.warmup_num_steps' = ", sc.warmup_num_steps,
                     " must be >= 0 (DeepSpeed warms up over at least 2 steps: 0 and 1 give 2)"));
  }
  if (sc.last_batch_iteration < -1) {
    problems.add({"scheduler.params.last_batch_iteration"},
                 str("'scheduler.params.last_batch_iteration' = ", sc.last_batch_iteration,
                     " must be -1 (a fresh run) or the index of the last batch trained on (>= 0)"));
  }
  if (sc.type != "WarmupDecayLR" && sc.type != "WarmupCosineLR") return;
  const std::string total_key = "scheduler.params.total_num_steps";
  if (!sc.total_num_steps) {
    problems.add({total_key, "scheduler.type"},
                 str("scheduler ", sc.type, " needs '", total_key, "' (DeepSpeed's constructor requires it): give "
                     "the run's optimizer steps, or \"auto\" (train.steps)"));
    return;
  }
  const int64_t total = *sc.total_num_steps, k = sc.last_batch_iteration;
  const bool decay = sc.type == "WarmupDecayLR";
  // total_num_steps at or below the warm-up is DeepSpeed's warning, not an
  // error (ineffective_settings): the rate warms up, then ends at once.
  if (const int64_t end = decay ? total : total - 1; total > sc.warmup_steps() && k + 1 >= end) {
    // Step 2 would train at position k + 1, where the decay has ended.
    problems.add({"scheduler.params.last_batch_iteration", total_key},
                 str("'scheduler.params.last_batch_iteration' = ", k, " starts the run past the end of ", sc.type,
                     "'s schedule ('", total_key, "' = ", total, from_auto(c, total_key),
                     "): from step 2 on every step would train at ",
                     decay ? "warmup_min_lr" : "cos_min_ratio x optimizer.params.lr", "; raise total_num_steps above ",
                     decay ? k + 1 : k + 2, " plus the steps to train, or set last_batch_iteration to -1"));
  }
}

void check_scheduler(const Config& c, Problems& problems) {
  if (c.scheduler.type == "none") return;
  check_scheduler_keys(c, problems);
  check_scheduler_values(c, problems);
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
  if (const auto& sc = c.scheduler; sc.type != "none" && sc.warmup_num_steps < 2) {
    out.push_back(str("scheduler.params.warmup_num_steps = ", sc.warmup_num_steps, ": the warm-up lasts 2 steps, "
                      "as DeepSpeed raises it to at least 2 (and from 0.19.3 refuses 0); give 2 to say so"));
  }
  if (const auto& sc = c.scheduler; (sc.type == "WarmupDecayLR" || sc.type == "WarmupCosineLR") &&
                                     sc.total_num_steps && *sc.total_num_steps <= sc.warmup_steps()) {
    out.push_back(str("scheduler ", sc.type, ": 'scheduler.params.total_num_steps' (", *sc.total_num_steps,
                      from_auto(c, "scheduler.params.total_num_steps"), ") is not above the warm-up (",
                      sc.warmup_steps(), " steps), so the rate warms up and then ends at its minimum without "
                      "decaying (DeepSpeed warns likewise); raise total_num_steps or lower warmup_num_steps"));
  }
  for (auto& line : deepspeed_keys::tuning_without_effect(c)) out.push_back(std::move(line));
  return out;
}

}  // namespace remat
