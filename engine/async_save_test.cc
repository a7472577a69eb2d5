// Saves written in the background (train.async_save, SaveOptions::async)
// under mpirun: the same files as a blocking save, resumed bitwise; training
// goes on while the files are written; a write that fails on one rank is the
// same error on every rank; back-to-back saves, a load or an export right
// after one, and an engine destroyed with one pending.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/save/storage.h"
#include "engine/save_dir.h"
#include "engine/step_counters.h"
#include "models/gpt.h"
#include "runtime/communicator.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using remat::testing::error_of;
using remat::testing::world;
using ::testing::HasSubstr;

// A shared folder for this job (rank 0 names it; emptied first).
std::string job_dir(const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir =
      (fs::temp_directory_path() / str("remat_async_save_", stamp.item<int64_t>(), "_", name)).string();
  if (world()->rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world()->barrier()->wait();
  return dir;
}

// An environment variable set for the scope (every rank sets it alike).
struct ScopedEnv {
  ScopedEnv(const char* name, const std::string& value) : name_(name) { ::setenv(name, value.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  const char* name_;
};

// The GPT trained through the engine at ZeRO `stage`, with dropout so that
// the saved random state matters.
struct Trainer {
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;
  int64_t steps = 0;

  explicit Trainer(int stage, bool async = false) {
    at::manual_seed(7);
    model = models::Gpt(remat::testing::small_gpt(29, 2, /*dropout=*/0.1));
    const Config config = parse_config(
        str(R"({"train_micro_batch_size_per_gpu": 2, "train": {"seed": 7, "async_save": )", async ? "true" : "false",
            R"(}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
                "zero_optimization": {"stage": )", stage, R"(, "stage3_param_persistence_threshold": 40}})"),
        "<async_save_test>");
    EngineOptions options;
    options.layout = remat::testing::layout_ptr(1);
    engine = initialize(model, config, options);
  }

  // `nan_on_rank0`: rank 0's loss is NaN (the verdict is every rank's).
  double step(bool nan_on_rank0 = false) {
    at::Tensor idx =
        at::arange(2 * 12, at::kLong).view({2, 12}).mul(world()->rank() + 1).add(steps * 5).remainder(29);
    const bool nan = nan_on_rank0 && world()->rank() == 0;
    at::Tensor loss = engine->forward([&] {
      at::Tensor l = model->loss(idx, idx.roll(-1, 1));
      return nan ? l * std::numeric_limits<double>::quiet_NaN() : l;
    });
    engine->backward(loss);
    engine->step();
    ++steps;
    return loss.item<double>();
  }
};

std::string bytes_of(const fs::path& path) { return save::read_file(path.string()); }

// A background save writes the files a blocking save of the same state
// writes, byte for byte (the manifest too: it records no time), and a run
// resumed from either continues as the run that saved it did, bitwise.
TEST(AsyncSave, SameFilesAsABlockingSaveAndResumesBitwise) {
  for (int stage : {0, 3}) {
    const std::string blocking = job_dir(str("blocking", stage)), async = job_dir(str("async", stage));
    std::vector<double> whole;
    {
      Trainer t(stage);
      for (int i = 0; i < 3; ++i) t.step();
      t.engine->save_checkpoint(blocking, {{"at", 3}});
      const std::string folder = t.engine->save_checkpoint(async, {{"at", 3}}, SaveOptions{true});
      for (int i = 0; i < 3; ++i) whole.push_back(t.step());
      t.engine->wait_for_saves();
      EXPECT_FALSE(t.engine->save_pending());
      EXPECT_TRUE(fs::exists(fs::path(folder) / "manifest.json"));
    }
    const fs::path a = fs::path(async) / save::step_folder(3), b = fs::path(blocking) / save::step_folder(3);
    EXPECT_EQ(bytes_of(a / "manifest.json"), bytes_of(b / "manifest.json")) << "stage " << stage;
    for (int r = 0; r < world()->size(); ++r) {
      EXPECT_EQ(bytes_of(a / str("rank_", r, ".pt")), bytes_of(b / str("rank_", r, ".pt")))
          << "stage " << stage << " rank file " << r;
    }
    EXPECT_EQ(latest_step(async), 3);
    for (const std::string& dir : {async, blocking}) {
      Trainer t(stage);
      EXPECT_EQ(t.engine->load_checkpoint(dir).at("at"), 3);
      t.steps = 3;
      std::vector<double> resumed;
      for (int i = 0; i < 3; ++i) resumed.push_back(t.step());
      EXPECT_EQ(resumed, whole) << "stage " << stage << " resumed from " << dir;
    }
    world()->barrier()->wait();
  }
}

// The step after a background save does not wait for its write: with the
// write paused (REMAT_FAULT_SAVE_PAUSE_MS), the save and the next step both
// return while the file is still being written (pending, not complete: a
// save that waited for its write would be neither; no wall-clock bound, which
// a loaded machine can miss), the snapshot's host bytes are counted
// meanwhile, and the save completes at wait_for_saves.
TEST(AsyncSave, TrainingGoesOnWhileTheFileIsWritten) {
  const std::string dir = job_dir("overlap");
  Trainer t(2, /*async=*/true);
  for (int i = 0; i < 2; ++i) t.step();
  constexpr int kPauseMs = 1500;
  {
    ScopedEnv pause(knobs::kFaultSavePauseMs, std::to_string(kPauseMs));
    t.engine->save_checkpoint(dir);  // train.async_save
    t.step();
    EXPECT_TRUE(t.engine->save_pending()) << "the write (paused " << kPauseMs << " ms) finished before the step returned";
    EXPECT_EQ(latest_step(dir), -1) << "the save is complete before its file is written";
    const int64_t held = t.engine->last_metrics().counter<int64_t>("save_snapshot_bytes");
    EXPECT_GT(held, 0) << "the snapshot's host bytes are not counted while it is written";
    EXPECT_EQ(held, Counters::read().save_snapshot_bytes);
    t.engine->wait_for_saves();
  }
  EXPECT_FALSE(t.engine->save_pending());
  EXPECT_EQ(latest_step(dir), 2);
  EXPECT_EQ(Counters::read().save_snapshot_bytes, 0) << "the snapshot is released once written";
  t.step();
  EXPECT_EQ(t.engine->last_metrics().counter<int64_t>("save_snapshot_bytes"), 0);
}

// A background write that fails on one rank is the same Error on every rank
// at the next step, naming the rank and the step; the previous save stays
// the latest, the failed one leaves nothing, and training goes on.
TEST(AsyncSave, AFailedWriteIsTheSameErrorOnEveryRankAtTheNextStep) {
  const std::string dir = job_dir("fail");
  const int failing = world()->size() - 1;
  Trainer t(1, /*async=*/true);
  t.step();
  t.engine->save_checkpoint(dir);
  t.engine->wait_for_saves();
  t.step();
  {
    ScopedEnv fail(knobs::kFaultSaveFail, std::to_string(failing));
    t.engine->save_checkpoint(dir);
  }
  // The failure surfaces where the save completes: the first step whose
  // poll finds every rank's writer done (wait_for_saves at the latest).
  std::string message;
  try {
    for (int i = 0; i < 20 && t.engine->save_pending(); ++i) t.step();
    t.engine->wait_for_saves();
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr(str("failed on rank ", failing)));
  EXPECT_THAT(message, HasSubstr("of step 2"));
  EXPECT_THAT(message, HasSubstr("REMAT_FAULT_SAVE_FAIL"));
  // At one rank too, the suffix docs/engine.md promises.
  EXPECT_THAT(message, HasSubstr(str("(the background save of step 2 failed on rank ", failing, " of ",
                                     world()->size())));
  at::Tensor crc = at::full({1}, save::crc32_of(message), at::kLong), crcs = at::empty({world()->size()}, at::kLong);
  world()->allGather(crcs, crc)->wait();
  EXPECT_TRUE(crcs.eq(crc).all().item<bool>()) << "the ranks stopped with different errors";
  EXPECT_FALSE(t.engine->save_pending());
  EXPECT_EQ(latest_step(dir), 1);
  EXPECT_FALSE(fs::exists(fs::path(dir) / save::staging_folder(2))) << "the failed save left its staging folder";
  t.step();
  t.engine->save_checkpoint(dir);
  t.engine->wait_for_saves();
  EXPECT_EQ(latest_step(dir), t.engine->global_steps());
}

// A step that stops on a non-finite loss (every rank alike) completes the
// background save of the step before it first, as a blocking save would
// have been complete: it stays the latest, and nothing of it is left staged.
TEST(AsyncSave, AStepStoppedOnANonFiniteLossKeepsTheSaveBeforeIt) {
  const std::string dir = job_dir("nonfinite");
  Trainer t(1, /*async=*/true);
  t.step();
  t.engine->save_checkpoint(dir);
  t.engine->wait_for_saves();
  t.step();
  std::string message;
  {
    // Still being written when the step stops (kept until no write is in flight).
    ScopedEnv pause(knobs::kFaultSavePauseMs, "300");
    t.engine->save_checkpoint(dir);
    message = error_of<Error>([&] { t.step(/*nan_on_rank0=*/true); });
  }
  EXPECT_THAT(message, HasSubstr("went non-finite"));
  EXPECT_FALSE(t.engine->save_pending()) << "the stopped step left the save pending";
  world()->barrier()->wait();
  EXPECT_EQ(latest_step(dir), 2);
  EXPECT_TRUE(fs::exists(fs::path(dir) / save::step_folder(2) / "manifest.json"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / save::staging_folder(2)));
}

// A second save waits for the first; a load and an export right after a
// background save see it complete.
TEST(AsyncSave, BackToBackSavesThenALoadAndAnExport) {
  const std::string dir = job_dir("back_to_back");
  Trainer t(3, /*async=*/true);
  t.step();
  const std::string exported = dir + "_model.pt";
  {
    // Kept until no write is in flight: the writers' pauses read it.
    ScopedEnv pause(knobs::kFaultSavePauseMs, "300");
    t.engine->save_checkpoint(dir, {{"at", 1}});
    t.engine->save_checkpoint(dir, {{"at", 1}, {"again", true}});  // the same step: replaces the first, once complete
    t.step();
    t.engine->save_checkpoint(dir, {{"at", 2}});
    EXPECT_TRUE(t.engine->save_pending());
    t.engine->export_model(exported);
    EXPECT_FALSE(t.engine->save_pending()) << "the export did not complete the save first";
  }
  EXPECT_EQ(latest_step(dir), 2);
  EXPECT_TRUE(fs::exists(fs::path(dir) / save::step_folder(1) / "manifest.json"));
  t.step();
  t.engine->save_checkpoint(dir, {{"at", 3}});
  EXPECT_EQ(t.engine->load_checkpoint(dir).at("at"), 3) << "the load did not complete the save first";
  EXPECT_EQ(t.engine->load_checkpoint(dir + "/" + save::step_folder(1)).at("again"), true);
  if (world()->rank() == 0) fs::remove(exported);
}

// An engine destroyed with a save pending waits for its thread but runs no
// collective: the save stays incomplete, the previous one the latest, and
// the next run's leftover cleanup removes its staging folder.
TEST(AsyncSave, AnEngineDestroyedWithASavePendingLeavesThePreviousSave) {
  const std::string dir = job_dir("destroyed");
  {
    Trainer t(2, /*async=*/true);
    t.step();
    t.engine->save_checkpoint(dir);
    t.engine->wait_for_saves();
    t.step();
    t.engine->save_checkpoint(dir);
    EXPECT_TRUE(t.engine->save_pending());
  }
  world()->barrier()->wait();
  EXPECT_EQ(latest_step(dir), 1);
  EXPECT_TRUE(fs::exists(fs::path(dir) / save::staging_folder(2)));
  world()->barrier()->wait();
  if (world()->rank() == 0) {
    const auto removed = save::remove_save_leftovers(dir);
    EXPECT_EQ(removed, std::vector<std::string>{save::staging_folder(2)});
  }
  world()->barrier()->wait();
  Trainer t(2);
  EXPECT_NO_THROW(t.engine->load_checkpoint(dir));
  EXPECT_EQ(t.engine->global_steps(), 1);
}

}  // namespace
}  // namespace remat
