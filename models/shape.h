// The shape of the GPT and the test stack (models/gpt.h, models/stack.h),
// declared once with its defaults and validated here. engine/config.cc binds
// the JSON section model onto it; messages name the JSON keys.
#pragma once

#include <string>
#include <vector>

namespace remat::models {

struct ModelShape {
  int n_layer = 4;   // transformer blocks
  int n_head = 4;    // attention heads (a multiple of tensor_parallel.size)
  int d_model = 128; // hidden width (a multiple of n_head)
  int d_ff = 512;    // MLP width (a multiple of tensor_parallel.size)
  int seq_len = 64;  // longest sequence (position embeddings)
  double dropout = 0.1;
};

// Where the dropouts inside the sequence-parallel region (after attention,
// after the MLP, after the embeddings) draw their masks when each
// tensor-parallel rank holds 1/tp of the sequence:
//   kPerRank     from the RNG tracker's model-parallel state (a different
//                stream on each tensor-parallel rank), each rank drawing the
//                mask of its own tokens only.
//   kReplicated  the mask of the whole sequence from the default generator
//                (the same on every rank of the group), each rank keeping its
//                tokens' rows: the masks without sequence parallelism, so the
//                model computes what it computes at tp 1, at the cost of
//                drawing tp x the random numbers.
enum class SequenceParallelDropout { kPerRank, kReplicated };
const std::vector<std::string>& sequence_parallel_dropout_names();

// The rules of the shape alone, written once: an empty string when valid,
// else every rule broken, one per line, each saying what is wrong and which
// key to change. (The multiples of the
// tensor-parallel size are checked where the group is known: BlockImpl.)
std::string check_model_shape(const ModelShape& shape);

}  // namespace remat::models
