#include "rng/rng_tracker.h"
#include "rng/rng_state_io.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "runtime/context.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

TEST(RngTracker, DuplicateNameOrSeedIsAnError) {
  RNGStatesTracker tracker;
  tracker.add("a", 1);
  EXPECT_THAT(error_of<Error>([&] { tracker.add("a", 2); }),
              HasSubstr("a state named 'a' exists already"));
  EXPECT_THAT(error_of<Error>([&] { tracker.add("b", 1); }),
              HasSubstr("seed 1 is used by state 'a' already"));
  EXPECT_THAT(error_of<Error>([&] { auto g = tracker.fork("c"); }),
              HasSubstr("no state named 'c' (known: a)"));
  tracker.reset();
  tracker.add("a", 1);  // allowed again after reset
}

TEST(RngTracker, ForkDrawsFromTheNamedStateAndRestoresTheDefault) {
  RNGStatesTracker tracker;
  torch::manual_seed(5);
  tracker.add("s", 99);
  at::Tensor inside;
  {
    auto guard = tracker.fork("s");
    inside = torch::rand({8});
  }
  at::Tensor after = torch::rand({8});
  torch::manual_seed(99);
  EXPECT_TRUE(torch::equal(inside, torch::rand({8})));  // the state was seeded with 99
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(after, torch::rand({8})));  // the default stream was untouched
}

TEST(RngTracker, NestedForksBehaveLikeUnnested) {
  auto draws = [](bool nested) {
    RNGStatesTracker tracker;
    torch::manual_seed(1);
    tracker.add("a", 10);
    tracker.add("b", 20);
    std::vector<at::Tensor> out;
    if (nested) {
      auto ga = tracker.fork("a");
      out.push_back(torch::rand({3}));  // a
      {
        auto gb = tracker.fork("b");
        out.push_back(torch::rand({3}));  // b
        auto ga2 = tracker.fork("a");
        out.push_back(torch::rand({3}));  // a continues
      }
      out.push_back(torch::rand({3}));  // a continues
    } else {
      { auto g = tracker.fork("a"); out.push_back(torch::rand({3})); }
      { auto g = tracker.fork("b"); out.push_back(torch::rand({3})); }
      { auto g = tracker.fork("a"); out.push_back(torch::rand({3})); }
      { auto g = tracker.fork("a"); out.push_back(torch::rand({3})); }
    }
    out.push_back(torch::rand({3}));  // default
    return out;
  };
  auto nested = draws(true), flat = draws(false);
  ASSERT_EQ(nested.size(), flat.size());
  for (size_t i = 0; i < nested.size(); ++i) EXPECT_TRUE(torch::equal(nested[i], flat[i])) << i;
}

TEST(RngTracker, GetAndSetStatesRoundTrip) {
  RNGStatesTracker tracker;
  tracker.add("s", 3);
  auto saved = tracker.get_states();
  at::Tensor first;
  { auto g = tracker.fork("s"); first = torch::rand({4}); }
  tracker.set_states(saved);
  { auto g = tracker.fork("s"); EXPECT_TRUE(torch::equal(first, torch::rand({4}))); }
  auto g = tracker.fork("s");
  EXPECT_THAT(error_of<Error>([&] { tracker.set_states(saved); }),
              HasSubstr("set_states() inside a fork (of 's')"));
}

TEST(RngTracker, ModelParallelSeeds) {
  for (int tp_rank : {0, 1, 3}) {
    model_parallel_manual_seed(1000, tp_rank);
    at::Tensor default_draw = torch::rand({4});
    at::Tensor tracked;
    { auto g = get_rng_tracker().fork(); tracked = torch::rand({4}); }
    torch::manual_seed(1000);
    EXPECT_TRUE(torch::equal(default_draw, torch::rand({4})));
    torch::manual_seed(1000 + 2718 + tp_rank);
    EXPECT_TRUE(torch::equal(tracked, torch::rand({4}))) << "tp_rank " << tp_rank;
  }
}

TEST(RngTracker, CaptureAndRestoreEverything) {
  model_parallel_manual_seed(11, 0);
  RngSnapshot snap = capture_rng();
  at::Tensor a = torch::rand({3});
  at::Tensor b;
  { auto g = get_rng_tracker().fork(); b = torch::rand({3}); }
  restore_rng(snap);
  EXPECT_TRUE(torch::equal(a, torch::rand({3})));
  { auto g = get_rng_tracker().fork(); EXPECT_TRUE(torch::equal(b, torch::rand({3}))); }
}

