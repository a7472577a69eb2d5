#include "optim/host_adam.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::optim {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

// Parameter sizes with every kind of tail: empty, one element, less than a
// vector, vector and a bit, several parallel chunks and an odd remainder.
const std::vector<int64_t> kSizes = {0, 1, 7, 33, 100003};

// The distance in representable floats between a and b (0: the same bits).
int64_t ulps(float a, float b) {
  auto ordered = [](float x) {
    int32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits < 0 ? -static_cast<int64_t>(bits & 0x7fffffff) : static_cast<int64_t>(bits);
  };
  return std::llabs(ordered(a) - ordered(b));
}

// How far the host parameters are from LibTorch's: in representable floats
// (0: bitwise the same), and in absolute value.
struct Divergence {
  int64_t ulps = 0;
  double abs = 0;

  void add(const at::Tensor& a, const at::Tensor& b) {
    const float* x = a.data_ptr<float>();
    const float* y = b.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      ulps = std::max(ulps, remat::optim::ulps(x[i], y[i]));
      abs = std::max(abs, static_cast<double>(std::fabs(x[i] - y[i])));
    }
  }
};

// One set of parameters in three groups: group 0 with the defaults, group 1
// with its own lr, betas, eps and weight decay, group 2 without weight decay
// and with a frozen parameter (no gradient) first.
struct Model {
  std::vector<std::vector<at::Tensor>> groups;

  static Model make(uint64_t seed) {
    torch::manual_seed(seed);
    Model m;
    m.groups.resize(3);
    for (size_t i = 0; i < kSizes.size(); ++i) {
      m.groups[i < 3 ? 0 : 1].push_back(torch::randn({kSizes[i]}));
    }
    m.groups[2].push_back(torch::randn({5}));       // frozen
    m.groups[2].push_back(torch::randn({17, 3}));
    return m;
  }

  Model clone() const {
    Model m;
    for (const auto& group : groups) {
      m.groups.emplace_back();
      for (const auto& p : group) m.groups.back().push_back(p.detach().clone());
    }
    return m;
  }

  // Gradients of step `step`, the same for every clone; the frozen one stays undefined.
  void set_grads(int step) {
    torch::manual_seed(1000 + step);
    for (auto& group : groups) {
      for (auto& p : group) {
        if (&p == &groups[2][0]) continue;
        p.mutable_grad() = torch::randn_like(p) * (step % 2 ? 1e-2 : 3.0);
      }
    }
  }

  template <typename Options>
  std::vector<torch::optim::OptimizerParamGroup> param_groups() const {
    std::vector<torch::optim::OptimizerParamGroup> out;
    out.emplace_back(groups[0]);
    Options second(3e-3);
    second.betas(std::make_tuple(0.8, 0.99)).eps(1e-6).weight_decay(0.1);
    out.emplace_back(groups[1], std::make_unique<Options>(second));
    Options third(2e-3);
    third.weight_decay(0);
    out.emplace_back(groups[2], std::make_unique<Options>(third));
    return out;
  }
};

// Steps LibTorch's optimizer and the host one on twin parameters with the
// same gradients; the lr of group 1 changes after step 2. Returns the worst
// ulp distance of any parameter or moment after any step.
template <typename Reference, typename Host, typename Options>
Divergence divergence_over_steps(int steps, HostAdamKernel kernel = HostAdamKernel::kAuto) {
  Model ref_model = Model::make(7);
  Model host_model = ref_model.clone();
  Reference reference(ref_model.param_groups<Options>(), Options(1e-3).weight_decay(0.01));
  Host host(host_model.param_groups<Options>(), Options(1e-3).weight_decay(0.01));
  host.set_kernel(kernel);
  Divergence worst;
  for (int step = 1; step <= steps; ++step) {
    ref_model.set_grads(step);
    host_model.set_grads(step);
    if (step == 3) {
      reference.param_groups()[1].options().set_lr(5e-4);
      host.param_groups()[1].options().set_lr(5e-4);
    }
    reference.step();
    host.step();
    for (size_t g = 0; g < ref_model.groups.size(); ++g) {
      for (size_t i = 0; i < ref_model.groups[g].size(); ++i) {
        worst.add(ref_model.groups[g][i], host_model.groups[g][i]);
      }
    }
    const auto ref_state = reference.state().size(), host_state = host.state().size();
    EXPECT_EQ(ref_state, host_state);
  }
  // The frozen parameter never moved and got no state.
  EXPECT_TRUE(torch::equal(host_model.groups[2][0], Model::make(7).groups[2][0]));
  EXPECT_EQ(host.state().size(), kSizes.size() + 1);
  return worst;
}

