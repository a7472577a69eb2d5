// zero_optimization.offload_optimizer through the engine (issue 42, item 1),
// under mpirun at 1 and 2 ranks. On this CPU the host and the device are one
// memory, so an offloaded run computes the same bits as the run without it:
// at stages 1, 2 and 3 and with hybrid sharding, in float32 and bf16, with
// clipping, gradient accumulation, fp16's loss scaler (and an overflow), for
// AdamW, Adam (the fused host loops, optim/host_adam.h) and SGD. The
// optimizer's parameters and state are host tensors of their own (no alias
// of the model's), the metrics count their bytes, and saves resume across
// offload on and off, at another data-parallel size too.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>


#include "engine/config.h"
#include "engine/engine.h"
#include "optim/optimizer.h"
#include "models/gpt.h"
#include "nn/module_call.h"
#include "optim/host_adam.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/error_of.h"
#include "tests/offload_runs.h"
#include "tests/parallel_setup.h"

namespace remat {
namespace {

using remat::testing::expect_same;
using remat::testing::job_dir;
using remat::testing::world;
using OffloadRun = remat::testing::TrainedRun;

// Whether `zero` holds a part of the model state at `place` (ZeroModel::holding).
bool holds_at(const parallel::ZeroModel& zero, parallel::Place place) {
  for (const auto& part : zero.holding()) {
    if (part.place == place) return true;
  }
  return false;
}

struct OffloadSetup {
  int stage = 1;
  bool offload = false;
  bool pin = false;
  bool bf16 = false;
  bool fp16 = false;  // the loss scaler over float32 compute
  std::string optimizer = "AdamW";
  int steps = 5;
  int micro_steps = 1;
  int hybrid = 0;
  int ranks = 0;  // the first `ranks` ranks train (0: all)
  std::set<int> inject;  // steps (1-based) whose first host gradient gets an inf, on rank 0
  std::vector<std::string> frozen;  // parameters made requires_grad false before initialize
};

Config config_of(const OffloadSetup& s) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.gradient_accumulation_steps = s.micro_steps;
  c.gradient_clipping = 1.0;
  c.train.seed = 9;
  c.optimizer.type = s.optimizer;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.optimizer.momentum = 0.9;  // SGD
  c.bf16.enabled = s.bf16;
  c.fp16.enabled = s.fp16;
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.reduce_bucket_size = 900;  // several buckets
  c.zero_optimization.stage3_param_persistence_threshold = 40;  // some whole parameters at stage 3
  c.zero_optimization.hybrid_shard_size = s.hybrid;
  c.zero_optimization.offload_optimizer.device = s.offload ? parallel::OffloadDevice::kCpu : parallel::OffloadDevice::kNone;
  c.zero_optimization.offload_optimizer.pin_memory = s.pin;
  return c;
}

// The GPT trained `s.steps` steps in all (a resume from `from` counts its
// steps); saves into `save_to` after step `save_at`. Checks, every step, that
// the optimizer's tensors share no memory with the model's.
OffloadRun train(const OffloadSetup& s, const std::string& from = "", const std::string& save_to = "", int save_at = -1) {
  const int n = s.ranks > 0 ? s.ranks : world()->size();
  auto group = world()->split(world()->rank() < n ? 0 : -1, world()->rank());
  if (world()->rank() >= n) return {};
  auto layout = std::make_shared<ParallelLayout>(group, ParallelDims::from_world(group->size(), 1));
  models::GptOptions o = remat::testing::small_gpt(29, 3, /*dropout=*/0.1);
  at::manual_seed(9);
  models::Gpt model(o);
  for (const auto& name : s.frozen) model->named_parameters()[name].requires_grad_(false);
  EngineOptions options;
  options.layout = layout;
  options.fp16_scaler_at_float32 = s.fp16;
  auto engine = initialize(model, config_of(s), options);
  if (!from.empty()) engine->load_checkpoint(from);
  parallel::ZeroModel& zero = engine->sharding();
  EXPECT_EQ(holds_at(zero, parallel::Place::kHostOptimizer), s.offload);
  auto inject = [&](int step) {
    if (!s.inject.count(step) || world()->rank() != 0) return;
    for (auto& p : zero.parameters()) {
      if (p.grad().defined() && p.grad().numel() > 0) {
        p.mutable_grad().view({-1})[0] = std::numeric_limits<float>::infinity();
        return;
      }
    }
  };
  return remat::testing::train_to(*engine, model, *layout, o.vocab_size, s.steps, s.micro_steps, {save_to, save_at},
                                  inject);
}

// The same losses and final weights, bit for bit, with the optimizer on the
// host: every stage, float32 and bf16, accumulation, hybrid sharding.
TEST(OffloadOptimizer, EveryStageTrainsBitwiseAsWithout) {
  for (int stage : {1, 2, 3}) {
    for (bool bf16 : {false, true}) {
      for (int micro : {1, 2}) {
        OffloadSetup s;
        s.stage = stage;
        s.bf16 = bf16;
        s.micro_steps = micro;
        const OffloadRun device = train(s);
        s.offload = true;
        const OffloadRun host = train(s);
        expect_same(device, host, str("stage ", stage, bf16 ? " bf16" : " float32", ", micro-steps ", micro));
        EXPECT_LT(host.losses.back(), host.losses.front()) << "trains";
      }
    }
  }
  if (world()->size() > 1) {
    for (int stage : {1, 2, 3}) {
      OffloadSetup s;
      s.stage = stage;
      s.hybrid = 1;
      const OffloadRun device = train(s);
      s.offload = true;
      expect_same(device, train(s), str("stage ", stage, " hybrid"));
    }
  }
}

// Adam (the fused host loop) and SGD with momentum (LibTorch's) too; and the
// optimizer an offloaded engine makes is the fused one.
TEST(OffloadOptimizer, AdamAndSgdTrainBitwiseAsWithout) {
  for (const std::string type : {"Adam", "SGD"}) {
    for (int stage : {1, 3}) {
      OffloadSetup s;
      s.stage = stage;
      s.optimizer = type;
      const OffloadRun device = train(s);
      s.offload = true;
      expect_same(device, train(s), type + " at stage " + std::to_string(stage));
    }
  }
  Config c = config_of(OffloadSetup{});
  auto made = optim::make_optimizer(c.optimizer, {at::zeros({3}).requires_grad_(true)});  // host float32
  EXPECT_NE(dynamic_cast<optim::HostAdamW*>(made.get()), nullptr);
}

// fp16's loss scaler unscales, and skips on an overflow, the host gradients
// as it would the device's: the same losses, scales and skipped steps.
TEST(OffloadOptimizer, Fp16LossScalerAndOverflowAsWithout) {
  for (int stage : {1, 2, 3}) {
    OffloadSetup s;
    s.stage = stage;
    s.fp16 = true;
    s.inject = {2};
    const OffloadRun device = train(s);
    s.offload = true;
    const OffloadRun host = train(s);
    expect_same(device, host, str("fp16 stage ", stage));
    ASSERT_EQ(host.metrics.size(), 5u);
    EXPECT_TRUE(host.metrics[1].at("skipped").get<bool>()) << "the inf skipped step 2";
    for (size_t i = 0; i < host.metrics.size(); ++i) {
      EXPECT_EQ(host.metrics[i].at("loss_scale"), device.metrics[i].at("loss_scale")) << "step " << i + 1;
    }
  }
}

// The host tensors are tensors of their own: none shares memory with a
// model parameter, and the optimizer state lies on the host beside them. The
// metrics count their bytes (a run without offload has no such key); pinning
// is asked for and, on a LibTorch without CUDA, not possible (logged).
TEST(OffloadOptimizer, StateLivesInSeparateHostTensorsAndIsCounted) {
  for (int stage : {1, 2, 3}) {
   for (bool bf16 : {false, true}) {
    OffloadSetup s;
    s.stage = stage;
    s.bf16 = bf16;
    s.offload = true;
    s.pin = true;
    const auto layout = remat::testing::layout_ptr(1);
    at::manual_seed(9);
    models::Gpt model(remat::testing::small_gpt(29, 3, 0.1));
    EngineOptions options;
    options.layout = layout;
    auto engine = initialize(model, config_of(s), options);
    parallel::ZeroModel& zero = engine->sharding();
    at::Tensor idx = at::arange(24, at::kLong).view({2, 12}).remainder(29);
    engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
    int64_t master_bytes = 0, grad_bytes = 0;
    for (const auto& p : zero.parameters()) {
      if (!p.requires_grad()) continue;
      EXPECT_TRUE(p.device().is_cpu());
      EXPECT_EQ(p.scalar_type(), at::kFloat);
      EXPECT_EQ(p.is_pinned(), at::globalContext().hasCUDA()) << "pinned where this LibTorch can pin";
      for (const auto& q : model->parameters()) {
        EXPECT_FALSE(p.is_alias_of(q)) << "stage " << stage << ": a host master shares a model parameter's memory";
      }
      master_bytes += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) {
        grad_bytes += static_cast<int64_t>(p.grad().nbytes());
        for (const auto& q : model->parameters()) EXPECT_FALSE(p.grad().is_alias_of(q));
      }
    }
    EXPECT_GT(grad_bytes, 0) << "the reduced gradients reached the host";
    engine->step();
    const auto state = optim::optimizer_state_tensors(engine->optimizer());
    ASSERT_FALSE(state.empty());
    for (const auto& t : state) {
      EXPECT_TRUE(t.device().is_cpu());
      for (const auto& q : model->parameters()) EXPECT_FALSE(t.is_alias_of(q));
    }
    const nlohmann::json m = engine->last_metrics().to_json();
    EXPECT_EQ(zero.stats().host_bytes, master_bytes + grad_bytes) << "stage " << stage;
    // Adam: two moments as large as the masters, and a step count each.
    EXPECT_GE(m.at("optimizer_state_bytes").get<int64_t>(), 2 * master_bytes);
    EXPECT_EQ(m.at("host_optimizer_bytes").get<int64_t>(),
              master_bytes + grad_bytes + m.at("optimizer_state_bytes").get<int64_t>());
    // A host master written between steps reaches the model at the next forward.
    for (auto& p : zero.parameters()) {
      if (p.requires_grad()) {
        c10::NoGradGuard no_grad;
        p.fill_(0.25);
      }
    }
    zero.begin_forward();
    auto whole = zero.install_whole_parameters(/*as_computed=*/false, /*keep_values=*/true);
    for (const auto& [name, value] : whole.values) {
      EXPECT_TRUE(at::equal(value, at::full_like(value, 0.25))) << "stage " << stage << ": " << name;
    }
    for (auto& [p, data] : whole.restore) p.set_data(data);
    zero.end_evaluation();
   }
  }
  OffloadSetup plain;
  plain.steps = 1;
  EXPECT_EQ(train(plain).metrics[0].count("host_optimizer_bytes"), 0u) << "a run without offload keeps its keys";
}

