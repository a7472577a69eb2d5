// The re-slicing plan without a single file: saves described by their
// manifests only, their values made up from whole tensors (share_of, the cut
// the tensor-parallel layers make), the plan applied in memory and every
// element of every resumed tensor compared with the share it must hold.
#include "engine/save/reslice.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "parallel/tensor_split.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::save {
namespace {

using parallel::ShardLayout;
using parallel::SplitKind;
using parallel::TensorSplit;
using ::testing::HasSubstr;

// A model of whole parameters with their splits; element values are
// 1000 * (parameter number + 1) + the element's flat index in the whole
// parameter, so a wrong element is told from a right one anywhere.
struct Model {
  Splits splits;
  std::vector<at::Tensor> whole;

  void add(const std::string& name, TensorSplit split) {
    const int64_t numel = std::accumulate(split.full_sizes.begin(), split.full_sizes.end(), int64_t{1},
                                          std::multiplies<int64_t>());
    whole.push_back(at::arange(numel, at::kLong).add(1000 * static_cast<int64_t>(whole.size() + 1))
                        .reshape(split.full_sizes));
    splits.emplace_back(name, std::move(split));
  }
  size_t index(const std::string& name) const {
    for (size_t i = 0; i < splits.size(); ++i) {
      if (splits[i].first == name) return i;
    }
    ADD_FAILURE() << "no parameter " << name;
    return 0;
  }
  // Parameter `name`'s share at tensor-parallel rank `rank` of `parts`, flattened.
  at::Tensor share(const std::string& name, int parts, int rank) const {
    const size_t i = index(name);
    return parallel::share_of(whole[i], splits[i].second, parts, rank).contiguous().reshape({-1});
  }
  int64_t share_numel(const std::string& name, int parts, int rank) const { return share(name, parts, rank).numel(); }
};

// Stage 0: one tensor per parameter, holding its whole share.
std::vector<ShardLayout> per_parameter(const Model& model, int tp_size, int tp_rank) {
  std::vector<ShardLayout> out;
  for (const auto& [name, split] : model.splits) {
    out.push_back({{{name, 0, 0, model.share_numel(name, tp_size, tp_rank)}}});
  }
  return out;
}

// ZeRO's flat shards: the shares of every parameter one after the other,
// cut at `bounds` (bounds[r] to bounds[r + 1] is data-parallel rank r's
// single tensor); ranges may be uneven.
ShardLayout flat_shard(const Model& model, int tp_size, int tp_rank, int64_t lo, int64_t hi) {
  ShardLayout layout;
  int64_t at = 0;
  for (const auto& [name, split] : model.splits) {
    const int64_t n = model.share_numel(name, tp_size, tp_rank);
    const int64_t a = std::max(lo, at), b = std::min(hi, at + n);
    if (a < b) layout.segments.push_back({name, a - at, a - lo, b - a});
    at += n;
  }
  return layout;
}

// A save of tensor-parallel size `tp` x data-parallel size `dp`, file
// r = dp_rank * tp + tp_rank holding `layouts(tp_rank, dp_rank)`.
template <typename Layouts>
Manifest save_of(const Model& model, int tp, int dp, Layouts layouts) {
  Manifest m;
  m.format = kFormat;
  m.tp_size = tp;
  m.dp_size = dp;
  m.world_size = tp * dp;
  m.splits = model.splits;
  for (int d = 0; d < dp; ++d) {
    for (int t = 0; t < tp; ++t) {
      Manifest::File f;
      f.name = str("rank_", d * tp + t, ".pt");
      f.tp_rank = t;
      f.dp_rank = d;
      f.tensors = layouts(t, d);
      m.files.push_back(std::move(f));
    }
  }
  return m;
}

TrainShards shards_of(const Model& model, int tp, int tp_rank, int dp, int dp_rank, std::vector<ShardLayout> layout) {
  TrainShards s;
  s.layout = std::move(layout);
  s.splits = model.splits;
  s.tp_size = tp;
  s.tp_rank = tp_rank;
  s.dp_size = dp;
  s.dp_rank = dp_rank;
  return s;
}

// The values `layout` holds at tensor-parallel rank `tp_rank` of `tp`
// (-1 where no segment lies).
std::vector<at::Tensor> values_of(const Model& model, int tp, int tp_rank, const std::vector<ShardLayout>& layout) {
  std::vector<at::Tensor> out;
  for (const auto& t : layout) {
    int64_t size = 0;
    for (const auto& s : t.segments) size = std::max(size, s.shard_offset + s.length);
    at::Tensor v = at::full({size}, -1, at::kLong);
    for (const auto& s : t.segments) {
      v.narrow(0, s.shard_offset, s.length).copy_(model.share(s.name, tp, tp_rank).narrow(0, s.param_offset, s.length));
    }
    out.push_back(v);
  }
  return out;
}

// Plans this rank's resume from `saved`, applies it to values made up for
// the saved files and checks every element of every tensor; returns the plan.
std::vector<Copy> check_plan(const Model& model, const Manifest& saved, const TrainShards& shards) {
  const std::vector<size_t> files = files_to_read(saved, shards, "<manifest>");
  const std::vector<Copy> copies = plan_copies(saved, shards, files, "<save>");
  std::vector<std::vector<at::Tensor>> saved_values;
  for (const auto& f : saved.files) {
    saved_values.push_back(values_of(model, static_cast<int>(saved.tp_size), static_cast<int>(f.tp_rank), f.tensors));
  }
  const std::vector<at::Tensor> expected = values_of(model, shards.tp_size, shards.tp_rank, shards.layout);
  std::vector<at::Tensor> resumed;
  for (const auto& t : expected) resumed.push_back(at::full_like(t, -2));
  for (const auto& c : copies) {
    EXPECT_NE(std::find(files.begin(), files.end(), c.file), files.end()) << "a copy from a file not read";
    resumed[c.target].narrow(0, c.target_offset, c.length)
        .copy_(saved_values[c.file][c.source].narrow(0, c.source_offset, c.length));
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(at::equal(resumed[i], expected[i])) << "tensor " << i << ": resumed " << resumed[i]
                                                    << " expected " << expected[i];
  }
  return copies;
}

bool same(const Copy& a, const Copy& b) {
  return a.file == b.file && a.source == b.source && a.source_offset == b.source_offset && a.target == b.target &&
         a.target_offset == b.target_offset && a.length == b.length;
}

void expect_copies(const std::vector<Copy>& got, const std::vector<Copy>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(same(got[i], want[i])) << "copy " << i << ": {" << got[i].file << ", " << got[i].source << ", "
                                       << got[i].source_offset << ", " << got[i].target << ", "
                                       << got[i].target_offset << ", " << got[i].length << "}";
  }
}

