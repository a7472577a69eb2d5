// The bytes of a save on disk: files written atomically, read back whole,
// their CRC-32, and the names of a save root's step folders.
//
// Internal to engine/: only the save format (engine/save/) and the engine's
// sources include it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace remat::save {

// Writes `bytes` to `path` atomically: temporary file, flush, fsync, rename,
// then the folder fsynced; a crash leaves either the old or the new file.
void write_atomically(const std::string& path, const std::string& bytes);

// Takes the pieces of a file's bytes in order.
using Sink = std::function<void(const void* data, size_t size)>;

// A file written from pieces: its size and CRC-32.
struct WrittenBytes {
  int64_t bytes = 0, crc32 = 0;
};

// write_atomically for bytes made in pieces: `produce` hands each piece to
// the sink it is given, in order; they go to the file as they come (the
// whole is never held in memory), and its CRC-32 is computed on the way.
WrittenBytes write_atomically_streamed(const std::string& path, const std::function<void(const Sink&)>& produce);

// The whole of `path`; a file that cannot be read is a ConfigError ("resume: ...").
std::string read_file(const std::string& path);

// zlib's CRC-32 of `bytes`.
int64_t crc32_of(const std::string& bytes);

// This host's name.
std::string host_name();

// "step_00000010" for step 10; and back (-1 for a name that is not one).
std::string step_folder(int64_t step);
int64_t step_of(const std::string& name);

// The step folders under `root`, newest first.
std::vector<std::pair<int64_t, std::filesystem::path>> step_folders(const std::string& root);

// The save root a step folder lies in.
std::string root_of(const std::string& folder);

// The folder a save of `step` is written in until it is complete
// (".staging_step_00000010"): never a step folder, so nothing reads a save
// before its manifest is there, and a save never writes into a folder that
// holds another one.
std::string staging_folder(int64_t step);

// Puts the complete save in `staging` at `final` in one rename: where `final`
// holds a save already, the two are exchanged atomically (the old save then
// lies at `staging`, for the caller to remove once `latest` is written), so a
// crash leaves one complete save there, the old or the new. Where the file
// system cannot exchange, the old save is first renamed to a hidden name that
// remove_save_leftovers puts back if the second rename never happened.
// Returns whether an old save was replaced.
bool install_save(const std::string& staging, const std::string& final);

// The hidden name a step folder is renamed to before it is removed
// ("root/.removed_step_00000010"), so that no step folder is ever seen half
// removed.
std::string removed_folder(const std::string& step_folder);

// What killed saves left in `root`, removed at the start of a run (rank 0,
// under the save folder's lock): staging folders, replaced saves (put back
// where their step folder is missing), folders being removed and `latest`'s
// temporary file. Returns what was removed, for one log line.
std::vector<std::string> remove_save_leftovers(const std::string& root);

// REMAT_FAULT_SAVE_PAUSE_MS: pauses before `what` is renamed into place,
// saying so on stderr, so a test can kill a save at each of its steps.
void fault_pause(const std::string& what);

// REMAT_FAULT_SAVE_FAIL=<rank>: whether rank `rank`'s write of its file is
// to fail, as a write that failed, so a test can check that every rank stops
// with the same error. Read in the caller's thread when the save starts (the
// environment is not read from a background thread).
bool fault_fail(int rank);

// The host bytes background saves' snapshots hold now in this process (the
// save_snapshot_bytes metric), counted as a snapshot is taken and released.
int64_t snapshot_host_bytes();
void count_snapshot_host_bytes(int64_t delta);

}  // namespace remat::save
