// The streamed export (engine/export.h) under mpirun at 1 and 2 ranks: the
// pickle streamed one unit at a time is byte for byte the file written at
// once from the gathered parameters, at every ZeRO stage and at tp 2; a
// safetensors file and a sharded set (read back by SafetensorsFile and
// SafetensorsSet) hold the same tensors bitwise, bf16 ones the float32 values
// rounded; a write that fails (a file size limit standing in for a full
// disk) leaves nothing and is the same Error on every rank; a folder holding
// other files is refused before anything is gathered, a previous export's is
// replaced whole, and a re-export failing half-way leaves a folder readers
// refuse; paths that would lose or hide a file (an index, a file of another
// kind, a file in a sharded export's folder) are refused, stale temporaries
// removed; --export-max-shard-size's faults each named.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/export.h"
#include "engine/safetensors.h"
#include "models/gpt.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/pickle_at_once.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using remat::testing::error_of;
using remat::testing::world;

constexpr int64_t kVocab = 31;

// A shared folder for this job (rank 0 names it), removed by `done`.
std::string job_dir(const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir = (fs::temp_directory_path() / str("remat_export_", stamp.item<int64_t>(), "_", name)).string();
  if (world()->rank() == 0) fs::create_directories(dir);
  world()->barrier()->wait();
  return dir;
}
void done(const std::string& dir) {
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The GPT (frozen first block optional) trained two steps through the
// engine at tp x dp over the world, bf16 when asked.
struct Trained {
  std::shared_ptr<ParallelLayout> layout;
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;

  Trained(int tp, int stage, bool bf16 = false, bool freeze = false) {
    layout = std::make_shared<ParallelLayout>(world(), ParallelDims::from_world(world()->size(), tp));
    at::manual_seed(5);
    models::GptOptions o = remat::testing::small_gpt(kVocab, 2, /*dropout=*/0.0);
    if (tp > 1) o.tensor_parallel = layout->tp_group();
    model = models::Gpt(o);
    if (freeze) {
      for (const auto& item : model->named_parameters()) {
        if (item.key().rfind("blocks.0.", 0) == 0) item.value().requires_grad_(false);
      }
    }
    const Config config = parse_config(
        str(R"({"train_micro_batch_size_per_gpu": 2, "train": {"seed": 5}, "tensor_parallel": {"size": )", tp,
            R"(}, "bf16": {"enabled": )", bf16 ? "true" : "false",
            R"(}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": )", stage,
            R"(, "stage3_param_persistence_threshold": 40, "reduce_bucket_size": 700,
                "stage3_gather_16bit_weights_on_model_save": )", bf16 ? "true" : "false", "}}"),
        "<export_test>");
    EngineOptions options;
    options.layout = layout;
    engine = initialize(model, config, options);
    for (int64_t s = 0; s < 2; ++s) {
      at::Tensor idx = at::arange(2 * 10, at::kLong).view({2, 10}).mul(layout->dp_rank() + 1).add(s).remainder(kVocab);
      engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
      engine->step();
    }
  }
};

