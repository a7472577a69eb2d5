// A save's manifest: written (manifest_json), read with its own checksum and
// every field checked (read_manifest), and checked against the run that
// resumes it (check_manifest_fits, check_same_model); where a save is
// (resolve_save) and, when one is unusable, which intact save to offer.
//
// Internal to engine/: only the save format (engine/save/) and its tests
// include it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "engine/save/types.h"

namespace remat::save {

// [[name, {"split": "column", "dim": 0, "stride": 3, "shape": [48, 16]}], ...]
nlohmann::json splits_json(const Splits& splits);

// Each saved tensor's [name, parameter offset, offset, length] segments.
nlohmann::json layout_json(const std::vector<parallel::ShardLayout>& layout);

// [[name, shape], ...]
nlohmann::json parameters_json(const std::vector<std::pair<std::string, std::vector<int64_t>>>& parameters);

// One rank file as rank 0 lists it in the manifest.
struct ListedFile {
  int64_t bytes = 0, crc32 = 0, tp_rank = 0, dp_rank = 0;
  std::string layout;  // layout_json's text
};

// The manifest of a save of `position` made by `world_size` ranks (`files`,
// by rank), with its own CRC-32 over its compact form without that field.
nlohmann::json manifest_json(const TrainPosition& position, const TrainShards& shards,
                             const SaveIdentity& identity, int world_size, const std::vector<ListedFile>& files);

// A manifest read with its checksum and every field checked: a hand-edited
// or damaged one is a ConfigError naming `path`.
Manifest read_manifest(const std::string& path);

// The newest step folder in `root` (other than `skip`) whose manifest and
// every rank file verify; "" when none does.
std::string newest_intact_step(const std::string& root, const std::string& skip = "");

// The sentence an error about a save in `root` ends with: the newest save
// (other than the broken `skip`) whose manifest and every rank file verify.
std::string offer_newest(const std::string& root, const std::string& skip = "");

// The step folder to load: `dir` itself when it holds a manifest, else the
// one its `latest` names (a ConfigError saying what is missing otherwise).
std::string resolve_save(const std::string& dir);

// The save in `folder` can be resumed by this run: its format, model
// signature and settings match `identity`, and at another tensor-parallel
// size it records its splits (ConfigError naming what differs).
void check_manifest_fits(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                         const SaveIdentity& identity);

// A save of another model is refused naming what differs: each parameter's
// whole shape (format 5, any tensor-parallel size), and at the saved
// tensor-parallel size each share's shape (identity.parameters).
void check_same_model(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                      const SaveIdentity& identity);

}  // namespace remat::save
