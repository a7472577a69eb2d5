// DeepSpeed configuration keys that remat recognises and does not implement
// (internal to the config library): each is refused by name, with the reason
// and what to do instead, rather than reported as an unknown key.
#pragma once

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
