// The shape of the GPT and the test stack (models/gpt.h, models/stack.h),
// declared once with its defaults and validated here. engine/config.cc binds
// the JSON section model onto it; messages name the JSON keys.
#pragma once

#include <string>

namespace remat::models {

struct ModelShape {
  int n_layer = 4;   // transformer blocks
  int n_head = 4;    // attention heads (a multiple of tensor_parallel.size)
  int d_model = 128; // hidden width (a multiple of n_head)
  int d_ff = 512;    // MLP width (a multiple of tensor_parallel.size)
  int seq_len = 64;  // longest sequence (position embeddings)
  double dropout = 0.1;
};

// The rules of the shape alone, written once: an empty string when valid,
// else what is wrong and which key to change. (The multiples of the
// tensor-parallel size are checked where the group is known: BlockImpl.)
std::string check_model_shape(const ModelShape& shape);

}  // namespace remat::models
