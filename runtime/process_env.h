// Where this process sits among the launched processes.
//
// Read from Open MPI's variables (mpirun), else from the RANK / WORLD_SIZE /
// LOCAL_RANK convention (torchrun and friends), else a single process.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace remat {

struct ProcessEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // "openmpi", "env" or "single": which convention supplied the values.
  std::string source = "single";
};

using EnvLookup = std::function<std::optional<std::string>(const char*)>;

// Reads the process environment. Inconsistent or non-numeric values are a
// ConfigError naming the variable.
ProcessEnv detect_process_env();

// Same, with an injectable lookup (tests).
ProcessEnv detect_process_env(const EnvLookup& lookup);

}  // namespace remat
