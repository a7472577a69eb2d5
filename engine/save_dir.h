// A run's save folder, as the engine's users see it: the options of
// Engine::use_save_dir, which step the folder's `latest` names, and the
// removal of saves later than a step (remat-train's --overwrite-saves).
// The save format itself (rank files, manifest, re-slicing) is the engine's
// own (engine/save/).
#pragma once

#include <cstdint>
#include <string>

namespace remat {

class Communicator;

struct SaveDirOptions {
  // The run resumes (it loaded a save from this folder; remat-train's
  // --resume): saves already in the folder may be continued.
  bool resuming = false;
  // A new run may take a folder holding another run's saves
  // (discard_saves_after removes them once its first save is complete;
  // remat-train's --overwrite-saves).
  bool overwrite = false;
};

// Removes the saves in `dir` later than `step` (every one for step 0), but
// the one of step `except`, and points `latest` at the newest complete save
// left, or removes it: what --overwrite-saves does once a run's first save
// (`except`) is complete, so that a run which fails before it leaves the old
// saves as they were. Rank 0 removes; collective over `world`. Returns the
// number of step folders removed.
int discard_saves_after(const std::string& dir, int64_t step, Communicator& world, int64_t except = -1);

// The step `latest` in `dir` names, or -1 when there is none (or it names no
// step folder).
int64_t latest_step(const std::string& dir);

}  // namespace remat
