// The rule every output path follows (output_file.h): what it refuses, in
// what words, and which spellings it finds to be one file.
#include "runtime/output_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using ::remat::testing::error_of;
using ::testing::HasSubstr;
using ::testing::Not;

class OutputFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("remat_output_file_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "sub");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  static std::string refusal(const std::string& path) {
    return error_of<ConfigError>([&] { check_output_file({"--memory-trace", path, "memory.json"}); });
  }
  fs::path dir_;
};

TEST_F(OutputFileTest, NewAndRegularFilesAreAcceptedAndLeftAsTheyWere) {
  EXPECT_NO_THROW(check_output_file({"--metrics", at("new.jsonl")}));
  EXPECT_FALSE(fs::exists(at("new.jsonl")));
  std::ofstream(at("old.jsonl")) << "kept";
  std::ofstream(at("old.jsonl.tmp")) << "the user's";
  EXPECT_NO_THROW(check_output_file({"--metrics", at("old.jsonl")}));
  std::ifstream old(at("old.jsonl")), tmp(at("old.jsonl.tmp"));
  std::string a, b;
  std::getline(old, a);
  std::getline(tmp, b);
  EXPECT_EQ(a, "kept");
  EXPECT_EQ(b, "the user's");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 3);  // no probe left
}

TEST_F(OutputFileTest, NodesLinksAndDirectoriesAreRefusedAndNamed) {
  ASSERT_EQ(::mkfifo(at("fifo").c_str(), 0644), 0);
  fs::create_symlink("/dev/null", at("to_null"));
  std::ofstream(at("file")) << "x";
  fs::create_symlink(at("file"), at("to_file"));
  EXPECT_THAT(refusal("/dev/null"), HasSubstr("--memory-trace '/dev/null' is a character device, not a regular "
                                              "file: the output is written beside it and renamed to that path, "
                                              "which would replace it"));
  EXPECT_THAT(refusal(at("fifo")), HasSubstr("is a fifo, not a regular file"));
  EXPECT_THAT(refusal(at("to_null")), HasSubstr("is a symbolic link, not a regular file"));
  EXPECT_THAT(refusal(at("to_file")), HasSubstr("(to write where the link points: '" + at("file") + "')"));
  EXPECT_THAT(refusal(dir_.string()), HasSubstr("--memory-trace '" + dir_.string() + "' is a directory: give a file "
                                                "path (e.g. " + at("memory.json") + ")"));
  EXPECT_THAT(refusal(at("no/m.json")), HasSubstr("its folder '" + at("no") + "' does not exist: create it first"));
  EXPECT_THAT(refusal(at("file/m.json")), HasSubstr("its folder '" + at("file") + "' is not a directory"));
  EXPECT_THAT(refusal(""), HasSubstr("--memory-trace is empty: give the path of the file to write"));
  EXPECT_TRUE(fs::is_symlink(at("to_null")));  // left as it was
}

TEST_F(OutputFileTest, OneFileSpelledTwiceIsRefusedNamingBothFlags) {
  fs::create_directory_symlink(dir_ / "sub", at("link"));
  const std::string metrics = at("sub/m.json");
  for (const std::string& other : {at("sub/../sub/m.json"), at("link/m.json"), metrics}) {
    EXPECT_THAT(error_of<ConfigError>([&] { check_distinct_outputs({{"--metrics", metrics}, {"--export", other}}); }),
                HasSubstr("--export '" + other + "' and --metrics '" + metrics +
                          "' are the same file, so one would overwrite the other: give each its own path"))
        << other;
  }
  std::ofstream(metrics) << "{}";  // an existing file: by device and inode, hard links too
  fs::create_hard_link(metrics, at("hard.json"));
  EXPECT_THAT(error_of<ConfigError>(
                  [&] { check_distinct_outputs({{"--metrics", metrics}, {"--memory-trace", at("link/m.json")}}); }),
              HasSubstr("are the same file"));
  EXPECT_THAT(error_of<ConfigError>(
                  [&] { check_distinct_outputs({{"--metrics", metrics}, {"--export", at("hard.json")}}); }),
              HasSubstr("are the same file"));
  EXPECT_NO_THROW(check_distinct_outputs({{"--metrics", metrics}, {"--export", at("sub/e.pt")}, {"--json", ""}}));
}

