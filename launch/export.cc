#include "launch/export.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/nn/module.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "parallel/layers.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/error.h"

namespace remat {

std::vector<std::pair<std::string, at::Tensor>> consolidated_parameters(parallel::ZeroModel& zero,
                                                                        const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> params = zero.full_parameters();
  // Tensor-parallel layers: each parameter of `prefix.name` gathered by its layer.
  std::map<std::string, const parallel::TensorParallelModule*> layers;
  for (const auto& item : model.named_modules()) {
    if (auto* tp = dynamic_cast<const parallel::TensorParallelModule*>(item.value().get())) layers[item.key()] = tp;
  }
  for (auto& [name, value] : params) {
    const auto dot = name.rfind('.');
    const std::string owner = dot == std::string::npos ? std::string() : name.substr(0, dot);
    auto layer = layers.find(owner);
    if (layer != layers.end()) value = layer->second->gather_full(name.substr(dot + 1), value).contiguous();
  }
  return params;
}

int64_t write_model_file(const std::string& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& parameters) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, value] : parameters) dict.insert(name, value.detach().contiguous());
  // torch::pickle_save's format, without the type tag it adds to a typed
  // dictionary (torch.jit._pickle.restore_type_tag): Python's torch.load with
  // weights_only (the default from PyTorch 2.6 on) refuses that global, and a
  // plain {str: tensor} needs no tag.
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickled.insert(pickled.end(), data, data + size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  if (std::filesystem::is_directory(path)) {
    throw ConfigError(str("--export '", path, "' is a directory: give a file path (e.g. ",
                          (std::filesystem::path(path) / "model.pt").string(), ")"));
  }
  std::string bytes;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      bytes.append(static_cast<const char*>(data), size);
      return size;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  }  // the writer finishes the zip archive when it goes
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      throw ConfigError(str("--export '", path, "': cannot write '", tmp, "' (", std::strerror(errno),
                            "): give a path in a writable folder"));
    }
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw Error(str("--export '", path, "': writing failed (disk full?)"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    throw ConfigError(str("--export '", path, "': cannot put the file there (", ec.message(),
                          "): give a file path in a writable folder"));
  }
  return static_cast<int64_t>(bytes.size());
}

int64_t export_model(const std::string& path, parallel::ZeroModel& zero, const torch::nn::Module& model,
                     Communicator& world) {
  const auto params = consolidated_parameters(zero, model);
  int64_t bytes = 0;
  std::string failure;
  if (world.rank() == 0) {
    try {
      bytes = write_model_file(path, params);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // Every rank learns whether rank 0 wrote it.
  at::Tensor failed = at::full({1}, failure.empty() ? 0 : 1, at::kLong);
  if (world.size() > 1) world.broadcast(failed, {0})->wait();
  if (failed.item<int64_t>() != 0) {
    throw ConfigError(world.rank() == 0 ? failure : str("--export '", path, "': rank 0 could not write it"));
  }
  return bytes;
}

}  // namespace remat
