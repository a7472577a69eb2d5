// remat::Engine on a model written as a user would (not one of remat's):
// the step lifecycle, parity across stages and checkpointing, save/resume
// with client state, GatheredParameters, and each misuse's error.
#include "engine/engine.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <cstdlib>
#include <cstring>
#include <set>
#include <type_traits>

#include "optim/optimizer.h"
#include "engine/save_dir.h"
#include "nn/module_call.h"
#include "runtime/error.h"
#include "tests/deepspeed_lr.h"
#include "runtime/layout.h"
#include "tests/error_of.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

constexpr int64_t kVocab = 11, kSeq = 6, kWidth = 8;

struct MlpBlockImpl : torch::nn::Module {
  explicit MlpBlockImpl(double dropout = 0.2) : p(dropout) {
    up = register_module("up", torch::nn::Linear(kWidth, 2 * kWidth));
    down = register_module("down", torch::nn::Linear(2 * kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) {
    return x + at::dropout(down(at::gelu(up(x))), p, is_training());
  }
  double p;
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(MlpBlock);

// An embedding, blocks in a ModuleList called through remat::forward, a
// norm and a head; `frozen`: the embedding does not train.
struct TinyLmImpl : torch::nn::Module {
  explicit TinyLmImpl(int layers = 3, bool frozen = false, double dropout = 0.2) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    layers_list = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) layers_list->push_back(MlpBlock(dropout));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(kWidth, kVocab));
    if (frozen) embed->weight.requires_grad_(false);
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = embed(x);
    for (size_t i = 0; i < layers_list->size(); ++i) {
      h = direct ? layers_list->ptr<MlpBlockImpl>(i)->forward(h) : remat::forward(layers_list->ptr<MlpBlockImpl>(i), h);
    }
    at::Tensor logits = head(norm(h));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers_list{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
  bool direct = false;  // calls its blocks without remat::forward (breaks the contract)
};
TORCH_MODULE(TinyLm);

struct NoBlocksImpl : torch::nn::Module {
  NoBlocksImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(NoBlocks);

std::string config_json(int stage, const std::string& variant, int accumulation = 1,
                        const std::string& optimizer = "AdamW") {
  return str(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": )", accumulation,
             R"(, "optimizer": {"type": ")", optimizer, R"(", "params": {"lr": 0.01}},
                "zero_optimization": {"stage": )", stage, R"(, "stage3_param_persistence_threshold": 0},
                "activation_checkpointing": {"variant": ")", variant, R"("},
                "train": {"seed": 5}})");
}

std::pair<at::Tensor, at::Tensor> batch(int64_t step, int64_t micro) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + 10 * micro +
                                                                           testing::world()->rank()));
  at::Tensor x = at::randint(kVocab, {2, kSeq}, gen, at::kLong);
  at::Tensor y = at::randint(kVocab, {2, kSeq}, gen, at::kLong);
  return {x, y};
}

struct Trainer {
  TinyLm model{nullptr};
  std::unique_ptr<Engine> engine;
  explicit Trainer(const std::string& config, bool frozen = false, EngineOptions options = {}, double dropout = 0.2) {
    Config parsed = parse_config(config, "<test>");
    if (!options.layout) {
      options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                        ParallelDims::from_world(testing::world()->size(), 1));
    }
    at::manual_seed(static_cast<uint64_t>(parsed.train.seed));
    model = TinyLm(3, frozen, dropout);
    engine = initialize(model, parsed, options);
  }
  // Losses of `steps` optimizer steps from the engine's current step.
  std::vector<double> train(int steps) {
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      const int64_t step = engine->global_steps() + 1;
      do {
        auto [x, y] = batch(step, engine->micro_steps());
        engine->backward(engine->forward([&, x = x, y = y] { return model->loss(x, y); }));
        engine->step();
      } while (engine->micro_steps() != 0);
      losses.push_back(engine->last_metrics().loss);
    }
    return losses;
  }
};

std::string scratch(const std::string& name) {
  const std::string dir = (fs::temp_directory_path() / str("remat_engine_test_", name, "_", ::getppid())).string();
  if (testing::world()->rank() == 0) fs::remove_all(dir);
  testing::world()->barrier()->wait();
  return dir;
}

// One micro-step a step: every stage averages the same per-rank gradients in
// one reduction, so every stage and variant gives stage 0's losses bitwise.
TEST(Engine, EveryStageWithAndWithoutCheckpointingMatchesStage0Bitwise) {
  const std::vector<double> reference = Trainer(config_json(0, "none")).train(3);
  for (int stage : {0, 1, 2, 3}) {
    for (const char* variant : {"none", "full", "selective_op"}) {
      const std::vector<double> losses = Trainer(config_json(stage, variant)).train(3);
      EXPECT_EQ(losses, reference) << "stage " << stage << ", variant " << variant;
    }
  }
}

// Two micro-steps a step: stages 0 and 1 sum them on each rank and reduce
// once; stages 2 and 3 reduce each micro-step's gradients and sum the
// averages, a different rounding (equal on LibTorch 1.13 here, one float
// step apart on 2.6). So checkpointing is bitwise within each stage, stage 1
// bitwise with stage 0, and stages 2 and 3 equal stage 0 within float rounding.
TEST(Engine, AccumulationIsBitwiseWithinEachStageAndWithStage1) {
  const std::vector<double> reference = Trainer(config_json(0, "none", 2)).train(3);
  for (int stage : {0, 1, 2, 3}) {
    const std::vector<double> plain = Trainer(config_json(stage, "none", 2)).train(3);
    for (const char* variant : {"full", "selective_op"}) {
      EXPECT_EQ(Trainer(config_json(stage, variant, 2)).train(3), plain) << "stage " << stage << ", " << variant;
    }
    for (size_t i = 0; i < plain.size(); ++i) {
      if (stage <= 1) {
        EXPECT_EQ(plain[i], reference[i]) << "stage " << stage << ", step " << i + 1;
      } else {
        EXPECT_NEAR(plain[i], reference[i], 1e-6 * std::abs(reference[i])) << "stage " << stage << ", step " << i + 1;
      }
    }
  }
}

TEST(Engine, FrozenParametersStayBitwiseUnchangedAtEveryStage) {
  for (int stage : {0, 1, 2, 3}) {
    Trainer run(config_json(stage, "full"), /*frozen=*/true);
    at::Tensor before, after;
    {
      GatheredParameters gathered(*run.engine);
      before = run.engine->parameter("embed.weight").clone();
    }
    run.train(2);
    GatheredParameters gathered(*run.engine);
    after = run.engine->parameter("embed.weight");
    EXPECT_TRUE(at::equal(before, after)) << "stage " << stage;
    EXPECT_FALSE(at::equal(run.engine->parameter("head.weight"), at::zeros_like(after))) << "stage " << stage;
  }
}

TEST(Engine, ResumeWithClientStateRepeatsTheUninterruptedRun) {
  for (int stage : {0, 3}) {
    const std::string dir = scratch(str("resume", stage));
    const std::vector<double> whole = Trainer(config_json(stage, "full", 2)).train(4);
    {
      Trainer first(config_json(stage, "full", 2));
      first.train(2);
      first.engine->save_checkpoint(dir, {{"epoch", 7}, {"position", "abc"}});
    }
    Trainer second(config_json(stage, "full", 2));
    const nlohmann::json client = second.engine->load_checkpoint(dir);
    EXPECT_EQ(client, (nlohmann::json{{"epoch", 7}, {"position", "abc"}}));
    EXPECT_EQ(second.engine->global_steps(), 2);
    const std::vector<double> rest = second.train(2);
    EXPECT_EQ(rest, std::vector<double>(whole.begin() + 2, whole.end())) << "stage " << stage;
  }
}

TEST(Engine, ASaveResumesAtAnotherStage) {
  const std::string dir = scratch("restage");
  const std::vector<double> whole = Trainer(config_json(1, "none")).train(3);
  {
    Trainer first(config_json(1, "none"));
    first.train(1);
    first.engine->save_checkpoint(dir);
  }
  Trainer second(config_json(3, "full"));
  second.engine->load_checkpoint(dir);
  EXPECT_EQ(second.train(2), std::vector<double>(whole.begin() + 1, whole.end()));
}

