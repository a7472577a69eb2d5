// Rank-tagged logging on spdlog.
//
// Every line carries the prefix built once per process, e.g.
// "[rank 3/4 tp 1/2 dp 1/2]". The level comes from REMAT_LOG_LEVEL.
//
//   remat::log().info("applied {} to {} modules", what, n);
//   remat::log_rank0().info("step {} loss {:.4f}", step, loss);  // rank 0 only
#pragma once

#include <spdlog/logger.h>

#include <string>

namespace remat {

// The process-wide logger (created on first use with prefix "[rank 0/1]").
spdlog::logger& log();

// log() on rank 0; a silent logger elsewhere.
spdlog::logger& log_rank0();

// Sets the rank prefix. tp/dp coordinates are added once a layout exists.
void set_log_rank(int rank, int world_size);
void set_log_layout(int tp_rank, int tp_size, int dp_rank, int dp_size);

// REMAT_LOG_LEVEL parsed (info when unset); an unknown name is a ConfigError.
spdlog::level::level_enum log_level_from_env();

// The current prefix, e.g. "[rank 1/2]".
std::string log_prefix();

}  // namespace remat
