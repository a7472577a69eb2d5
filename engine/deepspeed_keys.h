// DeepSpeed configuration keys that remat recognises and does not implement
// (internal to the config library): each is refused by name, with the reason
// and what to do instead, rather than reported as an unknown key; where a
// value asks for nothing (DeepSpeed's default that turns a feature off, a
// section switched off), it is accepted. Its tuning keys that cannot change
// what remat computes are accepted, and said to have no effect
// (tuning_without_effect).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "parallel/zero_options.h"
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

// A key of offload to NVMe in an offload section (nvme_path, pipeline_read,
// ...): it asks for nothing at `off` (DeepSpeed's default) or while the
// section's device is not "nvme" (DeepSpeed reads it only then); beside
// device "nvme" it is refused with `reason`, in the same error as the device.
json_schema::Field nvme_key(const char* name, json_schema::json off, const std::string& reason);

// The top-level sections and keys, and those of zero_optimization.
std::vector<json_schema::Field> deepspeed_only_top_level();
std::vector<json_schema::Field> deepspeed_only_zero();

}  // namespace remat::deepspeed_keys

namespace remat {
struct Config;
}

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
