// Every counter remat keeps, read in one snapshot, and a step's share of
// them: what remat-train writes to its metrics, and what tests and
// benchmarks compare.
//
//   remat::Counters before = remat::Counters::read(&zero);
//   ... forward, backward, step ...
//   remat::Counters step = remat::Counters::read(&zero).since(before);
//   step.zero.collective_bytes();   // this step's ZeRO traffic
//   step.stored.kept_bytes;         // bytes kept now
#pragma once

#include <cstdint>

#include "checkpointing/offload_activations.h"
#include "checkpointing/stored_inputs.h"
#include "parallel/zero.h"
#include "runtime/field_table.h"

namespace remat {

struct Counters {
  // Checkpoint regions (checkpoint.h).
  int64_t recomputes = 0;              // total: regions recomputed
  int64_t checkpoint_saved_bytes = 0;  // now: bytes live regions hold for backward
  double recompute_ms = 0;             // total: time profiled regions spent recomputing
  // Their stored inputs (stored_inputs.h): kept_* now, the rest totals.
  StoredInputStats stored;
  // Activation offloading (offload_activations.h): kept_bytes and host_bytes
  // now, the rest totals.
  ActivationOffloadStats offload;
  // Tensor-parallel mappings: total bytes through collectives.
  int64_t tensor_parallel_comm_bytes = 0;
  // Background saves (engine/save/): host bytes their snapshots hold now,
  // until each rank file is written (train.async_save).
  int64_t save_snapshot_bytes = 0;
  // ZeRO (zero.h): bytes now and totals; zero when read without a ZeroModel.
  parallel::ZeroStats zero;

  // Reads every counter. The profile's recompute time is summed over regions
  // without resetting it.
  static Counters read(const parallel::ZeroModel* zero = nullptr);

  // This snapshot's share since `before`: totals as differences, values that
  // describe "now" (kept bytes, parameter and gradient bytes, gathered bytes
  // and their peaks) as they are in this snapshot. Each field's kind is its
  // row in its type's field table (runtime/field_table.h), which ships with the
  // type: ZeroStats::fields() in parallel/zero.h, StoredInputStats::fields() in
  // checkpointing/stored_inputs.h, and so on; this struct's own fields are in
  // step_counters.cc.
  Counters since(const Counters& before) const;

  // The metrics these counters give, by their keys: every row of the tables
  // above that names one (a step's share of them is what remat-train writes).
  MetricValues metrics() const;

  // Bytes through every collective: stored-input all-gathers, tensor-parallel
  // mappings and ZeRO.
  int64_t comm_bytes() const {
    return stored.gathered_bytes + tensor_parallel_comm_bytes + zero.collective_bytes();
  }
};

}  // namespace remat
