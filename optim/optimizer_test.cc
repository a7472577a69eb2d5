// The factory and the options' rules (optim/optimizer.h, optim/options.h).
#include "optim/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "optim/host_adam.h"
#include "optim/options.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::optim {
namespace {

using ::testing::HasSubstr;

OptimizerOptions of_type(const char* type) {
  OptimizerOptions o;
  o.type = type;
  return o;
}

TEST(Optimizer, BuildsEachTypeAndSetsTheRate) {
  torch::nn::Linear lin(2, 2);
  for (const char* type : {"AdamW", "Adam", "SGD"}) {
    auto opt = make_optimizer(of_type(type), lin->parameters());
    set_learning_rate(*opt, 0.25);
    for (auto& group : opt->param_groups()) EXPECT_EQ(group.options().get_lr(), 0.25) << type;
    EXPECT_EQ(optimizer_name(*opt), type);
    ASSERT_TRUE(options_of(*opt).has_value()) << type;
    EXPECT_EQ(options_of(*opt)->type, type);
  }
}

// The host Adam where the parameters are what its loop steps (dense,
// contiguous float32 on the CPU), LibTorch's elsewhere.
TEST(Optimizer, ChoosesTheHostAdamFromWhereTheParametersLive) {
  const at::Tensor host = at::zeros({3}).requires_grad_(true);
  EXPECT_TRUE(host_adam_fits({host}));
  EXPECT_NE(dynamic_cast<HostAdamW*>(make_optimizer(of_type("AdamW"), {host}).get()), nullptr);
  EXPECT_NE(dynamic_cast<HostAdam*>(make_optimizer(of_type("Adam"), {host}).get()), nullptr);
  const at::Tensor wide = at::zeros({3}, at::kDouble).requires_grad_(true);
  const at::Tensor strided = at::zeros({4, 4}).t().requires_grad_(true);
  for (const auto& params : std::vector<std::vector<at::Tensor>>{{wide}, {host, strided}, {}}) {
    EXPECT_FALSE(host_adam_fits(params));
    auto made = make_optimizer(of_type("AdamW"), params);
    EXPECT_EQ(dynamic_cast<HostAdamW*>(made.get()), nullptr);
    EXPECT_NE(dynamic_cast<torch::optim::AdamW*>(made.get()), nullptr);
  }
}

TEST(OptimizerOptions, StateBytesPerElement) {
  EXPECT_EQ(state_bytes_per_element(of_type("AdamW")), 8);
  EXPECT_EQ(state_bytes_per_element(of_type("Adam")), 8);
  EXPECT_EQ(state_bytes_per_element(of_type("Adam"), 2), 4);
  OptimizerOptions sgd = of_type("SGD");
  EXPECT_EQ(state_bytes_per_element(sgd), 0);
  sgd.momentum = 0.9;
  EXPECT_EQ(state_bytes_per_element(sgd), 4);
  EXPECT_EQ(optimizer_kind(sgd), OptimizerKind::kSGD);
  const std::string e = remat::testing::error_of<ConfigError>([] { optimizer_kind(of_type("Lion")); });
  EXPECT_THAT(e, HasSubstr("'optimizer.type' = \"Lion\" is not one of AdamW, Adam, SGD"));
}

TEST(OptimizerOptions, EveryBrokenRuleOnALineNamingItsKey) {
  EXPECT_EQ(check_optimizer_options(OptimizerOptions{}), "");
  OptimizerOptions o;
  o.lr = 0;
  o.betas = {0.9, 1.0};
  o.nesterov = true;
  const std::string problems = check_optimizer_options(o);
  EXPECT_EQ(problems, "'optimizer.params.lr' = 0 must be > 0\n"
                      "'optimizer.params.betas' [0.9, 1]: beta2 must be in [0, 1)\n"
                      "'optimizer.params.nesterov' applies to SGD only (optimizer.type is AdamW): remove it");
  o = of_type("SGD");
  o.nesterov = true;
  EXPECT_EQ(check_optimizer_options(o), "'optimizer.params.nesterov' needs 'optimizer.params.momentum' > 0");
}

}  // namespace
}  // namespace remat::optim
