#include "parallel/tensor_split.h"

#include <ATen/ATen.h>

#include "parallel/mappings.h"
#include "runtime/error.h"

namespace remat::parallel {
namespace {

// A split's geometry for one rank: the tensor seen as [outer, size, inner]
// around `dim`, `stride` blocks of `block` along it, the rank holding
// [start, start + length) of each block.
struct Geometry {
  int64_t outer = 1, size = 1, inner = 1, block = 1, stride = 1, start = 0, length = 1;
  int64_t share_size() const { return stride * length; }  // along `dim`
};

Geometry geometry(const TensorSplit& split, int parts, int rank) {
  check_split(split);
  REMAT_CHECK(parts >= 1 && rank >= 0 && rank < parts, "tensor split: rank ", rank, " of ", parts);
  Geometry g;
  if (split.kind == SplitKind::kReplicated || parts == 1 || split.full_sizes.empty()) {
    for (int64_t s : split.full_sizes) g.inner *= s;
    return g;  // the whole tensor as one block every rank holds
  }
  const auto& sizes = split.full_sizes;
  for (int64_t d = 0; d < split.dim; ++d) g.outer *= sizes[d];
  for (size_t d = split.dim + 1; d < sizes.size(); ++d) g.inner *= sizes[d];
  g.size = sizes[split.dim];
  g.stride = split.stride;
  g.block = g.size / g.stride;
  const Range range = partition_range(g.block, parts, rank);
  g.start = range.start;
  g.length = range.length;
  return g;
}

}  // namespace

const char* split_kind_name(SplitKind kind) {
  switch (kind) {
    case SplitKind::kColumn: return "column";
    case SplitKind::kRow: return "row";
    case SplitKind::kVocabulary: return "vocabulary";
    case SplitKind::kReplicated: break;
  }
  return "replicated";
}

std::optional<SplitKind> split_kind_from_name(const std::string& name) {
  for (SplitKind kind : {SplitKind::kReplicated, SplitKind::kColumn, SplitKind::kRow, SplitKind::kVocabulary}) {
    if (name == split_kind_name(kind)) return kind;
  }
  return std::nullopt;
}

void check_split(const TensorSplit& split) {
  for (int64_t s : split.full_sizes) {
    if (s < 0) throw Error(str("tensor split: negative size in ", c10::IntArrayRef(split.full_sizes)));
  }
  if (split.kind == SplitKind::kReplicated) return;
  if (split.dim < 0 || split.dim >= static_cast<int64_t>(split.full_sizes.size())) {
    throw Error(str("tensor split: ", split_kind_name(split.kind), " split along dim ", split.dim, " of a ",
                    c10::IntArrayRef(split.full_sizes), " tensor"));
  }
  if (split.stride < 1 || split.full_sizes[split.dim] % split.stride != 0) {
    throw Error(str("tensor split: size ", split.full_sizes[split.dim], " along dim ", split.dim,
                    " is not a multiple of stride ", split.stride));
  }
}

std::vector<int64_t> share_sizes(const TensorSplit& split, int parts, int rank) {
  const Geometry g = geometry(split, parts, rank);
  std::vector<int64_t> sizes = split.full_sizes;
  if (split.kind != SplitKind::kReplicated && parts > 1 && !sizes.empty()) sizes[split.dim] = g.share_size();
  return sizes;
}

at::Tensor share_of(const at::Tensor& full, const TensorSplit& split, int parts, int rank) {
  if (full.sizes().vec() != split.full_sizes) {
    throw Error(str("share_of: a ", full.sizes(), " tensor where the split describes ",
                    c10::IntArrayRef(split.full_sizes)));
  }
  const Geometry g = geometry(split, parts, rank);
  if (split.kind == SplitKind::kReplicated || parts == 1 || split.full_sizes.empty()) return full;
  std::vector<at::Tensor> pieces;
  for (int64_t s = 0; s < g.stride; ++s) pieces.push_back(full.narrow(split.dim, s * g.block + g.start, g.length));
  return pieces.size() == 1 ? pieces[0] : at::cat(pieces, split.dim);
}

at::Tensor full_indices(const TensorSplit& split, int parts, int rank, int64_t offset, int64_t length) {
  const Geometry g = geometry(split, parts, rank);
  const int64_t share_numel = g.outer * g.share_size() * g.inner;
  if (offset < 0 || length < 0 || offset + length > share_numel) {
    throw Error(str("full_indices: elements [", offset, ", ", offset + length, ") of rank ", rank,
                    "'s share, which has ", share_numel));
  }
  at::Tensor local = at::arange(offset, offset + length, at::kLong);
  if (length == 0 || g.share_size() == g.size) return local;  // empty, or the whole tensor
  // local = (outer * share + c) * inner + rest, c = b * length + w - start
  at::Tensor rest = local.remainder(g.inner);
  at::Tensor row = local.div(g.inner, "floor");
  at::Tensor c = row.remainder(g.share_size());
  at::Tensor outer = row.div(g.share_size(), "floor");
  at::Tensor along = c.div(g.length, "floor").mul(g.block).add(c.remainder(g.length)).add(g.start);
  return outer.mul(g.size).add(along).mul(g.inner).add(rest);
}

at::Tensor share_indices(const TensorSplit& split, int parts, int rank, const at::Tensor& full_index) {
  const Geometry g = geometry(split, parts, rank);
  if (g.share_size() == g.size) return full_index.clone();
  at::Tensor rest = full_index.remainder(g.inner);
  at::Tensor row = full_index.div(g.inner, "floor");
  at::Tensor c = row.remainder(g.size);
  at::Tensor outer = row.div(g.size, "floor");
  at::Tensor w = c.remainder(g.block).sub(g.start);
  at::Tensor held = w.ge(0).logical_and(w.lt(g.length));
  at::Tensor local = outer.mul(g.share_size()).add(c.div(g.block, "floor").mul(g.length).add(w)).mul(g.inner).add(rest);
  return at::where(held, local, at::full_like(local, -1));
}

}  // namespace remat::parallel