// Each context has its own tracker: seeding one leaves the other's states
// (and the process default's) alone, and capture/restore act on the current one.
TEST(RngTracker, EachContextHasItsOwnTracker) {
  model_parallel_manual_seed(5, 0);  // the process default's tracker
  const auto outside = get_rng_tracker().get_states();
  auto a = Context::create();
  auto b = Context::create();
  {
    ContextScope scope(a);
    EXPECT_FALSE(get_rng_tracker().has(kModelParallelRng)) << "a new context starts empty";
    model_parallel_manual_seed(100, 0);
    get_rng_tracker().add("only-in-a", 7);
  }
  {
    ContextScope scope(b);
    EXPECT_FALSE(get_rng_tracker().has("only-in-a"));
    model_parallel_manual_seed(200, 1);
  }
  // Each tracker draws from its own seed.
  auto tracked_draw = [](const std::shared_ptr<Context>& context) {
    ContextScope scope(context);
    auto guard = get_rng_tracker().fork();
    return torch::rand({4});
  };
  const at::Tensor from_a = tracked_draw(a);
  const at::Tensor from_b = tracked_draw(b);
  torch::manual_seed(100 + 2718);
  EXPECT_TRUE(torch::equal(from_a, torch::rand({4})));
  torch::manual_seed(200 + 2718 + 1);
  EXPECT_TRUE(torch::equal(from_b, torch::rand({4})));
  // The process default's tracker did not move, and has no state of a's.
  EXPECT_FALSE(get_rng_tracker().has("only-in-a"));
  const auto now = get_rng_tracker().get_states();
  ASSERT_EQ(now.size(), outside.size());
  EXPECT_TRUE(torch::equal(now.at(kModelParallelRng).cpu, outside.at(kModelParallelRng).cpu));

  // A snapshot taken in a restores a's states, not b's.
  RngSnapshot snapshot;
  at::Tensor after_snapshot;
  {
    ContextScope scope(a);
    snapshot = capture_rng();
    auto guard = get_rng_tracker().fork();
    after_snapshot = torch::rand({4});  // a's state moves on
  }
  const auto b_before = [&] {
    ContextScope scope(b);
    return get_rng_tracker().get_states();
  }();
  {
    ContextScope scope(a);
    restore_rng(snapshot);
  }
  EXPECT_TRUE(torch::equal(tracked_draw(a), after_snapshot)) << "a's state was put back";
  ContextScope scope(b);
  EXPECT_TRUE(torch::equal(get_rng_tracker().get_states().at(kModelParallelRng).cpu,
                           b_before.at(kModelParallelRng).cpu))
      << "b's state was left alone";
}

TEST(RngTracker, ScopesNestAndTheInnermostWins) {
  auto a = Context::create();
  auto b = Context::create();
  RNGStatesTracker* outer = &get_rng_tracker();
  {
    ContextScope sa(a);
    RNGStatesTracker* in_a = &get_rng_tracker();
    EXPECT_NE(in_a, outer);
    {
      ContextScope sb(b);
      EXPECT_NE(&get_rng_tracker(), in_a);
      EXPECT_EQ(&Context::current(), b.get());
    }
    EXPECT_EQ(&get_rng_tracker(), in_a);
    ContextScope none(nullptr);  // installs nothing
    EXPECT_EQ(&get_rng_tracker(), in_a);
  }
  EXPECT_EQ(&get_rng_tracker(), outer);
  EXPECT_EQ(&Context::current(), Context::process_default().get());
}

// The snapshot through an archive's bytes and back, as a save and a resume do.
RngSnapshot round_trip(const RngSnapshot& snapshot) {
  torch::serialize::OutputArchive out;
  write_rng_snapshot(out, snapshot);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  return read_rng_snapshot(in);
}

void expect_same_states(const GeneratorStates& a, const GeneratorStates& b, const std::string& what) {
  ASSERT_EQ(a.cpu.defined(), b.cpu.defined()) << what << " cpu";
  if (a.cpu.defined()) {
    EXPECT_TRUE(torch::equal(a.cpu, b.cpu)) << what << " cpu";
  }
  ASSERT_EQ(a.cuda.defined(), b.cuda.defined()) << what << " cuda";
  if (a.cuda.defined()) {
    EXPECT_TRUE(torch::equal(a.cuda.cpu(), b.cuda.cpu())) << what << " cuda";
  }
}

void expect_same_snapshot(const RngSnapshot& a, const RngSnapshot& b) {
  expect_same_states(a.defaults, b.defaults, "default generators");
  ASSERT_EQ(a.tracker.size(), b.tracker.size());
  for (const auto& [name, states] : a.tracker) {
    ASSERT_TRUE(b.tracker.count(name)) << name;
    expect_same_states(states, b.tracker.at(name), "tracker state " + name);
  }
}

TEST(RngSnapshotIo, EveryStateSurvivesTheArchiveCudaPartsIncluded) {
  model_parallel_manual_seed(3, 1);
  get_rng_tracker().add("data-rng", 77);
  torch::rand({5});
  RngSnapshot snapshot = capture_rng();
  expect_same_snapshot(snapshot, round_trip(snapshot));

  // The CUDA parts as a GPU run has them (state bytes of a CUDA generator,
  // here stand-ins of that form): written, and read back, for every stream.
  RngSnapshot with_cuda = snapshot;
  with_cuda.defaults.cuda = torch::arange(16, torch::kByte);
  int k = 0;
  for (auto& [name, states] : with_cuda.tracker) states.cuda = torch::arange(16, torch::kByte) + ++k;
  RngSnapshot loaded = round_trip(with_cuda);
  expect_same_snapshot(with_cuda, loaded);

  // Restoring what was read continues every stream where it stopped.
  at::Tensor next = torch::rand({8});
  at::Tensor next_tracked;
  {
    auto guard = get_rng_tracker().fork("data-rng");
    next_tracked = torch::rand({8});
  }
  restore_rng(round_trip(snapshot));
  EXPECT_TRUE(torch::equal(next, torch::rand({8})));
  {
    auto guard = get_rng_tracker().fork("data-rng");
    EXPECT_TRUE(torch::equal(next_tracked, torch::rand({8})));
  }
  // Where a GPU is present, its generator continues bitwise too.
  if (capture_default_generators().cuda.defined()) {
    RngSnapshot now = capture_rng();
    at::Tensor gpu_next = torch::rand({8}, torch::kCUDA);
    restore_rng(round_trip(now));
    EXPECT_TRUE(torch::equal(gpu_next, torch::rand({8}, torch::kCUDA)));
  }
}

}  // namespace
}  // namespace remat
