// Saves resumed at another data-parallel size and ZeRO stage, and the
// one-file export, under mpirun at 4 ranks: groups of 1 to 4 ranks (split from
// the world) save and load, so that one job covers N != M both ways.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine/export.h"
#include "optim/optimizer.h"
#include "engine/save/train_state.h"
#include "engine/save_dir.h"
#include "models/gpt.h"
#include "parallel/layers.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using remat::testing::world;

// A shared folder for this job (rank 0 names it).
std::string job_dir(const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir = (fs::temp_directory_path() / str("remat_train_state_", stamp.item<int64_t>(), "_", name)).string();
  if (world()->rank() == 0) fs::create_directories(dir);
  world()->barrier()->wait();
  return dir;
}

// The first `n` ranks of the world as one group (null elsewhere).
std::shared_ptr<Communicator> first(int n) {
  return world()->split(world()->rank() < n ? 0 : -1, world()->rank());
}

// The GPT trained through the engine on `group`; the saves are written and
// read through train_state.h directly, with the engine's sharding and optimizer.
struct Trainer {
  std::shared_ptr<Communicator> group;
  std::shared_ptr<ParallelLayout> layout;
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;
  parallel::ZeroModel* zero = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  int64_t steps = 0;

  // `freeze`: the first block's parameters are frozen (requires_grad false).
  Trainer(std::shared_ptr<Communicator> g, int stage, int hybrid = 0, bool freeze = false) : group(std::move(g)) {
    layout = std::make_shared<ParallelLayout>(group, ParallelDims::from_world(group->size(), 1));
    at::manual_seed(5);
    model = models::Gpt(remat::testing::small_gpt(31, 2, /*dropout=*/0.0));
    if (freeze) {
      for (const auto& item : model->named_parameters()) {
        if (item.key().rfind("blocks.0.", 0) == 0) item.value().requires_grad_(false);
      }
    }
    // Some whole parameters at stage 3 too, several buckets at stages 1 and 2.
    const Config config = parse_config(
        str(R"({"train_micro_batch_size_per_gpu": 2, "train": {"seed": 5},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
                "zero_optimization": {"stage": )", stage, R"(, "hybrid_shard_size": )", hybrid,
            R"(, "stage3_param_persistence_threshold": 40, "reduce_bucket_size": 700}})"),
        "<train_state_test>");
    EngineOptions options;
    options.layout = layout;
    engine = initialize(model, config, options);
    zero = &engine->sharding();
    optimizer = &engine->optimizer();
  }

  double step() {
    at::Tensor idx = at::arange(2 * 10, at::kLong).view({2, 10}).mul(layout->dp_rank() + 1).add(steps * 3).remainder(31);
    at::Tensor loss = engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); });
    engine->backward(loss);
    engine->step();
    ++steps;
    return loss.item<double>();
  }

  TrainShards shards() const { return train_shards(*zero, *layout, *model); }

  SaveIdentity identity() const {
    SaveIdentity id;
    id.model_signature = model->options().to_string();
    id.run_id = "test-run";
    id.settings = {{"optimizer.type", "AdamW"}};
    return id;
  }

  // Each parameter's optimizer field (or value: "") whole, by name: every
  // rank contributes the elements its tensors hold; the lowest rank holding
  // an element provides it.
  std::map<std::string, at::Tensor> consolidated(const std::string& field) const {
    std::map<std::string, at::Tensor> full, held;
    for (const auto& item : model->named_parameters()) {
      full[item.key()] = at::zeros({item.value().numel()}, at::kFloat);
      held[item.key()] = at::zeros({item.value().numel()}, at::kFloat);
    }
    const auto params = zero->parameters();
    const auto lay = zero->layout();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor values = field.empty() ? params[i].detach() : optim::optimizer_state_of(*optimizer, params[i]).at(field);
      values = values.reshape({-1});
      for (const auto& s : lay[i].segments) {
        full[s.name].narrow(0, s.param_offset, s.length).copy_(values.narrow(0, s.shard_offset, s.length));
        held[s.name].narrow(0, s.param_offset, s.length).fill_(1);
      }
    }
    const int n = group->size();
    for (auto& [name, t] : full) {
      at::Tensor all = at::empty({n * t.numel()}, at::kFloat), masks = at::empty({n * t.numel()}, at::kFloat);
      group->allGather(all, t)->wait();
      group->allGather(masks, held[name])->wait();
      at::Tensor out = at::zeros_like(t), done = at::zeros_like(t, at::kBool);
      for (int r = 0; r < n; ++r) {
        at::Tensor mine = masks.narrow(0, r * t.numel(), t.numel()).gt(0).logical_and(done.logical_not());
        out = at::where(mine, all.narrow(0, r * t.numel(), t.numel()), out);
        done = done.logical_or(mine);
      }
      EXPECT_TRUE(done.all().item<bool>()) << name << " is not held by any rank";
      t = out;
    }
    return full;
  }
};

