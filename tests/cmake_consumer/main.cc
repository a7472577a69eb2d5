// Checkpoints one region through an installed remat and checks the gradient
// against the plain run bitwise; exits nonzero on a mismatch.
#include <torch/torch.h>

#include <cstdio>

#include "checkpointing/checkpoint.h"

int main() {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 8);
  at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  auto f = [&](const at::Tensor& in) { return torch::gelu(lin->forward(in)); };
  f(x).sum().backward();
  at::Tensor plain = x.grad().clone();
  x.mutable_grad().reset();
  remat::checkpoint(f, x).sum().backward();
  bool same = torch::equal(plain, x.grad());
  std::printf("find_package(remat) consumer: checkpointed gradient %s the plain one\n",
              same ? "equals" : "DIFFERS from");
  return same ? 0 : 1;
}
