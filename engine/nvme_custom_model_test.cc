// offload_optimizer and offload_param on "nvme" with a model written as a
// user would (not remat's GPT), under mpirun at 1 and 2 ranks: sizes no
// multiple of the ranks, a zero-size parameter, integer buffers, frozen
// parameters, a weight used by two modules (tied in the forward), bf16,
// accumulation, max_in_cpu 0, 1 and some; a gradient penalty taken with
// torch::autograd::grad in the forward; pretrained weights loaded over the
// files (frozen ones too); a skipped non-finite step, a modifying
// GatheredParameters edit, evaluate() between steps, an async save resumed
// across the devices: losses, weights and buffers bitwise those of "cpu".
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <limits>
#include <map>

#include "engine/engine.h"
#include "nn/module_call.h"
#include "runtime/layout.h"
#include "tests/offload_runs.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using remat::testing::job_dir;
using remat::testing::world;

constexpr int64_t kVocab = 13, kSeq = 5, kWidth = 7;  // odd sizes: no multiple of the ranks

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    up = register_module("up", torch::nn::Linear(kWidth, 3 * kWidth));
    down = register_module("down", torch::nn::Linear(3 * kWidth, kWidth));
    empty = register_parameter("empty", at::zeros({0}));
    register_buffer("counter", at::zeros({3}, at::kLong));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(x))) + empty.sum(); }
  torch::nn::Linear up{nullptr}, down{nullptr};
  at::Tensor empty;
};
TORCH_MODULE(Block);

// `tie`: the head computes with the embedding's weight (registered once).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool tie) : tie(tie) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(Block());
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kWidth, kVocab).bias(false)));
    register_buffer("steps_seen", at::zeros({1}, at::kInt));
  }
  at::Tensor embedded(const at::Tensor& x) { return embed(x); }
  at::Tensor through_blocks(at::Tensor h) {
    for (size_t i = 0; i < blocks->size(); ++i) h = remat::forward(blocks->ptr<BlockImpl>(i), h);
    return h;
  }
  at::Tensor rest(const at::Tensor& h, const at::Tensor& y) {
    at::Tensor logits = tie ? at::linear(norm(h), embed->weight) + head(h) : head(norm(h));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
  bool tie;
};
TORCH_MODULE(Net);

struct RunSetup {
  int stage = 3;
  std::string opt = "cpu";    // offload_optimizer device
  std::string param = "none";  // offload_param device
  std::string path;
  int64_t max_in_cpu = 0;
  bool tie = false;
  bool penalty = false;
  bool bf16 = false;
  int micro = 1;
  std::vector<std::string> frozen;
  std::string pretrained;  // a safetensors file loaded after initialize
  int steps = 3;
  int seed = 5;
  int nan_at = 0;         // the loss of this step is NaN (skipped with on_nonfinite skip)
  int edit_at = 0;        // after this step, a modifying GatheredParameters scope edits weights
  bool evaluate = false;  // an evaluate() after every step
  std::string save_dir;   // async save after step 2
  std::string resume;     // loaded after initialize
};

std::string config_of(const RunSetup& s) {
  return str(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": )", s.micro,
             R"(, "gradient_clipping": 1.0, "bf16": {"enabled": )", s.bf16 ? "true" : "false",
             R"(}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
                "zero_optimization": {"stage": )", s.stage,
             R"(, "stage3_param_persistence_threshold": 0, "sub_group_size": 1024,
                  "offload_optimizer": {"device": ")", s.opt, R"(", "nvme_path": ")", s.path,
             R"("}, "offload_param": {"device": ")", s.param, R"(", "nvme_path": ")", s.path,
             R"(", "max_in_cpu": )", s.max_in_cpu, R"(}}, "train": {"seed": )", s.seed,
             R"(, "on_nonfinite": "skip", "async_save": true}})");
}

struct Result {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;
  std::map<std::string, at::Tensor> buffers;
};

