#include "parallel/internal/zero_units.h"

#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/module.h>

#include <map>
#include <unordered_set>

#include "runtime/error.h"

namespace remat::parallel {

std::vector<UnitParameters> unit_parameters(torch::nn::Module& model,
                                            const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  std::unordered_set<const void*> in_units;
  std::vector<UnitParameters> out;
  std::map<const torch::nn::Module*, std::string> names;
  for (const auto& item : model.named_modules()) names[item.value().get()] = item.key();
  for (const auto& m : units) {
    REMAT_CHECK(names.count(m.get()), "ZeroModel: a unit is not a submodule of the model");
    std::vector<at::Tensor> ps;
    for (const auto& p : m->parameters()) {
      if (in_units.insert(p.unsafeGetTensorImpl()).second) ps.push_back(p);
    }
    out.push_back({names[m.get()], m.get(), ps});
  }
  std::vector<at::Tensor> root;
  for (const auto& p : model.parameters()) {
    if (!in_units.count(p.unsafeGetTensorImpl())) root.push_back(p);
  }
  out.push_back({"root", nullptr, root});
  return out;
}

void release_storage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t, int64_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = impl->allocator() ? impl->allocator() : c10::GetAllocator(t.device().type());
  impl->set_data_ptr_noswap(allocator->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

bool data_needed_in_backward(const at::Tensor& x, const std::unordered_set<const void*>& params) {
  if (!x.requires_grad() || x.grad_fn() == nullptr || params.empty()) return false;
  std::vector<torch::autograd::Node*> stack{x.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen{x.grad_fn().get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next == nullptr) continue;
      // Every consumer of a parameter is looked at, not only the first.
      if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(next)) {
        if (params.count(acc->variable.unsafeGetTensorImpl()) && node->name().rfind("EmbeddingBackward", 0) != 0) {
          return true;
        }
        continue;
      }
      if (seen.insert(next).second) stack.push_back(next);
    }
  }
  return false;
}

}  // namespace remat::parallel
