// checkpoint_sequential: a torch::nn::Sequential cut into segments, each
// segment but the last run as one checkpoint region.
//
//   auto y = remat::checkpoint_sequential(seq, /*segments=*/4, x);
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include "checkpointing/checkpoint.h"

namespace remat {

// segments must be in [1, seq->size()]; the modules take and return one tensor.
at::Tensor checkpoint_sequential(torch::nn::Sequential& seq, int64_t segments,
                                 const at::Tensor& input,
                                 const CheckpointOptions& options = default_checkpoint_options());

}  // namespace remat
