// What one data-parallel rank keeps of the model state, and where: the one
// memory rule (zero_memory.cc, one function per stage, which each strategy
// answers gradient_hold() by, and offload's places). A config not yet built
// asks state_elements over its parameters' sizes (remat::estimate_memory);
// a live ZeroModel answers holding() (zero.h) for its tensors by the same
// places (optimizer_on_host here), which the engine's meter and budget
// check read instead of asking the offload mode.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/zero_options.h"

namespace remat::parallel {

// Where a part of one rank's model state lives. The host has two accounts,
// what a run's metrics report as host_optimizer_bytes and host_parameter_bytes.
enum class Place : uint8_t {
  kDevice,
  kHostOptimizer,   // offload_optimizer: the float32 masters, their gradients and the optimizer's state
  kHostParameters,  // offload_param: stage 3's float32 shards themselves and their gradients
};

// What a part of one rank's model state is.
enum class StatePart : uint8_t {
  kParameters,      // the model's parameters as it computes with them (16-bit copies under bf16 or fp16)
  kGatheredOnUse,   // stage 3: the model's parameters, views of units gathered around each use
  kStepped,         // what the optimizer steps: shards, float32 masters, persistent parameters
  kOptimizerState,  // the optimizer's state, made beside what it steps
};

// offload_optimizer (stages 1-3): the optimizer steps float32 masters on the
// host, its state made beside them (Place::kHostOptimizer); else its state is
// the device's account (offload_param's host shards are stepped where they are).
bool optimizer_on_host(const ZeroOptions& options);

// One parameter as the memory rules see it.
struct ParameterCount {
  int64_t numel = 0;
  bool trainable = true;
  int unit = -1;  // stage 3's unit: its block's index; -1 outside the blocks (the root unit)
  // Split over the tensor-parallel ranks: stage 3 flattens these apart from
  // the replicated ones, each a shard of its own (page-padded on NVMe).
  bool tp_sharded = false;
};

// The gradients one rank holds, from the model's trainable amount and this
// rank's part of it (what its optimizer steps), both in elements or both in
// bytes: the rules are sums of the two.
struct GradientHold {
  // At the step's most: stages 1 and 2 hold every gradient until its bucket
  // is reduced, and the shard's beside it.
  int64_t peak = 0;
  // Between the micro-batches of an accumulation window: stages 0 and 1
  // every gradient, 2 and 3 their shards'.
  int64_t between_micro_batches = 0;
};

// The elements one rank keeps under a stage.
struct StateElements {
  int64_t stored = 0;           // parameters: whole ones, its shards, persistent ones
  int64_t trainable = 0;        // the model's trainable elements, whole
  int64_t local_trainable = 0;  // what its optimizer steps (its state is sized by these)
  GradientHold gradients;
  int64_t bucket = 0;    // stages 1 and 2: the gradient bucket being reduced (inside gradients.peak)
  int64_t gathered = 0;  // stage 3: a unit and the one prefetched beside it, at most
  // bf16 or fp16 at stages 0-2: the model's 16-bit copies of the whole parameters,
  // beside `stored` float32 masters (stage 3's are `gathered`).
  int64_t compute_copies = 0;
  // masters_on_host (zero_options.h): no float32 master on the device
  // (`stored` 0); `compute_copies` are the 16-bit parameters it keeps
  // (stages 1-2: whole, stage 3: the shards); the host holds the trainable
  // masters (local_trainable) and these, the frozen parameters' float32 values.
  int64_t host_frozen = 0;
  // offload_param (stage 3): the shards (every parameter not persistent, trained
  // and frozen) are float32 host tensors, `host_shards` elements, of which
  // `host_trainable` get gradients there and are stepped there (inside
  // local_trainable); `stored` and `gradients` keep the device's: the
  // persistent parameters and theirs, and at the step's most the reduced
  // shard of the largest unit before it is copied to the host.
  int64_t host_shards = 0;
  int64_t host_trainable = 0;
  // offload_param "nvme": `disk_shards` of host_shards' elements live in its
  // file, `disk_shard_bytes` there (laid end to end, up to the page), past
  // the first max_in_cpu elements kept in memory, units in the stage's order
  // (the blocks, then the root; each unit's trained shard, then its frozen one).
  int64_t disk_shards = 0;
  int64_t disk_shard_bytes = 0;
  // optimizer_on_host: the optimizer's state (of local_trainable) is on the
  // host, with `host_masters` float32 masters and their gradient buffers
  // (offload_param's host shards are masters already: not among them), and
  // the frozen ones of host_frozen; in an accumulation window's last
  // micro-step each reduced gradient shard leaves the device as its
  // reduction ends (gradients.peak: stages 1-2 the buckets' whole gradients,
  // stage 3 the persistent parameters' and the largest unit's shard).
  bool optimizer_on_host = false;
  int64_t host_masters = 0;
};

// options.stage's rule over `params` sharded within groups of `shard_group`
// ranks (stage 3's mixed precision shards every parameter: none persistent;
// stages 0-2's keeps a 16-bit copy of every parameter), offloaded as
// `options` asks; `accumulation`: the micro-steps of an accumulation window
// (offload_optimizer's gradients are held as without it between them).
StateElements state_elements(const ZeroOptions& options, const MixedPrecision& mixed, int shard_group,
                             const std::vector<ParameterCount>& params, int64_t accumulation = 1);

// Each stage's memory rule, which state_elements applies (written once, in
// zero_memory.cc):
// what a rank stores from the parameters' sizes, and the gradients it holds
// from the model's trainable amount and its own part of it. Each strategy's
// gradient_hold() is its stage's (parallel/internal/sharding_strategy.h).
StateElements data_parallel_state(const std::vector<ParameterCount>& params);
GradientHold data_parallel_gradients(int64_t trainable, int64_t local_trainable);
StateElements stage12_state(const ZeroOptions& options, int shard_group, const std::vector<ParameterCount>& params);
GradientHold stage12_gradients(const ZeroOptions& options, int64_t trainable, int64_t local_trainable);
StateElements stage3_state(const ZeroOptions& options, const MixedPrecision& mixed, int shard_group,
                           const std::vector<ParameterCount>& params);
GradientHold stage3_gradients(int64_t trainable, int64_t local_trainable);

}  // namespace remat::parallel