TEST(Engine, GatheredParametersWritesEditsBackAtEveryStage) {
  for (int stage : {0, 1, 2, 3}) {
    Trainer run(config_json(stage, "none"));
    run.train(1);
    {
      GatheredParameters gathered(*run.engine, /*modify=*/true);
      at::NoGradGuard no_grad;
      run.engine->parameter("head.bias").fill_(0.25);
    }
    {
      GatheredParameters gathered(*run.engine);
      EXPECT_TRUE(at::equal(run.engine->parameter("head.bias"), at::full({kVocab}, 0.25))) << "stage " << stage;
    }
    // Training goes on from the edit.
    EXPECT_NO_THROW(run.train(1)) << "stage " << stage;
  }
}

TEST(Engine, AParameterOutsideTheGatheredScopeAtStage3IsAnErrorNamingTheScope) {
  Trainer run(config_json(3, "full"));
  const std::string error = error_of<Error>([&] { run.engine->parameter("layers.0.up.weight"); });
  EXPECT_NE(error.find("GatheredParameters"), std::string::npos) << error;
  GatheredParameters gathered(*run.engine);
  EXPECT_EQ(run.engine->parameter("layers.0.up.weight").sizes(), (std::vector<int64_t>{2 * kWidth, kWidth}));
  EXPECT_NE(error_of<Error>([&] { run.engine->parameter("nope"); }).find("no parameter 'nope'"), std::string::npos);
}

TEST(Engine, MisusedLifecycleCallsAreErrorsThatSayWhatToCall) {
  Trainer run(config_json(3, "full"));
  auto [x, y] = batch(1, 0);
  auto loss_fn = [&, x = x, y = y] { return run.model->loss(x, y); };
  EXPECT_NE(error_of<Error>([&] { run.engine->step(); }).find("no backward()"), std::string::npos);
  at::Tensor loss = run.engine->forward(loss_fn);
  EXPECT_NE(error_of<Error>([&] { run.engine->forward(loss_fn); }).find("call backward(loss)"), std::string::npos);
  run.engine->backward(loss);
  EXPECT_NE(error_of<Error>([&] { run.engine->backward(loss); }).find("twice"), std::string::npos);
  EXPECT_NE(error_of<Error>([&] { run.engine->forward(loss_fn); }).find("step() was not called"), std::string::npos);
  run.engine->step();
  EXPECT_EQ(run.engine->global_steps(), 1);
}

TEST(Engine, InitializeTwiceOnOneModelIsAnError) {
  Trainer run(config_json(0, "none"));
  Config parsed = parse_config(config_json(0, "none"), "<test>");
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  const std::string error = error_of<Error>([&] { initialize(run.model, parsed, options); });
  EXPECT_NE(error.find("already trained by another live engine"), std::string::npos) << error;
  run.engine.reset();
  EXPECT_NO_THROW(initialize(run.model, parsed, options));
}

TEST(Engine, SaveInsideAnAccumulationWindowIsRefused) {
  const std::string dir = scratch("window");
  Trainer run(config_json(0, "none", 2));
  auto [x, y] = batch(1, 0);
  run.engine->backward(run.engine->forward([&, x = x, y = y] { return run.model->loss(x, y); }));
  EXPECT_FALSE(run.engine->step());
  const std::string error = error_of<Error>([&] { run.engine->save_checkpoint(dir); });
  EXPECT_NE(error.find("inside a gradient accumulation window (micro-step 1 of 2)"), std::string::npos) << error;
}

TEST(Engine, LoadingAnotherModelNamesTheFirstParameterThatDiffers) {
  const std::string dir = scratch("other_model");
  {
    Trainer run(config_json(0, "none"));
    run.train(1);
    run.engine->save_checkpoint(dir);
  }
  Config parsed = parse_config(config_json(0, "none"), "<test>");
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  TinyLm deeper(4);
  auto engine = initialize(deeper, parsed, options);
  const std::string error = error_of<Error>([&] { engine->load_checkpoint(dir); });
  EXPECT_NE(error.find("holds another model"), std::string::npos) << error;
  EXPECT_NE(error.find("layers.3.up.weight"), std::string::npos) << error;
}

TEST(Engine, LoadingIntoAnotherOptimizerTypeIsRefused) {
  const std::string dir = scratch("other_optimizer");
  {
    Trainer run(config_json(0, "none"));
    run.train(1);
    run.engine->save_checkpoint(dir);
  }
  EngineOptions options;
  options.optimizer = [](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  };
  Trainer sgd(config_json(0, "none"), false, options);
  const std::string error = error_of<Error>([&] { sgd.engine->load_checkpoint(dir); });
  EXPECT_NE(error.find("optimizer.type = AdamW but this run has SGD"), std::string::npos) << error;
}

TEST(Engine, AForwardThatThrowsHalfWayLeavesTheEngineReady) {
  for (int stage : {0, 3}) {
    const std::vector<double> clean = Trainer(config_json(stage, "full")).train(2);
    Trainer run(config_json(stage, "full"));
    auto [x, y] = batch(1, 0);
    const std::string error = error_of<Error>([&, x = x] {
      run.engine->forward([&] {
        // The first block runs (gathered, checkpointed), then the user's code fails.
        remat::forward(run.model->layers_list->ptr<MlpBlockImpl>(0), run.model->embed(x));
        throw Error("user code failed");
        return at::Tensor();
      });
    });
    EXPECT_NE(error.find("user code failed"), std::string::npos);
    // The RNG the failed forward drew from is put back as a fresh run has it.
    at::manual_seed(5);
    EXPECT_EQ(run.train(2), clean) << "stage " << stage;
  }
}

TEST(Engine, AModelThatBreaksTheBlockContractGetsAnErrorNamingTheFix) {
  Config parsed = parse_config(config_json(0, "full"), "<test>");
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  NoBlocks flat;
  std::string error = error_of<Error>([&] { initialize(flat, parsed, options); });
  EXPECT_NE(error.find("holds no torch::nn::ModuleList of blocks"), std::string::npos) << error;
  EXPECT_NE(error.find("remat::forward(block, ...)"), std::string::npos) << error;

  Trainer run(config_json(0, "full"));
  run.model->direct = true;
  error = error_of<Error>([&] { run.train(1); });
  EXPECT_NE(error.find("none ran as a checkpoint region"), std::string::npos) << error;
}

TEST(Engine, TheConfigComesAsAFileJsonTextOrAParsedObjectWithOverrides) {
  const std::string dir = scratch("config_forms");
  const std::string path = dir + "/ds_config.json";
  if (testing::world()->rank() == 0) {
    fs::create_directories(dir);
    std::ofstream(path) << config_json(1, "full");
  }
  testing::world()->barrier()->wait();
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  options.overrides = {"zero_optimization.stage=3", "activation_checkpointing.variant=none"};
  {
    TinyLm model;
    auto engine = initialize(model, path, options);
    EXPECT_EQ(engine->config().zero_optimization.stage, 3);
    EXPECT_EQ(engine->config().activation_checkpointing.variant, CheckpointVariant::kNone);
  }
  {
    TinyLm model;
    auto engine = initialize(model, config_json(2, "full"), options);
    EXPECT_EQ(engine->config().zero_optimization.stage, 3);
  }
  {
    TinyLm model;
    auto engine = initialize(model, nlohmann::json::parse(config_json(1, "full")), options);
    EXPECT_EQ(engine->config().zero_optimization.stage, 3);
    EXPECT_EQ(engine->config().train.seed, 5);
  }
  TinyLm model;
  options.overrides = {"zero_optimization.stage=7"};
  const std::string error = error_of<Error>([&] { initialize(model, config_json(0, "none"), options); });
  EXPECT_NE(error.find("zero_optimization.stage=7"), std::string::npos) << error;
  EXPECT_NO_THROW(initialize(model, config_json(0, "none"), EngineOptions{{}, options.layout}));
}

