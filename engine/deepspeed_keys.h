// DeepSpeed configuration keys that remat recognises and does not implement
// (internal to the config library): each is refused by name, with the reason
// and what to do instead, rather than reported as an unknown key. Its tuning
// keys that cannot change what remat computes are accepted, and said to have
// no effect (tuning_without_effect).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "runtime/json_schema.h"

namespace remat::deepspeed_keys {

// A recognised DeepSpeed key: loading it is an error naming it, `reason`, and
// `instead` when remat has another way.
json_schema::Field deepspeed_only(const char* name, const char* reason, const char* instead = "");

// The top-level sections and keys, and those of zero_optimization.
std::vector<json_schema::Field> deepspeed_only_top_level();
std::vector<json_schema::Field> deepspeed_only_zero();

}  // namespace remat::deepspeed_keys

namespace remat {
struct Config;
}

namespace remat::deepspeed_keys {

// The accepted tuning keys of `config` (Config::deepspeed_tuning) that have no
// effect in remat, one line each saying why (ineffective_settings' part).
std::vector<std::string> tuning_without_effect(const Config& config);

// Values of those keys that ask for what remat does not do (the old offload
// switches set to true): {key, problem} pairs.
std::vector<std::pair<std::string, std::string>> tuning_problems(const Config& config);

}  // namespace remat::deepspeed_keys
