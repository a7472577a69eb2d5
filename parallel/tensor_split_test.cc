// The split description against the shards it describes: for each kind, an
// uneven and a stride split, every rank of 1 to 5 ranks, the share cut by
// share_of and the indices full_indices / share_indices give agree element
// by element, and the ranks' shares cover the whole tensor exactly once.
#include "parallel/tensor_split.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::parallel {
namespace {

int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

TEST(TensorSplit, IndicesMatchTheSharesForEveryKindAndRank) {
  const std::vector<TensorSplit> splits = {
      {SplitKind::kColumn, 0, 3, {12, 5}},   // q | k | v, blocks of 4
      {SplitKind::kColumn, 0, 3, {9}},       // its bias, blocks of 3
      {SplitKind::kColumn, 0, 1, {7, 3}},    // uneven rows
      {SplitKind::kRow, 1, 1, {4, 7}},       // uneven columns
      {SplitKind::kVocabulary, 0, 1, {31, 4}},
      TensorSplit::replicated({3, 2}),
  };
  for (const auto& split : splits) {
    const int64_t n = numel_of(split.full_sizes);
    const at::Tensor whole = at::arange(n, at::kLong).view(split.full_sizes);
    for (int parts = 1; parts <= 5; ++parts) {
      at::Tensor holders = at::zeros({n}, at::kLong);
      for (int rank = 0; rank < parts; ++rank) {
        const std::string what = str(split_kind_name(split.kind), " ", c10::IntArrayRef(split.full_sizes),
                                     " stride ", split.stride, ", rank ", rank, " of ", parts);
        const at::Tensor share = share_of(whole, split, parts, rank).reshape({-1});
        EXPECT_EQ(share_of(whole, split, parts, rank).sizes().vec(), share_sizes(split, parts, rank)) << what;
        EXPECT_TRUE(at::equal(full_indices(split, parts, rank, 0, share.numel()), share)) << what;
        if (share.numel() > 2) {  // a piece from the middle
          EXPECT_TRUE(at::equal(full_indices(split, parts, rank, 1, share.numel() - 2),
                                share.narrow(0, 1, share.numel() - 2))) << what;
        }
        const at::Tensor where = share_indices(split, parts, rank, at::arange(n, at::kLong));
        const at::Tensor held = where.ge(0);
        EXPECT_EQ(held.sum().item<int64_t>(), share.numel()) << what;
        // Each held element sits where the share has it.
        EXPECT_TRUE(at::equal(share.index_select(0, where.masked_select(held)),
                              at::arange(n, at::kLong).masked_select(held))) << what;
        holders.add_(held.to(at::kLong));
      }
      const int64_t copies = split.kind == SplitKind::kReplicated ? parts : 1;
      EXPECT_TRUE(holders.eq(copies).all().item<bool>())
          << split_kind_name(split.kind) << " over " << parts << ": " << holders;
    }
  }
}

TEST(TensorSplit, InconsistentSplitsAreNamed) {
  using remat::testing::error_of;
  EXPECT_THAT(error_of<Error>([] { check_split({SplitKind::kColumn, 0, 3, {10, 2}}); }),
              ::testing::HasSubstr("size 10 along dim 0 is not a multiple of stride 3"));
  EXPECT_THAT(error_of<Error>([] { check_split({SplitKind::kRow, 1, 1, {10}}); }),
              ::testing::HasSubstr("row split along dim 1 of a [10] tensor"));
  EXPECT_THAT(error_of<Error>([] { share_of(at::zeros({4, 2}), {SplitKind::kRow, 1, 1, {2, 4}}, 2, 0); }),
              ::testing::HasSubstr("a [4, 2] tensor where the split describes [2, 4]"));
  for (SplitKind kind : {SplitKind::kReplicated, SplitKind::kColumn, SplitKind::kRow, SplitKind::kVocabulary}) {
    EXPECT_EQ(split_kind_from_name(split_kind_name(kind)), kind);
  }
  EXPECT_FALSE(split_kind_from_name("diagonal").has_value());
}

}  // namespace
}  // namespace remat::parallel
