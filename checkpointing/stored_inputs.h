// What a checkpoint region keeps of its inputs between forward and recompute.
//
// Plain regions keep their input tensors as they are. With the options below,
// every floating-point tensor input (other than leaf tensors that require
// grad: parameters stay alive anyway) is stored instead:
//
// - partition (partition_activations): each rank of the tensor-parallel group
//   keeps ceil(numel / size) elements of the flattened input, the last share
//   padded with zeros; the recompute all-gathers the shares. The inputs must
//   be the same on every rank of the group (the hidden states of a
//   tensor-parallel transformer are).
// - offload (cpu_checkpointing): the kept tensor (or share) moves to host
//   memory, pinned when it came from a GPU and copied on a side stream; it
//   returns ahead of its recompute: when a region's backward begins, the
//   previous region's inputs start coming back (and, partitioned, their
//   all-gather starts). The last region's inputs stay on the device (they
//   are needed first) unless offload_keep_last is false; tensors under
//   offload_min_bytes stay (0 by default: every input moves, as DeepSpeed's
//   cpu_checkpointing promises); bool and integer tensors pass through
//   untouched. An expanded or dense view moves the span of storage its
//   elements cover (never its expanded size) and comes back with its sizes
//   and strides; a view with gaps moves a dense copy of its elements. On a CPU-only
//   build the same path copies into separate host tensors.
//
// Whatever the form, the recompute sees the input as the forward saw it: an
// input changed in place in between is an error at backward (checkpoint.cc
// compares version counters), as it is for tensors autograd keeps.
// - contiguous (contiguous_memory_optimization): the kept shares and offloaded
//   copies go into one preallocated buffer per argument position with a slot
//   for each of number_checkpoints regions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checkpointing/region_options.h"
#include "runtime/field_table.h"

namespace remat {

class Communicator;
class Context;
class ContiguousBuffers;
namespace internal {
struct CheckpointingState;  // checkpointing/internal/state.h
}

// Preallocated storage for the kept tensors of up to `number_checkpoints`
// live regions: one buffer per argument position (allocated at first use,
// sized by the first region's tensor at that position), one slot per region.
class ContiguousBuffers {
 public:
  explicit ContiguousBuffers(int64_t number_checkpoints);
  int64_t number_checkpoints() const { return number_checkpoints_; }

  // A slot index for a new region; Error when all are held by live regions.
  int64_t acquire(const std::string& region);
  void release(int64_t slot, uint64_t generation);
  uint64_t generation() const { return generation_; }
  int64_t slots_in_use() const;

  // Slot `slot` of position `position`'s buffer: `numel` elements of `like`'s
  // dtype on `device` (pinned host memory when `pinned`).
  at::Tensor view(int64_t slot, size_t position, int64_t numel, at::ScalarType dtype,
                  at::Device device, bool pinned, const std::string& region);

  // Frees the buffers; regions alive now keep their own slots' storage.
  void reset();
  // Bytes of the buffers allocated now.
  int64_t allocated_bytes() const;

 private:
  struct Buffer {
    at::Tensor storage;  // [number_checkpoints, slot_numel]
    int64_t slot_numel = 0;
  };
  int64_t number_checkpoints_;
  std::vector<bool> in_use_;
  std::vector<Buffer> buffers_;
  uint64_t generation_ = 0;
  // Regions take slots in forward and free them in backward, which may run on
  // another thread (autograd's device threads).
  mutable std::mutex mutex_;
};

// Counters of stored inputs in the current context (runtime/context.h; for
// tests, metrics and benchmarks): a region counts into the context of its forward.
struct StoredInputStats {
  int64_t kept_bytes = 0;          // now: bytes live regions keep for stored inputs
  int64_t kept_padding_bytes = 0;  // now: of which padding of the last share
  int64_t gathered_bytes = 0;      // total: bytes of all-gather outputs on recompute
  int64_t offloaded_bytes = 0;     // total: bytes copied to host
  int64_t fetched_bytes = 0;       // total: bytes copied back from host
  int64_t offload_copies = 0;      // total: tensors copied to host
  int64_t fetch_copies = 0;        // total: tensors copied back
  int64_t left_small_bytes = 0;    // total: bytes left on the device under offload_min_bytes
  static const FieldTable<StoredInputStats>& fields();
};
StoredInputStats stored_input_stats();

// Each field once (runtime/field_table.h): its kind, and its key in a step's
// metrics if it has one. A new counter is its field, its row and its increment.
inline const FieldTable<StoredInputStats>& StoredInputStats::fields() {
  using S = StoredInputStats;
  static const FieldTable<S> table = {
      {"kept_bytes", FieldKind::kNow, &S::kept_bytes},
      {"kept_padding_bytes", FieldKind::kNow, &S::kept_padding_bytes},
      {"gathered_bytes", FieldKind::kTotal, &S::gathered_bytes, "ckpt_gathered_bytes"},
      {"offloaded_bytes", FieldKind::kTotal, &S::offloaded_bytes, "ckpt_offloaded_bytes"},
      {"fetched_bytes", FieldKind::kTotal, &S::fetched_bytes},
      {"offload_copies", FieldKind::kTotal, &S::offload_copies},
      {"fetch_copies", FieldKind::kTotal, &S::fetch_copies},
      {"left_small_bytes", FieldKind::kTotal, &S::left_small_bytes},
  };
  return table;
}

// Bytes a stored input takes: the storage span its elements cover when that
// is no larger than its elements (dense, or expanded with stride 0), else its
// elements (a view with gaps is moved as a dense copy).
int64_t covered_bytes(const at::Tensor& t);

// The inputs of one region (see above). Created at the region's forward,
// restored at its recompute; it belongs to the context current at its
// creation (its prefetch chain and counters), wherever it is restored.
class StoredInputs {
 public:
  // `inputs` are the region's tensor inputs in order; `store[i]` says which are
  // stored (see stores()). Registers the region in the prefetch chain.
  StoredInputs(const std::vector<at::Tensor>& inputs, const std::vector<bool>& store,
               InputStorageOptions options, std::string region);
  ~StoredInputs();
  StoredInputs(const StoredInputs&) = delete;
  StoredInputs& operator=(const StoredInputs&) = delete;

  // Whether `t` would be stored under `options` (else kept as it is).
  static bool stores(const at::Tensor& t, const InputStorageOptions& options);
  // stores() for each of a region's inputs; counts (and logs) those that
  // offloading leaves on the device for being under offload_min_bytes.
  static std::vector<bool> select(const std::vector<at::Tensor>& inputs,
                                  const InputStorageOptions& options, const std::string& region);

  // The stored inputs, full size, in order (positions with store[i] false are
  // undefined). Starts the previous region's fetch first. Each call fetches
  // and gathers again: once per backward.
  std::vector<at::Tensor> restore();

  // Frees what is kept (after a backward that does not retain the graph).
  void release();
  bool released() const { return released_; }

  // Tensors held now, for tests (kept shares, host copies, prefetched data).
  std::vector<at::Tensor> held_tensors() const;
  int64_t kept_bytes() const;

  struct Entry;

 private:
  void offload_now();
  void prefetch();

  std::shared_ptr<Context> context_;
  internal::CheckpointingState* state_;
  InputStorageOptions options_;
  std::string region_;
  std::vector<std::unique_ptr<Entry>> entries_;  // one per input; null when not stored
  int64_t slot_ = -1;
  uint64_t slot_generation_ = 0;
  bool offload_pending_ = false;
  bool prefetched_ = false;
  bool released_ = false;
};

}  // namespace remat
