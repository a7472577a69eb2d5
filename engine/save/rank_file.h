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

#include "engine/save/storage.h"
#include "engine/save/types.h"
#include "rng/rng_tracker.h"

namespace torch::optim {
class Optimizer;
}

namespace remat::save {

// Rank file keys: "t<i>" a tensor's values, "t<i>__<field>" its optimizer state.
std::string tensor_key(size_t i);
std::string state_key(size_t i, const std::string& field);

// Everything a rank file holds, taken at a step boundary: this rank's
// tensors and their optimizer state on the host, its random state, the
// position and what identifies the file. The file's bytes are made from it
// alone, so a background thread can write them while training goes on and
// changes the live state.
struct RankSnapshot {
  TrainPosition position;
  std::string model_signature, run_id;
  std::vector<parallel::ShardLayout> layout;
  Splits splits;
  int rank = 0, world_size = 1, tp_rank = 0, dp_rank = 0;
  std::vector<at::Tensor> tensors;                         // on the host
  std::vector<std::map<std::string, at::Tensor>> states;  // each tensor's optimizer state, on the host
  RngSnapshot rng;
  // Host bytes copied for it: 0 where it refers to the live host tensors
  // (copy false), else what it holds until it is written.
  int64_t host_bytes = 0;
};

// This rank's snapshot (rank `rank` of `world_size`). With `copy`, every
// tensor is copied (a device tensor into pinned host memory, copied without
// blocking and synchronized once; a host tensor cloned), so the snapshot
// stays as it is while the optimizer steps on; without, host tensors are
// referred to, not copied (a save written before the next step).
RankSnapshot snapshot_rank(const TrainPosition& position, const TrainShards& shards,
                           torch::optim::Optimizer& optimizer, const SaveIdentity& identity, int rank,
                           int world_size, bool copy);

// The bytes of the rank file of `snapshot`, handed to `sink` piece by piece
// as they are made (a tensor's bytes straight from the snapshot, without a
// copy of the whole file in memory); `layout` gets its layout's JSON
// (layout_json). Touches nothing but the snapshot (any thread may call it).
void write_rank_file_bytes(const RankSnapshot& snapshot, std::string& layout, const Sink& sink);

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
