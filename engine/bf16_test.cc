// bf16 at every ZeRO stage through the engine (issue 41, item 1): float32
// masters and optimizer state, bf16 compute copies, gradients reduced in
// bf16 (DeepSpeed's default) or float32 and accumulated in float32. Stages
// 1-3 and hybrid sharding against bf16 at stage 0, bf16 against float32 over
// 50 steps, checkpointing bitwise inside bf16, saves of float32 masters, and
// a model whose float32 input reaches a Conv2d (the inputs cast to bf16); the
// export in bf16 (stage3_gather_16bit_weights_on_model_save).
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/export.h"
#include "models/gpt.h"
#include "nn/module_call.h"
#include "parallel/zero.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

namespace fs = std::filesystem;
using remat::testing::world;

struct Bf16Setup {
  int stage = 0;
  bool bf16 = true;
  int steps = 6;
  int micro_steps = 1;
  std::string variant = "none";
  double dropout = 0.1;
  double clip = 1.0;
  int hybrid = 0;
  bool freeze = false;
  bool contiguous_gradients = true;  // the first block and the token embedding (a fine-tune's base weights)
  parallel::ReduceDtype reduce = parallel::ReduceDtype::kDefault;
};

Config config_of(const Bf16Setup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = s.micro_steps;
  c.gradient_clipping = s.clip;
  c.train.seed = 21;
  c.optimizer.type = "AdamW";
  c.optimizer.lr = 1e-2;
  c.bf16.enabled = s.bf16;
  c.bf16.reduce_dtype = s.reduce;
  c.activation_checkpointing.variant = checkpoint_variant_from_name(s.variant);
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.reduce_bucket_size = 1000;  // several buckets
  c.zero_optimization.hybrid_shard_size = s.hybrid;
  c.zero_optimization.contiguous_gradients = s.contiguous_gradients;
  return c;
}

struct Bf16Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> final_params;  // whole, float32
  std::map<std::string, at::Tensor> frozen;        // the frozen parameters' initial values
  parallel::ZeroStats stats;
};

// The GPT of zero_engine_test trained `s.steps` steps from `from` (a save to
// resume, or empty); saves into `save_to` after `save_at` steps when given.
Bf16Run train(const Bf16Setup& s, const std::string& from = "", const std::string& save_to = "", int save_at = -1) {
  const auto& l = remat::testing::layout(1);
  models::GptOptions o = remat::testing::small_gpt(29, 3, s.dropout);
  at::manual_seed(21);
  models::Gpt model(o);
  Bf16Run run;
  if (s.freeze) {
    for (const auto& item : model->named_parameters()) {
      if (item.key().rfind("blocks.0.", 0) == 0 || item.key().find("tok_emb") != std::string::npos) {
        item.value().requires_grad_(false);
        run.frozen[item.key()] = item.value().detach().clone();
      }
    }
  }
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(1);
  auto engine = initialize(model, config_of(s), options);
  if (!from.empty()) engine->load_checkpoint(from);
  for (const auto& p : engine->sharding().parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "fp32 masters";
  for (int step = 0; step < s.steps; ++step) {
    const int64_t global = engine->global_steps();
    for (int m = 0; m < s.micro_steps; ++m) {
      at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12})
                           .mul(l.dp_rank() + 1).add(global * 3 + m).remainder(o.vocab_size);
      engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
      if (m + 1 == s.micro_steps) run.stats = engine->sharding().stats();
      engine->step();
    }
    run.losses.push_back(engine->last_metrics().loss);
    if (step + 1 == save_at) engine->save_checkpoint(save_to);
  }
  for (const auto& [name, value] : engine->sharding().full_parameters()) run.final_params[name] = value;
  return run;
}

std::string describe(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return str("max |difference| ", worst);
}