// A save from an offloaded run resumes without offload, and one without
// offload resumes offloaded, bit for bit as the run that never stopped; at
// another data-parallel size (1 rank of 2), either save resumes alike.
TEST(OffloadOptimizer, SavesResumeAcrossOffloadAndDataParallelSize) {
  for (const auto& [stage, bf16] : std::vector<std::pair<int, bool>>{{2, false}, {3, false}, {1, true}, {3, true}}) {
    OffloadSetup s;
    s.stage = stage;
    s.bf16 = bf16;
    s.steps = 6;
    const OffloadRun straight = train(s);
    const std::string on = job_dir("remat_offload_", str("on", stage, bf16));
    const std::string off = job_dir("remat_offload_", str("off", stage, bf16));
    OffloadSetup saving = s;
    saving.steps = 3;
    saving.offload = true;
    train(saving, "", on, 3);
    saving.offload = false;
    train(saving, "", off, 3);
    for (bool offload : {false, true}) {
      OffloadSetup rest = s;
      rest.offload = offload;
      const OffloadRun tail = train(rest, offload ? off : on);
      ASSERT_EQ(tail.losses.size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(tail.losses[i], straight.losses[3 + i])
            << "stage " << stage << (offload ? ": offloaded from a device save" : ": from an offloaded save")
            << ", step " << 4 + i;
      }
    }
    if (world()->size() > 1) {
      OffloadSetup one = s;
      one.ranks = 1;
      const OffloadRun from_off = train(one, off);
      one.offload = true;
      const OffloadRun from_on = train(one, on);
      if (from_on.trained) {
        expect_same(from_off, from_on, str("stage ", stage, " at 1 rank of ", world()->size()));
        for (double l : from_on.losses) EXPECT_TRUE(std::isfinite(l));
      }
    }
  }
}

