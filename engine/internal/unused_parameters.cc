#include "engine/internal/unused_parameters.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <set>

#include "optim/optimizer.h"
#include "runtime/error.h"

namespace remat::internal {
namespace {

// The optimizer state of `tensor` by name, without its step count (none for
// an optimizer remat does not know: its values alone are then kept).
std::map<std::string, at::Tensor> moments_of(const torch::optim::Optimizer& optimizer, const at::Tensor& tensor) {
  std::map<std::string, at::Tensor> out;
  try {
    out = optim::optimizer_state_of(optimizer, tensor);
  } catch (const Error&) {
  }
  out.erase("step");
  return out;
}

}  // namespace

std::vector<UnusedElements> leave_unused_alone(parallel::ZeroModel& zero, torch::nn::Module& model,
                                               const at::Tensor& arrived, const torch::optim::Optimizer& optimizer) {
  std::set<std::string> unused;
  const at::Tensor flags = arrived.contiguous();
  const auto got = flags.accessor<double, 1>();
  int64_t k = 0;
  for (const auto& item : model.named_parameters()) {
    if (item.value().requires_grad() && got[k] == 0) unused.insert(item.key());
    ++k;
  }
  std::vector<UnusedElements> held;
  if (unused.empty()) return held;
  const auto tensors = zero.parameters();
  const auto layout = zero.layout();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].grad().defined()) continue;
    UnusedElements e{tensors[i], {}, {}, {}};
    bool any_used = false;
    for (const auto& seg : layout[i].segments) {
      if (unused.count(seg.name)) {
        e.segments.push_back(seg);
      } else {
        any_used = true;
      }
    }
    if (e.segments.empty()) continue;
    if (!any_used) {
      tensors[i].mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor flat = tensors[i].detach().view({-1});
    const auto moments = moments_of(optimizer, tensors[i]);
    for (const auto& seg : e.segments) {
      e.values.push_back(flat.narrow(0, seg.shard_offset, seg.length).clone());
      std::map<std::string, at::Tensor> state;
      for (const auto& [field, value] : moments) {
        state[field] = value.reshape({-1}).narrow(0, seg.shard_offset, seg.length).clone();
      }
      e.state.push_back(std::move(state));
    }
    held.push_back(std::move(e));
  }
  return held;
}

void put_back_unused(const std::vector<UnusedElements>& held, const torch::optim::Optimizer& optimizer) {
  at::NoGradGuard no_grad;
  for (const auto& e : held) {
    const at::Tensor flat = e.tensor.detach().view({-1});
    const auto moments = moments_of(optimizer, e.tensor);
    for (size_t j = 0; j < e.segments.size(); ++j) {
      const auto& seg = e.segments[j];
      flat.narrow(0, seg.shard_offset, seg.length).copy_(e.values[j]);
      for (const auto& [field, value] : moments) {
        at::Tensor slice = value.view({-1}).narrow(0, seg.shard_offset, seg.length);
        auto before = e.state[j].find(field);
        if (before == e.state[j].end()) {
          slice.zero_();
        } else {
          slice.copy_(before->second);
        }
      }
    }
  }
}

}  // namespace remat::internal
