// How a parameter is split across a tensor-parallel group, and which elements
// of the whole tensor each rank's share holds: the one description the
// tensor-parallel layers cut their shards by (layers.h) and saves are
// re-sliced by at another tensor-parallel size (engine/save/reslice.h).
//
//   kColumn      dim 0 (a linear's output features, weight rows and bias), in
//                `stride` equal blocks each split on its own (a fused q | k | v
//                projection: stride 3), so a rank holds its share of every
//                block, one after the other.
//   kRow         dim 1 (a linear's input features, weight columns).
//   kVocabulary  dim 0 of an embedding (vocabulary rows).
//   kReplicated  every rank holds the whole tensor.
//
// Shares may be uneven: of each block of size / stride along `dim`, rank r of
// `parts` holds partition_range(size / stride, parts, r) (mappings.h).
//
//   TensorSplit qkv{SplitKind::kColumn, 0, 3, {48, 16}};
//   at::Tensor mine = share_of(full, qkv, 2, 1);          // [24, 16]: rows 8-15, 24-31, 40-47
//   at::Tensor where = full_indices(qkv, 2, 1, 0, 16);   // those elements' flat indices in `full`
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace remat::parallel {

enum class SplitKind { kReplicated, kColumn, kRow, kVocabulary };

// "replicated", "column", "row", "vocabulary"; and back (nullopt for another name).
const char* split_kind_name(SplitKind kind);
std::optional<SplitKind> split_kind_from_name(const std::string& name);

struct TensorSplit {
  SplitKind kind = SplitKind::kReplicated;
  int64_t dim = 0;                  // the dimension split (column, vocabulary: 0; row: 1)
  int64_t stride = 1;               // blocks along `dim`, each split on its own
  std::vector<int64_t> full_sizes;  // the whole tensor's shape

  static TensorSplit replicated(std::vector<int64_t> sizes) {
    return {SplitKind::kReplicated, 0, 1, std::move(sizes)};
  }
  bool operator==(const TensorSplit& o) const {
    return kind == o.kind && dim == o.dim && stride == o.stride && full_sizes == o.full_sizes;
  }
  bool operator!=(const TensorSplit& o) const { return !(*this == o); }
};

// An Error unless `split` is consistent: `dim` within the shape, the size
// along it a multiple of `stride` (a replicated split: anything).
void check_split(const TensorSplit& split);

// The shape of rank `rank`'s share when split over `parts` ranks.
std::vector<int64_t> share_sizes(const TensorSplit& split, int parts, int rank);

// Rank `rank`'s share of `full` (whose shape is split.full_sizes): a view
// where it is one piece, else the pieces concatenated.
at::Tensor share_of(const at::Tensor& full, const TensorSplit& split, int parts, int rank);

// For `length` elements from `offset` of rank `rank`'s flattened share, their
// indices in the flattened whole tensor (int64).
at::Tensor full_indices(const TensorSplit& split, int parts, int rank, int64_t offset, int64_t length);

// For int64 indices into the flattened whole tensor, where rank `rank`'s
// flattened share holds each element, -1 where it does not hold it.
at::Tensor share_indices(const TensorSplit& split, int parts, int rank, const at::Tensor& full_index);

}  // namespace remat::parallel
