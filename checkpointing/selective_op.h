// Selective-op checkpointing below autograd.
//
// Inside a region, listed ops (aten::mm, ...) keep their outputs from the
// forward; during recompute the dispatcher hands those outputs back instead of
// running the kernel, while autograd above still records the op (so its
// backward is exact). Every other op is recomputed. The interception is a
// boxed fallback on c10's Fake dispatch key, which sits below autograd and
// above the backends and is unused by LibTorch 1.13 itself; the key is added
// to the thread's included set only while a region's forward or recompute
// runs. See docs/selective-op.md.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace remat {

using SaveOps = std::set<std::string>;

// The ops' outputs one region kept, in call order.
struct SelectiveCache {
  struct Entry {
    std::string op;
    std::vector<c10::IValue> returns;
  };
  std::vector<Entry> entries;
  size_t next = 0;    // replay position
  int64_t bytes = 0;  // tensor bytes held
};

// The ops whose outputs selective_op keeps when activation_checkpointing.save_ops
// is unset: the projections' matmuls (aten::mm, aten::addmm: every Linear).
// The attention core (scores, softmax, dropout, the product with V) and the
// element-wise ops are recomputed. docs/checkpointing.md has the measurements
// behind this choice.
std::vector<std::string> default_save_ops();

// Every matmul and attention kernel (mm, addmm, bmm, LibTorch's fused
// attention kernels, whose names differ between 1.13 and 2.x) and max: keeps
// the B*H*T*T attention scores too (less recompute, more memory).
std::vector<std::string> matmul_save_ops();

// The tensor-parallel collectives of the mappings' forwards (all-reduce,
// all-gather, reduce-scatter), which parallel/mappings.cc registers as
// operators: kept, the recompute reuses their outputs instead of
// communicating again (activation_checkpointing.save_collectives).
std::vector<std::string> collective_save_ops();

// Checks op names against the dispatcher: an unknown name is an Error naming
// the closest registered op. Names of matmul_save_ops() that this LibTorch
// lacks (version-specific attention ops) and collective_save_ops() in a
// program without tensor-parallel layers are dropped silently.
SaveOps resolve_save_ops(const std::vector<std::string>& names);

// While alive, listed ops record into (kRecord) or replay from (kReplay) the cache.
class SelectiveOpScope {
 public:
  enum class Mode { kRecord, kReplay };
  SelectiveOpScope(const SaveOps& ops, SelectiveCache& cache, Mode mode);
  ~SelectiveOpScope();
  SelectiveOpScope(const SelectiveOpScope&) = delete;
  SelectiveOpScope& operator=(const SelectiveOpScope&) = delete;

  struct State;  // defined in the .cc; the dispatcher fallback reads it

 private:
  std::unique_ptr<State> state_;
};

// True while the current op call is a real kernel run under a scope (tests use
// this in RecordFunction observers to tell executed from replayed ops).
bool selective_op_kernel_running();

}  // namespace remat
