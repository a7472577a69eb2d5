// The trained model as one file: every parameter whole, by the model's
// state-dict name, as a {name: tensor} dictionary that torch::pickle_load
// (LibTorch) and torch.load (Python) read.
//
//   remat::export_model("model.pt", zero, *model, *world);   // collective
//   c10::IValue dict = torch::pickle_load(bytes);            // elsewhere
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace remat {

class Communicator;
namespace parallel {
class ZeroModel;
}

// The model's parameters, whole and in float32: gathered over the
// data-parallel group (ZeroModel::full_parameters()) and, for tensor-parallel
// layers, over the tensor-parallel group. Collective over every rank.
std::vector<std::pair<std::string, at::Tensor>> consolidated_parameters(parallel::ZeroModel& zero,
                                                                        const torch::nn::Module& model);

// Writes `parameters` as one {name: tensor} dictionary file (to a temporary
// name, then renamed). Returns the bytes written.
int64_t write_model_file(const std::string& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& parameters);

// consolidated_parameters(), written by rank 0 of `world`. Returns the bytes
// written on rank 0, 0 elsewhere. An unwritable path is a ConfigError on every rank.
int64_t export_model(const std::string& path, parallel::ZeroModel& zero, const torch::nn::Module& model,
                     Communicator& world);

}  // namespace remat
