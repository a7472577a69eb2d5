#include "runtime/internal/host_staging.h"

#include <ATen/ATen.h>

#include "runtime/error.h"

namespace remat::internal {

StagingPlan plan_staging(const std::vector<c10::Device>& devices, bool force_cpu, const char* op,
                         const char* backend) {
  for (size_t i = 0; i < devices.size(); ++i) {
    const c10::Device& d = devices[i];
    if (!d.is_cpu() && !d.is_cuda()) {
      throw CommError(str(op, ": the ", backend, " backend takes CPU or CUDA tensors, got one on ", d.str(),
                          "; move it with .cpu() or .cuda()"));
    }
    if (d != devices[0]) {
      throw CommError(str(op, ": the tensors of one call must be on one device, got ", devices[0].str(),
                          " (tensor 0) and ", d.str(), " (tensor ", i, "); move them to one device (the ",
                          backend, " backend copies CUDA tensors through host memory, one device per call)"));
    }
  }
  const bool cuda = !devices.empty() && devices[0].is_cuda();
  return {cuda || (force_cpu && !devices.empty()), cuda};
}

std::vector<at::Tensor> HostStaging::stage(const std::vector<at::Tensor>& tensors,
                                           const std::vector<StagedRole>& roles) {
  REMAT_CHECK_EQ(tensors.size(), roles.size(), "HostStaging::stage: one role per tensor");
  if (!plan_.stage) return tensors;
  at::NoGradGuard no_grad;  // MPI writes bytes; autograd records nothing either way
  std::vector<at::Tensor> host;
  host.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    // Pinned memory exists only where CUDA does: never asked of a CPU tensor.
    at::Tensor buffer = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(plan_.pinned));
    if (roles[i] != StagedRole::kOut) {
      buffer.copy_(t);  // blocking: on the tensor's current stream, complete on return
      bytes_ += buffer.nbytes();
    }
    if (roles[i] != StagedRole::kIn) {
      write_back_.emplace_back(t, buffer);
      bytes_ += buffer.nbytes();
    }
    host.push_back(std::move(buffer));
  }
  return host;
}

void HostStaging::finish() {
  at::NoGradGuard no_grad;
  for (auto& [tensor, buffer] : write_back_) tensor.copy_(buffer, /*non_blocking=*/plan_.pinned);
  write_back_.clear();
}

}  // namespace remat::internal
