#include "engine/step_counters.h"

#include "checkpointing/checkpoint.h"
#include "engine/save/storage.h"
#include "parallel/mappings.h"
#include "runtime/field_table.h"

namespace remat {
namespace {

// The counters the engine reads itself (the stats types ship their own tables):
// a new one is its field, its row here and where read() reads it.
const FieldTable<Counters>& counter_fields() {
  static const FieldTable<Counters> table = {
      {"recomputes", FieldKind::kTotal, &Counters::recomputes},
      {"checkpoint_saved_bytes", FieldKind::kNow, &Counters::checkpoint_saved_bytes},
      {"recompute_ms", FieldKind::kTotal, &Counters::recompute_ms, "recompute_ms"},
      {"tensor_parallel_comm_bytes", FieldKind::kTotal, &Counters::tensor_parallel_comm_bytes, "tp_comm_bytes"},
      {"save_snapshot_bytes", FieldKind::kNow, &Counters::save_snapshot_bytes, "save_snapshot_bytes"},
  };
  return table;
}

}  // namespace

Counters Counters::read(const parallel::ZeroModel* zero) {
  Counters c;
  c.recomputes = checkpoint_recompute_count();
  c.checkpoint_saved_bytes = remat::checkpoint_saved_bytes();
  for (const auto& [name, p] : checkpoint_profile()) c.recompute_ms += p.recompute_ms;
  c.stored = stored_input_stats();
  c.offload = activation_offload_stats();
  c.tensor_parallel_comm_bytes = parallel::tensor_parallel_comm_bytes();
  c.save_snapshot_bytes = save::snapshot_host_bytes();
  if (zero != nullptr) c.zero = zero->stats();
  return c;
}

Counters Counters::since(const Counters& before) const {
  Counters d = *this;
  subtract_totals(counter_fields(), d, before);
  subtract_totals(StoredInputStats::fields(), d.stored, before.stored);
  subtract_totals(ActivationOffloadStats::fields(), d.offload, before.offload);
  subtract_totals(parallel::ZeroStats::fields(), d.zero, before.zero);
  return d;
}

MetricValues Counters::metrics() const {
  MetricValues out;
  append_metrics(counter_fields(), *this, out);
  append_metrics(StoredInputStats::fields(), stored, out);
  append_metrics(ActivationOffloadStats::fields(), offload, out);
  append_metrics(parallel::ZeroStats::fields(), zero, out);
  return out;
}

}  // namespace remat
