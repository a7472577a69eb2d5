// The memory timeline of a real step (Engine::trace_memory): a small GPT with
// full checkpointing at every ZeRO stage; its categories add up to the
// tracker's count at every sample, its peak is the step's mem_peak_bytes, and
// the file is a Chrome trace whose spans nest as the step ran.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/engine.h"
#include "optim/optimizer.h"
#include "parallel/zero.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::error_of;

constexpr int64_t kVocab = 13, kLayers = 3;

MemoryTrackerOptions keeping() {
  MemoryTrackerOptions o;
  o.keep_allocations = true;
  return o;
}

std::string config_json(int stage, const std::string& variant, int accumulation, bool offload = false,
                        bool offload_param = false) {
  return str(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": )", accumulation,
             R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                "zero_optimization": {"stage": )", stage, R"(, "stage3_param_persistence_threshold": 0)",
             offload ? R"(, "offload_optimizer": {"device": "cpu"})" : "",
             offload_param ? R"(, "offload_param": {"device": "cpu"})" : "", R"(},
                "activation_checkpointing": {"variant": ")", variant, R"("}, "train": {"seed": 5}})");
}

std::string scratch_file(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / str("remat_memory_trace_test_", ::getppid());
  fs::create_directories(dir);
  return (dir / str(name, "_rank", testing::world()->rank(), ".json")).string();
}

// A GPT trained through the engine, its tracker started before the model so
// that the parameters are counted.
struct Trained {
  MemoryTracker tracker{keeping()};
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;
  int accumulation;

  Trained(int stage, const std::string& variant, int accumulation = 1, bool offload = false,
          bool offload_param = false)
      : accumulation(accumulation) {
    Config config = parse_config(config_json(stage, variant, accumulation, offload, offload_param), "<test>");
    EngineOptions options;
    options.layout = testing::layout_ptr(1);
    options.memory = &tracker;
    options.blocks = "blocks";
    at::manual_seed(5);
    model = models::Gpt(testing::small_gpt(kVocab, kLayers, 0.1));
    engine = initialize(model, config, options);
  }
  void step() {
    for (int micro = 0; micro < accumulation; ++micro) {
      at::Generator gen = at::detail::createCPUGenerator(
          static_cast<uint64_t>(100 * engine->global_steps() + 10 * micro + testing::world()->rank()));
      at::Tensor x = at::randint(kVocab, {2, 12}, gen, at::kLong);
      at::Tensor y = at::randint(kVocab, {2, 12}, gen, at::kLong);
      engine->backward(engine->forward([&] { return model->loss(x, y); }));
      engine->step();
    }
  }
};

int64_t unique_bytes(const std::vector<at::Tensor>& tensors) {
  std::map<const void*, int64_t> storages;
  for (const auto& t : tensors) {
    if (t.defined() && t.storage().data() != nullptr) storages[t.storage().data()] = t.storage().nbytes();
  }
  int64_t n = 0;
  for (const auto& [ptr, bytes] : storages) n += bytes;
  return n;
}

struct Sample {
  double ts;
  std::map<std::string, int64_t> bytes;
  int64_t tracked;
};

struct Parsed {
  json trace;
  std::vector<Sample> samples;
  std::vector<json> spans;                            // "X"
  std::map<std::string, std::vector<json>> by_name;   // "X" by name
  std::map<int64_t, std::pair<json, json>> async;     // "b", "e" by id
};

Parsed parse(const std::string& path) {
  Parsed p;
  std::ifstream in(path);
  p.trace = json::parse(in);
  EXPECT_TRUE(p.trace["traceEvents"].is_array());
  const json* pending = nullptr;
  // A counter series read as chrome://tracing does (missing: 0) and as
  // Perfetto does (missing: the last value): both must agree.
  std::map<std::string, int64_t> held;
  for (const auto& e : p.trace["traceEvents"]) {
    EXPECT_TRUE(e.contains("ph") && e.contains("name") && e.contains("pid")) << e.dump();
    const std::string ph = e["ph"];
    if (ph == "C" && e["name"] == "cpu memory by category") {
      pending = &e;
    } else if (ph == "C" && e["name"] == "cpu memory tracked") {
      // Each "by category" sample is followed by the tracker's count at the same time.
      EXPECT_NE(pending, nullptr);
      if (pending == nullptr) continue;
      EXPECT_EQ((*pending)["ts"], e["ts"]);
      Sample s{e["ts"].get<double>(), {}, e["args"]["tracked"].get<int64_t>()};
      for (const auto& name : p.trace["otherData"]["categories"]) s.bytes[name] = 0;
      if (p.samples.empty()) {
        EXPECT_EQ((*pending)["args"].size(), kMemoryCategories) << "the first names them all";
      }
      for (const auto& [name, bytes] : (*pending)["args"].items()) {
        EXPECT_EQ(s.bytes.count(name), 1u) << name;
        s.bytes[name] = held[name] = bytes.get<int64_t>();
      }
      for (const auto& [name, bytes] : s.bytes) EXPECT_EQ(held[name], bytes) << name << " at " << s.ts;
      p.samples.push_back(s);
      pending = nullptr;
    } else if (ph == "X") {
      p.spans.push_back(e);
      p.by_name[e["name"]].push_back(e);
    } else if (ph == "b") {
      p.async[e["id"].get<int64_t>()].first = e;
    } else if (ph == "e") {
      p.async[e["id"].get<int64_t>()].second = e;
    }
  }
  return p;
}

