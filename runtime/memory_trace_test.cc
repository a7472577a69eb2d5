#include "runtime/memory_trace.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/error_of.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

MemoryTrackerOptions keeping() {
  MemoryTrackerOptions o;
  o.keep_allocations = true;
  return o;
}

int64_t of(const MemoryTraceSample& s, MemoryCategory c) { return s.bytes[static_cast<size_t>(c)]; }

int64_t sum(const MemoryTraceSample& s) {
  int64_t n = 0;
  for (int64_t b : s.bytes) n += b;
  return n;
}

TEST(MemoryTrace, CategoriesSplitTheTrackersCountAtEverySample) {
  MemoryTracker tracker(keeping());
  at::Tensor weight = at::empty({1000});  // 4000 bytes, named a parameter below
  at::Tensor state;
  {
    MemoryCategoryScope scope(MemoryCategory::kOptimizerState);
    state = at::empty({500});  // 2000 bytes, allocated as optimizer state
  }
  at::Tensor loose = at::empty({100});  // 400 bytes, other
  MemoryTrace trace(tracker, {{weight, MemoryCategory::kParameters}});
  at::Tensor act, grad;
  {
    MemoryCategoryScope scope(MemoryCategory::kSavedActivations);
    act = at::empty({250});  // 1000
    {
      MemoryCategoryScope inner(MemoryCategory::kCommunication);
      at::Tensor buffer = at::empty({50});  // 200, freed at once
    }
  }
  grad = at::empty({300});  // 1200, other until classified
  act = at::Tensor();
  state = at::Tensor();
  classify_memory(grad, MemoryCategory::kGradients);
  grad = at::Tensor();
  trace.stop();
  at::Tensor after = at::empty({64});  // not in the trace

  const auto samples = trace.samples(c10::DeviceType::CPU);
  ASSERT_EQ(samples.size(), 1u + 3 + 4 + 1);  // start, 3 allocations, 4 frees, stop
  for (const auto& s : samples) {
    EXPECT_EQ(sum(s), s.tracked) << "at " << s.t_ns << " ns";
    for (int64_t b : s.bytes) EXPECT_GE(b, 0);
  }
  const auto& first = samples.front();
  EXPECT_EQ(first.tracked, 6400);
  EXPECT_EQ(of(first, MemoryCategory::kParameters), 4000);
  EXPECT_EQ(of(first, MemoryCategory::kOptimizerState), 2000);
  EXPECT_EQ(of(first, MemoryCategory::kOther), 400);
  EXPECT_EQ(of(samples[1], MemoryCategory::kSavedActivations), 1000);
  EXPECT_EQ(of(samples[2], MemoryCategory::kCommunication), 200);
  EXPECT_EQ(of(samples[3], MemoryCategory::kCommunication), 0);
  // The gradient counts as one over its whole life, from its allocation on.
  EXPECT_EQ(of(samples[4], MemoryCategory::kGradients), 1200);
  EXPECT_EQ(of(samples[4], MemoryCategory::kOther), 400);
  EXPECT_EQ(of(samples[6], MemoryCategory::kOptimizerState), 0);  // state freed
  const auto& last = samples.back();
  EXPECT_EQ(last.tracked, 4400);
  EXPECT_EQ(of(last, MemoryCategory::kParameters), 4000);
  EXPECT_EQ(of(last, MemoryCategory::kOther), 400);
  EXPECT_EQ(tracker.current(), 4400 + 256);
}

TEST(MemoryTrace, NeedsATrackerThatKeepsItsAllocationsAndOneTraceAtATime) {
  MemoryTracker plain;
  EXPECT_THAT(error_of<Error>([&] { MemoryTrace trace(plain); }), ::testing::HasSubstr("keep_allocations = true"));
  MemoryTracker tracker(keeping());
  MemoryTrace first(tracker);
  EXPECT_THAT(error_of<Error>([&] { MemoryTrace second(tracker); }),
              ::testing::HasSubstr("another memory trace records in this process"));
  first.stop();
  MemoryTrace again(tracker);  // once stopped, another may start
  EXPECT_TRUE(memory_trace_active());
}

TEST(MemoryTrace, SpansNestOnTheirThreadAndCollectivesEndWhereTheyComplete) {
  EXPECT_FALSE(memory_trace_active());
  { TraceSpan nothing("phase", "before"); }
  EXPECT_EQ(begin_trace_span("collective", "allGather", ""), 0u);
  MemoryTracker tracker(keeping());
  MemoryTrace trace(tracker);
  uint64_t open = 0, waited = 0;
  {
    TraceSpan outer("phase", "backward");
    {
      TraceSpan inner("recompute", "blocks.0");
      waited = begin_trace_span("collective", "allGather", "allGather(seq=0, float[4] cpu)");
    }
    end_trace_span(waited);
    end_trace_span(waited);  // twice: nothing more
    open = begin_trace_span("collective", "reduceScatter", "");
  }
  std::thread([] { TraceSpan other("phase", "elsewhere"); }).join();
  trace.stop();
  end_trace_span(open);  // after the stop: nothing
  const auto spans = trace.spans();
  ASSERT_EQ(spans.size(), 5u);
  std::map<std::string, MemoryTraceSpan> by_name;
  for (const auto& s : spans) by_name[s.name] = s;
  const auto& backward = by_name.at("backward");
  const auto& recompute = by_name.at("blocks.0");
  EXPECT_EQ(recompute.kind, "recompute");
  EXPECT_LE(backward.begin_ns, recompute.begin_ns);
  EXPECT_GE(backward.end_ns, recompute.end_ns);
  EXPECT_EQ(backward.thread, 1);
  EXPECT_EQ(by_name.at("elsewhere").thread, 2);
  EXPECT_TRUE(by_name.at("allGather").async);
  EXPECT_EQ(by_name.at("allGather").detail, "allGather(seq=0, float[4] cpu)");
  EXPECT_LE(by_name.at("allGather").end_ns, backward.end_ns);
  EXPECT_EQ(by_name.at("reduceScatter").detail, "not complete when the trace stopped");
}

