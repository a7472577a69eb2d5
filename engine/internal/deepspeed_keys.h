// DeepSpeed configuration keys that remat recognises and does not implement,
// as fields of the config's schema (engine/config_schema.cc): each is refused
// by name, with the reason and what to do instead, rather than reported as an
// unknown key; where a value asks for nothing (DeepSpeed's default that turns
// a feature off, a section switched off), it is accepted. Its tuning keys
// that cannot change what remat computes are accepted, and said to have no
// effect (engine/internal/config_tuning.h).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "runtime/json_schema.h"

namespace remat::deepspeed_keys {

// A recognised DeepSpeed key: loading it is an error naming it, `reason`, and
// `instead` when remat has another way.
json_schema::Field deepspeed_only(const char* name, const char* reason, const char* instead = "");

// A recognised DeepSpeed key that asks for nothing at any of `off` (its
// DeepSpeed default, or the value that turns it off): accepted there and
// ignored; any other value is refused as deepspeed_only does, naming the
// value given and off[0] to write instead.
json_schema::Field deepspeed_only_unless(const char* name, std::vector<json_schema::json> off, const char* reason,
                                         const char* instead = "");

// The top-level sections and keys, and those of zero_optimization.
std::vector<json_schema::Field> deepspeed_only_top_level();
std::vector<json_schema::Field> deepspeed_only_zero();

}  // namespace remat::deepspeed_keys
