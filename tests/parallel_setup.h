// Test helper for multi-rank tests of parallel code: the world communicator,
// one cached ParallelLayout per tensor-parallel size, and a small GPT.
//
//   for (int tp : tp_sizes(4)) { const ParallelLayout& l = layout(tp); ... }
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "models/gpt.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"

namespace remat::testing {

inline std::shared_ptr<Communicator> world() {
  static auto w = Runtime::init().world(Backend::kMpi);
  return w;
}

// Collective the first time a size is asked for (every rank must ask).
inline const std::shared_ptr<ParallelLayout>& layout_ptr(int tp) {
  static std::map<int, std::shared_ptr<ParallelLayout>> layouts;
  auto& l = layouts[tp];
  if (!l) l = std::make_shared<ParallelLayout>(world(), ParallelDims::from_world(world()->size(), tp));
  return l;
}
inline const ParallelLayout& layout(int tp) { return *layout_ptr(tp); }

// The tensor-parallel sizes 1, 2, 4, ... up to `max` that divide the world.
inline std::vector<int> tp_sizes(int max) {
  std::vector<int> out;
  for (int tp = 1; tp <= max; tp *= 2) {
    if (world()->size() % tp == 0) out.push_back(tp);
  }
  return out;
}

// A GPT small enough for many steps in a test: sequence 12, 4 heads, d_model
// 16, d_ff 32; tensor parallel over `tp`'s group when tp > 1.
inline models::GptOptions small_gpt(int64_t vocab, int64_t layers, double dropout, int tp = 1) {
  models::GptOptions o;
  o.vocab_size = vocab;
  o.shape.seq_len = 12;
  o.shape.n_layer = static_cast<int>(layers);
  o.shape.n_head = 4;
  o.shape.d_model = 16;
  o.shape.d_ff = 32;
  o.shape.dropout = dropout;
  if (tp > 1) o.tensor_parallel = layout(tp).tp_group();
  return o;
}

}  // namespace remat::testing