TEST(HostAdam, AdamWMatchesLibTorchBitwise) {
  const auto d = divergence_over_steps<torch::optim::AdamW, HostAdamW, torch::optim::AdamWOptions>(6);
  EXPECT_EQ(d.ulps, 0) << "largest difference " << d.abs;
}

TEST(HostAdam, AdamMatchesLibTorchBitwise) {
  const auto d = divergence_over_steps<torch::optim::Adam, HostAdam, torch::optim::AdamOptions>(6);
  EXPECT_EQ(d.ulps, 0) << "largest difference " << d.abs;
}

TEST(HostAdam, MatchesLibTorchBitwiseOnTwoThreads) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const auto d = divergence_over_steps<torch::optim::AdamW, HostAdamW, torch::optim::AdamWOptions>(3);
  at::set_num_threads(threads);
  EXPECT_EQ(d.ulps, 0) << "largest difference " << d.abs;
}

// The build kAuto does not pick rounds `x + a * b` the other way from ATen's
// kernels: the bitwise tests above catch a kernel that does, and this is
// what it costs. Counted in ulps of each element the difference has no useful
// bound (a parameter that lands near zero has tiny ulps: 296 here), so the
// bound is absolute: over six steps the moments' last-bit changes move a
// parameter by at most 1.2e-7 (AdamW) and 2.4e-7 (Adam) here, one ulp of a
// parameter of magnitude 1 or 2 and a ten-thousandth of one step (lr 1e-3);
// asserted with a factor of two to spare.
TEST(HostAdam, TheOtherRoundingDiffersInTheLastBits) {
  const HostAdamKernel other = auto_kernel() == HostAdamKernel::kAvx2Fma ? HostAdamKernel::kGeneric
                                                                         : HostAdamKernel::kAvx2Fma;
  if (other == HostAdamKernel::kAvx2Fma &&
      !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    // No other rounding to compare with here; asking for it is an error.
    HostAdamW optimizer({torch::zeros({1})});
    EXPECT_THAT(error_of<Error>([&] { optimizer.set_kernel(other); }),
                HasSubstr("HostAdamW: the avx2+fma kernel needs a CPU with AVX2 and FMA"));
    return;
  }
  const auto adamw =
      divergence_over_steps<torch::optim::AdamW, HostAdamW, torch::optim::AdamWOptions>(6, other);
  const auto adam =
      divergence_over_steps<torch::optim::Adam, HostAdam, torch::optim::AdamOptions>(6, other);
  std::printf("other rounding: AdamW %lld ulps, %.3g; Adam %lld ulps, %.3g\n",
              static_cast<long long>(adamw.ulps), adamw.abs, static_cast<long long>(adam.ulps), adam.abs);
  EXPECT_GT(adamw.ulps, 0) << "the other rounding should differ somewhere";
  EXPECT_GT(adam.ulps, 0);
  EXPECT_LE(adamw.abs, 5e-7);
  EXPECT_LE(adam.abs, 5e-7);
}

// Steps `first` twice, saves it, loads the save into `second` (built on
// twins of the same parameters) and steps both twice more.
template <typename First, typename Second, typename Options>
void expect_state_round_trip() {
  Model first_model = Model::make(11);
  Model second_model = first_model.clone();
  First first(first_model.param_groups<Options>(), Options(1e-3).weight_decay(0.05));
  for (int step = 1; step <= 2; ++step) {
    first_model.set_grads(step);
    first.step();
  }
  std::stringstream saved;
  torch::save(first, saved);
  second_model = first_model.clone();
  Second second(second_model.param_groups<Options>(), Options(1e-3).weight_decay(0.05));
  torch::load(second, saved);
  for (int step = 3; step <= 4; ++step) {
    first_model.set_grads(step);
    second_model.set_grads(step);
    first.step();
    second.step();
  }
  for (size_t g = 0; g < first_model.groups.size(); ++g) {
    for (size_t i = 0; i < first_model.groups[g].size(); ++i) {
      EXPECT_TRUE(torch::equal(first_model.groups[g][i], second_model.groups[g][i]))
          << "group " << g << " parameter " << i;
    }
  }
}

TEST(HostAdam, LibTorchAdamWLoadsTheHostState) {
  expect_state_round_trip<HostAdamW, torch::optim::AdamW, torch::optim::AdamWOptions>();
}

TEST(HostAdam, HostAdamWLoadsLibTorchState) {
  expect_state_round_trip<torch::optim::AdamW, HostAdamW, torch::optim::AdamWOptions>();
}

TEST(HostAdam, AdamStateRoundTripsBothWays) {
  expect_state_round_trip<HostAdam, torch::optim::Adam, torch::optim::AdamOptions>();
  expect_state_round_trip<torch::optim::Adam, HostAdam, torch::optim::AdamOptions>();
}