void expect_bitwise(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    EXPECT_TRUE(at::equal(t, b.at(name))) << what << ": " << name;
  }
}

struct Case {
  int save_ranks, save_stage, save_hybrid, load_ranks, load_stage, load_hybrid;
};

// Saved at one size and stage, loaded at another: every parameter and every
// optimizer moment equals the saved one, and training goes on.
TEST(TrainState, ResumesAtAnotherDataParallelSizeAndStage) {
  if (world()->size() != 4) GTEST_SKIP() << "needs 4 ranks (runs in the 4-rank variant)";
  const std::vector<Case> cases = {
      {2, 3, 0, 3, 1, 0}, {2, 3, 0, 4, 2, 0}, {4, 2, 0, 2, 3, 0}, {3, 1, 0, 1, 0, 0},
      {4, 3, 2, 3, 2, 0}, {1, 0, 0, 4, 1, 2}, {2, 2, 0, 2, 2, 0},
  };
  for (const auto& c : cases) {
    const std::string what = str("dp ", c.save_ranks, " stage ", c.save_stage, " hybrid ", c.save_hybrid, " -> dp ",
                                 c.load_ranks, " stage ", c.load_stage, " hybrid ", c.load_hybrid);
    const std::string dir = job_dir(str(c.save_ranks, c.save_stage, c.save_hybrid, c.load_ranks, c.load_stage));
    std::map<std::string, at::Tensor> values, exp_avg, exp_avg_sq;
    at::Tensor saved = at::zeros({3}, at::kDouble);  // consolidated, broadcast to every rank as a file
    auto group = first(c.save_ranks);
    if (group) {
      Trainer t(group, c.save_stage, c.save_hybrid);
      for (int i = 0; i < 3; ++i) t.step();
      save_train_state(dir, {3, R"({"data_window": 7})"}, t.shards(), *t.optimizer, t.identity(), *group);
      values = t.consolidated("");
      exp_avg = t.consolidated("exp_avg");
      exp_avg_sq = t.consolidated("exp_avg_sq");
      if (group->rank() == 0) {
        std::vector<std::pair<std::string, at::Tensor>> all;
        for (const auto& [k, v] : values) all.emplace_back("value/" + k, v);
        for (const auto& [k, v] : exp_avg) all.emplace_back("exp_avg/" + k, v);
        for (const auto& [k, v] : exp_avg_sq) all.emplace_back("exp_avg_sq/" + k, v);
        write_model_file(dir + "/expected.pt", all);
      }
    }
    world()->barrier()->wait();
    std::ifstream in(dir + "/expected.pt", std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto dict = torch::pickle_load(bytes).toGenericDict();
    std::map<std::string, at::Tensor> want_values, want_avg, want_avg_sq;
    for (const auto& item : dict) {
      const std::string key = item.key().toStringRef();
      const auto slash = key.find('/');
      auto& into = key.substr(0, slash) == "value" ? want_values : key.substr(0, slash) == "exp_avg" ? want_avg : want_avg_sq;
      into[key.substr(slash + 1)] = item.value().toTensor();
    }
    auto load_group = first(c.load_ranks);
    if (load_group) {
      Trainer t(load_group, c.load_stage, c.load_hybrid);
      const TrainPosition p = load_train_state(dir, t.shards(), *t.optimizer, t.identity(), *load_group);
      EXPECT_EQ(p.step, 3) << what;
      EXPECT_EQ(p.client_state, R"({"data_window":7})") << what;
      expect_bitwise(t.consolidated(""), want_values, what + " parameters");
      expect_bitwise(t.consolidated("exp_avg"), want_avg, what + " exp_avg");
      expect_bitwise(t.consolidated("exp_avg_sq"), want_avg_sq, what + " exp_avg_sq");
      for (const auto& p : t.zero->parameters()) {
        EXPECT_EQ(optim::optimizer_state_of(*t.optimizer, p).at("step").item<int64_t>(), 3) << what;
      }
      // The model's own parameters are the loaded ones once gathered.
      std::map<std::string, at::Tensor> full;
      for (const auto& [k, v] : t.zero->full_parameters()) full[k] = v.reshape({-1});
      expect_bitwise(full, want_values, what + " full_parameters()");
      const double loss = t.step();
      EXPECT_TRUE(std::isfinite(loss)) << what;
    }
    world()->barrier()->wait();
    if (world()->rank() == 0) fs::remove_all(dir);
  }
}

// Unchanged size and stage: the run continues bitwise.
TEST(TrainState, SameLayoutContinuesBitwise) {
  const int n = world()->size();
  for (int stage : {0, 1, 2, 3}) {
    const std::string dir = job_dir(str("same", stage));
    std::vector<double> whole, resumed;
    {
      Trainer t(world(), stage);
      for (int i = 0; i < 2; ++i) t.step();
      save_train_state(dir, {2}, t.shards(), *t.optimizer, t.identity(), *world());
      for (int i = 0; i < 3; ++i) whole.push_back(t.step());
    }
    {
      Trainer t(world(), stage);
      load_train_state(dir, t.shards(), *t.optimizer, t.identity(), *world());
      t.steps = 2;
      for (int i = 0; i < 3; ++i) resumed.push_back(t.step());
    }
    EXPECT_EQ(whole, resumed) << "stage " << stage << " at " << n << " ranks";
    world()->barrier()->wait();
    if (world()->rank() == 0) fs::remove_all(dir);
  }
}

// A path the export cannot be written to is refused before the parameters are
// gathered, as the same ConfigError kind on every rank (it used to fail on
// rank 0 only after gathering and writing: "it is a directory now").
TEST(Export, AFolderHoldingOtherFilesIsRefusedOnEveryRankBeforeGathering) {
  const std::string dir = job_dir("export_dir");
  if (world()->rank() == 0) std::ofstream(dir + "/notes.txt") << "the user's";
  Trainer t(world(), 3);
  t.step();
  const std::string message = remat::testing::error_of<ConfigError>(
      [&] { export_model(dir, *t.zero, *t.model, *world()); });
  // Rank 0 checks; every rank raises its message.
  EXPECT_THAT(message, ::testing::HasSubstr(str("remat::Engine::export_model '", dir,
                                                "' is a folder holding 'notes.txt', which is not a remat "
                                                "safetensors export's")));
  EXPECT_THAT(message, ::testing::HasSubstr(str("(the export's path check failed on rank 0 of ", world()->size(),
                                                "; every rank stops with this error)")));
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

// The export holds every parameter whole under its state-dict name, bitwise
// equal to the gathered parameters, and reads back with torch::pickle_load.
TEST(Export, PickleLoadReadsTheGatheredParameters) {
  for (int stage : {0, 1, 2, 3}) {
    const std::string dir = job_dir(str("export", stage));
    Trainer t(world(), stage);
    for (int i = 0; i < 2; ++i) t.step();
    const std::string path = dir + "/model.pt";
    const int64_t bytes = export_model(path, *t.zero, *t.model, *world());
    EXPECT_EQ(bytes > 0, world()->rank() == 0);
    const auto gathered = t.zero->full_parameters();
    std::ifstream in(path, std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto dict = torch::pickle_load(data).toGenericDict();
    EXPECT_EQ(static_cast<size_t>(dict.size()), gathered.size());
    for (const auto& [name, value] : gathered) {
      ASSERT_TRUE(dict.contains(name)) << name;
      at::Tensor loaded = dict.at(name).toTensor();
      EXPECT_EQ(loaded.sizes(), t.model->named_parameters()[name].sizes()) << name;
      EXPECT_TRUE(at::equal(loaded, value)) << "stage " << stage << ": " << name;
    }
    if (stage == 0) {  // whole on every rank already
      for (const auto& item : t.model->named_parameters()) {
        EXPECT_TRUE(at::equal(dict.at(item.key()).toTensor(), item.value().detach())) << item.key();
      }
    }
    world()->barrier()->wait();
    if (world()->rank() == 0) fs::remove_all(dir);
  }
}

// With tensor parallelism the export holds the full (unsplit) weights: the
// same names and shapes as a tensor-parallel size 1 model's.
TEST(Export, TensorParallelShardsAreGatheredWhole) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  const auto& l = remat::testing::layout(2);
  at::manual_seed(5);
  models::Gpt model(remat::testing::small_gpt(31, 2, 0.0, 2));
  at::manual_seed(5);
  models::Gpt plain(remat::testing::small_gpt(31, 2, 0.0, 1));
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& b : *model->blocks) units.push_back(b);
  parallel::ZeroOptions zc;
  zc.stage = 2;
  parallel::ZeroModel zero(*model, units, l.dp_group(), zc, parallel::Bf16Options{}, parallel::sharded_parameters(*model));
  const auto params = consolidated_parameters(zero, *model);
  ASSERT_EQ(params.size(), plain->named_parameters().size());
  // The size estimate counts shards at their whole size.
  EXPECT_NEAR(static_cast<double>(estimated_export_bytes(*model)),
              static_cast<double>(estimated_export_bytes(*plain)), 2.0);
  for (const auto& [name, value] : params) {
    EXPECT_EQ(value.sizes(), plain->named_parameters()[name].sizes()) << name;
  }
  // Each rank's share is where its layer keeps it.
  for (const auto& item : model->named_modules()) {
    if (auto* tp = dynamic_cast<parallel::TensorParallelModule*>(item.value().get())) {
      const std::string name = item.key() + ".weight";
      for (const auto& [n, v] : params) {
        if (n == name) {
          EXPECT_TRUE(at::equal(v, tp->gather_full_weight())) << name;
        }
      }
    }
  }
}

// The export writes a temporary file of its own beside the path (a PATH.tmp
// of the user's is left alone), refuses a path its rename would replace, and
// reports a failed write as a plain Error (not a configuration error) leaving
// nothing behind; the start-up checks refuse what the write would not do.
// Each rank in its own folder, no collectives.
TEST(Export, WritesBesideThePathAndRefusesWhatItWouldReplace) {
  const std::string dir =
      (fs::temp_directory_path() / str("remat_export_", ::getpid(), "_", world()->rank())).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  at::manual_seed(5);
  models::Gpt model(remat::testing::small_gpt(31, 2, 0.0));
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : model->named_parameters()) params.emplace_back(item.key(), item.value());
  auto leftovers = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      n += e.path().filename().string().find(".remat-tmp.") != std::string::npos;
    }
    return n;
  };

  const std::string path = dir + "/model.pt";
  { std::ofstream(path + ".tmp") << "the user's"; }
  check_export_path(path);
  const int64_t bytes = write_model_file(path, params);
  EXPECT_EQ(bytes, static_cast<int64_t>(fs::file_size(path)));
  std::ifstream user(path + ".tmp");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(user), {}), "the user's");
  EXPECT_EQ(leftovers(), 0);
  // The estimate holds the file, with a margin of a few percent.
  const int64_t estimate = estimated_export_bytes(*model);
  EXPECT_GE(estimate, bytes);
  EXPECT_LE(estimate, bytes + bytes / 20 + 64 * 1024);

  const std::string link = dir + "/link.pt";
  fs::create_symlink(path, link);
  EXPECT_THAT(remat::testing::error_of<ConfigError>([&] { check_export_path(link); }),
              ::testing::HasSubstr("is a symbolic link, not a regular file"));
  EXPECT_THAT(remat::testing::error_of<ConfigError>([&] { check_export_path("/dev/full"); }),
              ::testing::HasSubstr("'/dev/full' is a character device"));
  EXPECT_THAT(remat::testing::error_of<ConfigError>([&] { check_export_path(dir); }),
              ::testing::HasSubstr("which is not a remat safetensors export's"));
  EXPECT_THAT(remat::testing::error_of<ConfigError>([&] { check_export_space(path, int64_t{1} << 60); }),
              ::testing::HasSubstr("KiB) free: free space there"));

  // Write failures: Error, never ConfigError; the symbolic link stays one.
  auto write_error = [&](const std::string& to) -> std::string {
    try {
      write_model_file(to, params);
    } catch (const ConfigError& e) {
      ADD_FAILURE() << "a ConfigError for a failed write: " << e.what();
      return "";
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "writing " << to << " did not fail";
    return "";
  };
  EXPECT_THAT(write_error(link), ::testing::HasSubstr("cannot put the file there (it is a symbolic link now)"));
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_THAT(write_error(dir + "/no/such/model.pt"), ::testing::HasSubstr("cannot create a file in"));
  EXPECT_EQ(leftovers(), 0);
  fs::remove_all(dir);
}

