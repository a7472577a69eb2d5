// The config's types: whether a key was given "auto", and the batch sizes'
// arithmetic. The schema and the parse are config_schema.cc's, the rules
// config_rules.cc's.
#include "engine/config.h"

#include <algorithm>
#include <string>

#include "runtime/error.h"

namespace remat {

bool Config::is_auto(const std::string& key) const {
  return std::any_of(auto_values.begin(), auto_values.end(), [&](const AutoValue& a) { return a.key == key; });
}

bool Config::is_undecided_auto(const std::string& key) const {
  return std::any_of(auto_values.begin(), auto_values.end(),
                     [&](const AutoValue& a) { return a.key == key && a.value.empty(); });
}

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
  } else if (is_undecided_auto("train_micro_batch_size_per_gpu")) {
    fail_batch("train_micro_batch_size_per_gpu is \"auto\" and not decided yet: remat-train and remat-estimate "
               "decide it from their model's memory estimate (engine/auto_values.h); elsewhere give it a number");
  } else if (is_auto("train_batch_size") || is_auto("gradient_accumulation_steps")) {
    fail_batch(str(is_auto("train_batch_size") ? "train_batch_size" : "gradient_accumulation_steps",
                   " is \"auto\", which remat derives from train_micro_batch_size_per_gpu, and that is not set: give "
                   "train_micro_batch_size_per_gpu a number (or \"auto\", sized by remat-train from the memory "
                   "each rank has)"));
  } else {
    fail_batch("set train_batch_size or train_micro_batch_size_per_gpu (or both)");
  }
  return out;
}

AsyncIoOptions AioConfig::options() const {
  AsyncIoOptions o;
  o.block_size = block_size > 0 ? static_cast<size_t>(block_size) : 0;
  o.queue_depth = queue_depth;
  o.thread_count = thread_count;
  o.single_submit = single_submit;
  o.overlap_events = overlap_events;
  return o;
}

}  // namespace remat