// The stage rules of float32 (zero_engine_test: stages 1-3 against stage 0
// within float tolerance, the reductions and the clipping norm summing in
// another order) hold in bf16. Without clipping (whose global norm each
// stage sums over its own pieces) and with one micro-step every stage
// reduces the same bf16 gradients in the same bf16 sums, so the losses are
// bitwise those of stage 0; with
// accumulation, stages 2 and 3 reduce each micro-step's gradients where 0
// and 1 reduce their float32 sum once (bf16 roundings apart: 1.4e-3 at most
// measured over 6 steps, bound 5e-3). Reducing in float32
// (communication_data_type "fp32") is bitwise across stages too, and differs
// from reducing in bf16.
TEST(Bf16, EveryStageAndHybridShardingMatchStage0) {
  const int n = world()->size();
  for (int micro : {1, 2}) {
    Bf16Setup base;
    base.micro_steps = micro;
    base.clip = 0;
    const Bf16Run zero0 = train(base);
    for (int stage : {1, 2, 3}) {
      for (int hybrid : {0, 1}) {
        if (hybrid == 1 && n == 1) continue;  // hybrid needs replicas
        Bf16Setup s = base;
        s.stage = stage;
        s.hybrid = hybrid;
        const Bf16Run r = train(s);
        const std::string what = str("stage ", stage, " micro-steps ", micro, " hybrid ", hybrid, ": ",
                                     describe(zero0.losses, r.losses));
        for (size_t i = 0; i < r.losses.size(); ++i) {
          if (micro == 1 || stage == 1) {
            EXPECT_EQ(zero0.losses[i], r.losses[i]) << what << " step " << i;
          } else {
            EXPECT_NEAR(zero0.losses[i], r.losses[i], 5e-3) << what << " step " << i;
          }
        }
        if (world()->rank() == 0) std::printf("bf16 %s\n", what.c_str());
      }
    }
    // Gradients kept on the parameters (no contiguous buffer) accumulate in
    // float32 there: stage 1 still sums the window as stage 0 does.
    Bf16Setup kept = base;
    kept.stage = 1;
    kept.contiguous_gradients = false;
    const Bf16Run k = train(kept);
    for (size_t i = 0; i < k.losses.size(); ++i) {
      EXPECT_EQ(zero0.losses[i], k.losses[i]) << "stage 1 without contiguous_gradients, micro-steps " << micro;
    }
  }
  if (n == 1) return;  // nothing is reduced
  Bf16Setup fp32_reduce, bf16_reduce_setup;
  fp32_reduce.reduce = parallel::ReduceDtype::kFp32;
  fp32_reduce.clip = bf16_reduce_setup.clip = 0;
  const Bf16Run a = train(fp32_reduce), bf16_reduce = train(bf16_reduce_setup);
  fp32_reduce.stage = 2;
  const Bf16Run b = train(fp32_reduce);
  int differ = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "float32 reductions, stage 2 against 0, step " << i;
    if (a.losses[i] != bf16_reduce.losses[i]) ++differ;
  }
  EXPECT_GT(differ, 0) << "communication_data_type fp32 reduced in bf16";
}

// bf16 keeps 8 bits of mantissa: the logits' relative error is ~2^-8 and the
// trajectories drift apart step by step. Over 50 steps of this GPT (AdamW,
// lr 1e-2, loss from 3.4 down) the measured largest gap is printed; the bound
// is 4 % of the float32 loss at every step. Measured: LibTorch 1.13 at most
// 0.039 (1 rank; 1.9 % at that step), LibTorch 2.6, whose CPU bf16 kernels
// round differently, 0.053 at a loss of 2.02 (2.6 %). A bf16 step that broke
// the masters or the gradients' accumulation departs by far more.
TEST(Bf16, TracksFloat32Over50Steps) {
  for (int stage : {0, 2}) {
    Bf16Setup fp32;
    fp32.stage = stage;
    fp32.bf16 = false;
    fp32.steps = 50;
    Bf16Setup bf16 = fp32;
    bf16.bf16 = true;
    const Bf16Run a = train(fp32), b = train(bf16);
    int differ = 0;
    for (size_t i = 0; i < a.losses.size(); ++i) {
      EXPECT_NEAR(a.losses[i], b.losses[i], 0.04 * std::abs(a.losses[i])) << "stage " << stage << " step " << i;
      if (a.losses[i] != b.losses[i]) ++differ;
    }
    EXPECT_GT(differ, 40) << "bf16 ran in float32";
    EXPECT_LT(b.losses.back(), b.losses.front() - 0.5) << "bf16 trains";
    if (world()->rank() == 0) {
      std::printf("bf16 vs float32, stage %d, 50 steps: %s (first loss %.4f, last %.4f vs %.4f)\n", stage,
                  describe(a.losses, b.losses).c_str(), a.losses.front(), b.losses.back(), a.losses.back());
    }
    // The model holds bf16 copies beside the float32 masters: 6 bytes an
    // element where float32 holds 4.
    EXPECT_EQ(b.stats.param_bytes * 2, a.stats.param_bytes * 3) << "stage " << stage;
  }
}

