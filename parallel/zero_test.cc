// ZeroModel alone under mpirun at 2 ranks, on small models written for the
// tests (parallel/zero_test_models.h): what each stage refuses, replicas
// starting from rank 0's weights, stage 3's second gather of the root, and
// the overlapped reduction's misuse. Training through the engine at every
// stage, against stage 0, is engine/zero_engine_test.cc.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <map>
#include <string>

#include "parallel/zero.h"
#include "parallel/zero_test_models.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/runtime.h"
#include "tests/error_of.h"

namespace remat::parallel {
namespace {

using ::testing::HasSubstr;
using remat::testing::BranchyNet;
using remat::testing::error_of;
using remat::testing::RootNormNet;

std::shared_ptr<Communicator> world() {
  static auto w = Runtime::init().world(Backend::kMpi);
  return w;
}

// The data-parallel layout over every rank.
const ParallelLayout& layout() {
  static ParallelLayout l(world(), ParallelDims::from_world(world()->size(), 1));
  return l;
}

TEST(Zero, MisuseIsAClearError) {
  const auto& l = layout();
  RootNormNet model;
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& b : *model->blocks) units.push_back(b);
  ZeroOptions zc;
  zc.stage = 3;
  zc.stage3_param_persistence_threshold = 0;
  ZeroModel zero(*model, units, l.dp_group(), zc, Bf16Options{});
  at::Tensor idx = at::zeros({1, 4}, at::kLong);
  zero.begin_forward();
  // Not through finish_forward: refused in the backward, which would otherwise
  // free the root the head's backward needs.
  EXPECT_THAT(error_of<Error>([&] { model->loss(idx).backward(); }), HasSubstr("finish_forward(loss)"));
  zero.end_evaluation();
  ZeroOptions stage5;
  stage5.stage = 5;
  EXPECT_THAT(error_of<ConfigError>([&] { ZeroModel(*model, units, l.dp_group(), stage5, Bf16Options{}); }),
              HasSubstr("'zero_optimization.stage' = 5 must be 0, 1, 2 or 3"));
  ZeroOptions stage0;
  Bf16Options bf16_reduce;
  bf16_reduce.reduce_dtype = ReduceDtype::kBf16;
  EXPECT_THAT(error_of<ConfigError>([&] { ZeroModel(*model, units, l.dp_group(), stage0, bf16_reduce); }),
              HasSubstr("communication_data_type \"bf16\" reduces gradients in bf16, but bf16.enabled is false"));
}

// The compute dtype is an option (MixedPrecision): with fp16 the model holds
// fp16 copies at stages 0-2 (stage 3 gathers them on use) and parameters(),
// what the optimizer steps, are float32 masters at every stage. Gradients are
// reduced in float32 or in the compute dtype, nothing else.
TEST(Zero, TheComputeDtypeIsAnOption) {
  const auto& l = layout();
  MixedPrecision fp16;
  fp16.compute_dtype = fp16.reduce_dtype = at::kHalf;
  for (int stage : {0, 1, 2, 3}) {
    RootNormNet model;
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    for (const auto& b : *model->blocks) units.push_back(b);
    ZeroOptions zc;
    zc.stage = stage;
    ZeroModel zero(*model, units, l.dp_group(), zc, fp16);
    for (const auto& p : zero.parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "stage " << stage;
    if (stage == 3) continue;
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kHalf) << "stage " << stage;
  }
  RootNormNet model;
  MixedPrecision mixed;
  mixed.compute_dtype = at::kBFloat16;
  mixed.reduce_dtype = at::kHalf;
  EXPECT_THAT(error_of<ConfigError>([&] { ZeroModel(*model, {}, l.dp_group(), ZeroOptions{}, mixed); }),
              HasSubstr("communication_data_type \"fp16\" reduces gradients in fp16, but fp16.enabled is false (the "
                        "model computes in bf16"));
  mixed.compute_dtype = at::kDouble;
  EXPECT_THAT(error_of<ConfigError>([&] { ZeroModel(*model, {}, l.dp_group(), ZeroOptions{}, mixed); }),
              HasSubstr("the compute dtype is Double: remat computes in float32, bf16"));
}

// What a live ZeroModel holds where (holding()) is what the cold rule
// (state_elements) gives its parameters' sizes: the same parts on the host,
// and at one rank (no padding) the same elements.
TEST(Zero, HoldingIsTheColdRule) {
  const auto& l = layout();
  struct Case {
    int stage;
    bool offload_optimizer, offload_param;
  };
  for (const Case c : {Case{2, false, false}, Case{1, true, false}, Case{3, false, true}, Case{3, true, true},
                       Case{3, true, false}}) {
    RootNormNet model;
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    std::map<const void*, int> unit_of;
    for (const auto& b : *model->blocks) {
      for (const auto& p : b->parameters()) unit_of[p.unsafeGetTensorImpl()] = static_cast<int>(units.size());
      units.push_back(b);
    }
    std::vector<ParameterCount> params;
    for (const auto& p : model->parameters()) {
      auto it = unit_of.find(p.unsafeGetTensorImpl());
      params.push_back({p.numel(), true, it == unit_of.end() ? -1 : it->second});
    }
    ZeroOptions zc;
    zc.stage = c.stage;
    zc.stage3_param_persistence_threshold = 0;
    if (c.offload_optimizer) zc.offload_optimizer.device = OffloadDevice::kCpu;
    if (c.offload_param) zc.offload_param.device = OffloadDevice::kCpu;
    ZeroModel zero(*model, units, l.dp_group(), zc, Bf16Options{});
    const StateElements e = state_elements(zc, Bf16Options{}, zero.shard_size(), params);
    std::map<Place, int64_t> stepped;
    Place state = Place::kDevice;
    for (const HeldTensors& part : zero.holding()) {
      if (part.part == StatePart::kOptimizerState) state = part.place;
      if (part.part != StatePart::kStepped) continue;
      for (const auto& t : part.tensors) stepped[part.place] += t.numel();
    }
    const std::string what = str("stage ", c.stage, c.offload_optimizer ? " offload_optimizer" : "",
                                 c.offload_param ? " offload_param" : "");
    EXPECT_EQ(state == Place::kHostOptimizer, e.optimizer_on_host) << what;
    EXPECT_EQ(stepped[Place::kHostOptimizer] > 0, e.host_masters > 0) << what;
    EXPECT_EQ(stepped[Place::kHostParameters] > 0, e.host_shards > 0) << what;
    if (zero.shard_size() == 1) {
      EXPECT_EQ(stepped[Place::kHostOptimizer], e.host_masters) << what;
      EXPECT_EQ(stepped[Place::kHostParameters], e.host_shards) << what;
      EXPECT_EQ(stepped[Place::kDevice] + stepped[Place::kHostOptimizer] + stepped[Place::kHostParameters],
                e.local_trainable) << what;
    }
  }
}

TEST(Zero, HybridAndStage12MisuseIsAClearError) {
  const auto& l = layout();
  const int n = l.dp_group()->size();
  RootNormNet model;
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& b : *model->blocks) units.push_back(b);
  ZeroOptions bad;
  bad.stage = 2;
  bad.hybrid_shard_size = n + 1;
  EXPECT_THAT(error_of<ConfigError>([&] { ZeroModel(*model, units, l.dp_group(), bad, Bf16Options{}); }),
              HasSubstr(str("hybrid_shard_size ", n + 1, " must divide the data-parallel size ", n)));
  ZeroOptions stage1;
  stage1.stage = 1;
  ZeroModel zero(*model, units, l.dp_group(), stage1, Bf16Options{});
  torch::optim::AdamW optimizer(zero.parameters(), torch::optim::AdamWOptions(1e-2));
  at::Tensor idx = at::zeros({1, 4}, at::kLong);
  zero.begin_forward();
  zero.finish_forward(model->loss(idx)).backward();
  zero.finish_backward();
  optimizer.step();
  // The next forward without begin_forward would use the weights of before the step.
  at::Tensor loss = model->loss(idx);
  EXPECT_THAT(error_of<Error>([&] { zero.finish_forward(loss); }), HasSubstr("call begin_forward() before each forward"));
}