Result run(const RunSetup& s, const std::string& export_to = "") {
  Config parsed = parse_config(config_of(s), "<nvme_custom_model_test>");
  EngineOptions options;
  options.layout = std::make_shared<ParallelLayout>(world(), ParallelDims::from_world(world()->size(), 1));
  at::manual_seed(static_cast<uint64_t>(s.seed));
  Net model(s.tie);
  for (const auto& item : model->named_parameters()) {
    for (const auto& f : s.frozen) {
      if (item.key() == f) item.value().requires_grad_(false);
    }
  }
  auto engine = initialize(model, parsed, options);
  if (!s.pretrained.empty()) engine->load_pretrained(s.pretrained);
  if (!s.resume.empty()) engine->load_checkpoint(s.resume);
  Result r;
  for (int step = static_cast<int>(engine->global_steps()) + 1; step <= s.steps; ++step) {
    for (int m = 0; m < s.micro; ++m) {
      at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + 10 * m + world()->rank()));
      at::Tensor x = at::randint(kVocab, {2, kSeq}, gen, at::kLong);
      at::Tensor y = at::randint(kVocab, {2, kSeq}, gen, at::kLong);
      engine->backward(engine->forward([&] {
        at::Tensor e = model->through_blocks(model->embedded(x));
        at::Tensor loss = model->rest(e, y);
        if (step == s.nan_at) loss = loss * std::numeric_limits<float>::quiet_NaN();
        if (!s.penalty) return loss;
        at::Tensor g = torch::autograd::grad({loss}, {e}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
        return loss + 0.1 * g.pow(2).sum();
      }));
      engine->step();
    }
    r.losses.push_back(engine->last_metrics().loss);
    if (s.evaluate) {
      at::Tensor x = at::arange(2 * kSeq, at::kLong).view({2, kSeq}).remainder(kVocab);
      r.losses.push_back(engine->evaluate([&] { return model->rest(model->through_blocks(model->embedded(x)), x); })
                             .item<double>());
    }
    if (step == s.edit_at) {
      GatheredParameters gathered(*engine, /*modify=*/true);
      at::NoGradGuard no_grad;
      for (const auto& item : model->named_parameters()) {
        if (item.value().numel() > 0) item.value().mul_(0.5).add_(0.01);
      }
    }
    if (step == 2 && !s.save_dir.empty()) engine->save_checkpoint(s.save_dir);
  }
  engine->wait_for_saves();
  const nlohmann::json m = engine->last_metrics().to_json();
  if (s.opt == "nvme") {
    EXPECT_GT(m.value("nvme_state_bytes", int64_t{0}), 0) << "the moments on disk";
  }
  if (s.param == "nvme") {
    EXPECT_GT(m.value("nvme_parameter_bytes", int64_t{0}), 0) << "shards on disk";
  }
  {
    GatheredParameters gathered(*engine);
    for (const auto& item : model->named_parameters()) r.params[item.key()] = item.value().detach().clone();
    for (const auto& item : model->named_buffers()) r.buffers[item.key()] = item.value().detach().clone();
  }
  if (!export_to.empty()) engine->export_model(export_to);
  return r;
}

void expect_same(const Result& a, const Result& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_TRUE(a.losses[i] == b.losses[i] || (std::isnan(a.losses[i]) && std::isnan(b.losses[i])))
        << what << ", loss " << i + 1 << ": " << a.losses[i] << " vs " << b.losses[i];
  }
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  for (const auto& [name, value] : a.params) {
    EXPECT_TRUE(at::equal(value, b.params.at(name))) << what << ": " << name;
  }
  for (const auto& [name, value] : a.buffers) {
    EXPECT_TRUE(at::equal(value, b.buffers.at(name))) << what << ": buffer " << name;
  }
}

// Stages 1-3 (at 3 both offloads, and each alone), float32 and bf16, the
// head tied to the embedding or not, two micro-steps, two frozen parameters.
TEST(NvmeCustomModel, TrainsBitwiseAsCpu) {
  const std::string path = job_dir("remat_nvme_custom_", "custom");
  for (bool tie : {false, true}) {
    for (bool bf16 : {false, true}) {
      for (int stage : {1, 2, 3}) {
        for (int64_t max_in_cpu : {int64_t{0}, int64_t{1}, int64_t{50}}) {
          if (stage < 3 && max_in_cpu != 0) continue;
          RunSetup s;
          s.stage = stage;
          s.path = path;
          s.tie = tie;
          s.bf16 = bf16;
          s.micro = 2;
          s.max_in_cpu = max_in_cpu;
          s.frozen = {"blocks.1.up.weight", "norm.bias"};
          const std::string what = str("stage ", stage, tie ? " tied" : "", bf16 ? " bf16" : "", " max_in_cpu ", max_in_cpu);
          if (stage == 3) s.param = "cpu";
          const Result cpu = run(s);
          s.opt = "nvme";
          if (stage == 3) s.param = "nvme";
          expect_same(cpu, run(s), what);
          if (stage == 3) {
            s.opt = "cpu";
            expect_same(cpu, run(s), what + ", parameters alone on nvme");
            s.opt = "nvme";
            s.param = "cpu";
            expect_same(cpu, run(s), what + ", optimizer alone on nvme");
          }
        }
      }
    }
  }
}