TEST(Engine, TwoEnginesInOneProcessKeepTheirOwnSettingsAndCounters) {
  // Without dropout each run is deterministic whatever runs beside it.
  const std::string offloaded = R"({"train_micro_batch_size_per_gpu": 2, "train": {"seed": 5},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
      "activation_checkpointing": {"variant": "full", "cpu_checkpointing": true}})";
  const std::string plain = config_json(0, "none");
  const std::vector<double> alone_a = Trainer(offloaded, false, {}, 0.0).train(2);
  const std::vector<double> alone_b = Trainer(plain, false, {}, 0.0).train(2);
  Trainer a(offloaded, false, {}, 0.0);
  Trainer b(plain, false, {}, 0.0);  // configures its own checkpointing defaults: none offloaded
  std::vector<double> beside_a, beside_b;
  for (int step = 0; step < 2; ++step) {
    beside_a.push_back(a.train(1)[0]);
    EXPECT_GT(a.engine->last_metrics().counter("ckpt_offloaded_bytes"), 0) << "engine a's regions offload";
    beside_b.push_back(b.train(1)[0]);
    EXPECT_EQ(b.engine->last_metrics().ckpt_saved_bytes, 0) << "engine b has no regions";
    EXPECT_EQ(b.engine->last_metrics().counter("ckpt_offloaded_bytes"), 0) << "engine a's counters are not b's";
    EXPECT_EQ(b.engine->last_metrics().counter<double>("recompute_ms"), 0) << "engine a's recompute time is not b's";
  }
  EXPECT_EQ(beside_a, alone_a);
  EXPECT_EQ(beside_b, alone_b);
}

// The TinyLm's loss with `between(i, h)` applied to block i's input (i = n:
// the last block's output) and blocks listed in `skip` left out.
at::Tensor loss_between(TinyLm& m, const at::Tensor& x, const at::Tensor& y,
                        const std::function<at::Tensor(size_t, at::Tensor)>& between, std::set<size_t> skip = {}) {
  at::Tensor h = m->embed(x);
  const size_t n = m->layers_list->size();
  for (size_t i = 0; i < n; ++i) {
    h = between(i, h);
    if (!skip.count(i)) h = remat::forward(m->layers_list->ptr<MlpBlockImpl>(i), h);
  }
  h = between(n, h);
  at::Tensor logits = m->head(m->norm(h));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
}

// Every parameter whole, by name (collective).
std::map<std::string, at::Tensor> whole_parameters(Engine& engine) {
  GatheredParameters gathered(engine);
  std::map<std::string, at::Tensor> out;
  for (const auto& item : engine.module().named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

bool all_equal(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
               std::string* first_differing = nullptr) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !at::equal(t, it->second)) {
      if (first_differing) *first_differing = name;
      return false;
    }
  }
  return true;
}

TEST(Engine, ABackwardOfALossBuiltFromTheForwardsLossMatchesAForwardThatReturnsIt) {
  // `inside`: forward's function returns loss * 2 + 1; else backward gets it.
  auto run = [](int stage, bool inside) {
    Trainer t(config_json(stage, "full"));
    std::vector<double> losses;
    for (int step = 1; step <= 2; ++step) {
      auto [x, y] = batch(step, 0);
      at::Tensor loss = t.engine->forward([&, x = x, y = y] {
        at::Tensor l = t.model->loss(x, y);
        return inside ? l * 2 + 1 : l;
      });
      t.engine->backward(inside ? loss : loss * 2 + 1);
      t.engine->step();
      losses.push_back(t.engine->last_metrics().loss);
    }
    losses.push_back(whole_parameters(*t.engine).at("layers.2.down.weight").sum().item<double>());
    return losses;
  };
  for (int stage : {0, 3}) EXPECT_EQ(run(stage, true), run(stage, false)) << "stage " << stage;
}

// Every parameter frozen: a training forward is refused alike at every stage
// (stage 3's gathered units made the loss require grad, and its steps
// trained nothing, silently); evaluate() still runs.
TEST(Engine, AModelWithEveryParameterFrozenIsRefusedATrainingForward) {
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  auto [x, y] = batch(1, 0);
  for (int stage : {0, 1, 2, 3}) {
    TinyLm model;
    for (auto& p : model->parameters()) p.requires_grad_(false);
    auto engine = initialize(model, config_json(stage, "none"), options);
    const std::string error = error_of<Error>([&] { engine->forward([&] { return model->loss(x, y); }); });
    EXPECT_NE(error.find("no parameter of the model requires grad"), std::string::npos) << stage << ": " << error;
    EXPECT_NE(error.find("use evaluate()"), std::string::npos) << error;
    const at::Tensor loss = engine->evaluate([&] { return model->loss(x, y); });
    EXPECT_TRUE(std::isfinite(loss.item<double>())) << "stage " << stage;
  }
}

TEST(Engine, ALossBackwardRefusesLeavesTheForwardOpenForTheRightOne) {
  Trainer run(config_json(3, "full"));
  auto [x, y] = batch(1, 0);
  at::Tensor loss = run.engine->forward([&, x = x, y = y] { return run.model->loss(x, y); });
  std::string error = error_of<Error>([&] { run.engine->backward(loss.detach()); });
  EXPECT_NE(error.find("not requiring grad"), std::string::npos) << error;
  error = error_of<Error>([&] { run.engine->backward(loss.expand({2})); });
  EXPECT_NE(error.find("[2]"), std::string::npos) << error;
  run.engine->backward(loss);
  EXPECT_TRUE(run.engine->step());
  EXPECT_EQ(run.engine->global_steps(), 1);
}

// A forward whose function returns what backward() would refuse (no grad, or
// many elements) is refused by forward() itself, so that the engine is not
// left waiting for a backward it can never get.
TEST(Engine, AForwardReturningNoLossToBackpropagateIsRefusedAndLeavesTheEngineReady) {
  for (int stage : {0, 3}) {
    for (bool detached : {true, false}) {
      Trainer run(config_json(stage, "full"));
      auto [x, y] = batch(1, 0);
      const std::string error = error_of<Error>([&, x = x, y = y] {
        run.engine->forward([&] {
          return detached ? run.model->loss(x, y).detach() : run.model->head(run.model->embed(x)).sum(-1);
        });
      });
      EXPECT_NE(error.find(detached ? "requires grad" : "one-element"), std::string::npos)
          << "stage " << stage << ": " << error;
      EXPECT_NO_THROW(run.train(1)) << "stage " << stage;
    }
  }
}

