// The trained model exported whole: every parameter by the model's
// state-dict name, in one of the formats the ecosystem moves weights in,
// chosen by the path:
//
//   model.safetensors   one safetensors file (engine/safetensors.h); the
//                       extension in any case (X.SAFETENSORS)
//   export/             a folder (an existing directory or a path ending in
//                       '/'): safetensors shards and model.safetensors.index.json
//   model.pt            anything else: a {name: tensor} dictionary that
//                       torch::pickle_load (LibTorch) and torch.load (Python) read
//   *.json              refused (an index is never written alone: give the folder)
//
//   remat::export_model("model.safetensors", zero, *model, *world);   // collective
//
// Streamed: the parameters are gathered one unit at a time
// (ZeroModel::for_each_full_unit; tensor-parallel shards whole per parameter
// by their layer), converted, written and released, so that the writing rank
// holds one unit beside its own state, not the model. Every format's bytes
// depend on the values alone, not on the layout that trained them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
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

enum class ExportFormat { kPickle, kSafetensors, kSafetensorsShards };
// The format `path` gets (above).
ExportFormat export_format(const std::string& path);

struct ExportOptions {
  // A folder's shards: at most this many bytes of tensor data each (a tensor
  // larger than that alone in its shard). 50 GB (50 x 10^9 bytes): Hugging
  // Face transformers' save_pretrained default max_shard_size, "50GB", since
  // its v5 (huggingface/transformers#42734; "5GB" before, and still
  // huggingface_hub's save_torch_state_dict default).
  int64_t max_shard_bytes = 50'000'000'000;
  // Added to a safetensors export's __metadata__, beside {"format": "pt"}
  // and remat's own ("remat_dtype"; the engine adds "remat_step").
  std::map<std::string, std::string> metadata;
};

// A byte size as save_pretrained's max_shard_size takes it: plain bytes, or
// a number with KB, MB, GB, TB, PB, EB (powers of 1000) or KiB, MiB, GiB,
// TiB, PiB, EiB (powers of 1024), units in any case, e.g. "5GB", "500MB",
// "2GiB", "1.5GB"; a fraction where it gives a whole number of bytes. A
// ConfigError naming `flag` says which fault it is: not a size, zero, not a
// whole number of bytes, or more than int64 holds (8 EiB less one byte).
int64_t parse_byte_size(const std::string& text, const std::string& flag);

// The model's parameters whole, in float32, written by rank 0 of `world` in
// `dtype`: float32, or bf16 or fp16 (each value the float32 one rounded to
// it: the export of DeepSpeed's stage3_gather_16bit_weights_on_model_save).
// Streamed (above); the files appear whole or not at all (temporary names,
// fsynced, renamed). Returns the bytes written on rank 0, 0 elsewhere. A
// path check_export_path refuses is a ConfigError on every rank before
// anything is gathered; a failed write is an Error on every rank (rank 0
// stops writing and gathers on with the others, so nobody waits for it).
int64_t export_model(const std::string& path, parallel::ZeroModel& zero, const torch::nn::Module& model,
                     Communicator& world, at::ScalarType dtype = at::kFloat, const ExportOptions& options = {});

// The export gathered whole first (what export_model did before it
// streamed; kept for comparison: docs/benchmarks.md measures both). The
// model's parameters whole and in float32 (ZeroModel::full_parameters(),
// tensor-parallel layers gathered too; collective over every rank), and the
// pickle written from them at once.
std::vector<std::pair<std::string, at::Tensor>> consolidated_parameters(parallel::ZeroModel& zero,
                                                                        const torch::nn::Module& model);

// Writes `parameters` as one {name: tensor} dictionary file, the bytes
// export_model's pickle has: to a temporary file of a unique name beside it
// (PATH.remat-tmp.XXXXXX), flushed, fsynced and renamed over `path`. Returns
// the bytes written. A failure removes the temporary file and is an Error (a
// path that is not a regular file too: the rename would replace a device,
// fifo or symbolic link).
int64_t write_model_file(const std::string& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& parameters);

// Start-up checks, so that an export which cannot be written stops a run
// before it trains (call on the rank that writes). Each is a ConfigError
// saying what to change.
//
// A file `path` follows runtime/output_file.h's rule: where it exists, a
// regular file (not a directory, symbolic link, device or fifo), in a folder
// that takes a new file (a probe of a unique name). A folder `path` (a
// sharded export): a folder that takes new files, or a new one in a folder
// that does; where it exists, empty or holding a previous remat safetensors
// export alone (its shards, index and temporaries: the export replaces them),
// never anything else. A file that exists must be empty, a pickle archive
// (a zip) or a safetensors file of remat's export: anything else is not
// overwritten. A file is refused in a folder holding a sharded export's
// index (readers would take a model.safetensors there instead of the
// shards), and a *.json path always. `flag` names it in the message.
void check_export_path(const std::string& path, const std::string& flag = "--export");
// The folder `path` is written in has `bytes` free (statvfs), once the
// temporaries an earlier export stopped half-way left there (its names'
// PATH.remat-tmp.XXXXXX, their size reserved) are removed, each in a log
// line with its bytes; the error names those a process still holds.
// export_model removes them too before it writes.
void check_export_space(const std::string& path, int64_t bytes);

// What the export of `model` takes on disk, estimated from shapes alone with
// a margin: every parameter whole in `dtype` (a tensor-parallel shard counted
// at its full size) plus, per tensor, the pickle's records and names (more
// than a safetensors header and index need).
int64_t estimated_export_bytes(const torch::nn::Module& model, at::ScalarType dtype = at::kFloat);

}  // namespace remat