Model flat_model() {
  Model m;
  m.add("w", TensorSplit::replicated({10}));
  return m;
}

// dp 2 -> 3 (ZeRO's flat shards, uneven 4 + 3 + 3): rank 1 reads its own
// place modulo 2 (file 1) first, then file 0 for the element it lacks.
TEST(ReslicePlan, DataParallelTwoToThree) {
  const Model model = flat_model();
  const Manifest saved = save_of(model, 1, 2, [&](int t, int d) {
    return std::vector<ShardLayout>{flat_shard(model, 1, t, 5 * d, 5 * d + 5)};
  });
  const int64_t bounds[] = {0, 4, 7, 10};
  for (int r = 0; r < 3; ++r) {
    const TrainShards mine = shards_of(model, 1, 0, 3, r, {flat_shard(model, 1, 0, bounds[r], bounds[r + 1])});
    const std::vector<Copy> copies = check_plan(model, saved, mine);
    if (r == 1) expect_copies(copies, {{1, 0, 0, 0, 1, 2}, {0, 0, 4, 0, 0, 1}});
  }
  EXPECT_EQ(files_to_read(saved, shards_of(model, 1, 0, 3, 2, {}), "m"), (std::vector<size_t>{0, 1}));
}

// Stage 3 -> stage 0 at one rank: two flat shards (one cut inside a
// parameter) become one whole tensor per parameter.
TEST(ReslicePlan, StageThreeShardsToWholeParameters) {
  Model model;
  model.add("a", TensorSplit::replicated({2, 3}));
  model.add("b", TensorSplit::replicated({4}));
  const Manifest saved = save_of(model, 1, 2, [&](int t, int d) {
    return std::vector<ShardLayout>{flat_shard(model, 1, t, 5 * d, 5 * d + 5)};
  });
  const std::vector<Copy> copies = check_plan(model, saved, shards_of(model, 1, 0, 1, 0, per_parameter(model, 1, 0)));
  expect_copies(copies, {{0, 0, 0, 0, 0, 5}, {1, 0, 0, 0, 5, 1}, {1, 0, 1, 1, 0, 4}});
  // And back: whole parameters saved by two data-parallel ranks (each file
  // holds everything) to stage 3 at three ranks.
  const Manifest whole = save_of(model, 1, 2, [&](int t, int) { return per_parameter(model, 1, t); });
  const int64_t bounds[] = {0, 4, 7, 10};
  for (int r = 0; r < 3; ++r) {
    check_plan(model, whole, shards_of(model, 1, 0, 3, r, {flat_shard(model, 1, 0, bounds[r], bounds[r + 1])}));
  }
}

Model tensor_parallel_model() {
  Model m;
  m.add("column", {SplitKind::kColumn, 0, 1, {4, 3}});
  m.add("row", {SplitKind::kRow, 1, 1, {2, 4}});
  m.add("uneven", {SplitKind::kColumn, 0, 1, {3, 2}});      // rows 2 + 1 at size 2
  m.add("qkv", {SplitKind::kColumn, 0, 3, {6, 2}});         // three blocks, each split
  m.add("vocab", {SplitKind::kVocabulary, 0, 1, {5, 2}});   // rows 3 + 2 at size 2
  m.add("norm", TensorSplit::replicated({3}));
  return m;
}