TEST(Engine, AccumulationOfThreeStepsAtTheThirdAndRefusesSavesBefore) {
  const std::string dir = scratch("accumulate3");
  Trainer run(config_json(2, "full", 3));
  std::vector<bool> boundary, stepped;
  for (int micro = 0; micro < 3; ++micro) {
    EXPECT_EQ(run.engine->micro_steps(), micro);
    auto [x, y] = batch(1, micro);
    at::Tensor loss = run.engine->forward([&, x = x, y = y] { return run.model->loss(x, y); });
    const std::string error = error_of<Error>([&] { run.engine->save_checkpoint(dir); });
    EXPECT_NE(error.find(str("micro-step ", micro + 1, " of 3")), std::string::npos) << error;
    boundary.push_back(run.engine->is_gradient_accumulation_boundary());
    run.engine->backward(loss);
    stepped.push_back(run.engine->step());
    if (micro < 2) {
      const std::string between = error_of<Error>([&] { run.engine->save_checkpoint(dir); });
      EXPECT_NE(between.find(str("micro-step ", micro + 1, " of 3")), std::string::npos) << between;
      EXPECT_EQ(run.engine->global_steps(), 0);
    }
  }
  EXPECT_EQ(boundary, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(stepped, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(run.engine->global_steps(), 1);
  EXPECT_EQ(run.engine->micro_steps(), 0);
  EXPECT_EQ(run.engine->save_checkpoint(dir), dir + "/step_00000001");
}

// The rate every step of a 20-step run trains at (last_metrics().lr and the
// optimizer's param group) is DeepSpeed's for the same section
// (tests/deepspeed_lr.h: its schedules and its engine's order), get_lr() the
// next step's; a run saved at step 7 and resumed trains steps 8-20 at the
// uninterrupted run's rates.
TEST(Engine, EachStepTrainsAtDeepSpeedsRateAndAResumeContinuesTheSchedule) {
  const std::vector<nlohmann::json> schedules = {
      {{"type", "WarmupLR"},
       {"params", {{"warmup_min_lr", 1e-3}, {"warmup_max_lr", 0.02}, {"warmup_num_steps", 6}}}},
      {{"type", "WarmupDecayLR"},
       {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.01}, {"warmup_num_steps", 4},
                   {"warmup_type", "linear"}, {"total_num_steps", 16}, {"last_batch_iteration", 2}}}},
      {{"type", "WarmupCosineLR"},
       {"params", {{"warmup_num_steps", 5}, {"total_num_steps", 20}, {"warmup_min_ratio", 0.1}}}}};
  for (size_t n = 0; n < schedules.size(); ++n) {
    const std::string dir = scratch(str("schedule_", n));
    nlohmann::json config = nlohmann::json::parse(config_json(1, "none"));  // optimizer.params.lr 0.01
    config["scheduler"] = schedules[n];
    const std::vector<double> rates = testing::deepspeed_rates(0.01, schedules[n], 21);
    const std::string type = schedules[n]["type"];
    {
      Trainer run(config.dump());
      EXPECT_DOUBLE_EQ(run.engine->get_lr(), rates[0]) << type;
      for (int step = 1; step <= 20; ++step) {
        run.train(1);
        EXPECT_DOUBLE_EQ(run.engine->last_metrics().lr, rates[step - 1]) << type << ", step " << step;
        EXPECT_DOUBLE_EQ(run.engine->optimizer().param_groups()[0].options().get_lr(), rates[step - 1])
            << type << ", step " << step;
        EXPECT_DOUBLE_EQ(run.engine->get_lr(), rates[step]) << type << ", after step " << step;
        if (step == 7) run.engine->save_checkpoint(dir);
      }
    }
    Trainer resumed(config.dump());
    resumed.engine->load_checkpoint(dir);
    EXPECT_DOUBLE_EQ(resumed.engine->get_lr(), rates[7]) << type;
    for (int step = 8; step <= 20; ++step) {
      resumed.train(1);
      EXPECT_DOUBLE_EQ(resumed.engine->last_metrics().lr, rates[step - 1]) << type << ", resumed, step " << step;
    }
  }
}

// scheduler.params.last_batch_iteration k (issue 41, item 4): step 1 trains
// at the optimizer's rate, step s at position k + s - 1, as in DeepSpeed. A
// resume goes on from the save's step with the config's k, so a run resumed
// with its own config continues its schedule; saves do not record k, so a
// resume with k = -1 takes the unshifted schedule's rate of that step.
TEST(Engine, LastBatchIterationShiftsTheScheduleAndAResumeKeepsTheShift) {
  const std::string dir = scratch("shifted_schedule");
  nlohmann::json config = nlohmann::json::parse(config_json(1, "none"));
  config["scheduler"] = {{"type", "WarmupDecayLR"},
                         {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.02}, {"warmup_num_steps", 4},
                                     {"warmup_type", "linear"}, {"total_num_steps", 8},
                                     {"last_batch_iteration", 1}}}};
  const std::vector<double> shifted = testing::deepspeed_rates(0.01, config["scheduler"], 4);
  EXPECT_EQ(shifted[0], 0.01);  // the optimizer's own
  EXPECT_DOUBLE_EQ(shifted[1], 0.02 * 2 / 4);
  {
    Trainer run(config.dump());
    EXPECT_DOUBLE_EQ(run.engine->get_lr(), shifted[0]);
    for (int64_t step = 1; step <= 3; ++step) {
      run.train(1);
      EXPECT_DOUBLE_EQ(run.engine->last_metrics().lr, shifted[step - 1]) << "step " << step;
      if (step == 2) run.engine->save_checkpoint(dir);
    }
  }
  Trainer resumed(config.dump());
  resumed.engine->load_checkpoint(dir + "/step_00000002");
  EXPECT_DOUBLE_EQ(resumed.engine->get_lr(), shifted[2]);
  resumed.train(1);
  EXPECT_DOUBLE_EQ(resumed.engine->last_metrics().lr, shifted[2]);
  config["scheduler"]["params"]["last_batch_iteration"] = -1;
  Trainer unshifted(config.dump());
  unshifted.engine->load_checkpoint(dir + "/step_00000002");
  EXPECT_DOUBLE_EQ(unshifted.engine->get_lr(), testing::deepspeed_rates(0.01, config["scheduler"], 3)[2]);
}

TEST(Engine, ANonFiniteStepIsSkippedOrStoppedWithTheParametersUnchanged) {
  for (const char* mode : {"skip", "stop"}) {
    for (int stage : {0, 3}) {
      nlohmann::json config = nlohmann::json::parse(config_json(stage, "full"));
      config["train"]["on_nonfinite"] = mode;
      config["gradient_clipping"] = 1.0;
      Trainer run(config.dump());
      run.train(1);
      const double norm = run.engine->get_global_grad_norm();
      EXPECT_GT(norm, 0);
      const auto before = whole_parameters(*run.engine);
      auto [x, y] = batch(2, 0);
      run.engine->backward(run.engine->forward([&, x = x, y = y] {
        return run.model->loss(x, y) * std::numeric_limits<double>::quiet_NaN();
      }));
      const std::string where = str(mode, ", stage ", stage);
      if (std::string(mode) == "skip") {
        EXPECT_FALSE(run.engine->step()) << where;
        EXPECT_EQ(run.engine->global_steps(), 2) << where;  // the step counts (docs/engine.md)
        EXPECT_TRUE(run.engine->last_metrics().skipped) << where;
        EXPECT_EQ(run.engine->get_global_grad_norm(), -1) << where;
      } else {
        const std::string error = error_of<Error>([&] { run.engine->step(); });
        EXPECT_NE(error.find("step 2: the loss and the gradients went non-finite"), std::string::npos) << error;
        EXPECT_EQ(run.engine->global_steps(), 1) << where;
        EXPECT_EQ(run.engine->get_global_grad_norm(), norm) << where;
      }
      std::string differing;
      EXPECT_TRUE(all_equal(before, whole_parameters(*run.engine), &differing)) << where << ": " << differing;
      // Training goes on, from finite gradients only.
      EXPECT_NO_THROW(run.train(1)) << where;
      EXPECT_FALSE(run.engine->last_metrics().skipped) << where;
      EXPECT_TRUE(std::isfinite(run.engine->last_metrics().loss)) << where;
      EXPECT_TRUE(std::isfinite(run.engine->get_global_grad_norm())) << where;
    }
  }
}

TEST(Engine, EvaluateInsideAWindowReturnsItsValueRestoresTheModeAndChangesNoStep) {
  auto [ex, ey] = batch(77, 0);
  auto evaluate = [&, ex = ex, ey = ey](Trainer& t) {
    return t.engine->evaluate([&] { return t.model->loss(ex, ey); });
  };
  Trainer plain(config_json(3, "full", 2));
  const std::vector<double> plain_losses = plain.train(2);
  Trainer run(config_json(3, "full", 2));
  std::vector<double> losses;
  for (int step = 1; step <= 2; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      auto [x, y] = batch(step, micro);
      at::Tensor loss = run.engine->forward([&, x = x, y = y] { return run.model->loss(x, y); });
      const std::string error = error_of<Error>([&] { evaluate(run); });
      EXPECT_NE(error.find("call backward(loss) and step() first"), std::string::npos) << error;
      EXPECT_TRUE(run.model->is_training());
      run.engine->backward(loss);
      run.engine->step();
      at::Tensor value = evaluate(run);
      EXPECT_FALSE(value.requires_grad());
      EXPECT_TRUE(std::isfinite(value.item<double>()));
      EXPECT_TRUE(run.model->is_training());
    }
    losses.push_back(run.engine->last_metrics().loss);
  }
  EXPECT_EQ(losses, plain_losses);
  // Evaluation changed nothing the steps used; in eval mode (no dropout) it
  // repeats itself, and the mode the caller set is kept.
  run.model->eval();
  const at::Tensor value = evaluate(run);
  EXPECT_FALSE(run.model->is_training());
  EXPECT_TRUE(at::equal(value, evaluate(run)));
  EXPECT_TRUE(at::equal(value, evaluate(plain))) << value.item<double>() << " vs " << evaluate(plain).item<double>();
}

