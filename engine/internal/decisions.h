// What a run decided for itself, kept in its saves (TrainPosition::decisions,
// a JSON object): every "auto" value with its reason, the batch sizes with
// the data-parallel size, the budget device_memory_budget_bytes "auto"
// became, and the micro-batch search's measurements. A resume takes them
// back (keep_saved_decisions, engine/engine.h) and is told when its global
// batch differs from the save's.
//
//   {"auto": {"train_micro_batch_size_per_gpu": {"value": 16, "why": "..."}, ...},
//    "batch": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 16,
//              "gradient_accumulation_steps": 1, "data_parallel_size": 2},
//    "device_memory_budget_bytes": 11811160064,  // when "auto" decided it
//    "micro_batch_search": {...}}                // MicroBatchSearch::to_json
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "engine/config.h"
#include "engine/micro_batch_search.h"

namespace remat::internal {

// The decisions of a run of `config` at data-parallel size `dp`, as JSON text.
std::string decisions_json(const Config& config, const BatchSizes& batch, int dp,
                           std::optional<int64_t> device_budget, const MicroBatchSearch* search);

// Takes the saved `decisions` (of the save in `folder`, step `step`) into
// `config`: each key it still gives "auto", undecided, that the save decided,
// its reason saying so, and device_memory_budget_bytes "auto". The batch
// sizes only where `config` gives none of them a number, and
// train_batch_size only at the save's data-parallel size (elsewhere it
// follows the micro-batch). Returns the line to log ("" when nothing was
// taken).
std::string take_decisions(Config& config, const std::string& decisions, const std::string& folder, int64_t step,
                           int dp);

// The warning when `now` (at `dp`) trains another global batch than the
// saved decisions record; "" when the same or not recorded.
std::string batch_change(const std::string& decisions, const BatchSizes& now, int dp);

}  // namespace remat::internal