// The whole path (gathered, then written at once), the streamed pickle, a
// safetensors file and a sharded set of one run: the same tensors bitwise,
// the pickles byte for byte.
void expect_every_format_alike(Trained& run, const std::string& dir, const std::string& what) {
  const auto whole = consolidated_parameters(run.engine->sharding(), *run.model);
  if (world()->rank() == 0) write_model_file(dir + "/whole.pt", whole);
  const int64_t bytes = run.engine->export_model(dir + "/streamed.pt");
  run.engine->export_model(dir + "/model.safetensors");
  ExportOptions sharded;
  sharded.max_shard_bytes = 8000;
  run.engine->export_model(dir + "/shards/", sharded);
  if (world()->rank() != 0) {
    EXPECT_EQ(bytes, 0);
    return;
  }
  EXPECT_EQ(bytes, static_cast<int64_t>(fs::file_size(dir + "/streamed.pt"))) << what;
  EXPECT_TRUE(read_bytes(dir + "/whole.pt") == read_bytes(dir + "/streamed.pt"))
      << what << ": the streamed pickle differs from the one written at once";
  auto file = SafetensorsFile::open(dir + "/model.safetensors");
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->metadata().at("remat_step"), "2");
  auto set = SafetensorsSet::open(dir + "/shards");
  EXPECT_GE(set.files().size(), 3u) << what << ": shards of at most 8000 bytes";
  int64_t total = 0, values = 0;
  for (const auto& f : set.files()) total += f->file_bytes();
  EXPECT_EQ(set.total_bytes(), total);
  ASSERT_EQ(file->entries().size(), whole.size()) << what;
  ASSERT_EQ(set.names().size(), whole.size()) << what << ": every name once";
  for (size_t i = 0; i < whole.size(); ++i) {
    const auto& [name, value] = whole[i];
    EXPECT_EQ(file->entries()[i].name, name) << what << ": the file's order is the model's";
    EXPECT_TRUE(at::equal(file->tensor(name), value)) << what << ": " << name;
    EXPECT_TRUE(at::equal(set.tensor(name), value)) << what << " (shards): " << name;
    values += static_cast<int64_t>(value.nbytes());
  }
  EXPECT_LT(values, total);
}

TEST(Export, StreamedFormatsHoldTheGatheredParametersAtEveryStage) {
  for (int stage : {0, 1, 2, 3}) {
    const std::string dir = job_dir(str("stage", stage));
    Trained run(1, stage, /*bf16=*/false, /*freeze=*/stage == 2);
    expect_every_format_alike(run, dir, str("stage ", stage));
    done(dir);
  }
}