TEST(Engine, NestedAndReadOnlyScopesAtStage3KeepOnlyModifyingEdits) {
  Trainer run(config_json(3, "full"));
  run.train(1);
  const at::Tensor original = whole_parameters(*run.engine).at("head.bias");
  {
    GatheredParameters outer(*run.engine);
    {
      GatheredParameters inner(*run.engine);
      EXPECT_TRUE(at::equal(run.engine->parameter("head.bias"), original));
    }
    // The inner scope's end leaves the outer's values in place.
    EXPECT_TRUE(at::equal(run.engine->parameter("head.bias"), original));
    at::NoGradGuard no_grad;
    run.engine->parameter("head.bias").fill_(9);  // read-only scope: dropped
  }
  EXPECT_NE(error_of<Error>([&] { run.engine->parameter("head.bias"); }).find("GatheredParameters"),
            std::string::npos);
  EXPECT_TRUE(at::equal(whole_parameters(*run.engine).at("head.bias"), original));
  {
    GatheredParameters outer(*run.engine);
    {
      GatheredParameters inner(*run.engine, /*modify=*/true);
      at::NoGradGuard no_grad;
      run.engine->parameter("head.bias").fill_(0.5);
    }
  }
  EXPECT_TRUE(at::equal(whole_parameters(*run.engine).at("head.bias"), at::full({kVocab}, 0.5)));
  EXPECT_NO_THROW(run.train(1));
}

TEST(Engine, AnEditInAModifyingScopeIsWhatEveryStageTrainsFrom) {
  auto edited_run = [](int stage) {
    Trainer run(config_json(stage, "full"));
    run.train(1);
    {
      GatheredParameters gathered(*run.engine, /*modify=*/true);
      at::NoGradGuard no_grad;
      run.engine->parameter("head.bias").fill_(0.25);
      run.engine->parameter("layers.1.down.weight").mul_(0.5);
    }
    std::vector<double> losses = run.train(2);
    losses.push_back(whole_parameters(*run.engine).at("layers.1.down.weight").sum().item<double>());
    return losses;
  };
  const std::vector<double> reference = edited_run(0);
  for (int stage : {1, 2, 3}) EXPECT_EQ(edited_run(stage), reference) << "stage " << stage;
}

// Below stage 3 the parameters are whole on every rank, so Engine::parameter
// works outside a GatheredParameters scope (docs/engine.md): it must then
// give the values the last step made, not this rank's shard of them alone.
TEST(Engine, ParameterOutsideAScopeBelowStage3GivesTheSteppedValues) {
  for (int stage : {0, 1, 2}) {
    Trainer run(config_json(stage, "none"));
    run.train(1);
    std::map<std::string, at::Tensor> outside;
    for (const char* name : {"embed.weight", "layers.0.up.weight", "head.bias"}) {
      outside[name] = run.engine->parameter(name).clone();
    }
    const auto whole = whole_parameters(*run.engine);
    for (const auto& [name, value] : outside) EXPECT_TRUE(at::equal(value, whole.at(name))) << "stage " << stage << ": " << name;
  }
}

TEST(Engine, AFrozenParameterIsReadLikeAnyOther) {
  Trainer run(config_json(3, "full"), /*frozen=*/true);
  const std::string error = error_of<Error>([&] { run.engine->parameter("embed.weight"); });
  EXPECT_NE(error.find("GatheredParameters"), std::string::npos) << error;
  GatheredParameters gathered(*run.engine);
  const at::Tensor weight = run.engine->parameter("embed.weight");
  EXPECT_EQ(weight.sizes(), (std::vector<int64_t>{kVocab, kWidth}));
  EXPECT_FALSE(weight.requires_grad());
}

struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw Error("the model's backward failed on purpose");
  }
};

// As a forward that throws does (docs/engine.md), a backward that throws
// drops its micro-step: the next forward starts it again, and the run goes
// on as if the failed attempt had not happened.
TEST(Engine, ABackwardThatThrowsHalfWayLeavesTheEngineReady) {
  for (int stage : {0, 3}) {
    const std::vector<double> clean = Trainer(config_json(stage, "full"), false, {}, 0.0).train(2);
    Trainer run(config_json(stage, "full"), false, {}, 0.0);
    auto [x, y] = batch(1, 0);
    at::Tensor loss = run.engine->forward([&, x = x, y = y] {
      // Blocks 1 and 2 run their backward (reducing their gradients), then block 0's input fails.
      return loss_between(run.model, x, y, [](size_t i, at::Tensor h) { return i == 1 ? ThrowInBackward::apply(h) : h; });
    });
    const std::string error = error_of<std::exception>([&] { run.engine->backward(loss); });
    EXPECT_NE(error.find("failed on purpose"), std::string::npos) << error;
    std::vector<double> losses;
    EXPECT_NO_THROW(losses = run.train(2)) << "stage " << stage;
    EXPECT_EQ(losses, clean) << "stage " << stage;
  }
}

