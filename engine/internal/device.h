// Where an engine trains: the device train.device (or EngineOptions::device)
// names for this rank, and the model placed there before anything records
// its parameters (docs/engine.md, "The device").
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace torch::nn {
class Module;
}

namespace remat::internal {

// The CUDA devices this process sees (torch::cuda), or a test's.
struct CudaDevices {
  bool available = false;
  int count = 0;
};
CudaDevices visible_cuda_devices();

// The device `spec` names for local rank `local_rank`: auto is the local
// rank's CUDA device (local_rank % count, the one Runtime::init made
// current) where CUDA is available, else the CPU; cuda is the local rank's
// CUDA device; cuda:N is device N. A ConfigError naming `key` and `spec`
// for a malformed spec, CUDA asked for where none is visible, or an index
// past the devices seen.
at::Device resolve_device(const std::string& spec, int local_rank, const CudaDevices& cuda,
                          const std::string& key);

// Makes a CUDA `device` the process's current CUDA device (as
// torch.cuda.set_device does), so that what works on the current device
// (the tracked RNG's CUDA generator, new streams) works on the model's.
// Nothing for the CPU, or when it is current already (Runtime::init made the
// local rank's device current in a build with NCCL).
void make_current(at::Device device);

// Moves the model's parameters and buffers to `device` (Module::to, which
// keeps each parameter the same tensor with new data), logging from where.
// A model all on `device` is left alone: nothing is copied. Parameters or
// buffers on the meta device are a ConfigError (materialise them first).
// Returns how many tensors moved.
int64_t place_model(torch::nn::Module& model, at::Device device);

}  // namespace remat::internal