// GatheredParameters(modify) writes an edit into the host masters (what the
// optimizer steps and saves hold) and the model reads it; a run edited so
// trains on bitwise as the same run without offload.
TEST(OffloadOptimizer, AModifyingScopeReachesTheHostMasters) {
  for (const auto& [stage, bf16] : std::vector<std::pair<int, bool>>{{1, false}, {3, false}, {2, true}, {3, true}}) {
    std::vector<double> losses[2];
    for (bool offload : {false, true}) {
      at::manual_seed(9);
      models::Gpt model(remat::testing::small_gpt(29, 2, 0.0));
      OffloadSetup s;
      s.stage = stage;
      s.bf16 = bf16;
      s.offload = offload;
      EngineOptions options;
      options.layout = remat::testing::layout_ptr(1);
      auto engine = initialize(model, config_of(s), options);
      {
        GatheredParameters scope(*engine, /*modify=*/true);
        at::NoGradGuard no_grad;
        model->named_parameters()["pos_emb.weight"].fill_(0.5);
      }
      parallel::ZeroModel& zero = engine->sharding();
      const auto params = zero.parameters();
      const auto layout = zero.layout();
      for (size_t i = 0; i < params.size(); ++i) {
        for (const auto& seg : layout[i].segments) {
          if (seg.name != "pos_emb.weight") continue;
          at::Tensor mine = params[i].detach().reshape({-1}).narrow(0, seg.shard_offset, seg.length);
          EXPECT_TRUE(at::equal(mine, at::full_like(mine, 0.5))) << "stage " << stage;
        }
      }
      at::Tensor idx = at::arange(24, at::kLong).view({2, 12}).remainder(29);
      for (int step = 0; step < 2; ++step) {
        engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
        engine->step();
        losses[offload].push_back(engine->last_metrics().loss);
      }
    }
    EXPECT_EQ(losses[0], losses[1]) << "stage " << stage << (bf16 ? " bf16" : "");
  }
}