// autograd::grad inside the loss (a gradient penalty on the embeddings):
// every stage and checkpointing variant computes what stage 0 without
// checkpointing does, or refuses with remat's Error naming autograd::grad.
TEST(Engine, AGradientPenaltyInsideTheForwardMatchesStage0) {
  auto penalised = [](int stage, const char* variant) {
    Trainer run(config_json(stage, variant), false, {}, 0.0);
    std::vector<double> losses;
    for (int step = 1; step <= 2; ++step) {
      auto [x, y] = batch(step, 0);
      run.engine->backward(run.engine->forward([&, x = x, y = y] {
        at::Tensor embedded;
        at::Tensor ce = loss_between(run.model, x, y, [&](size_t i, at::Tensor h) {
          if (i == 0) embedded = h;
          return h;
        });
        at::Tensor g = torch::autograd::grad({ce}, {embedded}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
        return ce + 0.1 * g.pow(2).sum();
      }));
      run.engine->step();
      losses.push_back(run.engine->last_metrics().loss);
    }
    return losses;
  };
  const std::vector<double> reference = penalised(0, "none");
  for (int stage : {0, 3}) {
    for (const char* variant : {"none", "full"}) {
      std::vector<double> losses;
      try {
        losses = penalised(stage, variant);
      } catch (const Error& e) {
        // Refusing is fine too, if it says so in remat's words.
        EXPECT_NE(std::string(e.what()).find("autograd::grad"), std::string::npos) << e.what();
        continue;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "stage " << stage << ", variant " << variant << ": LibTorch's error instead of a "
                      << "result or remat's: " << std::string(e.what()).substr(0, 300);
        continue;
      }
      EXPECT_EQ(losses, reference) << "stage " << stage << ", variant " << variant;
    }
  }
}

// Blocks the forward leaves out (the same on every rank) get no gradient;
// every stage trains the others as stage 0 does.
TEST(Engine, ABlockLeftOutOfTheForwardTrainsAlikeAtEveryStage) {
  auto skipping = [](int stage) {
    Trainer run(config_json(stage, "full"));
    std::vector<double> losses;
    for (int step = 1; step <= 2; ++step) {
      auto [x, y] = batch(step, 0);
      run.engine->backward(run.engine->forward([&, x = x, y = y] {
        return loss_between(run.model, x, y, [](size_t, at::Tensor h) { return h; }, {1});
      }));
      run.engine->step();
      losses.push_back(run.engine->last_metrics().loss);
    }
    losses.push_back(whole_parameters(*run.engine).at("layers.1.up.weight").sum().item<double>());
    return losses;
  };
  const std::vector<double> reference = skipping(0);
  for (int stage : {1, 2, 3}) EXPECT_EQ(skipping(stage), reference) << "stage " << stage;
}

// A block's input that is an expanded view (stride 0), checkpointed with its
// inputs copied to the host, recomputes as the plain run computes.
TEST(Engine, AnExpandedViewIntoACheckpointedBlockMatchesThePlainRun) {
  auto expanded = [](const std::string& config) {
    Trainer run(config);
    std::vector<double> losses;
    for (int step = 1; step <= 2; ++step) {
      auto [x, y] = batch(step, 0);
      run.engine->backward(run.engine->forward([&, x = x, y = y] {
        return loss_between(run.model, x, y, [](size_t i, at::Tensor h) {
          return i == 0 ? h.narrow(1, 0, 1).expand({h.size(0), kSeq, kWidth}) : h;
        });
      }));
      run.engine->step();
      losses.push_back(run.engine->last_metrics().loss);
    }
    return losses;
  };
  const std::string offloaded = R"({"train_micro_batch_size_per_gpu": 2, "train": {"seed": 5},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "activation_checkpointing": {"variant": "full", "cpu_checkpointing": true}})";
  EXPECT_EQ(expanded(offloaded), expanded(config_json(0, "none")));
}

// A tensor captured from outside the forward that requires grad (an input
// being optimised, as in adversarial training) gets the same gradient at
// every stage and checkpointing variant.
TEST(Engine, ACapturedInputGetsTheSameGradientAtEveryStage) {
  std::vector<at::Tensor> grads;
  for (int stage : {0, 3}) {
    for (const char* variant : {"none", "full"}) {
      Trainer run(config_json(stage, variant));
      at::manual_seed(17);
      at::Tensor input = at::randn({2, kSeq, kWidth}).requires_grad_();
      auto [x, y] = batch(1, 0);
      run.engine->backward(run.engine->forward([&, y = y] {
        at::Tensor h = input;
        for (size_t i = 0; i < run.model->layers_list->size(); ++i) {
          h = remat::forward(run.model->layers_list->ptr<MlpBlockImpl>(i), h);
        }
        at::Tensor logits = run.model->head(run.model->norm(h));
        return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
      }));
      EXPECT_TRUE(run.engine->step());
      ASSERT_TRUE(input.grad().defined()) << "stage " << stage << ", variant " << variant;
      grads.push_back(input.grad());
    }
  }
  for (size_t i = 1; i < grads.size(); ++i) EXPECT_TRUE(at::equal(grads[i], grads[0])) << i;
}

struct Float64LmImpl : TinyLmImpl {
  Float64LmImpl() { to(at::kDouble); }
};
TORCH_MODULE(Float64Lm);

struct ParameterlessBlockImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return at::gelu(x); }
};
TORCH_MODULE(ParameterlessBlock);

struct ParameterlessImpl : torch::nn::Module {
  ParameterlessImpl() {
    layers = register_module("layers", torch::nn::ModuleList());
    layers->push_back(ParameterlessBlock());
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Parameterless);

TEST(Engine, InitializeNamesWhatIsWrongWithTheModel) {
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  Float64Lm doubled;
  std::string error = error_of<Error>([&] { initialize(doubled, config_json(1, "none"), options); });
  EXPECT_NE(error.find("parameters must be float32"), std::string::npos) << error;
  EXPECT_NE(error.find("Double"), std::string::npos) << error;


  TinyLm model;
  options.blocks = "blocks";
  error = error_of<Error>([&] { initialize(model, config_json(0, "full"), options); });
  EXPECT_NE(error.find("no submodule 'blocks'"), std::string::npos) << error;
  EXPECT_NE(error.find("layers"), std::string::npos) << error;
  EXPECT_NE(error.find("EngineOptions::blocks"), std::string::npos) << error;
  options.blocks = "norm";
  error = error_of<Error>([&] { initialize(model, config_json(0, "full"), options); });
  EXPECT_NE(error.find("not a torch::nn::ModuleList"), std::string::npos) << error;
  options.blocks = "layers";
  EXPECT_NO_THROW(initialize(model, config_json(0, "full"), options));

  // One parameter registered under two names (tied embeddings): every stage
  // trained it twice over (stage 0's optimizer stepped it twice, stages 1-3
  // sharded two copies; stage 3's gathers then failed with "map::at"), so
  // each is refused, naming both and the fix.
  for (int stage : {0, 1, 2, 3}) {
    TinyLm tied;
    tied->norm->register_parameter("tied", tied->embed->weight);
    error = error_of<ConfigError>([&] { initialize(tied, config_json(stage, "none"), options); });
    EXPECT_NE(error.find("parameter 'norm.tied' is the same tensor as 'embed.weight' (one parameter registered under "
                         "two names, e.g. tied embeddings)"), std::string::npos) << "stage " << stage << ": " << error;
    EXPECT_NE(error.find("Register it once and use it in both places in the forward"), std::string::npos) << error;
  }
}

TEST(Engine, SavingOntoAFileOrLoadingFromAnEmptyOrMissingFolderIsAConfigError) {
  const std::string dir = scratch("not_a_save");
  const std::string file = dir + "/a_file";
  if (testing::world()->rank() == 0) {
    fs::create_directories(dir + "/empty");
    std::ofstream(file) << "not a folder";
  }
  testing::world()->barrier()->wait();
  Trainer run(config_json(0, "none"));
  run.train(1);
  std::string error = error_of<ConfigError>([&] { run.engine->save_checkpoint(file); });
  EXPECT_NE(error.find(file), std::string::npos) << error;
  error = error_of<ConfigError>([&] { run.engine->load_checkpoint(dir + "/empty"); });
  EXPECT_NE(error.find("holds no manifest.json and no 'latest' file"), std::string::npos) << error;
  error = error_of<ConfigError>([&] { run.engine->load_checkpoint(dir + "/missing"); });
  EXPECT_NE(error.find("does not exist"), std::string::npos) << error;
  EXPECT_EQ(run.engine->global_steps(), 1);
  EXPECT_NO_THROW(run.train(1));
}

// A model trained by an engine, then by a second one after the first is
// destroyed (without reading the parameters through it first): the second
// starts from the values the first trained, whatever its stage, and none of
// the first's checkpointing remains.
TEST(Engine, ANewEngineOnTheSameModelStartsFromTheFirstOnesValues) {
  Trainer reference(config_json(0, "full"));
  reference.train(1);
  const auto trained = whole_parameters(*reference.engine);  // every stage steps these bits at dp 2
  for (int stage : {0, 1, 2, 3}) {
    Trainer run(config_json(stage, "full"));
    run.train(1);
    run.engine.reset();
    bool storage = true;
    for (const auto& p : run.model->parameters()) storage = storage && p.storage().nbytes() > 0;
    ASSERT_TRUE(storage) << "stage " << stage << ": the first engine left parameters without storage";
    EngineOptions options;
    options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                      ParallelDims::from_world(testing::world()->size(), 1));
    run.engine = initialize(run.model, parse_config(config_json(0, "none"), "<test>"), options);
    std::string differing;
    EXPECT_TRUE(all_equal(trained, whole_parameters(*run.engine), &differing)) << "stage " << stage << ": " << differing;
    run.train(1);
    EXPECT_EQ(run.engine->last_metrics().ckpt_saved_bytes, 0) << "stage " << stage;
    EXPECT_EQ(run.engine->last_metrics().counter<double>("recompute_ms"), 0) << "stage " << stage;
  }
}


// A TinyLm with parameters no forward uses (one of the root's, one in a
// block: a model's spare head, a branch left for later) and one that only
// rank 1's loss uses.
struct SpareLmImpl : TinyLmImpl {
  SpareLmImpl() : TinyLmImpl(3) {
    register_parameter("spare", at::full({5}, 0.5));
    layers_list[1]->register_parameter("spare", at::full({3}, -0.25));
    rank1_only = register_parameter("rank1_only", at::full({4}, 0.75));
  }
  at::Tensor rank1_only;
};
TORCH_MODULE(SpareLm);

