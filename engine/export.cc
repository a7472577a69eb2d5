#include "engine/export.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/nn/module.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "parallel/layers.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/outcome.h"
#include "runtime/output_file.h"

namespace remat {
namespace fs = std::filesystem;

namespace {

// The folder a file path lies in ("." for a bare name).
std::string folder_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

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
  // Host tensors: the file loads anywhere, not only where a GPU is.
  for (const auto& [name, value] : parameters) dict.insert(name, value.detach().cpu().contiguous());
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
  std::string bytes;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      bytes.append(static_cast<const char*>(data), size);
      return size;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  }  // the writer finishes the zip archive when it goes
  std::string tmp;
  const int fd = open_temporary_beside(path, tmp);
  if (fd < 0) {
    throw Error(str("export file '", path, "': cannot create a file in '", folder_of(path), "' (",
                    std::strerror(errno), ")"));
  }
  // Any failure from here on leaves nothing behind.
  auto fail = [&](const std::string& what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return Error(str("export file '", path, "': ", what, " (", std::strerror(err), "); the temporary file is removed"));
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw fail(str("writing ", bytes.size(), " bytes to '", tmp, "' failed after ", done, " bytes"), errno);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) throw fail(str("flushing '", tmp, "' to disk failed"), errno);
  // Checked at start too: the path may have changed since. Renamed while
  // still open (and so locked): a writer at work is never taken for a stale one.
  const std::string what = not_a_regular_file(path);
  if (!what.empty() || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error(str("export file '", path, "': cannot put the file there (",
                    what.empty() ? std::string(std::strerror(err)) : "it is " + what + " now",
                    "); the temporary file is removed"));
  }
  if (::close(fd) != 0) {
    throw Error(str("export file '", path, "': closing it failed (", std::strerror(errno),
                    "); export again to be sure of its contents"));
  }
  return static_cast<int64_t>(bytes.size());
}

int64_t export_model(const std::string& path, parallel::ZeroModel& zero, const torch::nn::Module& model,
                     Communicator& world, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
    throw Error(str("remat::export_model: dtype ", c10::toString(dtype), " is not float32, bf16 or fp16"));
  }
  // A path the file cannot go to is refused before anything is gathered, on every rank.
  agree_on_outcome(world, "the export's path check", [&] {
    if (world.rank() == 0) check_export_path(path, "remat::Engine::export_model");
  });
  auto params = consolidated_parameters(zero, model);
  if (world.rank() == 0 && dtype != at::kFloat) {
    for (auto& entry : params) entry.second = entry.second.to(dtype);  // from the float32 masters, rounded once
  }
  int64_t bytes = 0;
  // Every rank learns whether rank 0 wrote it, and why not.
  agree_on_outcome(world, "the export", [&] {
    if (world.rank() == 0) bytes = write_model_file(path, params);
  });
  return bytes;
}

void check_export_path(const std::string& path, const std::string& flag) {
  check_output_file({flag, path, "model.pt"});
}

void check_export_space(const std::string& path, int64_t bytes) {
  struct statvfs fsinfo {};
  const std::string folder = folder_of(path);
  if (::statvfs(folder.c_str(), &fsinfo) != 0) return;  // unknown: the write will tell
  const int64_t free_bytes = static_cast<int64_t>(fsinfo.f_bavail) * static_cast<int64_t>(fsinfo.f_frsize);
  if (free_bytes < bytes) {
    throw ConfigError(str("export file '", path, "' needs about ", bytes, " bytes (", (bytes + 1023) / 1024,
                          " KiB) but '", folder, "' has ", free_bytes, " bytes (", free_bytes / 1024,
                          " KiB) free: free space there, or export to a disk with room"));
  }
}

int64_t estimated_export_bytes(const torch::nn::Module& model, at::ScalarType dtype) {
  // Tensor-parallel layers: a sharded parameter is 1/k of its whole, k the
  // ratio of the full weight to this rank's.
  std::map<const void*, double> scale;
  for (const auto& item : model.named_modules()) {
    auto* tp = dynamic_cast<const parallel::TensorParallelModule*>(item.value().get());
    const auto own = item.value()->named_parameters(/*recurse=*/false);
    if (!tp || !own.contains("weight")) continue;
    double full = 1;
    for (int64_t d : tp->full_weight_sizes()) full *= static_cast<double>(d);
    const double k = full / static_cast<double>(std::max<int64_t>(own["weight"].numel(), 1));
    for (const auto& p : tp->sharded_parameters()) scale[p.unsafeGetTensorImpl()] = k;
  }
  double values = 0, records = 4096;  // the archive's fixed records (version, data.pkl, directory)
  for (const auto& item : model.named_parameters()) {
    auto k = scale.find(item.value().unsafeGetTensorImpl());
    values += static_cast<double>(c10::elementSize(dtype)) * static_cast<double>(item.value().numel()) *
              (k == scale.end() ? 1.0 : k->second);
    // Per tensor: a zip record aligned to 64 bytes, its directory entry and
    // its name and storage in the pickle.
    records += 512 + 2.0 * static_cast<double>(item.key().size());
  }
  return static_cast<int64_t>(values * 1.01 + records);
}

}  // namespace remat