TEST(HostAdam, AmsgradIsRefused) {
  auto p = torch::zeros({4});
  EXPECT_THAT(error_of<Error>([&] { HostAdamW({p}, torch::optim::AdamWOptions().amsgrad(true)); }),
              HasSubstr("HostAdamW: amsgrad is not implemented by the fused host Adam; set "
                        "amsgrad(false) or use torch::optim::AdamW"));
  HostAdam adam({p});
  static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).amsgrad(true);
  p.mutable_grad() = torch::ones({4});
  EXPECT_THAT(error_of<Error>([&] { adam.step(); }),
              HasSubstr("HostAdam: group 0 sets amsgrad, which the fused host Adam does not implement"));
}

// A parameter that the fused loop cannot update refuses the whole step:
// nothing moves, not even the parameters checked before it.
void expect_refused(const at::Tensor& bad, const at::Tensor& grad, const std::string& message) {
  auto good = torch::ones({3});
  good.mutable_grad() = torch::ones({3});
  auto bad_param = bad;
  bad_param.mutable_grad() = grad;
  HostAdamW optimizer({good, bad_param});
  EXPECT_THAT(error_of<Error>([&] { optimizer.step(); }), HasSubstr(message));
  EXPECT_TRUE(torch::equal(good, torch::ones({3})));
  EXPECT_TRUE(optimizer.state().empty());
}

TEST(HostAdam, UnfusableTensorsAreRefusedWithWhatToChange) {
  expect_refused(torch::zeros({4}, torch::kFloat64), torch::zeros({4}, torch::kFloat64),
                 "HostAdamW: parameter 1 of group 0 is Double with a Double gradient; the fused "
                 "host Adam updates dense, contiguous float32 CPU tensors only: keep float32 "
                 "master weights and gradients");
  expect_refused(torch::zeros({4, 4}).t(), torch::zeros({4, 4}).t(),
                 "HostAdamW: parameter 1 of group 0 or its gradient is not contiguous");
  expect_refused(torch::zeros({4}), torch::zeros({4}).to_sparse(),
                 "HostAdamW: parameter 1 of group 0 has a sparse gradient");
  expect_refused(torch::zeros({4}), torch::zeros({5}),
                 "HostAdamW: parameter 1 of group 0: its gradient has another size ([5] vs [4])");
}

// A rate beyond float's range: the update's scalars are converted as ATen
// converts them, so the step throws LibTorch's error (which the engine turns
// into one naming optimizer.params.lr) instead of writing infinities.
TEST(HostAdam, ARateBeyondFloatThrowsAsLibTorchDoes) {
  auto step_error = [](auto&& make) {
    auto p = torch::ones({8});
    p.mutable_grad() = torch::ones({8});
    auto optimizer = make(std::vector<at::Tensor>{p});
    std::string what;
    try {
      optimizer.step();
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    return std::make_pair(what, p.clone());
  };
  const auto options = torch::optim::AdamWOptions(1e39);
  const auto [torch_error, torch_p] =
      step_error([&](std::vector<at::Tensor> ps) { return torch::optim::AdamW(ps, options); });
  const auto [host_error, host_p] = step_error([&](std::vector<at::Tensor> ps) { return HostAdamW(ps, options); });
  EXPECT_THAT(torch_error, HasSubstr("value cannot be converted to type float without overflow"));
  EXPECT_EQ(host_error, torch_error);
  EXPECT_TRUE(torch::equal(host_p, torch::ones({8})));  // nothing written before the throw
}

TEST(HostAdam, StateOfAnotherSizeIsRefused) {
  auto p = torch::zeros({4});
  p.mutable_grad() = torch::ones({4});
  HostAdamW optimizer({p});
  optimizer.step();
  auto& state = static_cast<torch::optim::AdamWParamState&>(*optimizer.state().begin()->second);
  state.exp_avg_sq(torch::zeros({6}));
  EXPECT_THAT(error_of<Error>([&] { optimizer.step(); }),
              HasSubstr("HostAdamW: parameter 0 of group 0: its state's exp_avg_sq is not a "
                        "contiguous float32 CPU tensor of the parameter's size (Float [6] on cpu vs "
                        "float32 [4]); load a state saved for these parameters"));
  EXPECT_EQ(state.step(), 1);
}

TEST(HostAdam, KernelNames) {
  EXPECT_STREQ(kernel_name(HostAdamKernel::kGeneric), "generic");
  EXPECT_STREQ(kernel_name(HostAdamKernel::kAvx2Fma), "avx2+fma");
  EXPECT_NE(auto_kernel(), HostAdamKernel::kAuto);
}

}  // namespace
}  // namespace remat::optim
