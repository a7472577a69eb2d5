// The bytes of a save on disk: files written atomically, read back whole,
// their CRC-32, and the names of a save root's step folders.
//
// Internal to engine/: only the save format (engine/save/) and the engine's
// sources include it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace remat::save {

// Writes `bytes` to `path` atomically: temporary file, flush, fsync, rename,
// then the folder fsynced; a crash leaves either the old or the new file.
void write_atomically(const std::string& path, const std::string& bytes);

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

}  // namespace remat::save
