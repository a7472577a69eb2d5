// A save put in place (engine/save/storage.h): a new step folder, one
// exchanged with the save already at that step, and what killed saves leave
// removed or put back at the next run's start.
#include "engine/save/storage.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace remat::save {
namespace {

namespace fs = std::filesystem;

class SaveStorage : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("remat_save_storage_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  // A folder holding one file `name` with `text`.
  fs::path folder(const std::string& at, const std::string& text) {
    fs::create_directories(root_ / at);
    std::ofstream(root_ / at / "manifest.json") << text;
    return root_ / at;
  }
  std::string text_of(const fs::path& file) {
    std::ifstream in(file);
    std::string text;
    std::getline(in, text);
    return text;
  }
  fs::path root_;
};

TEST_F(SaveStorage, ANewSaveIsRenamedIntoItsStepFolder) {
  const fs::path staging = folder(staging_folder(3), "new");
  EXPECT_EQ(staging.filename().string(), ".staging_step_00000003");
  EXPECT_FALSE(install_save(staging.string(), (root_ / step_folder(3)).string()));
  EXPECT_EQ(text_of(root_ / "step_00000003" / "manifest.json"), "new");
  EXPECT_FALSE(fs::exists(staging));
}

TEST_F(SaveStorage, ASaveOfAStepAlreadySavedIsExchangedWithIt) {
  folder(step_folder(5), "old");
  const fs::path staging = folder(staging_folder(5), "new");
  EXPECT_TRUE(install_save(staging.string(), (root_ / step_folder(5)).string()));
  EXPECT_EQ(text_of(root_ / "step_00000005" / "manifest.json"), "new");
  EXPECT_EQ(text_of(staging / "manifest.json"), "old") << "the old save waits at the staging name";
}

TEST_F(SaveStorage, LeftoversOfKilledSavesAreRemovedOrPutBack) {
  folder(staging_folder(4), "partial");
  folder(".replaced_" + step_folder(6), "old, its replacement never in place");
  folder(".replaced_" + step_folder(7), "old, replaced");
  folder(step_folder(7), "new");
  folder(step_folder(2), "kept");
  std::ofstream(root_ / "latest.tmp") << "step_00000009\n";
  std::ofstream(root_ / "latest") << "step_00000002\n";
  std::ofstream(root_ / ".staging_notes") << "the user's";
  const std::vector<std::string> removed = remove_save_leftovers(root_.string());
  EXPECT_EQ(removed, (std::vector<std::string>{".replaced_step_00000007", ".staging_step_00000004", "latest.tmp"}));
  EXPECT_EQ(text_of(root_ / "step_00000006" / "manifest.json"), "old, its replacement never in place");
  EXPECT_EQ(text_of(root_ / "step_00000007" / "manifest.json"), "new");
  EXPECT_EQ(text_of(root_ / "step_00000002" / "manifest.json"), "kept");
  EXPECT_EQ(text_of(root_ / "latest"), "step_00000002");
  EXPECT_TRUE(fs::exists(root_ / ".staging_notes"));
  EXPECT_EQ(step_folders(root_.string()).size(), 3u);
}

}  // namespace
}  // namespace remat::save