// AdamW with weight decay, which moves every parameter it steps.
std::string decaying_config(int stage) {
  return str(R"({"train_micro_batch_size_per_gpu": 2,
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
                 "zero_optimization": {"stage": )", stage, R"(, "stage3_param_persistence_threshold": 0,
                                       "reduce_bucket_size": 200},
                 "train": {"seed": 5}})");
}

// Every parameter whole after `steps` AdamW steps of `model` (the loss of a
// SpareLm adds rank1_only's on rank 1).
template <class Model>
std::map<std::string, at::Tensor> trained(Model model, int stage, int steps) {
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                    ParallelDims::from_world(testing::world()->size(), 1));
  auto engine = initialize(model, parse_config(decaying_config(stage), "<test>"), options);
  for (int step = 1; step <= steps; ++step) {
    auto [x, y] = batch(step, 0);
    engine->backward(engine->forward([&, x = x, y = y] {
      at::Tensor loss = model->loss(x, y);
      if constexpr (std::is_same_v<Model, SpareLm>) {
        if (testing::world()->rank() == 1) loss = loss + model->rank1_only.square().sum();
      }
      return loss;
    }));
    engine->step();
  }
  return whole_parameters(*engine);
}

// A parameter no rank's forward uses is not stepped (a plain LibTorch loop
// leaves a parameter without .grad alone; weight decay would shrink the
// zeros the reduction gives it), at every stage, whether it has an optimizer
// tensor of its own or shares a shard with used ones; the used parameters
// train bitwise as in the model without the spare ones, and a parameter one
// rank uses is stepped alike on every rank.
TEST(Engine, AParameterNoForwardUsesIsNotSteppedAtEveryStage) {
  at::manual_seed(5);
  const auto reference = trained(TinyLm(3), 0, 3);
  for (int stage : {0, 1, 2, 3}) {
    const std::string where = str("stage ", stage);
    at::manual_seed(5);
    auto after = trained(SpareLm(), stage, 3);
    EXPECT_TRUE(at::equal(after.at("spare"), at::full({5}, 0.5))) << where << ": " << after.at("spare");
    EXPECT_TRUE(at::equal(after.at("layers.1.spare"), at::full({3}, -0.25)))
        << where << ": " << after.at("layers.1.spare");
    // Used on rank 1 only: averaged over both ranks and stepped on both.
    at::Tensor used_by_one = after.at("rank1_only");
    EXPECT_FALSE(at::equal(used_by_one, at::full({4}, 0.75))) << where;
    at::Tensor from_rank0 = used_by_one.clone();
    testing::world()->broadcast(from_rank0, {0})->wait();
    EXPECT_TRUE(at::equal(used_by_one, from_rank0)) << where;
    for (const char* name : {"spare", "layers.1.spare", "rank1_only"}) after.erase(name);
    std::string differing;
    EXPECT_TRUE(all_equal(after, reference, &differing)) << where << ": " << differing;
  }
}


using ::testing::HasSubstr;
using ::testing::Not;

// Options whose layout's collectives time out after 10 s (the tests' world
// waits 60): a call that leaves one rank waiting for another fails fast.
EngineOptions quick_timeout() {
  const char* given = std::getenv("REMAT_COMM_TIMEOUT_S");
  const std::string before = given ? given : "";
  ::setenv("REMAT_COMM_TIMEOUT_S", "10", 1);
  auto world = testing::world()->split(0, testing::world()->rank());
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(world, ParallelDims::from_world(world->size(), 1));
  if (before.empty()) {
    ::unsetenv("REMAT_COMM_TIMEOUT_S");
  } else {
    ::setenv("REMAT_COMM_TIMEOUT_S", before.c_str(), 1);
  }
  return options;
}

// Whether every rank holds the same `text` (collective).
bool same_on_every_rank(const std::string& text) {
  auto& world = *testing::world();
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  world.broadcast(length, {0})->wait();
  const bool same_length = length.item<int64_t>() == static_cast<int64_t>(text.size());
  at::Tensor bytes = at::zeros({std::max<int64_t>(length.item<int64_t>(), 1)}, at::kByte);
  if (world.rank() == 0) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  world.broadcast(bytes, {0})->wait();
  at::Tensor verdict = at::full({1}, same_length && std::string(static_cast<const char*>(bytes.data_ptr()),
                                                                text.size()) == text ? 1 : 0, at::kLong);
  world.allReduce(verdict, {ReduceOp::kMin})->wait();
  return verdict.item<int64_t>() == 1;
}

// An engine call that fails on one rank fails on every rank with the same
// error (a program that catches it, "resume if there is a save, else start
// fresh", goes on on every rank instead of leaving the others waiting), and
// the error names the engine's API, not remat-train's flags.
TEST(Engine, ASaveFolderOneRankCannotTakeIsTheSameErrorOnEveryRank) {
  const std::string dir = scratch("agree_folder");
  const std::string file = dir + "/a_file";
  if (testing::world()->rank() == 0) {
    fs::create_directories(dir);
    std::ofstream(file) << "not a folder";
  }
  testing::world()->barrier()->wait();
  Trainer run(config_json(0, "none"), false, quick_timeout());
  run.train(1);
  // Rank 1 is given a file where rank 0 has a good folder.
  const std::string mine = testing::world()->rank() == 1 ? file : dir + "/saves";
  const std::string error = error_of<ConfigError>([&] { run.engine->save_checkpoint(mine); });
  EXPECT_THAT(error, HasSubstr(str("save folder '", file, "' cannot be created")));
  EXPECT_THAT(error, HasSubstr("(the save folder check failed on rank 1 of 2; every rank stops with this error)"));
  EXPECT_TRUE(same_on_every_rank(error)) << error;
  // Every rank goes on: rank 0 let go of the folder it locked.
  EXPECT_EQ(run.engine->save_checkpoint(dir + "/saves"), dir + "/saves/step_00000001");
  EXPECT_NO_THROW(run.train(1));
}

TEST(Engine, ASaveFolderOfAnotherRunIsRefusedOnEveryRankNamingTheApi) {
  const std::string dir = scratch("agree_taken");
  {
    Trainer first(config_json(0, "none"), false, quick_timeout());
    first.train(1);
    first.engine->save_checkpoint(dir);
  }
  Trainer second(config_json(1, "none"), false, quick_timeout());
  second.train(1);
  // Rank 0 checks the folder under its lock; rank 1 learns its verdict.
  const std::string error = error_of<ConfigError>([&] { second.engine->save_checkpoint(dir); });
  EXPECT_THAT(error, HasSubstr(str("save folder '", dir, "' holds the saves of another run (1 step folder(s), "
                                   "latest step 1): a new run would overwrite them. Resume that run with "
                                   "Engine::load_checkpoint(\"", dir, "\"), give this run another save folder, or "
                                   "pass SaveDirOptions::overwrite = true to Engine::use_save_dir")));
  EXPECT_THAT(error, HasSubstr("failed on rank 0 of 2"));
  EXPECT_THAT(error, Not(HasSubstr("--")));
  EXPECT_TRUE(same_on_every_rank(error)) << error;
  SaveDirOptions overwrite;
  overwrite.overwrite = true;
  EXPECT_NO_THROW(second.engine->use_save_dir(dir, overwrite));
  EXPECT_EQ(second.engine->save_checkpoint(dir), dir + "/step_00000001");
}

