// Test helper for the offloading suites (engine/offload_test.cc,
// engine/offload_param_test.cc): a GPT's training run through the engine,
// what it leaves (losses, metrics, final float32 weights), the bitwise
// comparison of two runs, and a save folder the ranks of one job share.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "models/gpt.h"
#include "parallel/zero.h"
#include "runtime/error.h"
#include "tests/parallel_setup.h"

namespace remat::testing {

struct TrainedRun {
  std::vector<double> losses;
  std::vector<nlohmann::json> metrics;  // each step's
  std::map<std::string, at::Tensor> final_params;
  bool trained = false;  // this rank took part
};

// Where a run saves and when: after step `at` into `dir` (none when empty).
struct SaveAt {
  std::string dir;
  int at = -1;
};

// `model` trained through `engine` from its global step to step `steps`, in
// windows of `micro_steps`; each data-parallel rank reads its own tokens
// (below `vocab`). `after_backward(step)` runs after each window's last
// backward, before its step.
inline TrainedRun train_to(Engine& engine, models::Gpt& model, const ParallelLayout& layout, int64_t vocab,
                           int steps, int micro_steps, const SaveAt& save = {},
                           const std::function<void(int)>& after_backward = {}) {
  TrainedRun run;
  run.trained = true;
  for (int step = static_cast<int>(engine.global_steps()) + 1; step <= steps; ++step) {
    for (int m = 0; m < micro_steps; ++m) {
      at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12})
                           .mul(layout.dp_rank() + 1).add(step * 3 + m).remainder(vocab);
      engine.backward(engine.forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
      if (m + 1 == micro_steps && after_backward) after_backward(step);
      engine.step();
    }
    run.losses.push_back(engine.last_metrics().loss);
    run.metrics.push_back(engine.last_metrics().to_json());
    if (step == save.at) engine.save_checkpoint(save.dir);
  }
  for (const auto& [name, value] : engine.sharding().full_parameters()) run.final_params[name] = value;
  return run;
}

// The same losses and final weights, bit for bit.
inline void expect_same(const TrainedRun& a, const TrainedRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << ", step " << i + 1;
  ASSERT_EQ(a.final_params.size(), b.final_params.size()) << what;
  for (const auto& [name, value] : a.final_params) {
    EXPECT_TRUE(at::equal(value, b.final_params.at(name))) << what << ": " << name;
  }
}

// An empty folder in the temporary directory, named by `prefix`, rank 0's
// process id and `name`, the same on every rank (collective).
inline std::string job_dir(const std::string& prefix, const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir =
      (std::filesystem::temp_directory_path() / str(prefix, stamp.item<int64_t>(), "_", name)).string();
  if (world()->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  world()->barrier()->wait();
  return dir;
}

}  // namespace remat::testing
