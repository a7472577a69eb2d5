// Saves resumed at another tensor-parallel size, under mpirun at 2 and 4
// ranks: a tp 2 x dp 2 save (ZeRO stage 3, and stage 0) resumes at tp 1 x dp 4,
// tp 4 x dp 1 and tp 1 x dp 1 (every rank alone), and at 2 ranks tp 2 x dp 1
// goes to tp 1 x dp 2 and back. After the re-slice every parameter and AdamW
// moment, gathered whole, is bitwise the saved one, the export is byte for
// byte the save's, and the losses that follow equal those of a run that
// trained at the new layout from the start within 1e-6 (relative; the GPT's
// initialisation is the same at every tensor-parallel size, dropout is 0, the
// sums run in another order). Also: exports right after initialisation are
// the same file at every tensor-parallel size; another whole shape is named;
// a save without splits (an earlier remat's) is refused at another size.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/optimizer.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/engine.h"
#include "optim/optimizer.h"
#include "engine/save/train_state.h"
#include "models/gpt.h"
#include "parallel/layers.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using remat::testing::error_of;
using remat::testing::world;

constexpr int64_t kVocab = 31, kBatch = 4, kSeq = 12, kSaveAt = 2, kMore = 2;

// A shared folder for this job (rank 0 names it), removed by `done`.
std::string job_dir(const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir = (fs::temp_directory_path() / str("remat_tp_resume_", stamp.item<int64_t>(), "_", name)).string();
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

// The GPT trained through the engine at tp x dp over `group` (its ranks),
// on one global batch of kBatch sequences split over the data-parallel ranks.
struct TpRun {
  std::shared_ptr<ParallelLayout> layout;
  models::Gpt model{nullptr};
  std::unique_ptr<Engine> engine;
  int64_t steps = 0;

  TpRun(std::shared_ptr<Communicator> group, int tp, int stage, int64_t vocab = kVocab) {
    layout = std::make_shared<ParallelLayout>(group, ParallelDims::from_world(group->size(), tp));
    at::manual_seed(5);
    models::GptOptions o = remat::testing::small_gpt(vocab, 2, /*dropout=*/0.0);
    if (tp > 1) o.tensor_parallel = layout->tp_group();
    model = models::Gpt(o);
    const Config config = parse_config(
        str(R"({"train_micro_batch_size_per_gpu": )", kBatch / layout->dims().dp, R"(, "train": {"seed": 5},
                "tensor_parallel": {"size": )", tp, R"(},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
                "zero_optimization": {"stage": )", stage,
            R"(, "stage3_param_persistence_threshold": 40, "reduce_bucket_size": 700}})"),
        "<tp_resume_test>");
    EngineOptions options;
    options.layout = layout;
    engine = initialize(model, config, options);
  }

  // The global mean loss of the step.
  double step() {
    const int64_t share = kBatch / layout->dims().dp;
    at::Tensor all = at::arange(kBatch * kSeq, at::kLong).view({kBatch, kSeq}).mul(7).add(steps * 3).remainder(kVocab);
    at::Tensor idx = all.narrow(0, layout->dp_rank() * share, share);
    engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
    engine->step();
    ++steps;
    return engine->last_metrics().loss;
  }

  TrainShards shards() const { return train_shards(engine->sharding(), *layout, *model); }

  SaveIdentity identity() const {
    SaveIdentity id;
    id.model_signature = model->options().to_string();
    id.run_id = "test-run";
    id.settings = {{"optimizer.type", "AdamW"}, {"train.seed", "5"}};
    id.seed = 5;
    return id;
  }

  // Each parameter's value ("") or optimizer field, whole: this tensor-parallel
  // rank's share assembled from the data-parallel ranks' shards (the lowest
  // rank holding an element provides it), then gathered over the
  // tensor-parallel group by its layer (gather_full). The same on every rank.
  std::map<std::string, at::Tensor> whole(const std::string& field) const {
    auto& zero = engine->sharding();
    std::map<std::string, at::Tensor> share, held;
    std::map<std::string, std::vector<int64_t>> sizes;
    for (const auto& item : model->named_parameters()) {
      share[item.key()] = at::zeros({item.value().numel()}, at::kFloat);
      held[item.key()] = at::zeros({item.value().numel()}, at::kFloat);
      sizes[item.key()] = item.value().sizes().vec();
    }
    const auto params = zero.parameters();
    const auto lay = zero.layout();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor values =
          field.empty() ? params[i].detach() : optim::optimizer_state_of(engine->optimizer(), params[i]).at(field);
      values = values.reshape({-1});
      for (const auto& s : lay[i].segments) {
        share[s.name].narrow(0, s.param_offset, s.length).copy_(values.narrow(0, s.shard_offset, s.length));
        held[s.name].narrow(0, s.param_offset, s.length).fill_(1);
      }
    }
    std::map<std::string, const parallel::TensorParallelModule*> layers;
    for (const auto& item : model->named_modules()) {
      if (auto* tp = dynamic_cast<const parallel::TensorParallelModule*>(item.value().get())) layers[item.key()] = tp;
    }
    const auto& dp = layout->dp_group();
    const int n = dp->size();
    std::map<std::string, at::Tensor> out;
    for (auto& [name, t] : share) {
      at::Tensor all = at::empty({n * t.numel()}, at::kFloat), masks = at::empty({n * t.numel()}, at::kFloat);
      dp->allGather(all, t)->wait();
      dp->allGather(masks, held[name])->wait();
      at::Tensor mine = at::zeros_like(t), taken = at::zeros_like(t, at::kBool);
      for (int r = 0; r < n; ++r) {
        at::Tensor from = masks.narrow(0, r * t.numel(), t.numel()).gt(0).logical_and(taken.logical_not());
        mine = at::where(from, all.narrow(0, r * t.numel(), t.numel()), mine);
        taken = taken.logical_or(from);
      }
      EXPECT_TRUE(taken.all().item<bool>()) << name << " is not held by any data-parallel rank";
      mine = mine.view(sizes[name]);
      const auto dot = name.rfind('.');
      auto layer = layers.find(name.substr(0, dot));
      out[name] = layer == layers.end() ? mine : layer->second->gather_full(name.substr(dot + 1), mine).contiguous();
    }
    return out;
  }
};