// Under bf16 (and fp16) the float32 masters live in host memory alone: the
// device keeps the 16-bit parameters (stages 1-2 whole, stage 3 its shards),
// so the device's parameter bytes are a third (stages 1-2: 2 bytes of 6) or a
// half (stage 3: 2 of 4) of the run without offload. Frozen parameters' float32
// values go to the host too, and a run with some frozen trains bitwise as
// without offload and ends with the same float32 weights.
TEST(OffloadOptimizer, SixteenBitRunsKeepTheMastersOnTheHostAlone) {
  for (int stage : {1, 2, 3}) {
    OffloadSetup s;
    s.stage = stage;
    s.bf16 = true;
    s.steps = 3;
    s.frozen = {"pos_emb.weight", "blocks.1.ln1.weight"};
    const OffloadRun device = train(s);
    s.offload = true;
    const OffloadRun host = train(s);
    const std::string what = str("stage ", stage);
    expect_same(device, host, what + " with frozen parameters");
    EXPECT_LT(host.losses.back(), host.losses.front()) << what << ": trains";
    const int64_t on_device = device.metrics.back().at("param_bytes").get<int64_t>();
    const int64_t offloaded = host.metrics.back().at("param_bytes").get<int64_t>();
    EXPECT_EQ(offloaded * (stage < 3 ? 3 : 2), on_device) << what;

    at::manual_seed(9);
    models::Gpt model(remat::testing::small_gpt(29, 3, 0.1));
    int64_t frozen_elements = 0;
    for (const auto& name : s.frozen) {
      model->named_parameters()[name].requires_grad_(false);
      frozen_elements += model->named_parameters()[name].numel();
    }
    EngineOptions options;
    options.layout = remat::testing::layout_ptr(1);
    auto engine = initialize(model, config_of(s), options);
    parallel::ZeroModel& zero = engine->sharding();
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16) << what;
    int64_t master_bytes = 0, frozen_bytes = 0;
    for (const auto& p : zero.parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat) << what << ": the optimizer steps (and saves hold) float32 masters";
      for (const auto& q : model->parameters()) EXPECT_FALSE(p.is_alias_of(q)) << what;
      (p.requires_grad() ? master_bytes : frozen_bytes) += static_cast<int64_t>(p.nbytes());
    }
    // Stage 3 shards the frozen parameters too; 1 and 2 keep them whole.
    if (stage < 3 || world()->size() == 1) {
      EXPECT_EQ(frozen_bytes, 4 * frozen_elements) << what;
    }
    EXPECT_GT(frozen_bytes, 0) << what;
    // The trainable masters' gradient buffers, kept across steps, are made
    // with the masters: there before the first backward.
    EXPECT_EQ(zero.stats().host_bytes, 2 * master_bytes + frozen_bytes) << what << ": before the first backward";
    // What the masters are copied into: 16-bit device tensors, one per master,
    // the model's own storage at stages 1-2 (views of the bf16 buckets).
    const auto masters = zero.parameters();
    const auto kept = zero.device_parameters();
    ASSERT_EQ(kept.size(), masters.size()) << what;
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_EQ(kept[i].scalar_type(), at::kBFloat16) << what;
      EXPECT_EQ(kept[i].sizes(), masters[i].sizes()) << what;
      if (stage < 3) {
        bool shares = false;
        for (const auto& q : model->parameters()) shares = shares || kept[i].is_alias_of(q);
        EXPECT_TRUE(shares) << what << ": a 16-bit shard outside the model's buckets";
      }
    }
    // Clearing the gradients reaches the host masters' (between steps, as the engine does).
    at::Tensor idx = at::arange(24, at::kLong).view({2, 12}).remainder(29);
    engine->backward(engine->forward([&] { return model->loss(idx, idx.roll(-1, 1)); }));
    int64_t with_grad = 0;
    for (const auto& p : zero.parameters()) with_grad += p.grad().defined() ? 1 : 0;
    EXPECT_GT(with_grad, 0) << what;
    zero.zero_grad();
    for (const auto& p : zero.parameters()) EXPECT_FALSE(p.grad().defined()) << what;
    // A step copies the stepped masters back, not the frozen ones (unwritten).
    if (stage < 3) {
      const at::Tensor frozen = model->named_parameters()["pos_emb.weight"];
      const int64_t before = frozen._version();
      engine->step();  // the backward's above (its gradients dropped: nothing stepped)
      EXPECT_EQ(frozen._version(), before) << what << ": a frozen parameter copied again";
    }
  }
}

