// The config's own "auto" decisions: those the config alone decides, which
// parse_config makes, and what the later ones of engine/auto_values.h share
// with them.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "engine/config.h"

namespace remat::internal {

// Decides the keys the config alone decides (engine/auto_values.h lists
// them), before the config's rules are checked.
void decide_config_autos(Config& config);

// Records `key`'s decision, `value` with `why`, when it was given "auto" and
// is not decided yet.
void record_auto(Config& config, const std::string& key, const nlohmann::json& value, const std::string& why);

// stage3_param_persistence_threshold "auto", once bf16 and fp16 are decided:
// at stage 3 under bf16 or fp16 the threshold stage 3 uses (0), with why.
void decide_persistence_threshold(Config& config);

}  // namespace remat::internal