void expect_bitwise(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    EXPECT_EQ(t.sizes(), b.at(name).sizes()) << what << ": " << name;
    EXPECT_TRUE(at::equal(t, b.at(name))) << what << ": " << name;
  }
}

// Within 1e-6 relative, loss by loss; the largest difference is printed.
void expect_close(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), 1e-6 * std::abs(b[i])) << what << ", loss " << i << ": " << a[i] << " vs " << b[i];
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  }
  if (world()->rank() == 0) std::printf("[tp-resume] %s: %zu losses, max relative difference %.3g\n", what.c_str(), a.size(), worst);
}

// What a save holds, gathered whole at its layout.
struct Saved {
  std::map<std::string, at::Tensor> values, exp_avg, exp_avg_sq;
  std::string exported;  // the export's bytes
};

Saved train_and_save(TpRun& run, const std::string& dir, std::vector<double>& losses) {
  for (int64_t i = 0; i < kSaveAt; ++i) losses.push_back(run.step());
  save_train_state(dir, {kSaveAt, R"({"window": 3})"}, run.shards(), run.engine->optimizer(), run.identity(),
                   *run.layout->world());
  Saved s{run.whole(""), run.whole("exp_avg"), run.whole("exp_avg_sq"), ""};
  run.engine->export_model(dir + "/saved.pt");
  s.exported = read_bytes(dir + "/saved.pt");  // every rank of the group once rank 0 wrote it
  return s;
}

struct Layout {
  int tp, stage;
  bool alone = false;  // every rank alone (tp 1 x dp 1)
};

std::string name_of(const Layout& l, int ranks) {
  return str("tp ", l.tp, " x dp ", l.alone ? 1 : ranks / l.tp, " stage ", l.stage);
}

