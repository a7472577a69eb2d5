// Small models the ZeRO tests shard (parallel/zero_test.cc drives ZeroModel
// on them, engine/zero_engine_test.cc the engine): each block a Linear called
// through remat::forward, so stage 3 makes it a unit.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "nn/module_call.h"

namespace remat::testing {

// A model whose root unit has a parameter used before the first unit and
// needed by its backward (a LayerNorm after the embedding, kept in the root).
struct RootNormNetImpl : torch::nn::Module {
  RootNormNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(13, 8));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 13));
  }
  at::Tensor loss(const at::Tensor& idx) {
    at::Tensor x = norm->forward(emb->forward(idx));
    for (size_t i = 0; i < blocks->size(); ++i) x = at::tanh(remat::forward(blocks->ptr<torch::nn::LinearImpl>(i), x));
    return at::cross_entropy_loss(head->forward(x).view({-1, 13}), idx.roll(-1, 1).view({-1}));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(RootNormNet);

// A user's model whose loss uses a side branch only on some steps and some
// ranks (data-dependent), never uses one parameter at all, and takes a
// gradient penalty through autograd::grad inside its code.
struct BranchyNetImpl : torch::nn::Module {
  BranchyNetImpl() {
    embed = register_module("embed", torch::nn::Embedding(13, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(torch::nn::Linear(8, 8));
    side = register_module("side", torch::nn::Linear(8, 8));
    never = register_parameter("never", at::ones({5}));
    head = register_module("head", torch::nn::Linear(8, 13));
  }
  at::Tensor loss(const at::Tensor& idx, bool use_side, bool penalty) {
    at::Tensor h = embed(idx);
    for (size_t i = 0; i < blocks->size(); ++i) h = at::tanh(remat::forward(blocks->ptr<torch::nn::LinearImpl>(i), h));
    if (use_side) h = h + side(h);
    at::Tensor logits = head(h);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 13}), idx.roll(-1, 1).reshape({-1}));
    if (penalty) {
      at::Tensor g = torch::autograd::grad({loss}, {h}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
      loss = loss + 0.1 * g.pow(2).sum();
    }
    return loss;
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear side{nullptr}, head{nullptr};
  at::Tensor never;
};
TORCH_MODULE(BranchyNet);

}  // namespace remat::testing
