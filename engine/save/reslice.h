// The re-slicing plan of a resume: which saved rank files a rank reads and
// which elements of which saved tensor fill which of its own tensors, at
// another data-parallel size, ZeRO stage or tensor-parallel size. Pure: it
// reads only the manifest's account of the save (save::Manifest) and this
// rank's TrainShards (their layout, splits and ranks, not their values), no
// file and no saved tensor, so it is tested without either
// (engine/save/reslice_test.cc).
//
// Internal to engine/: only the save format (engine/save/) and its tests
// include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/save/types.h"

namespace remat::save {

// Elements to copy from a saved tensor into one of this rank's: `length`
// elements of tensor `source` of manifest file `file` from `source_offset`
// (flattened) into this rank's tensor `target` from `target_offset`.
struct Copy {
  size_t file, source;
  int64_t source_offset;
  size_t target;
  int64_t target_offset, length;
};

// The saved files this rank reads from (indices into manifest.files), in the
// order their copies are preferred: first the one at this rank's tensor- and
// data-parallel ranks modulo the saved sizes (its random state is taken),
// then the others of that tensor-parallel rank, then (at another
// tensor-parallel size) every other file. A manifest that lists no file at
// that first place is a ConfigError naming `manifest_path`.
std::vector<size_t> files_to_read(const Manifest& manifest, const TrainShards& shards,
                                  const std::string& manifest_path);

// The copies that fill every element of this rank's tensors from `files`
// (files_to_read; the first file holding an element provides it). At the
// saved tensor-parallel size a parameter's share is indexed alike in the
// save and here; at another one each element is found through its index in
// the whole parameter (both splits). Consecutive elements from one saved
// tensor make one copy. An element no file holds is a ConfigError naming
// the save in `folder` and the parameter.
std::vector<Copy> plan_copies(const Manifest& manifest, const TrainShards& shards, const std::vector<size_t>& files,
                              const std::string& folder);

}  // namespace remat::save
