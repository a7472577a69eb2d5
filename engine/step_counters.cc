#include "engine/step_counters.h"

#include "checkpointing/checkpoint.h"
#include "engine/internal/field_table.h"
#include "parallel/mappings.h"

namespace remat {
namespace {

using internal::FieldKind;
using internal::FieldTable;
constexpr FieldKind kTotal = FieldKind::kTotal, kNow = FieldKind::kNow, kPeak = FieldKind::kPeak;

// Every counter, once: a new one is its field and its row here.
const FieldTable<Counters> kCounterFields = {
    {"recomputes", kTotal, &Counters::recomputes},
    {"checkpoint_saved_bytes", kNow, &Counters::checkpoint_saved_bytes},
    {"recompute_ms", kTotal, &Counters::recompute_ms},
    {"tensor_parallel_comm_bytes", kTotal, &Counters::tensor_parallel_comm_bytes},
};

const FieldTable<StoredInputStats> kStoredInputFields = {
    {"kept_bytes", kNow, &StoredInputStats::kept_bytes},
    {"kept_padding_bytes", kNow, &StoredInputStats::kept_padding_bytes},
    {"gathered_bytes", kTotal, &StoredInputStats::gathered_bytes},
    {"offloaded_bytes", kTotal, &StoredInputStats::offloaded_bytes},
    {"fetched_bytes", kTotal, &StoredInputStats::fetched_bytes},
    {"offload_copies", kTotal, &StoredInputStats::offload_copies},
    {"fetch_copies", kTotal, &StoredInputStats::fetch_copies},
    {"left_small_bytes", kTotal, &StoredInputStats::left_small_bytes},
};

const FieldTable<ActivationOffloadStats> kActivationOffloadFields = {
    {"offloaded_tensors", kTotal, &ActivationOffloadStats::offloaded_tensors},
    {"offloaded_bytes", kTotal, &ActivationOffloadStats::offloaded_bytes},
    {"restored_tensors", kTotal, &ActivationOffloadStats::restored_tensors},
    {"restored_bytes", kTotal, &ActivationOffloadStats::restored_bytes},
    {"kept_tensors", kTotal, &ActivationOffloadStats::kept_tensors},
    {"kept_bytes", kNow, &ActivationOffloadStats::kept_bytes},
    {"host_bytes", kNow, &ActivationOffloadStats::host_bytes},
};

const FieldTable<parallel::ZeroStats> kZeroFields = {
    {"param_bytes", kNow, &parallel::ZeroStats::param_bytes},
    {"grad_bytes", kNow, &parallel::ZeroStats::grad_bytes},
    {"gathered_bytes", kNow, &parallel::ZeroStats::gathered_bytes},
    {"host_bytes", kNow, &parallel::ZeroStats::host_bytes},
    {"host_param_bytes", kNow, &parallel::ZeroStats::host_param_bytes},
    {"peak_gathered_bytes", kPeak, &parallel::ZeroStats::peak_gathered_bytes},
    {"peak_gathered_units", kPeak, &parallel::ZeroStats::peak_gathered_units},
    {"allgather_bytes", kTotal, &parallel::ZeroStats::allgather_bytes},
    {"reducescatter_bytes", kTotal, &parallel::ZeroStats::reducescatter_bytes},
    {"allreduce_bytes", kTotal, &parallel::ZeroStats::allreduce_bytes},
    {"peak_grad_bytes", kPeak, &parallel::ZeroStats::peak_grad_bytes},
    {"reduce_wait_ms", kTotal, &parallel::ZeroStats::reduce_wait_ms},
    {"buckets_reduced", kTotal, &parallel::ZeroStats::buckets_reduced},
    {"buckets_done_in_backward", kTotal, &parallel::ZeroStats::buckets_done_in_backward},
};

}  // namespace

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
  internal::subtract_totals(kCounterFields, d, before);
  internal::subtract_totals(kStoredInputFields, d.stored, before.stored);
  internal::subtract_totals(kActivationOffloadFields, d.offload, before.offload);
  internal::subtract_totals(kZeroFields, d.zero, before.zero);
  return d;
}

}  // namespace remat