TEST(Export, TensorParallelLayersAreWrittenWhole) {
  if (world()->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  for (int stage : {0, 3}) {
    const std::string dir = job_dir(str("tp", stage));
    Trained run(2, stage);
    expect_every_format_alike(run, dir, str("tp 2 stage ", stage));
    if (world()->rank() == 0) {
      auto file = SafetensorsFile::open(dir + "/model.safetensors");
      models::Gpt plain(remat::testing::small_gpt(kVocab, 2, 0.0));
      for (const auto& item : plain->named_parameters()) {
        ASSERT_NE(file->find(item.key()), nullptr) << item.key();
        EXPECT_EQ(file->find(item.key())->shape, item.value().sizes().vec()) << item.key();
      }
    }
    done(dir);
  }
}

// stage3_gather_16bit_weights_on_model_save with bf16: every format holds
// bf16 tensors, each the float32 master rounded once.
TEST(Export, Bf16ExportsAreTheFloat32ValuesRounded) {
  const std::string dir = job_dir("bf16");
  Trained run(1, 3, /*bf16=*/true);
  ASSERT_EQ(run.engine->export_dtype(), at::kBFloat16);
  const auto whole = consolidated_parameters(run.engine->sharding(), *run.model);
  run.engine->export_model(dir + "/model.safetensors");
  run.engine->export_model(dir + "/model.pt");
  if (world()->rank() == 0) {
    auto file = SafetensorsFile::open(dir + "/model.safetensors");
    EXPECT_EQ(file->metadata().at("remat_dtype"), "bf16");
    std::vector<std::pair<std::string, at::Tensor>> rounded;
    for (const auto& [name, value] : whole) {
      ASSERT_EQ(value.scalar_type(), at::kFloat);
      rounded.emplace_back(name, value.to(at::kBFloat16));
      EXPECT_EQ(file->find(name)->dtype, at::kBFloat16) << name;
      EXPECT_TRUE(at::equal(file->tensor(name), rounded.back().second)) << name;
    }
    write_model_file(dir + "/rounded.pt", rounded);
    EXPECT_TRUE(read_bytes(dir + "/rounded.pt") == read_bytes(dir + "/model.pt"));
  }
  done(dir);
}

// A file size limit on rank 0 (EFBIG, as a full disk's ENOSPC) makes each
// format's write fail: the same Error on every rank, nothing left behind,
// and the next export (no limit) works.
TEST(Export, AFailedWriteLeavesNothingAndFailsOnEveryRank) {
  const std::string dir = job_dir("fail");
  Trained run(1, 3);
  const auto handler = std::signal(SIGXFSZ, SIG_IGN);
  for (const std::string name : {"model.pt", "model.safetensors", "shards/"}) {
    rlimit old{};
    ::getrlimit(RLIMIT_FSIZE, &old);
    if (world()->rank() == 0) {
      rlimit small = old;
      small.rlim_cur = 5000;  // less than any of the files
      ::setrlimit(RLIMIT_FSIZE, &small);
    }
    ExportOptions options;
    options.max_shard_bytes = 12000;
    const std::string message = error_of<Error>([&] { run.engine->export_model(dir + "/" + name, options); });
    if (world()->rank() == 0) ::setrlimit(RLIMIT_FSIZE, &old);
    if (world()->size() > 1) {
      EXPECT_THAT(message, HasSubstr("failed on rank 0 of")) << name;
    }
    EXPECT_THAT(message, HasSubstr("File too large")) << name;
    world()->barrier()->wait();
    if (world()->rank() == 0) {
      const auto left = entries(dir);
      const bool nothing = left.empty() || (left == std::vector<std::string>{"shards"} && entries(dir + "/shards").empty());
      EXPECT_TRUE(nothing) << name << ": left " << ::testing::PrintToString(left);
      fs::remove_all(dir + "/shards");
    }
    world()->barrier()->wait();
  }
  std::signal(SIGXFSZ, handler);
  const int64_t bytes = run.engine->export_model(dir + "/model.safetensors");
  EXPECT_EQ(bytes > 0, world()->rank() == 0);
  done(dir);
}

// A folder holding anything but a previous remat export is refused on every
// rank before anything is gathered; a previous export's folder is replaced
// whole (its extra shards removed).
TEST(Export, AForeignFolderIsRefusedAndAPreviousExportReplaced) {
  const std::string dir = job_dir("folders");
  Trained run(1, 2);
  if (world()->rank() == 0) {
    fs::create_directories(dir + "/hf");
    std::ofstream(dir + "/hf/config.json") << "{}";
  }
  world()->barrier()->wait();
  const std::string message = error_of<ConfigError>([&] { run.engine->export_model(dir + "/hf"); });
  EXPECT_THAT(message, HasSubstr(str("remat::Engine::export_model '", dir, "/hf' is a folder holding 'config.json', "
                                     "which is not a remat safetensors export's")));
  if (world()->size() > 1) {
    EXPECT_THAT(message, HasSubstr("(the export's path check failed on rank 0 of"));
  }
  ExportOptions small, large;
  small.max_shard_bytes = 4000;
  large.max_shard_bytes = 1 << 20;
  run.engine->export_model(dir + "/out", small);  // a new folder without '/' at the end: a file
  run.engine->export_model(dir + "/shards/", small);
  world()->barrier()->wait();
  const size_t many = world()->rank() == 0 ? entries(dir + "/shards").size() : 0;
  run.engine->export_model(dir + "/shards", large);  // an existing folder: shards again
  if (world()->rank() == 0) {
    EXPECT_TRUE(fs::is_regular_file(dir + "/out"));
    EXPECT_GT(many, 3u);
    EXPECT_EQ(entries(dir + "/shards"),
              (std::vector<std::string>{"model-00001-of-00001.safetensors", "model.safetensors.index.json"}));
    EXPECT_NO_THROW(check_export_path(dir + "/shards"));
    std::ofstream(dir + "/shards/notes.txt") << "mine";
    EXPECT_THAT(error_of<ConfigError>([&] { check_export_path(dir + "/shards/"); }), HasSubstr("'notes.txt'"));
    EXPECT_THAT(error_of<ConfigError>([&] { check_export_path(dir + "/none/deeper/"); }),
                HasSubstr("does not exist: create it"));
    EXPECT_THAT(error_of<ConfigError>([&] { check_export_path(dir + "/out/"); }), HasSubstr("is not a directory"));
  }
  done(dir);
}

// The streamed pickle is byte for byte the archive LibTorch writes at once
// (Pickler + writeArchiveAndTensors: tests/pickle_at_once.h):
// views, bf16 and zero-size tensors alike.
TEST(Export, TheStreamedPickleIsTheArchiveWrittenAtOnce) {
  const std::string dir = job_dir("pickle");
  at::manual_seed(3);
  const at::Tensor base = at::randn({6, 5});
  const std::vector<std::pair<std::string, at::Tensor>> params = {
      {"a.weight", base.narrow(0, 2, 3)}, {"b", at::randn({4}).to(at::kBFloat16)}, {"empty", at::zeros({0, 3})},
      {"c.bias", base.t().contiguous()}};
  const std::string at_once = remat::testing::pickle_archive_at_once(params, /*copy=*/true);
  const std::string path = str(dir, "/", world()->rank(), ".pt");
  EXPECT_EQ(write_model_file(path, params), static_cast<int64_t>(at_once.size()));
  EXPECT_TRUE(read_bytes(path) == at_once);
  done(dir);
}

TEST(Export, ShardSizesAreReadAsSavePretrainedWritesThem) {
  EXPECT_EQ(export_format("a/model.safetensors"), ExportFormat::kSafetensors);
  EXPECT_EQ(export_format("a/X.SAFETENSORS"), ExportFormat::kSafetensors);
  EXPECT_EQ(export_format("a/m.SafeTensors"), ExportFormat::kSafetensors);
  EXPECT_EQ(export_format("a/export/"), ExportFormat::kSafetensorsShards);
  EXPECT_EQ(export_format("model.pt"), ExportFormat::kPickle);
  EXPECT_EQ(export_format("model.bin"), ExportFormat::kPickle);
  EXPECT_EQ(parse_byte_size("5GB", "--x"), 5'000'000'000);
  EXPECT_EQ(parse_byte_size("500MB", "--x"), 500'000'000);
  EXPECT_EQ(parse_byte_size("2GiB", "--x"), int64_t{2} << 30);
  EXPECT_EQ(parse_byte_size("100kb", "--x"), 100'000);
  EXPECT_EQ(parse_byte_size("1.5GB", "--x"), 1'500'000'000);
  EXPECT_EQ(parse_byte_size("1.5KiB", "--x"), 1536);
  EXPECT_EQ(parse_byte_size("0.001KB", "--x"), 1);
  EXPECT_EQ(parse_byte_size("2.000", "--x"), 2);
  EXPECT_EQ(parse_byte_size("123456", "--x"), 123456);
  EXPECT_EQ(parse_byte_size("9223372036854775807", "--x"), INT64_MAX);
  EXPECT_EQ(parse_byte_size("1EB", "--x"), 1'000'000'000'000'000'000);
  EXPECT_EQ(ExportOptions{}.max_shard_bytes, 50'000'000'000);
  const auto refusal = [](const std::string& text) {
    return error_of<ConfigError>([&] { parse_byte_size(text, "--export-max-shard-size"); });
  };
  for (const char* bad : {"", "5XB", "-1", "GB", "5 G B", "1e3", ".5", "1."}) {
    EXPECT_THAT(refusal(bad), HasSubstr(str("--export-max-shard-size '", bad, "' is not a size"))) << bad;
  }
  for (const char* zero : {"0", "0.0", "0GB"}) {
    EXPECT_THAT(refusal(zero), HasSubstr(str("'", zero, "' is zero: a size must be positive"))) << zero;
  }
  for (const char* large : {"9223372036854775808", "8EiB", "9.3EB", "99999999999999999999999999999999999999999TB"}) {
    EXPECT_THAT(refusal(large), HasSubstr(str("'", large, "' is too large: a size is at most 9223372036854775807 bytes")))
        << large;
  }
  EXPECT_THAT(refusal("0.5"), HasSubstr("'0.5' is not a whole number of bytes (it is 0.5)"));
  EXPECT_THAT(refusal("1.0000001"), HasSubstr("'1.0000001' is not a whole number of bytes"));
  EXPECT_THAT(refusal("0.0001KB"), HasSubstr("is not a whole number of bytes (it is 0.1)"));
}

// The path's rule beyond its format: no index alone, no file of another
// kind overwritten, no file in a sharded export's folder (nor a remat
// model.safetensors in a folder exported into), and the temporaries of an
// export stopped half-way removed (logged) before the room is checked, or
// named where a process holds them.
TEST(Export, PathsThatWouldLoseOrHideFilesAreRefused) {
  const std::string dir = job_dir("paths");
  Trained run(1, 2);
  ExportOptions small;
  small.max_shard_bytes = 4000;
  run.engine->export_model(dir + "/sd/", small);
  run.engine->export_model(dir + "/model.pt");
  run.engine->export_model(dir + "/single.safetensors");
  if (world()->rank() == 0) {
    const auto refused = [](const std::string& path) {
      return error_of<ConfigError>([&] { check_export_path(path, "--export"); });
    };
    EXPECT_THAT(refused(dir + "/sd/model.safetensors.index.json"),
                HasSubstr("ends in .json: an export writes weights, never an index alone. For a sharded safetensors "
                          "export give its folder (e.g. '" + dir + "/sd/')"));
    EXPECT_THAT(refused(dir + "/new.JSON"), HasSubstr("ends in .json"));
    EXPECT_THAT(refused(dir + "/sd/model.safetensors"),
                HasSubstr("which holds model.safetensors.index.json, a sharded export: a file there would be read "
                          "instead of its shards"));
    // A pickle over a safetensors export and back: both are remat's.
    EXPECT_NO_THROW(check_export_path(dir + "/model.pt"));
    fs::copy_file(dir + "/model.pt", dir + "/other.safetensors");
    EXPECT_NO_THROW(check_export_path(dir + "/other.safetensors"));
    EXPECT_NO_THROW(check_export_path(dir + "/single.safetensors"));
    fs::copy_file(dir + "/single.safetensors", dir + "/single.pt");
    EXPECT_NO_THROW(check_export_path(dir + "/single.pt"));
    std::ofstream(dir + "/notes.pt") << "mine!";
    EXPECT_THAT(refused(dir + "/notes.pt"),
                HasSubstr("'" + dir + "/notes.pt' exists and is a file of 5 bytes that is neither a pickle archive "
                          "(a zip, which starts 'PK\\x03\\x04') nor a safetensors file of remat's export: the export "
                          "would overwrite it with a pickle archive. Move it away, or give another path"));
    std::ofstream(dir + "/config.SAFETENSORS") << "{\"a\": 1}";
    EXPECT_THAT(refused(dir + "/config.SAFETENSORS"), HasSubstr("exists and is a JSON file: the export would "
                                                                "overwrite it with a safetensors file"));
    {
      SafetensorsWriter out(dir + "/theirs.safetensors", {{"w", at::kFloat, {2}}});
      out.write("w", at::ones({2}));
      out.finish();
    }
    EXPECT_THAT(refused(dir + "/theirs.safetensors"),
                HasSubstr("exists and is a safetensors file that remat's export did not write"));
    std::ofstream(dir + "/empty.pt");
    EXPECT_NO_THROW(check_export_path(dir + "/empty.pt"));
    fs::create_directories(dir + "/one");
    fs::copy_file(dir + "/single.safetensors", dir + "/one/model.safetensors");
    EXPECT_THAT(refused(dir + "/one"), HasSubstr("is a folder holding 'model.safetensors', a single-file export of "
                                                 "remat's: readers (Hugging Face's from_pretrained, remat's) take it "
                                                 "before a sharded export's index"));

    // Temporaries: two a killed export left (one of a shard count this
    // export will not write, so no writer of its own would meet it), one a
    // process holds, a look-alike of another name and a user's file.
    const auto put = [](const std::string& path, size_t bytes) { std::ofstream(path) << std::string(bytes, 'x'); };
    put(dir + "/sd/model-00001-of-00099.safetensors.remat-tmp.Ab12Cd", 3000);
    put(dir + "/sd/model.safetensors.index.json.remat-tmp.zzzzzz", 10);
    put(dir + "/sd/model-00002-of-00099.safetensors.remat-tmp.HELD00", 700);
    put(dir + "/model.pt.remat-tmp.q1w2e3", 500);
    put(dir + "/model.ptx.remat-tmp.q1w2e3", 400);
    put(dir + "/model.pt.remat-tmp.mine", 300);
    const int held = ::open((dir + "/sd/model-00002-of-00099.safetensors.remat-tmp.HELD00").c_str(), O_RDONLY);
    ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
    const std::string message = error_of<ConfigError>([&] { check_export_space(dir + "/sd", int64_t{1} << 60); });
    EXPECT_THAT(message, HasSubstr(" free (and 1 temporary files of an export there, which remat did not remove "
                                   "because a process holds them or they have other names, take 700 bytes: '" +
                                   dir + "/sd/model-00002-of-00099.safetensors.remat-tmp.HELD00'): free space"));
    EXPECT_FALSE(fs::exists(dir + "/sd/model-00001-of-00099.safetensors.remat-tmp.Ab12Cd"));
    EXPECT_FALSE(fs::exists(dir + "/sd/model.safetensors.index.json.remat-tmp.zzzzzz"));
    check_export_space(dir + "/model.pt", 1);
    EXPECT_FALSE(fs::exists(dir + "/model.pt.remat-tmp.q1w2e3"));
    EXPECT_TRUE(fs::exists(dir + "/model.ptx.remat-tmp.q1w2e3"));
    EXPECT_TRUE(fs::exists(dir + "/model.pt.remat-tmp.mine"));
    ::close(held);
  }
  world()->barrier()->wait();
  // The held one is stale now: the export into the folder removes it.
  run.engine->export_model(dir + "/sd/", small);
  if (world()->rank() == 0) {
    EXPECT_FALSE(fs::exists(dir + "/sd/model-00002-of-00099.safetensors.remat-tmp.HELD00"));
    EXPECT_NO_THROW(SafetensorsSet::open(dir + "/sd"));
  }
  done(dir);
}

// An export into an earlier export's folder that fails half-way through its
// renames is the same Error on every rank and leaves a folder that readers
// refuse (its index removed first), never a mix of both exports.
TEST(Export, AReExportThatFailsHalfWayLeavesAFolderNoReaderTakes) {
  const std::string dir = job_dir("mix");
  Trained run(1, 3);
  ExportOptions tiny;
  tiny.max_shard_bytes = 2000;
  run.engine->export_model(dir + "/sd/", tiny);
  ::setenv(knobs::kFaultExportRenameFail, "3", 1);
  const std::string message = error_of<Error>([&] { run.engine->export_model(dir + "/sd", tiny); });
  ::unsetenv(knobs::kFaultExportRenameFail);
  EXPECT_THAT(message, HasSubstr("cannot put the file in place (Input/output error)"));
  EXPECT_THAT(message, HasSubstr("the folder has no index now, so readers refuse it: export again"));
  if (world()->size() > 1) {
    EXPECT_THAT(message, HasSubstr("failed on rank 0 of"));
  }
  if (world()->rank() == 0) {
    EXPECT_FALSE(fs::exists(dir + "/sd/model.safetensors.index.json"));
    EXPECT_THAT(error_of<ConfigError>([&] { SafetensorsSet::open(dir + "/sd"); }),
                HasSubstr("an export into it was interrupted or failed before writing its index"));
  }
  world()->barrier()->wait();
  run.engine->export_model(dir + "/sd", tiny);
  if (world()->rank() == 0) {
    EXPECT_GT(SafetensorsSet::open(dir + "/sd").files().size(), 3u);
  }
  done(dir);
}

}  // namespace
}  // namespace remat