// Frozen parameters (a fine-tune's base weights) get bf16 copies too, keep
// their float32 values bitwise, and every stage trains the rest as stage 0.
TEST(Bf16, FrozenParametersAtEveryStage) {
  Bf16Setup base;
  base.freeze = true;
  base.clip = 0;
  const Bf16Run zero0 = train(base);
  for (int stage : {0, 1, 2, 3}) {
    Bf16Setup s = base;
    s.stage = stage;
    const Bf16Run r = stage == 0 ? zero0 : train(s);
    ASSERT_FALSE(r.frozen.empty());
    for (const auto& [name, value] : r.frozen) {
      EXPECT_TRUE(at::equal(value, r.final_params.at(name))) << "stage " << stage << ": " << name << " moved";
    }
    for (size_t i = 0; i < r.losses.size(); ++i) EXPECT_EQ(zero0.losses[i], r.losses[i]) << "stage " << stage;
  }
}

// Full checkpointing recomputes each block on the same bf16 copies with the
// same random state: bitwise the run without, with dropout on; at stage 3 the
// recompute runs inside the bf16 gather.
TEST(Bf16, CheckpointingIsBitwiseInsideBf16) {
  for (int stage : {0, 2, 3}) {
    Bf16Setup off;
    off.stage = stage;
    off.dropout = 0.1;
    Bf16Setup on = off;
    on.variant = "full";
    const Bf16Run a = train(off), b = train(on);
    for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "stage " << stage << " step " << i;
    for (const auto& [name, value] : a.final_params) {
      EXPECT_TRUE(at::equal(value, b.final_params.at(name))) << "stage " << stage << ": " << name;
    }
  }
}

// A shared folder for this job (rank 0 names it).
std::string job_dir(const std::string& name) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir = (fs::temp_directory_path() / str("remat_bf16_", stamp.item<int64_t>(), "_", name)).string();
  if (world()->rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world()->barrier()->wait();
  return dir;
}

// Saves hold the float32 masters: a bf16 run resumes bitwise, at the same
// stage and at another; a float32 run resumes from a bf16 save with the
// masters' values (not bf16-rounded), and a bf16 run from a float32 save.
TEST(Bf16, SavesHoldFloat32MastersAndResumeBitwise) {
  Bf16Setup s;
  s.stage = 1;
  s.steps = 6;
  const Bf16Run straight = train(s);
  const std::string dir = job_dir("resume");
  Bf16Setup first = s;
  first.steps = 3;
  const Bf16Run head = train(first, "", dir, 3);
  for (int stage : {1, 0, 3}) {
    Bf16Setup rest = s;
    rest.stage = stage;
    rest.steps = 3;
    const Bf16Run tail = train(rest, dir);
    for (size_t i = 0; i < 3; ++i) {
      if (stage == 1 || stage == 0) {
        EXPECT_EQ(tail.losses[i], straight.losses[3 + i]) << "resumed at stage " << stage << ", step " << 3 + i;
      } else {
        EXPECT_NEAR(tail.losses[i], straight.losses[3 + i], 1e-2) << "resumed at stage 3, step " << 3 + i;
      }
    }
  }
  // The masters carry more than bf16's 8 bits: a float32 run loads them as saved.
  Bf16Setup fp32 = s;
  fp32.bf16 = false;
  fp32.steps = 0;
  const Bf16Run loaded = train(fp32, dir);
  int finer = 0;
  for (const auto& [name, value] : head.final_params) {
    EXPECT_TRUE(at::equal(value, loaded.final_params.at(name))) << name;
    if (!at::equal(value, value.to(at::kBFloat16).to(at::kFloat))) ++finer;
  }
  EXPECT_GT(finer, 0) << "the saved masters were bf16-rounded";
  // And a bf16 run resumes from a float32 save.
  const std::string dir32 = job_dir("resume32");
  fp32.steps = 2;
  train(fp32, "", dir32, 2);
  Bf16Setup back = s;
  back.steps = 1;
  const Bf16Run resumed = train(back, dir32);
  EXPECT_TRUE(std::isfinite(resumed.losses[0]));
  if (world()->rank() == 0) {
    fs::remove_all(dir);
    fs::remove_all(dir32);
  }
}