// `model` sharded over the data-parallel group at `stage`, each of `blocks` a
// unit, every parameter sharded at stage 3.
std::unique_ptr<ZeroModel> zero_over_blocks(torch::nn::Module& model, const torch::nn::ModuleList& blocks,
                                            int stage) {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& b : *blocks) units.push_back(b);
  ZeroOptions zc;
  zc.stage = stage;
  zc.stage3_param_persistence_threshold = 0;
  return std::make_unique<ZeroModel>(model, units, layout().dp_group(), zc, Bf16Options{});
}

// Data-parallel replicas start from rank 0's weights, whatever each rank
// initialised: a rank that seeded differently does not train its own model.
TEST(Zero, ReplicasStartFromRankZerosWeights) {
  const auto& l = layout();
  for (int stage : {0, 1, 2, 3}) {
    at::manual_seed(100 + l.dp_rank());  // another initialisation on every rank
    RootNormNet model;
    auto zero = zero_over_blocks(*model, model->blocks, stage);
    for (const auto& [name, value] : zero->full_parameters()) {
      at::Tensor first = value.clone();
      l.dp_group()->broadcast(first, {0})->wait();
      EXPECT_TRUE(at::equal(first, value)) << "stage " << stage << " " << name;
    }
  }
}

// RootNormNet's LayerNorm, after the embedding in the root unit, is used
// before the first unit and its backward needs its data: stage 3 gathers the
// root again for that backward and trains as stage 0 does.
std::vector<double> train_root_norm_net(int stage) {
  const auto& l = layout();
  at::manual_seed(5);
  RootNormNet net;
  auto zero_ptr = zero_over_blocks(*net, net->blocks, stage);
  ZeroModel& zero = *zero_ptr;
  torch::optim::AdamW optimizer(zero.parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    for (auto& p : zero.parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor idx = at::arange(12, at::kLong).view({2, 6}).mul(l.dp_rank() + 1).add(step).remainder(13);
    zero.begin_forward();
    at::Tensor loss = zero.finish_forward(net->loss(idx));
    loss.backward();
    zero.finish_backward();
    optimizer.step();
    at::Tensor t = at::full({1}, loss.item<double>(), at::kDouble);
    l.dp_group()->allReduce(t, {ReduceOp::kAvg})->wait();
    losses.push_back(t.item<double>());
  }
  return losses;
}

TEST(Zero, Stage3GathersTheRootAgainForARootParameterBeforeTheFirstUnit) {
  const std::vector<double> zero0 = train_root_norm_net(0);
  const std::vector<double> zero3 = train_root_norm_net(3);
  ASSERT_EQ(zero0.size(), zero3.size());
  for (size_t i = 0; i < zero0.size(); ++i) EXPECT_NEAR(zero0[i], zero3[i], 1e-5) << "step " << i;
}

// With overlap_comm, the backward and finish_backward must agree on whether
// the micro-step synchronizes, and a parameter may not get a second gradient
// after its bucket's reduction started (two backward passes in one micro-step).
TEST(Zero, OverlapMisuseIsAClearError) {
  const int n = layout().dp_group()->size();
  if (n == 1) GTEST_SKIP() << "one rank reduces nothing, during or after the backward";
  for (int stage : {0, 1}) {
    at::manual_seed(3);
    BranchyNet net;
    ZeroOptions zc;
    zc.stage = stage;
    zc.reduce_bucket_size = 40;
    zc.overlap_comm = true;
    ZeroModel zero(*net, {}, layout().dp_group(), zc, Bf16Options{});
    at::Tensor idx = at::arange(12, at::kLong).view({2, 6}).remainder(13);
    zero.begin_forward();
    at::Tensor loss = zero.finish_forward(net->loss(idx, true, false));
    zero.begin_backward(/*synchronize=*/true);
    loss.backward();
    EXPECT_THAT(error_of<Error>([&] { zero.finish_backward(/*synchronize=*/false); }),
                HasSubstr("pass the same synchronize flag to both"))
        << "stage " << stage;
    zero.abandon_backward();
    zero.begin_forward();
    at::Tensor twice = zero.finish_forward(net->loss(idx, true, false));
    zero.begin_backward(/*synchronize=*/true);
    twice.backward({}, /*retain_graph=*/true);
    EXPECT_THAT(error_of<std::exception>([&] { twice.backward(); }), HasSubstr("arrived after its bucket"))
        << "stage " << stage;
    zero.abandon_backward();
    // Then it trains on.
    zero.begin_forward();
    at::Tensor again = zero.finish_forward(net->loss(idx, true, false));
    zero.begin_backward(true);
    again.backward();
    zero.finish_backward(true);
    for (const auto& p : zero.parameters()) {
      if (p.requires_grad()) {
        EXPECT_TRUE(p.grad().defined()) << "stage " << stage;
      }
    }
  }
}

}  // namespace
}  // namespace remat::parallel