TEST(TrainState, DamagedOrForeignSavesAreClearErrors) {
  const std::string dir = job_dir("damaged");
  {
    Trainer t(world(), 2);
    t.step();
    save_train_state(dir, {1}, t.shards(), *t.optimizer, t.identity(), *world());
  }
  // Another model: elements it lacks are named.
  {
    Trainer t(world(), 1);
    TrainShards s = t.shards();
    s.layout[0].segments[0].name = "no.such.parameter";
    const std::string e = remat::testing::error_of<ConfigError>([&] { load_train_state(dir, s, *t.optimizer, t.identity(), *world()); });
    EXPECT_NE(e.find("holds no values for elements"), std::string::npos) << e;
    EXPECT_NE(e.find("no.such.parameter"), std::string::npos) << e;
  }
  // Another value of a recorded setting: the key, both values and what to do.
  {
    Trainer t(world(), 2);
    SaveIdentity id = t.identity();
    id.settings["optimizer.type"] = "Adam";
    const std::string e = remat::testing::error_of<ConfigError>(
        [&] { load_train_state(dir, t.shards(), *t.optimizer, id, *world()); });
    EXPECT_NE(e.find("made with optimizer.type = AdamW but this run has Adam"), std::string::npos) << e;
    EXPECT_NE(e.find("resume with the override \"optimizer.type=AdamW\" (EngineOptions::overrides;"), std::string::npos) << e;
  }
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

// Rank files renamed among themselves are intact files of this save, not
// damaged ones: the message says so and which name each should have (issue
// 38, item 16). Every rank's file is another's, so every rank reports.
TEST(TrainState, SwappedRankFilesAreNamedAsSwapped) {
  const std::string dir = job_dir("swapped");
  {
    Trainer t(world(), 0);
    t.step();
    save_train_state(dir, {1}, t.shards(), *t.optimizer, t.identity(), *world());
  }
  const int n = world()->size();
  const std::string step = dir + "/step_00000001/";
  if (world()->rank() == 0) {  // rank_i.pt becomes rank_{i+1}.pt
    for (int i = 0; i < n; ++i) fs::rename(str(step, "rank_", i, ".pt"), str(step, "moved_", (i + 1) % n, ".pt"));
    for (int i = 0; i < n; ++i) fs::rename(str(step, "moved_", i, ".pt"), str(step, "rank_", i, ".pt"));
  }
  world()->barrier()->wait();
  Trainer t(world(), 0);
  const int me = world()->rank(), previous = (me + n - 1) % n;
  const std::string e = remat::testing::error_of<ConfigError>(
      [&] { load_train_state(dir, t.shards(), *t.optimizer, t.identity(), *world()); });
  EXPECT_THAT(e, ::testing::HasSubstr(str("rank_", me, ".pt' is intact but holds the file the manifest lists as 'rank_",
                                          previous, ".pt' (rank ", previous, "; same ")));
  EXPECT_THAT(e, ::testing::HasSubstr(str("the rank files of this save were renamed or swapped. Give each its own "
                                          "name back (this one is 'rank_", previous, ".pt')")));
  EXPECT_THAT(e, ::testing::Not(::testing::HasSubstr("damaged")));
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

// Ranks that loaded the same step of two runs' saves: the message names the
// runs, not "step 1 but ... step 1" (issue 38, item 16).
TEST(TrainState, TheSameStepOfAnotherRunIsNamedAsSuch) {
  const std::string a = job_dir("run_a"), b = job_dir("run_b");
  for (const auto& [dir, run] : {std::pair{a, "run-a"}, std::pair{b, "run-b"}}) {
    Trainer t(world(), 0);
    t.step();
    SaveIdentity id = t.identity();
    id.run_id = run;
    save_train_state(dir, {1}, t.shards(), *t.optimizer, id, *world());
  }
  Trainer t(world(), 0);
  const std::string e = remat::testing::error_of<ConfigError>(
      [&] { load_train_state(world()->rank() == 0 ? a : b, t.shards(), *t.optimizer, t.identity(), *world()); });
  EXPECT_THAT(e, ::testing::HasSubstr("resume: rank 1 loaded step 1 of another run than rank 0 did (from different "
                                      "saves): resume every rank from the same step folder"));
  EXPECT_THAT(e, ::testing::Not(::testing::HasSubstr("but rank 0 loaded step 1")));
  world()->barrier()->wait();
  if (world()->rank() == 0) {
    fs::remove_all(a);
    fs::remove_all(b);
  }
}

// A manifest is protected by its own checksum: two parameter names of the
// same size swapped (every field still well-formed) is refused naming it.
TEST(TrainState, AnEditedManifestIsRefused) {
  const std::string dir = job_dir("edited");
  {
    Trainer t(world(), 0);
    t.step();
    save_train_state(dir, {1}, t.shards(), *t.optimizer, t.identity(), *world());
  }
  const std::string manifest = dir + "/step_00000001/manifest.json";
  if (world()->rank() == 0) {
    std::ifstream in(manifest);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    in.close();
    const std::string a = "\"blocks.0.ln1.weight\"", b = "\"blocks.0.ln2.weight\"";
    for (size_t at = 0; (at = text.find(a, at)) != std::string::npos;) text.replace(at, a.size(), "\"SWAP\"");
    for (size_t at = 0; (at = text.find(b, at)) != std::string::npos;) text.replace(at, b.size(), a);
    for (size_t at = 0; (at = text.find("\"SWAP\"", at)) != std::string::npos;) text.replace(at, 6, b);
    std::ofstream(manifest, std::ios::trunc) << text;
  }
  world()->barrier()->wait();
  Trainer t(world(), 0);
  const std::string e = remat::testing::error_of<ConfigError>(
      [&] { load_train_state(dir, t.shards(), *t.optimizer, t.identity(), *world()); });
  EXPECT_NE(e.find("manifest.json' was modified or damaged after it was saved"), std::string::npos) << e;
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

// `latest` never moves back to an earlier step; discard_saves_after removes
// the later saves and points it at the newest one left.
TEST(TrainState, LatestNeverMovesBack) {
  const std::string dir = job_dir("latest");
  auto latest = [&] {
    std::ifstream in(dir + "/latest");
    std::string name;
    in >> name;
    return name;
  };
  Trainer t(world(), 1);
  t.step();
  save_train_state(dir, {3}, t.shards(), *t.optimizer, t.identity(), *world());
  save_train_state(dir, {2}, t.shards(), *t.optimizer, t.identity(), *world());
  // Rank 0 writes `latest` (and alone reads it in remat-train): checked
  // there, once every rank is past the saves.
  const bool writer = world()->rank() == 0;
  world()->barrier()->wait();
  if (writer) {
    EXPECT_EQ(latest(), "step_00000003");
    EXPECT_EQ(latest_step(dir), 3);
  }
  EXPECT_EQ(discard_saves_after(dir, 2, *world()), 1);
  world()->barrier()->wait();
  if (writer) {
    EXPECT_EQ(latest(), "step_00000002");
    EXPECT_FALSE(fs::exists(dir + "/step_00000003"));
  }
  EXPECT_EQ(discard_saves_after(dir, 0, *world()), 1);
  world()->barrier()->wait();
  if (writer) {
    EXPECT_FALSE(fs::exists(dir + "/latest"));
  }
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

// --overwrite-saves once the new run's first save (step 2) is complete: the
// old run's saves go, its own stays, and `latest` (on the old step 4) names it.
TEST(TrainState, DiscardKeepsTheNewRunsFirstSave) {
  const std::string dir = job_dir("discard_except");
  Trainer t(world(), 1);
  t.step();
  for (int64_t step : {1, 3, 4, 2}) save_train_state(dir, {step}, t.shards(), *t.optimizer, t.identity(), *world());
  world()->barrier()->wait();
  EXPECT_EQ(discard_saves_after(dir, 0, *world(), 2), 3);
  world()->barrier()->wait();
  if (world()->rank() == 0) {
    EXPECT_EQ(latest_step(dir), 2);
    for (int64_t step : {1, 3, 4}) EXPECT_FALSE(fs::exists(dir + str("/step_0000000", step))) << step;
    EXPECT_TRUE(fs::exists(dir + "/step_00000002/manifest.json"));
  }
  world()->barrier()->wait();
  if (world()->rank() == 0) fs::remove_all(dir);
}

// Frozen parameters travel with saves and exports: unchanged by training, in
// the export, and restored by a resume at another stage (over values the
// resuming model does not share).
TEST(TrainState, FrozenParametersAreSavedExportedAndRestored) {
  for (int save_stage : {3, 1}) {
    const std::string dir = job_dir(str("frozen", save_stage));
    std::map<std::string, at::Tensor> initial;
    {
      Trainer t(world(), save_stage, 0, /*freeze=*/true);
      for (const auto& [k, v] : t.zero->full_parameters()) {
        if (k.rfind("blocks.0.", 0) == 0) initial[k] = v;
      }
      ASSERT_FALSE(initial.empty());
      for (int i = 0; i < 2; ++i) t.step();
      save_train_state(dir, {2}, t.shards(), *t.optimizer, t.identity(), *world());
      export_model(dir + "/model.pt", *t.zero, *t.model, *world());
      for (const auto& [k, v] : t.zero->full_parameters()) {
        if (initial.count(k)) {
          EXPECT_TRUE(at::equal(v, initial.at(k))) << "trained, stage " << save_stage << ": " << k;
        }
      }
    }
    world()->barrier()->wait();
    std::ifstream in(dir + "/model.pt", std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto dict = torch::pickle_load(data).toGenericDict();
    for (const auto& [k, v] : initial) {
      ASSERT_TRUE(dict.contains(k)) << k;
      EXPECT_TRUE(at::equal(dict.at(k).toTensor(), v)) << "exported, stage " << save_stage << ": " << k;
    }
    const int load_stage = save_stage == 3 ? 1 : 3;
    Trainer t(world(), load_stage, 0, /*freeze=*/true);
    {
      at::NoGradGuard no_grad;
      for (auto& p : t.zero->parameters()) {
        if (!p.requires_grad()) p.zero_();  // what the load must overwrite
      }
    }
    load_train_state(dir, t.shards(), *t.optimizer, t.identity(), *world());
    t.step();
    for (const auto& [k, v] : t.zero->full_parameters()) {
      if (initial.count(k)) {
        EXPECT_TRUE(at::equal(v, initial.at(k))) << "stage " << save_stage << " -> " << load_stage << ": " << k;
      }
    }
    world()->barrier()->wait();
    if (world()->rank() == 0) fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace remat