// Loads `dir` at layout `to`, checks the re-slice bitwise and the export byte
// for byte, and trains on: losses within 1e-6 of an uninterrupted run at `to`.
void resume_and_compare(const std::string& dir, const Saved& saved, const Layout& to, const std::string& what) {
  auto group = to.alone ? world()->split(world()->rank(), 0) : world();
  std::vector<double> resumed, uninterrupted;
  {
    TpRun run(group, to.tp, to.stage);
    // Through the engine, as remat-train resumes (stages 1 and 2 then gather
    // the loaded shards into the parameters).
    EXPECT_EQ(run.engine->load_checkpoint(dir).dump(), R"({"window":3})") << what;
    expect_bitwise(run.whole(""), saved.values, what + ": parameters");
    expect_bitwise(run.whole("exp_avg"), saved.exp_avg, what + ": exp_avg");
    expect_bitwise(run.whole("exp_avg_sq"), saved.exp_avg_sq, what + ": exp_avg_sq");
    for (const auto& t : run.engine->sharding().parameters()) {
      EXPECT_EQ(optim::optimizer_state_of(run.engine->optimizer(), t).at("step").item<int64_t>(), kSaveAt) << what;
    }
    const std::string path = str(dir, "/resumed_", world()->rank(), ".pt");
    run.engine->export_model(path);
    if (group->rank() == 0) {
      EXPECT_TRUE(read_bytes(path) == saved.exported) << what << ": the export differs from the save's";
    }
    run.steps = kSaveAt;
    for (int64_t i = 0; i < kMore; ++i) resumed.push_back(run.step());
  }
  {
    TpRun run(group, to.tp, to.stage);
    for (int64_t i = 0; i < kSaveAt + kMore; ++i) {
      const double loss = run.step();
      if (i >= kSaveAt) uninterrupted.push_back(loss);
    }
  }
  expect_close(resumed, uninterrupted, what + ": losses after the resume vs uninterrupted");
}

TEST(TpResume, FourRanksToEveryOtherTensorParallelSize) {
  if (world()->size() != 4) GTEST_SKIP() << "needs 4 ranks (runs in the 4-rank variant)";
  for (int save_stage : {3, 0}) {
    const std::string dir = job_dir(str("four", save_stage));
    const Layout from{2, save_stage};
    std::vector<double> losses;
    Saved saved;
    {
      TpRun run(world(), from.tp, from.stage);
      saved = train_and_save(run, dir, losses);
    }
    {  // the first losses match a tp 1 run's: the same model at every size
      TpRun tp1(world()->split(world()->rank(), 0), 1, 0);
      std::vector<double> plain;
      for (int64_t i = 0; i < kSaveAt; ++i) plain.push_back(tp1.step());
      expect_close(losses, plain, "tp 2 x dp 2 vs tp 1 before the save");
    }
    const std::vector<Layout> targets = save_stage == 3
                                            ? std::vector<Layout>{{1, 1}, {4, 0}, {1, 0, true}}
                                            : std::vector<Layout>{{1, 3}, {4, 2}, {1, 3, true}};
    for (const Layout& to : targets) {
      resume_and_compare(dir, saved, to, name_of(from, 4) + " -> " + name_of(to, 4));
    }
    done(dir);
  }
}

TEST(TpResume, TwoRanksToTensorParallelOneAndBack) {
  if (world()->size() != 2) GTEST_SKIP() << "needs 2 ranks (runs in the 2-rank variant)";
  const std::vector<std::pair<Layout, Layout>> cases = {{{2, 0}, {1, 3}}, {{1, 1}, {2, 0}}};
  for (const auto& [from, to] : cases) {
    const std::string dir = job_dir(str("two", from.tp, from.stage));
    std::vector<double> losses;
    Saved saved;
    {
      TpRun run(world(), from.tp, from.stage);
      saved = train_and_save(run, dir, losses);
    }
    resume_and_compare(dir, saved, to, name_of(from, 2) + " -> " + name_of(to, 2));
    done(dir);
  }
}

