// remat::Engine on a model written as a user would (not one of remat's):
// the step lifecycle, parity across stages and checkpointing, save/resume
// with client state, GatheredParameters, and each misuse's error.
#include "engine/engine.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>

#include "engine/optim.h"
#include "nn/module_call.h"
#include "runtime/error.h"
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
    options.layout = std::make_shared<ParallelLayout>(testing::world(),
                                                      ParallelDims::from_world(testing::world()->size(), 1));
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

TEST(Engine, EveryStageWithAndWithoutCheckpointingMatchesStage0Bitwise) {
  const std::vector<double> reference = Trainer(config_json(0, "none", 2)).train(3);
  for (int stage : {0, 1, 2, 3}) {
    for (const char* variant : {"none", "full", "selective_op"}) {
      const std::vector<double> losses = Trainer(config_json(stage, variant, 2)).train(3);
      EXPECT_EQ(losses, reference) << "stage " << stage << ", variant " << variant;
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
    // The optimizer steps from the edited values: a step with lr 0 keeps them.
    set_learning_rate(run.engine->optimizer(), 0.0);
    auto [x, y] = batch(9, 0);
    run.engine->backward(run.engine->forward([&, x = x, y = y] { return run.model->loss(x, y); }));
    run.engine->step();
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
    EXPECT_GT(a.engine->last_metrics().ckpt_offloaded_bytes, 0) << "engine a's regions offload";
    beside_b.push_back(b.train(1)[0]);
    EXPECT_EQ(b.engine->last_metrics().ckpt_saved_bytes, 0) << "engine b has no regions";
    EXPECT_EQ(b.engine->last_metrics().ckpt_offloaded_bytes, 0) << "engine a's counters are not b's";
    EXPECT_EQ(b.engine->last_metrics().recompute_ms, 0) << "engine a's recompute time is not b's";
  }
  EXPECT_EQ(beside_a, alone_a);
  EXPECT_EQ(beside_b, alone_b);
}

}  // namespace
}  // namespace remat
