#include "engine/internal/device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>

#include <map>

#include "engine/config.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::internal {

CudaDevices visible_cuda_devices() {
  CudaDevices out;
  out.available = torch::cuda::is_available();
  out.count = out.available ? static_cast<int>(torch::cuda::device_count()) : 0;
  return out;
}

at::Device resolve_device(const std::string& spec, int local_rank, const CudaDevices& cuda,
                          const std::string& key) {
  if (const std::string why = device_spec_problem(spec, key); !why.empty()) throw ConfigError(why);
  const bool have_cuda = cuda.available && cuda.count > 0;
  if (spec == "cpu" || (spec == "auto" && !have_cuda)) return at::Device(at::kCPU);
  if (!have_cuda) {
    throw ConfigError(str("'", key, "' = \"", spec, "\" asks for a CUDA device, but no CUDA device is visible to "
                          "this process (torch::cuda::is_available() is false: no GPU, no driver, a LibTorch "
                          "built without CUDA, or CUDA_VISIBLE_DEVICES empty): set ", key, " to auto or cpu to "
                          "train on the CPU (remat-train: --device), or run where a GPU is visible"));
  }
  if (spec == "auto" || spec == "cuda") {
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank % cuda.count));
  }
  const int index = std::stoi(spec.substr(5));
  if (index >= cuda.count) {
    throw ConfigError(str("'", key, "' = \"", spec, "\" names CUDA device ", index, ", but this process sees ",
                          cuda.count, " (cuda:0 to cuda:", cuda.count - 1, "): name one of those, or give cuda "
                          "(the local rank's device, local rank % devices)"));
  }
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void make_current(at::Device device) {
  if (!device.is_cuda()) return;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(device.type());
  if (cuda->getDevice() == device) return;
  log().info("making {} the current CUDA device (it was {})", device.str(), cuda->getDevice().str());
  cuda->setDevice(device);
}

int64_t place_model(torch::nn::Module& model, at::Device device) {
  std::map<std::string, int64_t> from;  // device -> tensors there
  auto look = [&](const std::string& name, const at::Tensor& t, const char* what) {
    if (!t.defined()) return;
    if (t.is_meta()) {
      throw ConfigError(str("remat::initialize: ", what, " '", name, "' is on the meta device (it has a shape but "
                            "no values): materialise the model first (build it on ", device.str(), " or the CPU, "
                            "or load its values), then initialize"));
    }
    if (t.device() != device) ++from[t.device().str()];
  };
  for (const auto& item : model.named_parameters()) look(item.key(), item.value(), "parameter");
  for (const auto& item : model.named_buffers()) look(item.key(), item.value(), "buffer");
  if (from.empty()) return 0;
  int64_t moved = 0;
  std::string where;
  for (const auto& [name, n] : from) {
    where += str(where.empty() ? "" : ", ", n, " on ", name);
    moved += n;
  }
  model.to(device);
  log().info("placed the model on {}: moved {} parameters and buffers ({})", device.str(), moved, where);
  return moved;
}

}  // namespace remat::internal
