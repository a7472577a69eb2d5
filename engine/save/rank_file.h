// A rank file of a save: written (rank_file_bytes: this rank's tensors with
// their optimizer state, its random state and what identifies it) and read
// back, verified against the manifest (open_rank_file: size and CRC-32, its
// own ranks, layout and splits, step, rank, world size and run).
//
// Internal to engine/: only the save format (engine/save/) and its tests
// include it.
#pragma once

#include <torch/serialize/input-archive.h>

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/save/types.h"

namespace torch::optim {
class Optimizer;
}

namespace remat::save {

// Rank file keys: "t<i>" a tensor's values, "t<i>__<field>" its optimizer state.
std::string tensor_key(size_t i);
std::string state_key(size_t i, const std::string& field);

// This rank's file of a save (rank `rank` of `world_size`): its tensors with
// their optimizer state, its random state, and what identifies it; `layout`
// gets its layout's JSON (layout_json).
std::string rank_file_bytes(const TrainPosition& position, const TrainShards& shards,
                            torch::optim::Optimizer& optimizer, const SaveIdentity& identity, int rank,
                            int world_size, std::string& layout);

// One rank file, read, verified against the manifest and parsed.
struct RankFile {
  std::string path;
  torch::serialize::InputArchive archive, tensors;
  std::map<std::string, std::vector<std::string>> fields;  // tensor key -> optimizer state fields saved
};

// Reads and verifies file `index` of the manifest of the save in `folder`: a
// missing, damaged, swapped or foreign file is a ConfigError saying which,
// offering the newest intact save.
std::unique_ptr<RankFile> open_rank_file(const std::string& folder, const Manifest& manifest, size_t index);

}  // namespace remat::save
