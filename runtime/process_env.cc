#include "runtime/process_env.h"

#include "runtime/env_knobs.h"
#include "runtime/error.h"

namespace remat {
namespace {

std::optional<int> read_int(const EnvLookup& lookup, const char* name) {
  auto value = lookup(name);
  if (!value) return std::nullopt;
  return static_cast<int>(knobs::parse_whole(name, *value, 0, 1 << 30,
                                             {"a non-negative integer (at most 1073741824)",
                                              "unset it or fix the launcher"}));
}

ProcessEnv from_vars(const EnvLookup& lookup, const char* source,
                     const char* rank_var, const char* world_var,
                     const char* local_rank_var, const char* local_world_var) {
  ProcessEnv env;
  env.source = source;
  auto rank = read_int(lookup, rank_var);
  auto world = read_int(lookup, world_var);
  if (!rank || !world) {
    throw ConfigError(str(rank ? world_var : rank_var, " is not set while ",
                          rank ? rank_var : world_var,
                          " is: set both, or neither for a single process"));
  }
  env.rank = *rank;
  env.world_size = *world;
  if (env.world_size < 1) {
    throw ConfigError(str(world_var, "=", env.world_size, " must be at least 1"));
  }
  if (env.rank >= env.world_size) {
    throw ConfigError(str(rank_var, "=", env.rank, " is out of range for ",
                          world_var, "=", env.world_size,
                          ": ranks run from 0 to ", env.world_size - 1));
  }
  env.local_rank = read_int(lookup, local_rank_var).value_or(env.rank);
  env.local_world_size =
      read_int(lookup, local_world_var).value_or(env.world_size);
  if (env.local_rank >= env.local_world_size) {
    throw ConfigError(str(local_rank_var, "=", env.local_rank,
                          " is out of range for ", local_world_var, "=",
                          env.local_world_size));
  }
  return env;
}

}  // namespace

ProcessEnv detect_process_env(const EnvLookup& lookup) {
  if (lookup("OMPI_COMM_WORLD_RANK") || lookup("OMPI_COMM_WORLD_SIZE")) {
    return from_vars(lookup, "openmpi", "OMPI_COMM_WORLD_RANK",
                     "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "OMPI_COMM_WORLD_LOCAL_SIZE");
  }
  if (lookup("RANK") || lookup("WORLD_SIZE")) {
    return from_vars(lookup, "env", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                     "LOCAL_WORLD_SIZE");
  }
  return ProcessEnv{};
}

ProcessEnv detect_process_env() {
  return detect_process_env([](const char* name) { return knobs::get(name); });
}

}  // namespace remat