TEST(MemoryTrace, TheChromeTraceKeepsThePeakWithinItsSampleCap) {
  MemoryTracker tracker(keeping());
  MemoryTrace trace(tracker);
  std::vector<at::Tensor> held;
  for (int i = 0; i < 3000; ++i) {
    MemoryCategoryScope scope(i % 2 ? MemoryCategory::kSavedActivations : MemoryCategory::kGradients);
    held.push_back(at::empty({16}));
    if (i == 1717) at::Tensor spike = at::empty({100000});  // the peak, freed at once
    if (i % 3 == 0) held.erase(held.begin());
  }
  { TraceSpan forward("phase", "forward"); }
  trace.stop();
  const int64_t peak = tracker.peak();
  const auto all = trace.samples(c10::DeviceType::CPU);
  ASSERT_EQ(all.size(), 1u + 3000 + 1000 + 2 + 1);  // start, allocations and frees, stop
  ChromeTraceOptions options;
  options.max_samples = 200;
  options.pid = 3;
  const auto json = nlohmann::json::parse(trace.chrome_json(options, {{"step", 7}}));
  ASSERT_TRUE(json["traceEvents"].is_array());
  int by_category = 0, tracked = 0, phases = 0;
  int64_t highest = 0;
  std::map<double, int64_t> tracked_at;
  for (const auto& e : json["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("name") && e.contains("pid")) << e.dump();
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "C" && e["name"] == "cpu memory tracked") {
      ++tracked;
      tracked_at[e["ts"].get<double>()] = e["args"]["tracked"].get<int64_t>();
      highest = std::max(highest, e["args"]["tracked"].get<int64_t>());
    }
    if (e["ph"] == "X") ++phases;
  }
  for (const auto& e : json["traceEvents"]) {
    if (e["ph"] != "C" || e["name"] != "cpu memory by category") continue;
    ++by_category;
    int64_t total = 0;
    for (const auto& [name, bytes] : e["args"].items()) total += bytes.get<int64_t>();
    EXPECT_EQ(total, tracked_at.at(e["ts"].get<double>()));
  }
  EXPECT_LE(by_category, 200);
  EXPECT_GE(by_category, 190);
  EXPECT_EQ(tracked, by_category);
  EXPECT_EQ(phases, 1);
  EXPECT_EQ(highest, peak);
  EXPECT_EQ(json["otherData"]["peak"]["cpu"]["bytes"], peak);
  EXPECT_EQ(json["otherData"]["peak"]["cpu"]["by_category"]["saved activations"].get<int64_t>() +
                json["otherData"]["peak"]["cpu"]["by_category"]["gradients"].get<int64_t>(),
            peak);
  EXPECT_EQ(json["otherData"]["step"], 7);
  EXPECT_EQ(json["otherData"]["categories"].size(), kMemoryCategories);
}

TEST(MemoryTrace, AnUnwritablePathIsAConfigErrorThatSaysWhatToChange) {
  const fs::path dir = fs::temp_directory_path() / ("remat_trace_path_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  EXPECT_THAT(error_of<ConfigError>([&] { check_trace_path(dir.string(), "--memory-trace"); }),
              ::testing::HasSubstr("--memory-trace '" + dir.string() + "' is a directory: give a file path"));
  EXPECT_THAT(error_of<ConfigError>([&] { check_trace_path((dir / "no" / "t.json").string(), "--memory-trace"); }),
              ::testing::HasSubstr("does not exist: create it first, or give a path in an existing folder"));
  std::ofstream(dir / "file") << "x";
  EXPECT_THAT(error_of<ConfigError>([&] { check_trace_path((dir / "file" / "t.json").string(), "--memory-trace"); }),
              ::testing::HasSubstr("is not a directory"));
  const fs::path good = dir / "t.json";
  check_trace_path(good.string(), "--memory-trace");
  EXPECT_FALSE(fs::exists(good));
  EXPECT_FALSE(fs::exists(good.string() + ".tmp"));
  MemoryTracker tracker(keeping());
  MemoryTrace trace(tracker);
  trace.stop();
  trace.write(good.string(), {}, nlohmann::json::object());
  EXPECT_TRUE(nlohmann::json::parse(std::ifstream(good))["traceEvents"].is_array());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace remat
