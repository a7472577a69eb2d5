// What one data-parallel rank keeps of the model state under each ZeRO
// stage: the one memory rule per stage (zero_memory.cc, one function each,
// which each strategy answers gradient_hold() by),
// which remat::Engine applies to the tensors it holds (through
// ZeroModel::gradient_hold) and remat::estimate_memory to parameter sizes.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/zero_options.h"

namespace remat::parallel {

// One parameter as the memory rules see it.
struct ParameterCount {
  int64_t numel = 0;
  bool trainable = true;
  int unit = -1;  // stage 3's unit: its block's index; -1 outside the blocks (the root unit)
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
};

// options.stage's rule over `params` sharded within groups of `shard_group`
// ranks (stage 3's mixed precision shards every parameter: none persistent;
// stages 0-2's keeps a 16-bit copy of every parameter).
StateElements state_elements(const ZeroOptions& options, const MixedPrecision& mixed, int shard_group,
                             const std::vector<ParameterCount>& params);

}  // namespace remat::parallel
