// safetensors files, read and written by remat: the weights format the
// ecosystem moves models in (one file, or shards listed by a
// model.safetensors.index.json).
//
// The format: an 8-byte little-endian unsigned header length N, N bytes of
// UTF-8 JSON {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin,
// end]}, "__metadata__": {string: string}} (padded with spaces), then the
// data: each tensor's bytes, row-major and little-endian, at [begin, end)
// from the data's start. The index of a sharded set is {"metadata": {..},
// "weight_map": {name: "model-00001-of-00002.safetensors"}}.
//
//   auto file = remat::SafetensorsFile::open("model.safetensors");   // mapped, checked
//   at::Tensor w = file->tensor("lm_head.weight");                    // no copy
//
//   remat::SafetensorsWriter out("export/", plan, {.max_shard_bytes = 2 << 30});
//   out.write("lm_head.weight", w);        // in any order, each once
//   out.finish();                          // fsynced, renamed, index last
//
// Reading is bounded and never trusts the file: a header longer than
// kMaxHeaderBytes or than the file, JSON that does not parse or is not UTF-8,
// an unknown dtype, a negative or overflowing shape, offsets out of the data,
// out of order, overlapping or leaving a gap, a size that is not the shape's
// bytes, or a duplicated name is a ConfigError naming the file and what is
// wrong, before any tensor is read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat {

// The largest header read (100 MB, as the format's reference reader).
constexpr int64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// The __metadata__ key (in every shard) and index "metadata" key of a
// sharded set's id: the writer draws a new one per set, and a set whose
// files and index name different ids (a folder left half-replaced by an
// export that stopped) is refused.
constexpr const char* kSafetensorsExportIdKey = "remat_export_id";

// "F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"; and
// back (a ConfigError for a dtype remat cannot hold, naming it).
std::string safetensors_dtype_name(at::ScalarType dtype);
at::ScalarType safetensors_dtype(const std::string& name);

// One tensor of a file as its header describes it.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte offsets from the data's start
};

// One safetensors file, memory-mapped read-only and checked at open.
class SafetensorsFile {
 public:
  // A missing or unreadable file, or any of the faults above, is a ConfigError.
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t file_bytes() const { return file_bytes_; }
  // In the header's order of data offsets.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Null where the file has no tensor `name`.
  const SafetensorsEntry* find(const std::string& name) const;
  // A CPU tensor over the mapped bytes (no copy; pages are read as they are
  // touched), valid while this file is open. Read-only: writing it is a
  // fault. A name the file lacks is a ConfigError.
  at::Tensor tensor(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  int64_t file_bytes_ = 0, data_start_ = 0;
  void* map_ = nullptr;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// A model's weights in one file or a sharded set: `path` is a .safetensors
// file, a model.safetensors.index.json, or a folder holding either. A folder
// is read as Hugging Face's from_pretrained reads one: its model.safetensors
// where there is one (a log line says so when an index beside it is
// ignored), else its index, else its one .safetensors file. An index naming a
// file that is missing or does not hold the tensors it maps there, a name in
// two shards, or a shard whose remat_export_id is not the index's is a
// ConfigError; so is a folder of shards without an index (an export stopped
// before writing it).
class SafetensorsSet {
 public:
  static SafetensorsSet open(const std::string& path);

  // Every tensor's name, sorted.
  std::vector<std::string> names() const;
  // The file holding `name`, and its entry; null where no file holds it.
  const SafetensorsFile* file_of(const std::string& name) const;
  const SafetensorsEntry* find(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const;  // as SafetensorsFile::tensor
  int64_t total_bytes() const;                        // of every file
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> file_by_name_;
};

// What a writer will write: each tensor's name, dtype and shape, in file order.
struct SafetensorsPlanned {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

struct SafetensorsWriteOptions {
  // 0: one file at the writer's path. Else the path is a folder that gets
  // model-00001-of-0000K.safetensors shards, each at most this many bytes of
  // tensor data (a tensor larger than it alone in its shard), and
  // model.safetensors.index.json, written last. The earlier set's index in
  // the folder is removed before the first shard is renamed, and each shard
  // and the index carry a new kSafetensorsExportIdKey.
  int64_t max_shard_bytes = 0;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
};

// Writes a file (or a sharded set) whose header is fixed from the plan at
// construction, so that tensors are written as they come, in any order, each
// to its place (bounded memory: nothing is held but the caller's tensor).
// Files are written under temporary names beside their final ones and
// renamed by finish(); a writer destroyed before finish() removes them.
// Errors (a name not planned or written twice, a shape or dtype other than
// planned, a full disk, finish() with tensors unwritten) are Errors naming
// the file and the tensor.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsPlanned> plan, SafetensorsWriteOptions options = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // `value` (any device, any strides) in the planned dtype and shape.
  void write(const std::string& name, const at::Tensor& value);
  // Every file fsynced and renamed into place, the index last (its folder
  // fsynced). Returns the bytes written, every file together.
  int64_t finish();
  // The files it writes (final names), the index last where sharded.
  std::vector<std::string> paths() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remat
