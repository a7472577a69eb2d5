#include "engine/step_counters.h"

#include "checkpointing/checkpoint.h"
#include "parallel/mappings.h"

namespace remat {

Counters Counters::read(const parallel::ZeroModel* zero) {
  Counters c;
  c.recomputes = checkpoint_recompute_count();
  c.checkpoint_saved_bytes = remat::checkpoint_saved_bytes();
  for (const auto& [name, p] : checkpoint_profile()) c.recompute_ms += p.recompute_ms;
  c.stored = stored_input_stats();
  c.offload = activation_offload_stats();
  c.tensor_parallel_comm_bytes = parallel::tensor_parallel_comm_bytes();
  if (zero != nullptr) c.zero = zero->stats();
  return c;
}

Counters Counters::since(const Counters& before) const {
  Counters d = *this;
  d.recomputes -= before.recomputes;
  d.recompute_ms -= before.recompute_ms;
  d.stored.gathered_bytes -= before.stored.gathered_bytes;
  d.stored.offloaded_bytes -= before.stored.offloaded_bytes;
  d.stored.fetched_bytes -= before.stored.fetched_bytes;
  d.stored.offload_copies -= before.stored.offload_copies;
  d.stored.fetch_copies -= before.stored.fetch_copies;
  d.stored.left_small_bytes -= before.stored.left_small_bytes;
  d.offload.offloaded_tensors -= before.offload.offloaded_tensors;
  d.offload.offloaded_bytes -= before.offload.offloaded_bytes;
  d.offload.restored_tensors -= before.offload.restored_tensors;
  d.offload.restored_bytes -= before.offload.restored_bytes;
  d.offload.kept_tensors -= before.offload.kept_tensors;
  d.tensor_parallel_comm_bytes -= before.tensor_parallel_comm_bytes;
  d.zero.allgather_bytes -= before.zero.allgather_bytes;
  d.zero.reducescatter_bytes -= before.zero.reducescatter_bytes;
  d.zero.allreduce_bytes -= before.zero.allreduce_bytes;
  d.zero.reduce_wait_ms -= before.zero.reduce_wait_ms;
  d.zero.buckets_reduced -= before.zero.buckets_reduced;
  d.zero.buckets_done_in_backward -= before.zero.buckets_done_in_backward;
  return d;
}

}  // namespace remat
