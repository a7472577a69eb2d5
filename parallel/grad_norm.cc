#include "parallel/grad_norm.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "runtime/communicator.h"

namespace remat::parallel {
namespace {

bool spans_ranks(const std::shared_ptr<Communicator>& c) { return c && c->size() > 1; }

}  // namespace

double clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm, std::optional<at::Device> reduce_on) {
  std::vector<at::Tensor> all;
  for (const auto& g : groups) all.insert(all.end(), g.tensors.begin(), g.tensors.end());
  // Squares summed in double, per group, in order: the same arithmetic at
  // every layout, so a one-rank run and a sharded one agree.
  std::vector<double> sq(groups.size(), 0.0);
  for (size_t i = 0; i < groups.size(); ++i) {
    for (const auto& t : groups[i].tensors) {
      if (!t.grad().defined()) continue;
      const double n = t.grad().norm().item<double>();
      sq[i] += n * n;
    }
  }
  // One all-reduce per communicator, over the groups summed across it, in
  // the order communicators first appear.
  std::vector<Communicator*> done;
  for (const auto& g : groups) {
    for (const auto& c : g.summed_over) {
      if (!spans_ranks(c) || std::find(done.begin(), done.end(), c.get()) != done.end()) continue;
      done.push_back(c.get());
      std::vector<size_t> members;
      for (size_t i = 0; i < groups.size(); ++i) {
        const auto& over = groups[i].summed_over;
        if (std::find(over.begin(), over.end(), c) != over.end()) members.push_back(i);
      }
      // On the tensors' device: the communicator's backend takes them (nccl: CUDA only).
      const at::Device device = reduce_on ? *reduce_on : all.empty() ? at::Device(at::kCPU) : all.front().device();
      at::Tensor values =
          at::empty({static_cast<int64_t>(members.size())}, at::TensorOptions().dtype(at::kDouble).device(device));
      for (size_t k = 0; k < members.size(); ++k) values[k] = sq[members[k]];
      c->allReduce(values)->wait();
      for (size_t k = 0; k < members.size(); ++k) sq[members[k]] = values[k].item<double>();
    }
  }
  double total_sq = 0.0;
  for (double v : sq) total_sq += v;
  const double total = std::sqrt(total_sq);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    c10::NoGradGuard no_grad;
    for (auto& t : all) {
      if (t.grad().defined()) t.grad().mul_(coef);
    }
  }
  return total;
}

}  // namespace remat::parallel
