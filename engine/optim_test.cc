#include "engine/optim.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/config.h"

namespace remat {
namespace {

TEST(Optimizer, BuildsEachTypeAndSetsTheRate) {
  torch::nn::Linear lin(2, 2);
  for (const char* type : {"AdamW", "Adam", "SGD"}) {
    OptimizerConfig c;
    c.type = type;
    auto opt = make_optimizer(c, lin->parameters());
    set_learning_rate(*opt, 0.25);
    for (auto& group : opt->param_groups()) EXPECT_EQ(group.options().get_lr(), 0.25) << type;
  }
}

}  // namespace
}  // namespace remat