int64_t highest(const Parsed& p, const std::string& category) {
  int64_t n = 0;
  for (const auto& s : p.samples) n = std::max(n, s.bytes.at(category));
  return n;
}

bool within(const json& inner, const json& outer) {
  const double b = inner["ts"], e = b + inner["dur"].get<double>();
  const double ob = outer["ts"], oe = ob + outer["dur"].get<double>();
  return b >= ob && e <= oe;
}

void expect_sound(const Parsed& p, const StepMetrics& m, const std::string& what) {
  ASSERT_GE(p.samples.size(), 10u) << what;
  int64_t peak = 0;
  for (const auto& s : p.samples) {
    int64_t sum = 0;
    for (const auto& [name, bytes] : s.bytes) {
      EXPECT_GE(bytes, 0) << what << ": " << name << " at " << s.ts << " us";
      sum += bytes;
    }
    EXPECT_EQ(sum, s.tracked) << what << ": at " << s.ts << " us";
    peak = std::max(peak, s.tracked);
  }
  EXPECT_EQ(p.samples.front().tracked, m.mem_base_bytes) << what;
  EXPECT_EQ(peak, m.mem_peak_bytes) << what;
  EXPECT_EQ(p.trace["otherData"]["peak"]["cpu"]["bytes"], m.mem_peak_bytes) << what;
  EXPECT_EQ(p.trace["otherData"]["step"], m.step) << what;
  EXPECT_EQ(p.samples.back().bytes.at("gradients"), 0) << what << ": the step clears them";
  EXPECT_EQ(p.samples.back().bytes.at("checkpoint inputs"), 0) << what;
}

// Every stage with full checkpointing, the second step (the optimizer state
// exists): categories add up to the tracker's count at every sample, what is
// live at the start is split by what holds it, and each stage's own memory
// shows where it should.
TEST(MemoryTrace, EveryStagesStepAddsUpToTheTrackerAtEverySample) {
  for (int stage : {0, 1, 2, 3}) {
    const std::string what = str("stage ", stage);
    Trained run(stage, "full");
    run.step();
    const std::string path = scratch_file(str("stage", stage));
    run.engine->trace_memory(path);
    run.step();
    const StepMetrics& m = run.engine->last_metrics();
    const Parsed p = parse(path);
    expect_sound(p, m, what);
    // The start: parameters (and shards), the optimizer's moments, nothing else of the model.
    std::vector<at::Tensor> params = run.engine->sharding().parameters();
    if (stage != 3) {
      for (const auto& t : run.model->parameters()) params.push_back(t);
    }
    const auto& first = p.samples.front().bytes;
    EXPECT_EQ(first.at("parameters"), unique_bytes(params)) << what;
    EXPECT_EQ(first.at("optimizer state"), optim::optimizer_state_bytes(run.engine->optimizer())) << what;
    EXPECT_EQ(first.at("gradients"), 0) << what;
    EXPECT_EQ(first.at("saved activations"), 0) << what;
    EXPECT_GT(highest(p, "gradients"), 0) << what;
    EXPECT_GT(highest(p, "saved activations"), 0) << what;
    EXPECT_GT(highest(p, "checkpoint inputs"), 0) << what;
    // Stages 1 and 2 reduce in place at one rank.
    if (stage == 0 || stage == 3 || testing::world()->size() > 1) {
      EXPECT_GT(highest(p, "communication buffers"), 0) << what;
    }
    if (stage == 3) {
      EXPECT_GT(highest(p, "gathered units"), 0) << what;
    } else {
      EXPECT_EQ(highest(p, "gathered units"), 0) << what;
    }
    EXPECT_EQ(highest(p, "offloaded host copies"), 0) << what;
  }
}

