// DeepSpeed's tuning keys that remat reads (config.h: DeepSpeedTuningConfig),
// for the config's rules and warnings (engine/config_rules.cc) and its "auto"
// decisions (engine/internal/config_autos.cc, engine/auto_values.cc).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "parallel/zero_options.h"

namespace remat::deepspeed_keys {

// The accepted tuning keys of `config` (Config::deepspeed_tuning) that have no
// effect in remat, one line each saying why (ineffective_settings' part), and
// persistence_threshold_note's line.
std::vector<std::string> tuning_without_effect(const Config& config);

// Why sub_group_size and stage3_max_reuse_distance change nothing in remat
// (said for their values and for their "auto").
extern const char* const kSubGroupSizeWhy;
extern const char* const kMaxReuseDistanceWhy;

// Why stage 3 under `mixed` (bf16 or fp16) keeps no parameter whole: its
// persistence threshold is 0 (parallel::stage3_persistence_threshold).
std::string persistence_threshold_why(const parallel::MixedPrecision& mixed);

// zero_optimization.stage3_param_persistence_threshold given a value that
// stage 3 does not use (bf16 or fp16 at stage 3): one line naming the value
// given, the one used and why; "" otherwise (and for "auto", whose decision
// says it: engine/auto_values.h).
std::string persistence_threshold_note(const Config& config);

// Values of those keys that ask for what remat does not do (the old offload
// switches set to true, or given beside the current key's section):
// {key, problem} pairs.
std::vector<std::pair<std::string, std::string>> tuning_problems(const Config& config);

}  // namespace remat::deepspeed_keys
