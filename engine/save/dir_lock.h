// The save root of one run, held for the run's lifetime (Engine::use_save_dir).
//
// Internal to engine/: only the save format (engine/save/), the engine's
// sources and their tests include it.
#pragma once

#include <string>

#include "engine/save_dir.h"

namespace remat {

class Communicator;

// The save root of one run, held for the run's lifetime: created, checked
// writable by every rank (a probe file), and locked by rank 0 so that a second
// job given the same directory stops at its start naming the first one's pid
// and host (collective over `world`). A `latest` that is not a regular file,
// or (neither resuming nor overwriting) saves of another run there, are a
// ConfigError before anything is trained, the same on every rank whichever
// rank found it (runtime/outcome.h). Released when destroyed or the process
// ends.
class SaveDirLock {
 public:
  SaveDirLock(const std::string& dir, const std::string& run_id, Communicator& world,
              SaveDirOptions options = {});
  ~SaveDirLock();
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace remat