// zero_optimization.offload_optimizer: the optimizer's masters, their
// gradients and its state are one category of their own, "host optimizer"
// (on a GPU under the CPU's counter, apart from the device's): from the
// step's start it holds what the metrics report as host_optimizer_bytes, the
// trace's otherData names it, and no "optimizer state" is left on the device.
TEST(MemoryTrace, TheOffloadedOptimizerIsAHostCategory) {
  for (int stage : {1, 2, 3}) {
    const std::string what = str("stage ", stage, " offloaded");
    Trained run(stage, "full", 1, /*offload=*/true);
    run.step();
    const std::string path = scratch_file(str("offload", stage));
    run.engine->trace_memory(path);
    run.step();
    const StepMetrics& m = run.engine->last_metrics();
    ASSERT_TRUE(m.offload_optimizer) << what;
    const Parsed p = parse(path);
    expect_sound(p, m, what);
    const auto& first = p.samples.front().bytes;
    EXPECT_EQ(first.at("host optimizer"), m.host_optimizer_bytes) << what;
    EXPECT_EQ(first.at("optimizer state"), 0) << what;
    EXPECT_EQ(highest(p, "optimizer state"), 0) << what;
    EXPECT_EQ(p.trace["otherData"]["host_optimizer_bytes"].get<int64_t>(), m.host_optimizer_bytes) << what;
  }
  Trained plain(2, "full");
  plain.step();
  const std::string path = scratch_file("not_offloaded");
  plain.engine->trace_memory(path);
  plain.step();
  const Parsed p = parse(path);
  EXPECT_EQ(highest(p, "host optimizer"), 0);
  EXPECT_EQ(p.trace["otherData"].count("host_optimizer_bytes"), 0u);
}

// zero_optimization.offload_param: stage 3's host shards and their
// gradients are a category of their own, "host parameters" (on a GPU under
// the CPU's counter): at its highest it holds what the metrics report as
// host_parameter_bytes (the shards and their reduced gradients), and the
// trace's otherData names it; with offload_optimizer too, "host optimizer"
// keeps what host_optimizer_bytes counts, the shards not again.
TEST(MemoryTrace, OffloadedShardsAreHostParameters) {
  for (bool with_optimizer : {false, true}) {
    const std::string what = with_optimizer ? "offload_param and offload_optimizer" : "offload_param";
    Trained run(3, "full", 1, with_optimizer, /*offload_param=*/true);
    run.step();
    const std::string path = scratch_file(str("offload_param", with_optimizer));
    run.engine->trace_memory(path);
    run.step();
    const StepMetrics& m = run.engine->last_metrics();
    ASSERT_TRUE(m.offload_param) << what;
    const Parsed p = parse(path);
    expect_sound(p, m, what);
    EXPECT_GT(m.host_parameter_bytes, 0) << what;
    EXPECT_EQ(highest(p, "host parameters"), m.host_parameter_bytes) << what;
    EXPECT_EQ(p.trace["otherData"]["host_parameter_bytes"].get<int64_t>(), m.host_parameter_bytes) << what;
    if (with_optimizer) {
      EXPECT_EQ(highest(p, "host optimizer"), m.host_optimizer_bytes) << what;
    }
  }
}

