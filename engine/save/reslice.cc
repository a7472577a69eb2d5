#include "engine/save/reslice.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <utility>

#include "runtime/error.h"

namespace remat::save {

std::vector<size_t> files_to_read(const Manifest& manifest, const TrainShards& shards,
                                  const std::string& manifest_path) {
  const int64_t source_tp = shards.tp_rank % manifest.tp_size;
  const int64_t source_dp = shards.dp_rank % manifest.dp_size;
  std::vector<size_t> candidates;
  for (size_t f = 0; f < manifest.files.size(); ++f) {
    const auto& e = manifest.files[f];
    if (e.tp_rank == source_tp && e.dp_rank == source_dp) candidates.insert(candidates.begin(), f);
    else if (e.tp_rank == source_tp) candidates.push_back(f);
  }
  if (candidates.empty() || manifest.files[candidates[0]].dp_rank != source_dp) {
    throw ConfigError(str("resume: '", manifest_path, "' lists no file of tensor-parallel rank ", source_tp,
                          " and data-parallel rank ", source_dp, "; the manifest was edited or damaged"));
  }
  if (manifest.tp_size != shards.tp_size) {
    for (size_t f = 0; f < manifest.files.size(); ++f) {
      if (manifest.files[f].tp_rank != source_tp) candidates.push_back(f);
    }
  }
  return candidates;
}

namespace {

// Where the saved segments of each parameter lie.
struct Source {
  size_t file, tensor;
  int64_t param_offset, offset, length;
};
std::map<std::string, std::vector<Source>> sources_by_name(const Manifest& manifest,
                                                           const std::vector<size_t>& candidates) {
  std::map<std::string, std::vector<Source>> by_name;
  for (size_t f : candidates) {
    const auto& tensors = manifest.files[f].tensors;
    for (size_t j = 0; j < tensors.size(); ++j) {
      for (const auto& s : tensors[j].segments) by_name[s.name].push_back({f, j, s.param_offset, s.shard_offset, s.length});
    }
  }
  return by_name;
}

// The same tensor-parallel size: a parameter's flattened share is indexed
// alike in the save and here, so each of this rank's segments is filled by
// ranges of the saved segments of its tensor-parallel rank (the first file
// holding an element provides it).
std::vector<Copy> same_split_copies(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                                    const std::vector<size_t>& candidates) {
  const auto by_name = sources_by_name(manifest, candidates);
  std::vector<Copy> copies;
  for (size_t i = 0; i < shards.layout.size(); ++i) {
    for (const auto& seg : shards.layout[i].segments) {
      std::vector<std::pair<int64_t, int64_t>> open{{seg.param_offset, seg.param_offset + seg.length}};
      auto found = by_name.find(seg.name);
      if (found != by_name.end()) {
        for (const auto& src : found->second) {
          std::vector<std::pair<int64_t, int64_t>> still;
          for (const auto& [lo, hi] : open) {
            const int64_t a = std::max(lo, src.param_offset), b = std::min(hi, src.param_offset + src.length);
            if (a >= b) {
              still.emplace_back(lo, hi);
              continue;
            }
            copies.push_back({src.file, src.tensor, src.offset + a - src.param_offset, i,
                              seg.shard_offset + a - seg.param_offset, b - a});
            if (lo < a) still.emplace_back(lo, a);
            if (b < hi) still.emplace_back(b, hi);
          }
          open = std::move(still);
          if (open.empty()) break;
        }
      }
      if (!open.empty()) {
        throw ConfigError(str("resume: the save in '", folder, "' holds no values for elements [", open[0].first,
                              ", ", open[0].second, ") of parameter '", seg.name, "' (tensor-parallel rank ",
                              shards.tp_rank, "): it was made for another model; use the config it was made with"));
      }
    }
  }
  return copies;
}

// Where each of a chunk of elements lies in the save: `source` indexes
// `origins` (a saved file and tensor), `offset` is the element's place in
// that tensor, `filled` whether any saved file holds it.
struct Located {
  at::Tensor source, offset, filled;
  std::vector<std::pair<size_t, size_t>> origins;  // (file, tensor)
};

// Finds the `whole` indices (into the whole parameter) in the saved shares
// of the tensor-parallel ranks `tp_order` (the first that holds an element
// provides it), then in those ranks' saved segments `sources`.
Located locate(const Manifest& manifest, const parallel::TensorSplit& saved_split, const at::Tensor& whole,
               const std::vector<int64_t>& tp_order, const std::vector<Source>& sources) {
  const int64_t n = whole.numel();
  Located out{at::full({n}, -1, at::kLong), at::zeros({n}, at::kLong), at::zeros({n}, at::kBool), {}};
  for (int64_t t : tp_order) {
    const at::Tensor theirs_at = parallel::share_indices(saved_split, static_cast<int>(manifest.tp_size),
                                                         static_cast<int>(t), whole);
    at::Tensor open = theirs_at.ge(0).logical_and(out.filled.logical_not());
    for (const auto& src : sources) {
      if (manifest.files[src.file].tp_rank != t || !open.any().item<bool>()) continue;
      const at::Tensor here = open.logical_and(theirs_at.ge(src.param_offset))
                                  .logical_and(theirs_at.lt(src.param_offset + src.length));
      if (!here.any().item<bool>()) continue;
      out.source.masked_fill_(here, static_cast<int64_t>(out.origins.size()));
      out.offset = at::where(here, theirs_at - src.param_offset + src.offset, out.offset);
      out.origins.emplace_back(src.file, src.tensor);
      open.logical_and_(here.logical_not());
      out.filled.logical_or_(here);
    }
  }
  return out;
}

// One copy per run of located elements from the same saved tensor at
// consecutive offsets, into tensor `target` from `target_offset`.
void append_runs(const Located& located, size_t target, int64_t target_offset, std::vector<Copy>& copies) {
  const int64_t n = located.source.numel();
  at::Tensor breaks = at::ones({n}, at::kBool);
  if (n > 1) {
    breaks.narrow(0, 1, n - 1)
        .copy_(located.source.narrow(0, 1, n - 1).ne(located.source.narrow(0, 0, n - 1))
                   .logical_or(located.offset.narrow(0, 1, n - 1).ne(located.offset.narrow(0, 0, n - 1) + 1)));
  }
  const at::Tensor starts = breaks.nonzero().reshape({-1}).contiguous();
  const auto start = starts.accessor<int64_t, 1>();
  const auto from = located.source.accessor<int64_t, 1>();
  const auto at_offset = located.offset.accessor<int64_t, 1>();
  for (int64_t r = 0; r < starts.numel(); ++r) {
    const int64_t a = start[r], b = r + 1 < starts.numel() ? start[r + 1] : n;
    const auto [file, tensor] = located.origins[static_cast<size_t>(from[a])];
    copies.push_back({file, tensor, at_offset[a], target, target_offset + a, b - a});
  }
}

// Another tensor-parallel size: each element of this rank's segments is
// found by its index in the whole parameter (this rank's split), then in the
// share of each saved tensor-parallel rank (the saved split), then in that
// rank's saved segments; runs of consecutive elements become one copy. Index
// tensors (a few int64 per element) are built for at most kChunk elements at
// a time.
std::vector<Copy> resliced_copies(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                                  const std::vector<size_t>& candidates) {
  constexpr int64_t kChunk = int64_t{1} << 22;
  const auto by_name = sources_by_name(manifest, candidates);
  const std::map<std::string, parallel::TensorSplit> mine(shards.splits.begin(), shards.splits.end());
  const std::map<std::string, parallel::TensorSplit> theirs(manifest.splits.begin(), manifest.splits.end());
  // Saved tensor-parallel ranks in the order their copies are preferred
  // (a replicated parameter is read from the first).
  std::vector<int64_t> tp_order;
  for (size_t f : candidates) {
    const int64_t t = manifest.files[f].tp_rank;
    if (std::find(tp_order.begin(), tp_order.end(), t) == tp_order.end()) tp_order.push_back(t);
  }
  std::vector<Copy> copies;
  for (size_t i = 0; i < shards.layout.size(); ++i) {
    for (const auto& seg : shards.layout[i].segments) {
      auto my_split = mine.find(seg.name);
      auto saved_split = theirs.find(seg.name);
      auto found = by_name.find(seg.name);
      if (my_split == mine.end() || saved_split == theirs.end() || found == by_name.end()) {
        throw ConfigError(str("resume: the save in '", folder, "' holds no values for parameter '", seg.name,
                              "' (tensor-parallel rank ", shards.tp_rank, " of ", shards.tp_size,
                              "): it was made for another model; use the config it was made with"));
      }
      for (int64_t done = 0; done < seg.length; done += kChunk) {
        const int64_t n = std::min(kChunk, seg.length - done);
        const at::Tensor whole = parallel::full_indices(my_split->second, shards.tp_size, shards.tp_rank,
                                                        seg.param_offset + done, n);
        const Located located = locate(manifest, saved_split->second, whole, tp_order, found->second);
        if (!located.filled.all().item<bool>()) {
          const int64_t first = located.filled.logical_not().nonzero()[0][0].item<int64_t>();
          throw ConfigError(str("resume: the save in '", folder, "' holds no values for element ",
                                whole[first].item<int64_t>(), " of parameter '", seg.name, "' (whole shape ",
                                c10::IntArrayRef(my_split->second.full_sizes), "), needed by tensor-parallel rank ",
                                shards.tp_rank, " of ", shards.tp_size, ": no saved file of its ", manifest.tp_size,
                                " tensor-parallel ranks holds it; the save is incomplete or was made for "
                                "another model"));
        }
        append_runs(located, i, seg.shard_offset + done, copies);
      }
    }
  }
  return copies;
}

}  // namespace

std::vector<Copy> plan_copies(const Manifest& manifest, const TrainShards& shards, const std::vector<size_t>& files,
                              const std::string& folder) {
  return manifest.tp_size != shards.tp_size ? resliced_copies(folder, manifest, shards, files)
                                            : same_split_copies(folder, manifest, shards, files);
}

}  // namespace remat::save