TEST_F(OutputFileTest, OutputsOnTheRunsInputsOrInsideItsFoldersAreRefused) {
  std::ofstream(at("cfg.json")) << "{}";
  std::ofstream(at("corpus.txt")) << "text";
  fs::create_directories(dir_ / "saves" / "step_00000002");
  fs::create_directory_symlink(dir_ / "saves", at("saves_link"));
  const std::vector<RunInput> inputs{{"--config", at("cfg.json")},
                                     {"data.path", at("corpus.txt")},
                                     {"--resume", at("saves/step_00000002"), true, "the save this run reads"},
                                     {"--save-dir", at("saves"), true, "which holds this run's saves and their lock"}};
  auto refusal_of = [&](const std::string& flag, const std::string& path) {
    return error_of<ConfigError>([&] { check_outputs_spare_inputs({{flag, path}}, inputs); });
  };
  EXPECT_THAT(refusal_of("--metrics", at("cfg.json")),
              HasSubstr("--metrics '" + at("cfg.json") + "' is the --config file '" + at("cfg.json") +
                        "' this run reads, so writing it would destroy an input: give --metrics its own path"));
  EXPECT_THAT(refusal_of("--export", at("sub/../corpus.txt")), HasSubstr("is the data.path file"));
  EXPECT_THAT(refusal_of("--memory-trace", at("saves/.lock")),
              HasSubstr("--memory-trace '" + at("saves/.lock") + "' lies inside --save-dir '" + at("saves") +
                        "', which holds this run's saves and their lock, so writing it would damage them: give "
                        "--memory-trace a path outside that folder"));
  EXPECT_THAT(refusal_of("--metrics", at("saves_link/latest")), HasSubstr("lies inside --save-dir"));
  EXPECT_THAT(refusal_of("--export", at("saves/step_00000002/rank_0.pt")), HasSubstr("lies inside --resume"));
  EXPECT_THAT(refusal_of("--memory-trace", at("saves")), HasSubstr("--memory-trace '" + at("saves") + "' is --save-dir"));
  EXPECT_THAT(refusal_of("--memory-trace", at("saves/new/deeper.json")), HasSubstr("lies inside --save-dir"));
  // A folder that does not exist yet is compared by where it would be.
  EXPECT_THAT(error_of<ConfigError>([&] {
                check_outputs_spare_inputs({{"--metrics", at("fresh/m.json")}}, {{"--save-dir", at("fresh"), true}});
              }),
              HasSubstr("lies inside --save-dir"));
  // A hard link to an input is that input.
  fs::create_hard_link(at("cfg.json"), at("cfg_hard.json"));
  EXPECT_THAT(refusal_of("--metrics", at("cfg_hard.json")), HasSubstr("is the --config file"));
  EXPECT_NO_THROW(check_outputs_spare_inputs(
      {{"--metrics", at("m.json")}, {"--export", at("saves_sibling.pt")}, {"--json", ""}}, inputs));
  // A save folder's own entries only: a file of the user's may sit beside the saves.
  const std::vector<RunInput> saves{{"--save-dir", at("saves"), true, "which holds saves", save_folder_entries()}};
  for (const char* name : {"saves/.lock", "saves/latest", "saves/step_00000002/rank_0.pt", "saves/step_00000009",
                           "saves/.staging_step_00000004/manifest.json", "saves", "saves_link/latest.tmp"}) {
    EXPECT_THAT(error_of<ConfigError>([&] { check_outputs_spare_inputs({{"--export", at(name)}}, saves); }),
                HasSubstr("--save-dir"))
        << name;
  }
  EXPECT_NO_THROW(check_outputs_spare_inputs({{"--export", at("saves/model.pt")}}, saves));
  // A hard link elsewhere to a save's file is that file.
  std::ofstream(at("saves/step_00000002/rank_0.pt")) << "a rank's state";
  fs::create_hard_link(at("saves/step_00000002/rank_0.pt"), at("linked_rank.pt"));
  EXPECT_THAT(error_of<ConfigError>([&] { check_outputs_spare_inputs({{"--metrics", at("linked_rank.pt")}}, saves); }),
              HasSubstr("--metrics '" + at("linked_rank.pt") + "' is a hard link to a file inside --save-dir"));
  EXPECT_NO_THROW(check_outputs_spare_inputs({{"--metrics", at("saves/latest_metrics.jsonl")}}, saves));
  // A folder's own consequence in the message.
  EXPECT_THAT(error_of<ConfigError>([&] {
                check_outputs_spare_inputs({{"--metrics", at("ex/m.jsonl")}},
                                           {{"--export", at("ex/"), true, "the export's folder", {}, "so it fails"}});
              }),
              HasSubstr("--metrics '" + at("ex/m.jsonl") + "' lies inside --export '" + at("ex/") +
                        "', the export's folder, so it fails: give --metrics a path outside that folder"));
}

