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

// Writes `parameters` as one {name: tensor} dictionary file: to a temporary
// file of a unique name beside it (PATH.remat-tmp.XXXXXX), flushed, fsynced and
// renamed over `path`. Returns the bytes written. A failure removes the
// temporary file and is an Error (a path that is not a regular file too: the
// rename would replace a device, fifo or symbolic link).
int64_t write_model_file(const std::string& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& parameters);

// consolidated_parameters(), written by rank 0 of `world` in `dtype`: float32,
// or bf16 or fp16 (each value the float32 one rounded to it: the export of
// DeepSpeed's stage3_gather_16bit_weights_on_model_save). Returns the bytes
// written on rank 0, 0 elsewhere. A path check_export_path refuses is a
// ConfigError on every rank before anything is gathered; a failed write is an
// Error on every rank.
int64_t export_model(const std::string& path, parallel::ZeroModel& zero, const torch::nn::Module& model,
                     Communicator& world, at::ScalarType dtype = at::kFloat);

// Start-up checks, so that an export which cannot be written stops a run
// before it trains (call on the rank that writes). Each is a ConfigError
// saying what to change.
//
// `path` follows runtime/output_file.h's rule: where it exists, a regular
// file (not a directory, symbolic link, device or fifo), in a folder that
// takes a new file (a probe of a unique name). `flag` names it in the message.
void check_export_path(const std::string& path, const std::string& flag = "--export");
// The folder of `path` has `bytes` free (statvfs).
void check_export_space(const std::string& path, int64_t bytes);

// What the export of `model` takes on disk, estimated from shapes alone with
// a margin: every parameter whole in `dtype` (a tensor-parallel shard counted
// at its full size) plus the archive's records and the pickled names.
int64_t estimated_export_bytes(const torch::nn::Module& model, at::ScalarType dtype = at::kFloat);

}  // namespace remat