TEST(Engine, ASaveOneRankCannotWriteIsTheSameErrorOnEveryRank) {
  const std::string dir = scratch("agree_write");
  Trainer run(config_json(2, "none"), false, quick_timeout());
  run.train(1);
  run.engine->use_save_dir(dir);
  // Rank 1 cannot write its file: its files may not grow past 1 KiB (a full
  // disk as one process sees it).
  const std::string blocked = dir + "/.staging_step_00000001/rank_1.pt";
  struct rlimit before {};
  ::getrlimit(RLIMIT_FSIZE, &before);
  if (testing::world()->rank() == 1) {
    std::signal(SIGXFSZ, SIG_IGN);  // the write fails instead of ending the process
    struct rlimit small = before;
    small.rlim_cur = 1024;
    ::setrlimit(RLIMIT_FSIZE, &small);
  }
  const std::string error = error_of<Error>([&] { run.engine->save_checkpoint(dir); });
  if (testing::world()->rank() == 1) ::setrlimit(RLIMIT_FSIZE, &before);
  EXPECT_THAT(error, HasSubstr(blocked));
  EXPECT_THAT(error, HasSubstr("(the save of step 1 failed on rank 1 of 2; every rank stops with this error)"));
  EXPECT_TRUE(same_on_every_rank(error)) << error;
  EXPECT_EQ(latest_step(dir), -1) << "an incomplete save is not the latest";
  testing::world()->barrier()->wait();
  EXPECT_FALSE(fs::exists(dir + "/.staging_step_00000001")) << "a failed save leaves nothing of itself";
  EXPECT_FALSE(fs::exists(dir + "/step_00000001"));
  // Every rank has looked before rank 0 stages the next save of this step.
  testing::world()->barrier()->wait();
  EXPECT_EQ(run.engine->save_checkpoint(dir), dir + "/step_00000001");
  EXPECT_EQ(latest_step(dir), 1);
  EXPECT_NO_THROW(run.train(1));
}

TEST(Engine, ALoadOneRankCannotReadIsTheSameErrorOnEveryRankAndLoadsNothing) {
  const std::string dir = scratch("agree_load");
  {
    Trainer first(config_json(2, "none"), false, quick_timeout());
    first.train(2);
    first.engine->save_checkpoint(dir);
  }
  const std::string damaged = dir + "/step_00000002/rank_1.pt";
  if (testing::world()->rank() == 0) {
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  testing::world()->barrier()->wait();
  Trainer second(config_json(2, "none"), false, quick_timeout());
  second.train(1);
  const auto before = whole_parameters(*second.engine);
  const std::string error = error_of<ConfigError>([&] { second.engine->load_checkpoint(dir); });
  EXPECT_THAT(error, HasSubstr(str("resume: '", damaged, "' is damaged")));
  EXPECT_THAT(error, HasSubstr(str("(loading the save in '", dir, "' failed on rank 1 of 2; every rank stops "
                                   "with this error)")));
  EXPECT_THAT(error, Not(HasSubstr("--")));
  EXPECT_TRUE(same_on_every_rank(error)) << error;
  // No rank took anything of the save: the run starts fresh alike everywhere.
  EXPECT_EQ(second.engine->global_steps(), 1);
  std::string differing;
  EXPECT_TRUE(all_equal(before, whole_parameters(*second.engine), &differing)) << differing;
  EXPECT_NO_THROW(second.train(1));
}

TEST(Engine, AnExportRankZeroCannotWriteIsTheSameErrorOnEveryRank) {
  const std::string dir = scratch("agree_export");
  const std::string path = dir + "/no/such/folder/model.pt";
  Trainer run(config_json(3, "none"), false, quick_timeout());
  run.train(1);
  // Rank 0 finds the folder missing before anything is gathered.
  const std::string error = error_of<ConfigError>([&] { run.engine->export_model(path); });
  EXPECT_THAT(error, HasSubstr(str("remat::Engine::export_model '", path, "': its folder")));
  EXPECT_THAT(error, HasSubstr("(the export's path check failed on rank 0 of 2; every rank stops with this error)"));
  EXPECT_TRUE(same_on_every_rank(error)) << error;
  if (testing::world()->rank() == 0) fs::create_directories(dir);
  testing::world()->barrier()->wait();
  const int64_t bytes = run.engine->export_model(dir + "/model.pt");
  EXPECT_EQ(bytes > 0, testing::world()->rank() == 0);
  EXPECT_NO_THROW(run.train(1));
}

TEST(Engine, AnExportOrTraceInsideTheSaveFolderIsRefusedOnEveryRank) {
  const std::string dir = scratch("export_into_saves");
  Trainer run(config_json(3, "none"), false, quick_timeout());
  run.train(1);
  run.engine->save_checkpoint(dir);
  for (const std::string& path : {dir + "/.lock", dir + "/latest", dir + "/step_00000001/rank_0.pt", dir}) {
    const std::string error = error_of<ConfigError>([&] { run.engine->export_model(path); });
    EXPECT_THAT(error, HasSubstr(str("remat::Engine::export_model '", path, "'")));
    EXPECT_THAT(error, HasSubstr(str("the save folder '", dir, "', which holds this run's saves and their lock")));
    EXPECT_TRUE(same_on_every_rank(error)) << error;
  }
  EXPECT_THAT(error_of<ConfigError>([&] { run.engine->trace_memory(dir + "/step_00000001/trace.json"); }),
              HasSubstr("lies inside the save folder"));
  // A file of the user's beside the saves is theirs to write.
  EXPECT_EQ(run.engine->export_model(dir + "/model.pt") > 0, testing::world()->rank() == 0);
  EXPECT_NO_THROW(run.train(1));
  EXPECT_NO_THROW(run.engine->load_checkpoint(dir));  // the save is intact
}

// docs/engine.md's complete example, small: an embedding, residual MLP
// blocks and a head, the head called through remat::forward as the model
// contract says (`direct_head`: called as head(h), as the example did).
struct DocsBlockImpl : torch::nn::Module {
  explicit DocsBlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::gelu(fc1(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(DocsBlock);

struct DocsNetImpl : torch::nn::Module {
  DocsNetImpl(int64_t vocab, int64_t d, int n_blocks)
      : embed(register_module("embed", torch::nn::Embedding(vocab, d))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(d, vocab))) {
    for (int i = 0; i < n_blocks; ++i) blocks->push_back(DocsBlock(d));
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = embed(x);
    for (size_t i = 0; i < blocks->size(); ++i) h = remat::forward(blocks->ptr<DocsBlockImpl>(i), h);
    at::Tensor logits = direct_head ? head(h) : remat::forward(head, h);
    return at::cross_entropy_loss(logits.view({-1, logits.size(-1)}), y.view({-1}));
  }
  torch::nn::Embedding embed;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
  bool direct_head = false;
};
TORCH_MODULE(DocsNet);

// With activation offloading on, the example trains as docs/engine.md now
// writes it; its earlier head(h) fails at the first backward with the
// error the model contract's table quotes.
TEST(Engine, TheDocsCompleteExampleTrainsWithActivationOffloadingOnlyWithItsHeadOnTheCallRoute) {
  const std::string config = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
      "activation_checkpointing": {"variant": "full"},
      "activation_offloading": {"enabled": true, "min_offload_size": 0},
      "train": {"seed": 1234}})";
  for (bool direct_head : {false, true}) {
    at::manual_seed(1234);
    DocsNet model(kVocab, 16, 2);
    model->direct_head = direct_head;
    EngineOptions options;
    options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                      ParallelDims::from_world(testing::world()->size(), 1));
    auto engine = initialize(model, parse_config(config, "<test>"), options);
    auto train_step = [&] {
      for (int64_t m = 0; m < 2; ++m) {
        auto [x, y] = batch(engine->global_steps() + 1, m);
        engine->backward(engine->forward([&, x = x, y = y] { return model->loss(x, y); }));
        engine->step();
      }
    };
    if (!direct_head) {
      EXPECT_NO_THROW(train_step());
      EXPECT_NO_THROW(train_step());
      EXPECT_EQ(engine->global_steps(), 2);
      EXPECT_GT(engine->last_metrics().counter("act_offloaded_bytes"), 0);
    } else {
      const std::string error = error_of<Error>(train_step);
      EXPECT_THAT(error, HasSubstr("activation offloading: the output head 'head' was not called through "
                                   "remat::forward in this forward"));
      EXPECT_THAT(error, HasSubstr("Call it through remat::forward(module, args...)"));
    }
  }
}

}  // namespace
}  // namespace remat