// A model of the user's own, not remat's GPT: a Conv2d patch embedding on a
// float32 image, linear blocks, a head; its loss may add a gradient penalty
// taken with autograd::grad inside the forward.
struct PatchNetImpl : torch::nn::Module {
  PatchNetImpl() {
    patch = register_module("patch", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 4).stride(4)));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 4));
  }
  at::Tensor loss(const at::Tensor& image, const at::Tensor& label, double penalty) {
    const at::Tensor embedded = remat::forward(patch, image).flatten(2).transpose(1, 2);  // [B, 4, 8]
    at::Tensor x = embedded;
    for (size_t i = 0; i < blocks->size(); ++i) {
      x = x + at::gelu(remat::forward(blocks->ptr<torch::nn::LinearImpl>(i), x));
    }
    const at::Tensor ce = at::cross_entropy_loss(remat::forward(head, x.mean(1)).to(at::kFloat), label);
    if (penalty == 0) return ce;
    const at::Tensor g = torch::autograd::grad({ce}, {embedded}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return ce + penalty * g.pow(2).sum().to(at::kFloat);
  }
  torch::nn::Conv2d patch{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(PatchNet);

// PatchNet's losses over 4 steps, its patch bias frozen.
std::vector<double> train_patch_net(int stage, bool bf16, bool offload, double penalty) {
  at::manual_seed(5);
  PatchNet model;
  model->patch->bias.requires_grad_(false);
  OffloadSetup s;
  s.stage = stage;
  s.bf16 = bf16;
  s.offload = offload;
  Config c = config_of(s);
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  EngineOptions options;
  options.layout = remat::testing::layout_ptr(1);
  auto engine = initialize(model, c, options);
  EXPECT_EQ(holds_at(engine->sharding(), parallel::Place::kHostOptimizer), offload);
  at::manual_seed(6 + world()->rank());
  const at::Tensor image = at::randn({4, 3, 8, 8});  // float32, as a data loader gives it
  const at::Tensor label = at::arange(4, at::kLong);
  std::vector<double> losses;
  for (int step = 0; step < 4; ++step) {
    engine->backward(engine->forward([&] { return model->loss(image, label, penalty); }));
    engine->step();
    losses.push_back(engine->last_metrics().loss);
  }
  return losses;
}

// The user's model, a frozen parameter in it, trains with the optimizer on
// the host bitwise as without, at stages 1-3, float32 and bf16; so does its
// gradient penalty (autograd::grad inside the forward) at stages 1 and 2
// (stage 3 refuses a backward inside the forward, offloaded or not).
TEST(OffloadOptimizer, AUsersOwnModelAndAGradientPenaltyTrainAsWithout) {
  for (int stage : {1, 2, 3}) {
    for (bool bf16 : {false, true}) {
      for (double penalty : {0.0, 0.1}) {
        if (penalty > 0 && stage == 3) continue;
        const std::string what = str("stage ", stage, bf16 ? " bf16" : " float32", " penalty ", penalty);
        const std::vector<double> device = train_patch_net(stage, bf16, false, penalty);
        const std::vector<double> host = train_patch_net(stage, bf16, true, penalty);
        EXPECT_EQ(device, host) << what;
        EXPECT_LT(host.back(), host.front()) << what << ": trains";
      }
    }
  }
}

// In the window's last micro-step each gradient shard goes to the host as
// its reduction ends, during the backward (stages 2 and 3 reduce there; stage
// 3's root unit and persistent parameters after it): before finish_backward
// host masters hold their gradients already. In an earlier micro-step
// nothing moves.
TEST(OffloadOptimizer, GradientShardsMoveAsTheirReductionEnds) {
  for (int stage : {2, 3}) {
    OffloadSetup s;
    s.stage = stage;
    s.offload = true;
    at::manual_seed(9);
    models::Gpt model(remat::testing::small_gpt(29, 3, 0.1));
    EngineOptions options;
    options.layout = remat::testing::layout_ptr(1);
    auto engine = initialize(model, config_of(s), options);
    parallel::ZeroModel& zero = engine->sharding();
    at::Tensor idx = at::arange(24, at::kLong).view({2, 12}).remainder(29);
    auto host_grads = [&] {
      int n = 0;
      for (const auto& p : zero.parameters()) n += p.grad().defined() ? 1 : 0;
      return n;
    };
    for (bool last : {false, true}) {
      zero.begin_forward();
      at::Tensor loss = zero.finish_forward(model->loss(idx, idx.roll(-1, 1)));
      zero.begin_backward(last);
      loss.backward();
      const int early = host_grads();
      if (last) {
        EXPECT_GT(early, 0) << "stage " << stage << ": no gradient reached the host during the backward";
      } else {
        EXPECT_EQ(early, 0) << "stage " << stage << ": a gradient moved before the window's last micro-step";
      }
      zero.finish_backward(last);
      if (last) {
        int trainable = 0;
        for (const auto& p : zero.parameters()) trainable += p.requires_grad() ? 1 : 0;
        EXPECT_EQ(host_grads(), trainable) << "stage " << stage;
        // Stage 2 reduces every bucket in the backward, stage 3 the root unit after it.
        if (stage == 3) {
          EXPECT_LT(early, trainable) << "stage 3: the root unit's shards after the backward";
        }
      }
    }
  }
}

// The keys: device "cpu" from JSON with DeepSpeed's pipeline tuning accepted,
// stage 0 refused saying what to change; "nvme" read with its folder and
// refused without it, at stage 0 or with fewer than 2 buffers.
TEST(OffloadOptimizer, ConfigKeys) {
  const Config c = parse_config(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true,
          "buffer_count": 8, "fast_init": false, "ratio": 1.0}}})", "<offload_test>");
  EXPECT_TRUE(c.zero_optimization.offload_optimizer.enabled());
  EXPECT_TRUE(c.zero_optimization.offload_optimizer.pin_memory);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.buffer_count, 8);
  // As remat-train's --set gives it.
  const Config set = parse_config("{}", "<offload_test>",
                                  {"zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu",
                                   "zero_optimization.offload_optimizer.pin_memory=true"});
  EXPECT_TRUE(set.zero_optimization.offload_optimizer.enabled());
  EXPECT_TRUE(set.zero_optimization.offload_optimizer.pin_memory);
  const Config none = parse_config(R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}}})",
                                   "<offload_test>");
  EXPECT_FALSE(none.zero_optimization.offload_optimizer.enabled());
  // "nvme" without its folder: the error names the key to give.
  const std::string nvme = remat::testing::error_of<ConfigError>([] {
    parse_config(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})", "<offload_test>");
  });
  EXPECT_NE(nvme.find("offload_optimizer.device' = \"nvme\" needs 'zero_optimization.offload_optimizer.nvme_path'"),
            std::string::npos) << nvme;
  const std::string stage0 = remat::testing::error_of<ConfigError>([] {
    parse_config(R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})", "<offload_test>");
  });
  EXPECT_NE(stage0.find("set zero_optimization.stage to 1, 2 or 3"), std::string::npos) << stage0;
  // NVMe's keys: read beside the device "nvme" (the pipeline switches either
  // way: remat always overlaps); with "cpu" they ask for nothing.
  const Config on_disk = parse_config(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
      "nvme_path": "/x", "pipeline_read": true, "pipeline_write": false, "buffer_count": 2}}})", "<offload_test>");
  EXPECT_TRUE(on_disk.zero_optimization.offload_optimizer.on_nvme());
  EXPECT_TRUE(on_disk.zero_optimization.offload_optimizer.enabled());
  EXPECT_EQ(*on_disk.zero_optimization.offload_optimizer.nvme_path, "/x");
  const std::string few = remat::testing::error_of<ConfigError>([] {
    parse_config(R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/x",
        "buffer_count": 1}}})", "<offload_test>");
  });
  EXPECT_NE(few.find("2 problems"), std::string::npos) << few;
  EXPECT_NE(few.find("'zero_optimization.offload_optimizer.device' = \"nvme\" needs a sharded optimizer"),
            std::string::npos) << few;
  EXPECT_NE(few.find("'zero_optimization.offload_optimizer.buffer_count' = 1 with device \"nvme\""),
            std::string::npos) << few;
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "nvme_path": "/x"}}})",
                         "<offload_test>").zero_optimization.offload_optimizer.device,
            parallel::OffloadDevice::kCpu);
}

}  // namespace
}  // namespace remat