// The file is a Chrome trace: the step's phases in order, one recompute per
// checkpointed block inside the backward, and each collective begun and ended.
TEST(MemoryTrace, TheSpansNestAsTheStepRan) {
  Trained run(3, "full");
  run.step();
  const std::string path = scratch_file("spans");
  run.engine->trace_memory(path);
  run.step();
  const Parsed p = parse(path);
  EXPECT_EQ(p.trace["displayTimeUnit"], "ms");
  ASSERT_EQ(p.by_name.count("forward"), 1u);
  ASSERT_EQ(p.by_name.count("backward"), 1u);
  ASSERT_EQ(p.by_name.count("optimizer step"), 1u);
  const json& forward = p.by_name.at("forward").at(0);
  const json& backward = p.by_name.at("backward").at(0);
  const json& step = p.by_name.at("optimizer step").at(0);
  EXPECT_EQ(p.by_name.at("forward").size(), 1u);
  EXPECT_LE(forward["ts"].get<double>() + forward["dur"].get<double>(), backward["ts"].get<double>());
  EXPECT_LE(backward["ts"].get<double>() + backward["dur"].get<double>(), step["ts"].get<double>());
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string name = str("recompute blocks.", i);
    ASSERT_EQ(p.by_name.count(name), 1u) << name;
    ASSERT_EQ(p.by_name.at(name).size(), 1u) << name;
    const json& recompute = p.by_name.at(name).at(0);
    EXPECT_EQ(recompute["cat"], "recompute");
    EXPECT_TRUE(within(recompute, backward)) << recompute.dump() << " not in " << backward.dump();
    EXPECT_EQ(recompute["tid"], backward["tid"]);
  }
  // Recomputes run from the last block to the first.
  EXPECT_LT(p.by_name.at("recompute blocks.2").at(0)["ts"].get<double>(),
            p.by_name.at("recompute blocks.0").at(0)["ts"].get<double>());
  std::map<std::string, int> collectives;
  for (const auto& [id, pair] : p.async) {
    const auto& [begin, end] = pair;
    ASSERT_FALSE(begin.is_null()) << "an end without a begin: " << end.dump();
    ASSERT_FALSE(end.is_null()) << "a begin without an end: " << begin.dump();
    EXPECT_EQ(begin["cat"], "collective");
    EXPECT_EQ(begin["name"], end["name"]);
    EXPECT_LE(begin["ts"].get<double>(), end["ts"].get<double>());
    ++collectives[begin["name"]];
  }
  EXPECT_GE(collectives["allGather"], 2 * kLayers) << "each block gathered in forward and backward";
  EXPECT_GE(collectives["reduceScatter"], kLayers);
}

// Accumulation: a forward and backward span per micro-step, one optimizer
// step, and the categories still add up; fewer samples keep the peak.
TEST(MemoryTrace, AnAccumulatedStepHoldsEachMicroStep) {
  Trained run(2, "full", /*accumulation=*/2);
  run.step();
  const std::string path = scratch_file("accumulation");
  run.engine->trace_memory(path, /*max_samples=*/60);
  run.step();
  const Parsed p = parse(path);
  expect_sound(p, run.engine->last_metrics(), "accumulation");
  EXPECT_LE(p.samples.size(), 60u);
  EXPECT_GT(p.trace["otherData"]["peak"]["cpu"]["samples"].get<int64_t>(), 60);
  EXPECT_EQ(p.by_name.at("forward").size(), 2u);
  EXPECT_EQ(p.by_name.at("backward").size(), 2u);
  EXPECT_EQ(p.by_name.at("optimizer step").size(), 1u);
  EXPECT_EQ(p.by_name.at("recompute blocks.1").size(), 2u);
}

// Without checkpointing the forward keeps its activations: no checkpoint
// inputs, no recompute, and more saved activations at the peak than with it.
TEST(MemoryTrace, WithoutCheckpointingTheActivationsAreSavedActivations) {
  std::map<std::string, int64_t> most;
  for (const std::string variant : {"none", "full"}) {
    Trained run(0, variant);
    run.step();
    const std::string path = scratch_file("variant_" + variant);
    run.engine->trace_memory(path);
    run.step();
    const Parsed p = parse(path);
    expect_sound(p, run.engine->last_metrics(), variant);
    most[variant] = highest(p, "saved activations");
    if (variant == "none") {
      EXPECT_EQ(highest(p, "checkpoint inputs"), 0);
      for (const auto& [name, spans] : p.by_name) EXPECT_EQ(name.rfind("recompute", 0), std::string::npos) << name;
    }
  }
  EXPECT_GT(most["none"], most["full"]);
}

TEST(MemoryTrace, AnUnwritablePathOrATrackerWithoutAllocationsIsAConfigErrorBeforeAnyStep) {
  Trained run(0, "full");
  const std::string missing = (fs::temp_directory_path() / "remat_no_such_folder" / "t.json").string();
  EXPECT_THAT(error_of<ConfigError>([&] { run.engine->trace_memory(missing); }),
              ::testing::HasSubstr("remat::Engine::trace_memory '" + missing + "': its folder '" +
                                   fs::path(missing).parent_path().string() + "' does not exist"));
  run.step();  // trains on, untraced
  EXPECT_FALSE(fs::exists(missing));

  MemoryTracker plain;
  EngineOptions options;
  options.layout = testing::layout_ptr(1);
  options.memory = &plain;
  at::manual_seed(5);
  models::Gpt model(testing::small_gpt(kVocab, kLayers, 0.1));
  auto engine = initialize(model, parse_config(config_json(0, "full", 1), "<test>"), options);
  EXPECT_THAT(error_of<ConfigError>([&] { engine->trace_memory(scratch_file("plain")); }),
              ::testing::HasSubstr("construct it with MemoryTrackerOptions::keep_allocations = true"));
}

}  // namespace
}  // namespace remat