// Right after initialisation the export is the same file at every
// tensor-parallel size: the same whole weights, gathered.
TEST(TpResume, ExportsAreTheSameFileAtEveryTensorParallelSize) {
  const std::string dir = job_dir("export");
  std::string reference;
  {
    TpRun run(world()->split(world()->rank(), 0), 1, 0);
    const std::string path = str(dir, "/tp1_", world()->rank(), ".pt");
    run.engine->export_model(path);
    reference = read_bytes(path);
  }
  for (int tp : remat::testing::tp_sizes(4)) {
    for (int stage : {0, 3}) {
      TpRun run(world(), tp, stage);
      run.engine->export_model(dir + "/tp.pt");
      EXPECT_TRUE(read_bytes(dir + "/tp.pt") == reference)
          << "tp " << tp << " stage " << stage << ": the export differs from tp 1's";
      world()->barrier()->wait();
    }
  }
  EXPECT_GT(reference.size(), 1000u);
  done(dir);
}

// A parameter whose whole shape differs is named with both shapes, at the
// same tensor-parallel size and at another; so is one the save lacks.
TEST(TpResume, AnotherWholeShapeIsNamed) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  const std::string dir = job_dir("shape");
  {
    TpRun run(world(), 2, 1);
    run.step();
    save_train_state(dir, {1}, run.shards(), run.engine->optimizer(), run.identity(), *world());
  }
  for (int tp : {2, 1}) {
    TpRun run(world(), tp, 0, /*vocab=*/37);
    SaveIdentity id = run.identity();
    id.model_signature.clear();  // compared by the caller's settings otherwise
    const std::string e = error_of<ConfigError>(
        [&] { load_train_state(dir, run.shards(), run.engine->optimizer(), id, *world()); });
    EXPECT_THAT(e, HasSubstr("holds another model: parameter 'tok_emb.weight' has the whole shape [31, 16] in the "
                             "save but [37, 16] in this model")) << "tp " << tp;
  }
  {  // elements of a parameter the save does not hold, at another size
    TpRun run(world(), 1, 0);
    TrainShards s = run.shards();
    s.layout[0].segments[0].name = "no.such.parameter";
    const std::string e = error_of<ConfigError>(
        [&] { load_train_state(dir, s, run.engine->optimizer(), run.identity(), *world()); });
    EXPECT_THAT(e, HasSubstr("holds no values for parameter 'no.such.parameter' (tensor-parallel rank 0 of 1)"));
  }
  done(dir);
}

// A save as an earlier remat wrote it (format 4: no splits) resumes at its
// own tensor-parallel size and is refused at another, saying why.
TEST(TpResume, ASaveWithoutSplitsResumesAtItsOwnSizeOnly) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  const std::string dir = job_dir("format4");
  std::map<std::string, at::Tensor> values;
  {
    TpRun run(world(), 2, 0);
    run.step();
    save_train_state(dir, {1}, run.shards(), run.engine->optimizer(), run.identity(), *world());
    values = run.whole("");
  }
  if (world()->rank() == 0) {
    const std::string path = dir + "/step_00000001/manifest.json";
    nlohmann::json m = nlohmann::json::parse(read_bytes(path));
    m["format"] = 4;
    m.erase("splits");
    m.erase("manifest_crc32");
    const std::string compact = m.dump();
    m["manifest_crc32"] =
        static_cast<int64_t>(::crc32_z(0L, reinterpret_cast<const Bytef*>(compact.data()), compact.size()));
    std::ofstream(path, std::ios::trunc) << m.dump(1);
  }
  world()->barrier()->wait();
  {
    TpRun run(world(), 1, 0);
    const std::string e = error_of<ConfigError>(
        [&] { load_train_state(dir, run.shards(), run.engine->optimizer(), run.identity(), *world()); });
    EXPECT_THAT(e, HasSubstr("was made with tensor_parallel.size 2 but this run has 1, and it does not record how "
                             "its parameters are split across tensor-parallel ranks (format 4"));
    EXPECT_THAT(e, HasSubstr("Resume with the override \"tensor_parallel.size=2\" (EngineOptions::overrides;"));
  }
  {
    TpRun run(world(), 2, 3);
    load_train_state(dir, run.shards(), run.engine->optimizer(), run.identity(), *world());
    expect_bitwise(run.whole(""), values, "format 4 at its own size");
  }
  done(dir);
}

}  // namespace
}  // namespace remat