// torch::autograd::grad in the forward (through the root's parameters, on
// disk: stage 3 refuses one through its units alike with "cpu" and "nvme").
TEST(NvmeCustomModel, GradientPenaltyBitwiseAsCpu) {
  const std::string path = job_dir("remat_nvme_custom_", "penalty");
  RunSetup s;
  s.path = path;
  s.penalty = true;
  s.param = "cpu";
  const Result cpu = run(s);
  s.param = "nvme";
  s.opt = "nvme";
  expect_same(cpu, run(s), "penalty");
}

// load_pretrained after initialize, the masters (stages 1-2) or the shards
// (stage 3) already in their files: the run trains from the file's values,
// frozen ones included, as with "cpu".
TEST(NvmeCustomModel, PretrainedValuesReachTheFilesFrozenOnesToo) {
  const std::string path = job_dir("remat_nvme_custom_", "pretrained");
  const std::string file = path + "/pre.safetensors";
  RunSetup donor;
  donor.path = path;
  donor.seed = 77;
  donor.stage = 0;
  donor.opt = "none";
  const Result donated = run(donor, file);
  at::manual_seed(5);
  Net fresh(false);
  ASSERT_FALSE(at::equal(fresh->embed->weight, donated.params.at("embed.weight"))) << "the file holds other values";
  for (int stage : {1, 2, 3}) {
    RunSetup s;
    s.stage = stage;
    s.path = path;
    s.pretrained = file;
    s.frozen = {"embed.weight", "blocks.0.up.weight", "norm.weight"};
    if (stage == 3) s.param = "cpu";
    const Result cpu = run(s);
    s.opt = "nvme";
    if (stage == 3) s.param = "nvme";
    const Result nvme = run(s);
    expect_same(cpu, nvme, str("pretrained stage ", stage));
    for (const auto& f : s.frozen) {
      EXPECT_TRUE(at::equal(nvme.params.at(f), donated.params.at(f))) << "stage " << stage << ": " << f;
    }
  }
}

// A skipped non-finite step (on_nonfinite skip), a modifying
// GatheredParameters edit, evaluate() after each step, an async save at step
// 2 resumed with the other device: each as with "cpu".
TEST(NvmeCustomModel, SkipsEditsEvaluationsAndAsyncSavesAsCpu) {
  const std::string path = job_dir("remat_nvme_custom_", "extras");
  for (int stage : {1, 2, 3}) {
    RunSetup s;
    s.stage = stage;
    s.path = path;
    s.steps = 4;
    s.nan_at = 2;
    s.edit_at = 3;
    s.evaluate = true;
    s.frozen = {"norm.bias"};
    s.save_dir = path + str("/save_cpu", stage);
    if (stage == 3) s.param = "cpu";
    const Result cpu = run(s);
    s.save_dir = path + str("/save_nvme", stage);
    s.opt = "nvme";
    if (stage == 3) s.param = "nvme";
    const Result nvme = run(s);
    expect_same(cpu, nvme, str("extras stage ", stage));
    // Resume each save (steps 3, 4) with the other device.
    RunSetup r = s;
    r.save_dir = "";
    r.resume = path + str("/save_cpu", stage);
    const Result from_cpu = run(r);
    r.resume = path + str("/save_nvme", stage);
    r.opt = "cpu";
    if (stage == 3) r.param = "cpu";
    const Result from_nvme = run(r);
    expect_same(from_cpu, from_nvme, str("extras resumed stage ", stage));
    ASSERT_EQ(from_cpu.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(from_cpu.losses[i], cpu.losses[i + 4]) << "stage " << stage << " " << i;
    EXPECT_TRUE(std::isnan(cpu.losses[2])) << "step 2's loss is NaN";
    EXPECT_FALSE(std::isnan(cpu.losses[3])) << "an evaluation after it is finite (the step was skipped)";
  }
}

}  // namespace
}  // namespace remat