// What the run reads lying where an output folder writes: in the entries it
// owns (or, a file, hard-linked there), through symbolic links; beside them,
// or the folder itself, is left to the other checks.
TEST_F(OutputFileTest, InputsInsideAnOutputFoldersEntriesAreRefused) {
  fs::create_directories(dir_ / "saves" / "step_00000002");
  fs::create_directory_symlink(dir_ / "saves", at("saves_link"));
  std::ofstream(at("saves/.lock")) << "{}";
  std::ofstream(at("saves/step_00000002/cfg.json")) << "{}";
  std::ofstream(at("saves/corpus.txt")) << "text";
  std::ofstream(at("mine.json")) << "{}";
  const OutputFolder saves{"--save-dir", at("saves"), save_folder_entries(), "where remat writes its saves"};
  auto refusal_of = [&](const RunInput& in) { return error_of<ConfigError>([&] { check_inputs_outside(saves, {in}); }); };
  EXPECT_THAT(refusal_of({"--config", at("saves/.lock")}),
              HasSubstr("--config '" + at("saves/.lock") + "' lies inside --save-dir '" + at("saves") +
                        "', where remat writes its saves, so the run would destroy the file it reads: move it out "
                        "of that folder, or give --save-dir another one"));
  EXPECT_THAT(refusal_of({"data.path", at("saves_link/step_00000002/cfg.json")}), HasSubstr("lies inside --save-dir"));
  EXPECT_THAT(refusal_of({"--resume", at("saves/step_00000002/inner"), true}), HasSubstr("the folder it reads"));
  fs::create_hard_link(at("mine.json"), at("saves/latest"));
  EXPECT_THAT(refusal_of({"--config", at("mine.json")}),
              HasSubstr("--config '" + at("mine.json") + "' is a hard link to a file inside --save-dir"));
  EXPECT_NO_THROW(check_inputs_outside(saves, {{"data.path", at("saves/corpus.txt")},
                                               {"--resume", at("saves"), true},
                                               {"--pretrained", ""}}));
  EXPECT_NO_THROW(check_inputs_outside({"--save-dir", "", {}, ""}, {{"--config", at("saves/.lock")}}));
  // Every entry of a folder that owns them all (a sharded export's).
  EXPECT_THAT(error_of<ConfigError>([&] {
                check_inputs_outside({"--export", at("saves/"), {}, "the export's folder"},
                                     {{"data.path", at("saves/corpus.txt")}});
              }),
              HasSubstr("data.path '" + at("saves/corpus.txt") + "' lies inside --export"));
}

TEST_F(OutputFileTest, TheNextWriterRemovesTemporariesNoWriterHolds) {
  const std::string out = at("model.pt");
  std::ofstream(out + ".remat-tmp.Ab12Cd") << "left by a killed export";
  // The user's files, whatever they look like: other marks, other lengths,
  // other characters, or a second name (a hard link).
  const std::vector<std::string> theirs{".tmp", ".tmp.Ab12Cd", ".tmp.backup", ".remat-tmp.notours", ".remat-tmp.ab.cde",
                                        ".remat-tmp.Hard11"};
  for (const std::string& suffix : theirs) std::ofstream(out + suffix) << "the user's";
  fs::create_hard_link(out + ".remat-tmp.Hard11", at("kept_elsewhere"));
  std::string held;
  const int writing = open_temporary_beside(out, held);  // a writer at work
  ASSERT_GE(writing, 0);
  EXPECT_NE(held.find("model.pt.remat-tmp."), std::string::npos) << held;
  EXPECT_FALSE(fs::exists(out + ".remat-tmp.Ab12Cd"));
  EXPECT_EQ(remove_stale_temporaries(out), 0);
  EXPECT_TRUE(fs::exists(held)) << "a temporary still being written is left alone";
  ::close(writing);  // its writer was killed before renaming it
  EXPECT_EQ(remove_stale_temporaries(out), 1);
  EXPECT_FALSE(fs::exists(held));
  for (const std::string& suffix : theirs) EXPECT_TRUE(fs::exists(out + suffix)) << suffix;
}

TEST_F(OutputFileTest, AVeryLongPathIsCutInMessagesKeepingBothEnds) {
  const std::string name = std::string(3000, 'a') + "/" + std::string(5000, 'b') + "/end.json";
  const std::string shown = shown_path(name);
  EXPECT_EQ(shown, std::string(80, 'a') + "...(7810 characters)..." + std::string(111, 'b') + "/end.json");
  EXPECT_EQ(shown_path("short/path.json"), "short/path.json");
  const std::string message = refusal(name);
  EXPECT_LT(message.size(), 600u);
  EXPECT_THAT(message, HasSubstr("characters long, more than a path may have here"));
  EXPECT_THAT(message, Not(HasSubstr(std::string(200, 'b'))));
}

}  // namespace
}  // namespace remat
