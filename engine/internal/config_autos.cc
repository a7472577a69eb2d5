// The "auto" values the config alone decides, at parse time
// (engine/auto_values.h lists when each key is decided), and the record of a
// decision that auto_values.cc's decisions share.
#include "engine/internal/config_autos.h"

#include <string>

#include "engine/internal/config_tuning.h"
#include "runtime/error.h"

namespace remat::internal {

using nlohmann::json;

void record_auto(Config& c, const std::string& key, const json& value, const std::string& why) {
  for (auto& a : c.auto_values) {
    if (a.key == key && a.value.empty()) a = {key, value.dump(), why};
  }
}

namespace {

void decide_optimizer_and_clipping(Config& c) {
  const std::string of = str("remat's default for optimizer.type ", c.optimizer.type,
                             ", as when the key is left out");
  // The members still hold their defaults: "auto" stored nothing.
  record_auto(c, "gradient_clipping", c.gradient_clipping,
          "remat's default, no clipping (give a number, such as 1.0, to clip the gradients' norm)");
  record_auto(c, "optimizer.params.lr", c.optimizer.lr, of);
  // SGD reads neither: the default stands, said to be unused.
  const std::string adam_only = optim::optimizer_kind(c.optimizer) == optim::OptimizerKind::kSGD
                                    ? std::string("remat's default, unused: optimizer.type SGD has no betas or eps")
                                    : of;
  record_auto(c, "optimizer.params.betas", c.optimizer.betas, adam_only);
  record_auto(c, "optimizer.params.eps", c.optimizer.eps, adam_only);
  record_auto(c, "optimizer.params.weight_decay", c.optimizer.weight_decay, of);
}

// As Hugging Face's Trainer fills them (transformers' integrations/deepspeed.py).
void decide_scheduler(Config& c) {
  auto& s = c.scheduler;
  if (c.is_undecided_auto("scheduler.params.warmup_min_lr")) {
    s.warmup_min_lr = 0.0;
    record_auto(c, "scheduler.params.warmup_min_lr", 0.0, "0, as Hugging Face's Trainer fills it (DeepSpeed's default)");
  }
  if (c.is_undecided_auto("scheduler.params.warmup_max_lr")) {
    s.warmup_max_lr = c.optimizer.lr;
    record_auto(c, "scheduler.params.warmup_max_lr", c.optimizer.lr,
            "optimizer.params.lr, the rate the optimizer was given (as Hugging Face's Trainer fills it)");
  }
  if (c.is_undecided_auto("scheduler.params.total_num_steps")) {
    s.total_num_steps = c.train.steps;
    record_auto(c, "scheduler.params.total_num_steps", c.train.steps,
            "train.steps, the run's optimizer steps (as Hugging Face's Trainer fills it)");
  }
  if (c.is_undecided_auto("scheduler.params.warmup_num_steps")) {
    s.warmup_num_steps = 2;
    record_auto(c, "scheduler.params.warmup_num_steps", 2,
            "Hugging Face's Trainer fills its warmup_steps, 0 unless set, and DeepSpeed warms up over at least "
            "2 steps");
  }
}

// DeepSpeed's default of sub_group_size and stage3_max_reuse_distance, which
// have no effect in remat (config_tuning.cc).
constexpr int64_t kDeepSpeedTilingDefault = 1000000000;

void decide_zero_sizes(Config& c) {
  const auto& z = c.zero_optimization;
  const std::string why = "remat's default, as when the key is left out";
  record_auto(c, "zero_optimization.reduce_bucket_size", z.reduce_bucket_size, why);
  record_auto(c, "zero_optimization.allgather_bucket_size", z.allgather_bucket_size, why);
  record_auto(c, "zero_optimization.stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, why);
  record_auto(c, "zero_optimization.stage3_param_persistence_threshold", z.stage3_param_persistence_threshold, why);
  for (const char* key : {"zero_optimization.stage3_max_live_parameters", "zero_optimization.max_live_parameters"}) {
    record_auto(c, key, z.stage3_max_live_parameters, "remat's default (DeepSpeed's), as when the key is left out");
  }
  // Unset, as left out: their values would only be said to change nothing.
  for (const char* key : {"zero_optimization.stage3_max_reuse_distance", "zero_optimization.max_reuse_distance"}) {
    record_auto(c, key, kDeepSpeedTilingDefault,
            str("DeepSpeed's default, as when the key is left out; it has no effect in remat: ",
                deepspeed_keys::kMaxReuseDistanceWhy));
  }
  record_auto(c, "zero_optimization.sub_group_size", kDeepSpeedTilingDefault,
          str("DeepSpeed's default, as when the key is left out; it has no effect in remat: ",
              deepspeed_keys::kSubGroupSizeWhy));
}

}  // namespace

// stage3_param_persistence_threshold "auto", once the precision is known: at
// stage 3 under bf16 or fp16 the threshold stage 3 uses, 0, with why (one
// line says what was decided, what is used and why: no other line repeats it).
void decide_persistence_threshold(Config& c) {
  const std::string key = "zero_optimization.stage3_param_persistence_threshold";
  if (!c.is_auto(key) || c.is_undecided_auto("bf16.enabled") || c.is_undecided_auto("fp16.enabled")) return;
  auto& z = c.zero_optimization;
  const auto mixed = parallel::mixed_precision(c.bf16, c.fp16.enabled);
  const int64_t used = parallel::stage3_persistence_threshold(z, mixed);
  if (z.stage != 3 || used == z.stage3_param_persistence_threshold) return;
  z.stage3_param_persistence_threshold = used;
  for (auto& a : c.auto_values) {
    if (a.key != key) continue;
    a.value = json(used).dump();
    a.why = str(deepspeed_keys::persistence_threshold_why(mixed), " (remat's default, ",
                parallel::ZeroOptions{}.stage3_param_persistence_threshold, ", keeps smaller parameters whole in "
                "float32 runs)");
  }
}

void decide_config_autos(Config& config) {
  decide_optimizer_and_clipping(config);
  decide_scheduler(config);
  decide_zero_sizes(config);
  decide_persistence_threshold(config);  // where bf16 and fp16 are given, not "auto"
}

}  // namespace remat::internal