// tp 2 -> 1: each whole parameter gathered from both saved shares; the row
// split's whole rows alternate between the two files.
TEST(ReslicePlan, TensorParallelTwoToOne) {
  const Model model = tensor_parallel_model();
  const Manifest saved = save_of(model, 2, 1, [&](int t, int) { return per_parameter(model, 2, t); });
  const std::vector<Copy> copies = check_plan(model, saved, shards_of(model, 1, 0, 1, 0, per_parameter(model, 1, 0)));
  std::vector<Copy> row;
  for (const auto& c : copies) {
    if (c.target == 1) row.push_back(c);
  }
  // row [2, 4]: rank 0 holds columns 0-1, rank 1 columns 2-3.
  expect_copies(row, {{0, 1, 0, 1, 0, 2}, {1, 1, 0, 1, 2, 2}, {0, 1, 2, 1, 4, 2}, {1, 1, 2, 1, 6, 2}});
}

// tp 1 -> 2 and tp 2 -> 3 (uneven shares), with data-parallel ZeRO shards on
// both sides: every rank of the new layout gets exactly its share.
TEST(ReslicePlan, TensorParallelAcrossSizesWithFlatShards) {
  const Model model = tensor_parallel_model();
  auto total = [&](int tp, int t) {
    int64_t n = 0;
    for (const auto& [name, split] : model.splits) n += model.share_numel(name, tp, t);
    return n;
  };
  for (const auto& [saved_tp, saved_dp, tp, dp] : std::vector<std::array<int, 4>>{{1, 2, 2, 1}, {2, 2, 3, 1},
                                                                                 {2, 1, 1, 3}, {1, 1, 2, 2}}) {
    const Manifest saved = save_of(model, saved_tp, saved_dp, [&](int t, int d) {
      const int64_t n = total(saved_tp, t);
      return std::vector<ShardLayout>{flat_shard(model, saved_tp, t, n * d / saved_dp, n * (d + 1) / saved_dp)};
    });
    for (int t = 0; t < tp; ++t) {
      for (int d = 0; d < dp; ++d) {
        SCOPED_TRACE(str("tp ", saved_tp, " x dp ", saved_dp, " -> tp ", tp, " x dp ", dp, " at (", t, ", ", d, ")"));
        const int64_t n = total(tp, t);
        check_plan(model, saved, shards_of(model, tp, t, dp, d, {flat_shard(model, tp, t, n * d / dp, n * (d + 1) / dp)}));
      }
    }
  }
}

TEST(ReslicePlan, ElementsNoFileHoldsAreNamed) {
  const Model model = flat_model();
  // Only the first data-parallel rank's half is listed for the element range.
  const Manifest saved = save_of(model, 1, 2, [&](int t, int d) {
    return std::vector<ShardLayout>{flat_shard(model, 1, t, 0, d == 0 ? 5 : 3)};
  });
  const TrainShards mine = shards_of(model, 1, 0, 1, 0, {flat_shard(model, 1, 0, 0, 10)});
  const std::vector<size_t> files = files_to_read(saved, mine, "m");
  EXPECT_THAT(remat::testing::error_of<ConfigError>([&] { plan_copies(saved, mine, files, "DIR"); }),
              HasSubstr("resume: the save in 'DIR' holds no values for elements [5, 10) of parameter 'w' "
                        "(tensor-parallel rank 0)"));
  // At another tensor-parallel size the first missing element is named.
  Model tp = tensor_parallel_model();
  Manifest partial = save_of(tp, 2, 1, [&](int t, int) { return per_parameter(tp, 2, t); });
  partial.files[1].tensors[0].segments[0].length = 2;  // "column": rank 1's rows 2-3 cut short
  const TrainShards whole = shards_of(tp, 1, 0, 1, 0, per_parameter(tp, 1, 0));
  EXPECT_THAT(remat::testing::error_of<ConfigError>(
                  [&] { plan_copies(partial, whole, files_to_read(partial, whole, "m"), "DIR"); }),
              HasSubstr("holds no values for element 8 of parameter 'column' (whole shape [4, 3]), needed by "
                        "tensor-parallel rank 0 of 1: no saved file of its 2 tensor-parallel ranks holds it"));
}

TEST(ReslicePlan, AManifestWithoutThisRanksPlaceIsRefused) {
  const Model model = flat_model();
  Manifest saved = save_of(model, 1, 2, [&](int t, int d) {
    return std::vector<ShardLayout>{flat_shard(model, 1, t, 5 * d, 5 * d + 5)};
  });
  saved.files[1].dp_rank = 0;
  EXPECT_THAT(remat::testing::error_of<ConfigError>(
                  [&] { files_to_read(saved, shards_of(model, 1, 0, 2, 1, {}), "DIR/manifest.json"); }),
              HasSubstr("resume: 'DIR/manifest.json' lists no file of tensor-parallel rank 0 and data-parallel rank 1"));
}

}  // namespace
}  // namespace remat::save