// GatheredParameters(modify) at stages 0-2 edits the bf16 copies: what the
// scope leaves alone keeps its float32 master bitwise (not rounded to bf16),
// an edit reaches the master and, at the next forward, the copy.
TEST(Bf16, AModifyingScopeWritesBackOnlyWhatChanged) {
  for (int stage : {0, 2}) {
    at::manual_seed(21);
    models::Gpt model(remat::testing::small_gpt(29, 2, 0.0));
    Bf16Setup s;
    s.stage = stage;
    EngineOptions options;
    options.layout = remat::testing::layout_ptr(1);
    auto engine = initialize(model, config_of(s), options);
    const auto before = engine->sharding().full_parameters();
    {
      GatheredParameters scope(*engine, /*modify=*/true);
      at::NoGradGuard no_grad;
      model->named_parameters()["pos_emb.weight"].fill_(0.5);
    }
    int finer = 0;
    for (const auto& [name, value] : engine->sharding().full_parameters()) {
      const at::Tensor& was = std::find_if(before.begin(), before.end(), [&](const auto& p) { return p.first == name; })->second;
      if (name == "pos_emb.weight") {
        EXPECT_TRUE(at::equal(value, at::full_like(value, 0.5))) << "stage " << stage;
        continue;
      }
      EXPECT_TRUE(at::equal(value, was)) << "stage " << stage << ": " << name << " rewritten";
      if (!at::equal(was, was.to(at::kBFloat16).to(at::kFloat))) ++finer;
    }
    EXPECT_GT(finer, 0);
  }
}

// A vision model as users write one: a Conv2d patch embedding on the float32
// image, outside the blocks (in the root), then linear blocks. Under bf16 its
// parameters are bf16 and the image is not: remat::forward casts the
// floating-point inputs of the modules it calls (the model cannot know the
// compute dtype).
struct TinyVitImpl : torch::nn::Module {
  TinyVitImpl() {
    patch = register_module("patch", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 4).stride(4)));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 4));
  }
  at::Tensor loss(const at::Tensor& image, const at::Tensor& label) {
    at::Tensor x = remat::forward(patch, image).flatten(2).transpose(1, 2);  // [B, 4, 8]
    for (size_t i = 0; i < blocks->size(); ++i) {
      x = x + at::gelu(remat::forward(blocks->ptr<torch::nn::LinearImpl>(i), x));
    }
    at::Tensor logits = remat::forward(head, x.mean(1));
    return at::cross_entropy_loss(logits.to(at::kFloat), label);
  }
  torch::nn::Conv2d patch{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyVit);

TEST(Bf16, AConvPatchEmbeddingOnAFloat32ImageTrains) {
  for (int stage : {0, 3}) {
    at::manual_seed(5);
    TinyVit model;
    Config c = config_of(Bf16Setup{});
    c.zero_optimization.stage = stage;
    c.zero_optimization.stage3_param_persistence_threshold = 0;
    EngineOptions options;
    options.layout = remat::testing::layout_ptr(1);
    auto engine = initialize(model, c, options);
    EXPECT_EQ(model->patch->weight.scalar_type(), at::kBFloat16) << "stage " << stage;
    at::manual_seed(6 + world()->rank());
    const at::Tensor image = at::randn({4, 3, 8, 8});  // float32, as a data loader gives it
    const at::Tensor label = at::arange(4, at::kLong);
    std::vector<double> losses;
    for (int step = 0; step < 12; ++step) {
      engine->backward(engine->forward([&] { return model->loss(image, label); }));
      engine->step();
      losses.push_back(engine->last_metrics().loss);
    }
    EXPECT_LT(losses.back(), losses.front() - 0.1) << "stage " << stage;
  }
  // The cast is bf16's: a float32 run calls the Conv2d with the image as given.
  at::manual_seed(5);
  TinyVit model;
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(1);
  Bf16Setup fp32;
  fp32.bf16 = false;
  auto engine = initialize(model, config_of(fp32), options);
  EXPECT_EQ(model->patch->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(module_hook(*model->patch, HookSlot::kSharding), nullptr);
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

// The dictionary an export file holds.
std::map<std::string, at::Tensor> read_export(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  for (const auto& item : torch::pickle_load(data).toGenericDict()) out[item.key().toStringRef()] = item.value().toTensor();
  return out;
}

// stage3_gather_16bit_weights_on_model_save (issue 41, item 4): under bf16 the
// export holds every parameter whole in bf16, each the float32 export's value
// rounded to bf16, at stage 0 and at stage 3 (gathered over the ranks); with
// the key false it is float32 as before.
TEST(Bf16, TheExportIsInTheTrainingDtypeWhenAskedFor) {
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(stamp, {0})->wait();
  const std::string dir = (fs::temp_directory_path() / str("remat_bf16_export_", stamp.item<int64_t>())).string();
  if (world()->rank() == 0) fs::create_directories(dir);
  world()->barrier()->wait();
  for (int stage : {0, 3}) {
    for (bool gather16 : {true, false}) {
      Bf16Setup s;
      s.stage = stage;
      Config c = config_of(s);
      c.deepspeed_tuning.gather_16bit_weights_on_model_save = gather16;
      models::Gpt model(remat::testing::small_gpt(29, 3, 0.1));
      EngineOptions options;
      options.layout = remat::testing::layout_ptr(1);
      auto engine = initialize(model, c, options);
      for (int step = 0; step < 2; ++step) {
        at::Tensor idx = at::arange(2 * 12, at::kLong).view({2, 12}).add(step + world()->rank()).remainder(29);
        engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
        engine->step();
      }
      EXPECT_EQ(engine->export_dtype(), gather16 ? at::kBFloat16 : at::kFloat);
      const std::string path16 = str(dir, "/model", stage, gather16, ".pt"), path32 = path16 + ".fp32";
      EXPECT_EQ(engine->export_model(path16) > 0, world()->rank() == 0);
      export_model(path32, engine->sharding(), *model, *world());  // float32, the same state
      if (world()->rank() == 0) {
        const auto exported = read_export(path16), float32 = read_export(path32);
        ASSERT_EQ(exported.size(), float32.size());
        ASSERT_EQ(exported.size(), model->named_parameters().size());
        for (const auto& [name, value] : float32) {
          ASSERT_TRUE(exported.count(name)) << name;
          const at::Tensor& got = exported.at(name);
          EXPECT_EQ(value.scalar_type(), at::kFloat) << name;
          EXPECT_EQ(got.sizes(), model->named_parameters()[name].sizes()) << name;
          EXPECT_TRUE(at::equal(got, gather16 ? value.to(at::kBFloat16) : value))
              << "stage " << stage << (gather16 ? " bf16 " : " fp32 ") << name;
        }
        for (const auto& [name, value] : exported) {
          EXPECT_EQ(value.scalar_type(), gather16 ? at::kBFloat16 : at::kFloat) << name;
        }
      }
      world()->barrier()->wait();
    }
  }
  if (world()->rank() == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace remat
