#include "engine/export.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/internal/pickle_stream.h"
#include "engine/safetensors.h"
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

// A sharded export's own files: model-00001-of-00003.safetensors, the index.
const std::regex& shard_name() {
  static const std::regex re(R"(model-[0-9]{5}-of-[0-9]{5}\.safetensors)");
  return re;
}
constexpr const char* kIndexName = "model.safetensors.index.json";

// The tensor-parallel layers of `model`, by module name.
std::map<std::string, const parallel::TensorParallelModule*> tensor_parallel_layers(const torch::nn::Module& model) {
  std::map<std::string, const parallel::TensorParallelModule*> layers;
  for (const auto& item : model.named_modules()) {
    if (auto* tp = dynamic_cast<const parallel::TensorParallelModule*>(item.value().get())) layers[item.key()] = tp;
  }
  return layers;
}

// `value` (this rank's share of parameter `name`) whole: gathered by its
// tensor-parallel layer (collective over that group), else itself.
at::Tensor whole_of(const std::map<std::string, const parallel::TensorParallelModule*>& layers,
                    const std::string& name, const at::Tensor& value) {
  const auto dot = name.rfind('.');
  auto layer = layers.find(dot == std::string::npos ? std::string() : name.substr(0, dot));
  return layer == layers.end() ? value : layer->second->gather_full(name.substr(dot + 1), value);
}

// What rank 0 writes tensors into, whatever the format.
class ExportSink {
 public:
  virtual ~ExportSink() = default;
  virtual void write(size_t index, const std::string& name, const at::Tensor& value) = 0;
  virtual int64_t finish() = 0;
};

class PickleSink final : public ExportSink {
 public:
  PickleSink(const std::string& path, std::vector<SafetensorsPlanned> plan) : out_(path, std::move(plan)) {}
  void write(size_t index, const std::string&, const at::Tensor& value) override { out_.write(index, value); }
  int64_t finish() override { return out_.finish(); }

 private:
  internal::PickleStream out_;
};

// A folder export also removes the shards of a previous export that the new
// index does not name (check_export_path allowed nothing else there).
class SafetensorsSink final : public ExportSink {
 public:
  SafetensorsSink(const std::string& path, std::vector<SafetensorsPlanned> plan, SafetensorsWriteOptions options,
                  bool folder)
      : folder_(folder ? path : std::string()), out_(path, std::move(plan), std::move(options)) {}
  void write(size_t, const std::string& name, const at::Tensor& value) override { out_.write(name, value); }
  int64_t finish() override {
    const int64_t bytes = out_.finish();
    if (!folder_.empty()) remove_previous_shards();
    return bytes;
  }

 private:
  void remove_previous_shards() {
    std::set<std::string> kept;
    for (const auto& p : out_.paths()) kept.insert(fs::path(p).filename().string());
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(folder_, ec)) {
      const std::string name = entry.path().filename().string();
      if (std::regex_match(name, shard_name()) && !kept.count(name)) fs::remove(entry.path(), ec);
    }
  }
  std::string folder_;
  SafetensorsWriter out_;
};

// Every parameter's name, whole shape and the export's dtype, in
// named_parameters() order: the file's plan, from shapes alone.
std::vector<SafetensorsPlanned> export_plan(const torch::nn::Module& model, at::ScalarType dtype) {
  std::vector<SafetensorsPlanned> plan;
  for (auto& [name, split] : parallel::parameter_splits(model)) plan.push_back({name, dtype, split.full_sizes});
  return plan;
}

std::unique_ptr<ExportSink> open_sink(const std::string& path, std::vector<SafetensorsPlanned> plan,
                                      at::ScalarType dtype, const ExportOptions& options) {
  const ExportFormat format = export_format(path);
  if (format == ExportFormat::kPickle) return std::make_unique<PickleSink>(path, std::move(plan));
  SafetensorsWriteOptions write;
  write.metadata = options.metadata;
  write.metadata["format"] = "pt";
  write.metadata["remat_dtype"] = dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bf16" : "fp16";
  if (format == ExportFormat::kSafetensorsShards) {
    if (options.max_shard_bytes <= 0) {
      throw ConfigError(str("remat::ExportOptions::max_shard_bytes is ", options.max_shard_bytes,
                            ": give the most bytes a shard may hold (e.g. 5000000000, 5 GB)"));
    }
    write.max_shard_bytes = options.max_shard_bytes;  // the writer makes the folder
  }
  return std::make_unique<SafetensorsSink>(path, std::move(plan), std::move(write),
                                           format == ExportFormat::kSafetensorsShards);
}

}  // namespace

ExportFormat export_format(const std::string& path) {
  if (!path.empty() && path.back() == '/') return ExportFormat::kSafetensorsShards;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return ExportFormat::kSafetensorsShards;
  const std::string ext = ".safetensors";
  if (path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0) {
    return ExportFormat::kSafetensors;
  }
  return ExportFormat::kPickle;
}

std::vector<std::pair<std::string, at::Tensor>> consolidated_parameters(parallel::ZeroModel& zero,
                                                                        const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> params = zero.full_parameters();
  const auto layers = tensor_parallel_layers(model);
  for (auto& [name, value] : params) value = whole_of(layers, name, value).contiguous();
  return params;
}

int64_t write_model_file(const std::string& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& parameters) {
  std::vector<SafetensorsPlanned> plan;
  for (const auto& [name, value] : parameters) plan.push_back({name, value.scalar_type(), value.sizes().vec()});
  internal::PickleStream out(path, std::move(plan));
  for (size_t i = 0; i < parameters.size(); ++i) out.write(i, parameters[i].second.detach());
  return out.finish();
}

int64_t export_model(const std::string& path, parallel::ZeroModel& zero, const torch::nn::Module& model,
                     Communicator& world, at::ScalarType dtype, const ExportOptions& options) {
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
    throw Error(str("remat::export_model: dtype ", c10::toString(dtype), " is not float32, bf16 or fp16"));
  }
  const bool writes = world.rank() == 0;
  // A path the file cannot go to is refused before anything is gathered, on every rank.
  agree_on_outcome(world, "the export's path check", [&] {
    if (writes) check_export_path(path, "remat::Engine::export_model");
  });
  std::vector<SafetensorsPlanned> plan = export_plan(model, dtype);
  std::map<std::string, size_t> index;
  for (const auto& t : plan) index.emplace(t.name, index.size());
  std::unique_ptr<ExportSink> sink;
  agree_on_outcome(world, "the export's start", [&] {
    if (writes) sink = open_sink(path, plan, dtype, options);
  });
  // Rank 0 keeps its first failure and gathers on with the others (it must
  // not leave them waiting in a collective); every rank raises it below.
  std::exception_ptr failed;
  const auto layers = tensor_parallel_layers(model);
  zero.for_each_full_unit([&](parallel::ZeroModel::FullUnit& unit) {
    for (auto& [name, value] : unit) {
      at::Tensor whole = whole_of(layers, name, value);  // collective: every rank
      value = at::Tensor();
      if (!sink || failed) continue;
      try {
        // From the float32 masters, rounded once.
        sink->write(index.at(name), name, whole.to(dtype));
      } catch (...) {
        failed = std::current_exception();
      }
    }
  });
  int64_t bytes = 0;
  // Every rank learns whether rank 0 wrote it, and why not.
  agree_on_outcome(world, "the export", [&] {
    if (failed) std::rethrow_exception(failed);
    if (sink) bytes = sink->finish();
  });
  return bytes;
}

namespace {

// Whether `file` is a shard a remat export wrote: a safetensors header
// (bounded, parsed, never trusted) whose __metadata__ has remat's "remat_dtype".
bool is_remat_shard(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  unsigned char length[8] = {};
  if (!in.read(reinterpret_cast<char*>(length), 8)) return false;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  std::error_code ec;
  const uint64_t size = fs::file_size(file, ec);
  if (ec || n > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes) || n + 8 > size) return false;
  std::string header(n, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) return false;
  const auto json = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  return json.is_object() && json.contains("__metadata__") && json["__metadata__"].is_object() &&
         json["__metadata__"].contains("remat_dtype");
}

// Whether `file` is a remat export's index: its weight_map names shards alone.
bool is_remat_index(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  const auto json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object()) return false;
  for (const auto& item : json["weight_map"].items()) {
    if (!item.value().is_string() || !std::regex_match(item.value().get<std::string>(), shard_name())) return false;
  }
  return true;
}

// What in `folder` is not a previous remat export's ("" when nothing is).
std::string foreign_entry(const fs::path& folder) {
  static const std::regex temporary(R"((model-[0-9]{5}-of-[0-9]{5}\.safetensors|model\.safetensors\.index\.json))"
                                    R"(\.remat-tmp\.[A-Za-z0-9]{6})");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    const bool file = entry.is_regular_file(ec) && !entry.is_symlink(ec);
    if (file && name == kIndexName && is_remat_index(entry.path())) continue;
    if (file && std::regex_match(name, shard_name()) && is_remat_shard(entry.path())) continue;
    if (file && std::regex_match(name, temporary)) continue;
    return name;
  }
  return ec ? str("(unreadable: ", ec.message(), ")") : std::string();
}

// check_export_path for a sharded export's folder.
void check_export_folder(const std::string& path, const std::string& flag) {
  const std::string shown = shown_path(path);
  fs::path folder(path);
  if (!folder.has_filename()) folder = folder.parent_path();  // "export/": the folder "export"
  std::error_code ec;
  std::string probe;
  if (fs::exists(folder, ec)) {
    if (!fs::is_directory(folder, ec)) {
      throw ConfigError(str(flag, " '", shown, "' ends in '/' (a sharded safetensors export's folder) but is not a "
                            "directory: give a folder path, or a file path (model.safetensors, model.pt)"));
    }
    const std::string other = foreign_entry(folder);
    if (!other.empty()) {
      throw ConfigError(str(flag, " '", shown, "' is a folder holding '", other, "', which is not a remat "
                            "safetensors export's: the export would mix its shards with other files. Give a new "
                            "or empty folder, or a file path (model.safetensors, model.pt)"));
    }
    probe = (folder / kIndexName).string();
  } else {
    const fs::path parent = folder.parent_path().empty() ? fs::path(".") : folder.parent_path();
    if (!fs::is_directory(parent, ec)) {
      throw ConfigError(str(flag, " '", shown, "': its folder '", shown_path(parent.string()),
                            "' does not exist: create it, or give a path in an existing folder"));
    }
    probe = folder.string();
  }
  std::string tmp;
  const int fd = open_temporary_beside(probe, tmp);
  if (fd < 0) {
    throw ConfigError(str(flag, " '", shown, "' cannot be written (", std::strerror(errno),
                          "): give a folder in a writable place"));
  }
  ::close(fd);
  ::unlink(tmp.c_str());
}

// Where an export's files go: the folder of a file, a sharded export's
// folder (its parent while it does not exist yet).
std::string written_in(const std::string& path) {
  if (export_format(path) != ExportFormat::kSafetensorsShards) return folder_of(path);
  fs::path folder(path);
  if (!folder.has_filename()) folder = folder.parent_path();
  std::error_code ec;
  if (fs::is_directory(folder, ec)) return folder.string();
  return folder.parent_path().empty() ? std::string(".") : folder.parent_path().string();
}

}  // namespace

void check_export_path(const std::string& path, const std::string& flag) {
  if (!path.empty() && export_format(path) == ExportFormat::kSafetensorsShards) return check_export_folder(path, flag);
  check_output_file({flag, path, "model.safetensors"});
}

int64_t parse_byte_size(const std::string& text, const std::string& flag) {
  static const std::regex form(R"(\s*([0-9]+(\.[0-9]+)?)\s*([KMGT]i?B)?\s*)", std::regex::icase);
  std::smatch m;
  double value = 0;
  if (std::regex_match(text, m, form)) {
    value = std::stod(m[1].str());
    std::string unit = m[3].str();
    for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (!unit.empty()) {
      const bool binary = unit.size() == 3;
      const int power = std::string("KMGT").find(unit[0]) + 1;
      value *= std::pow(binary ? 1024.0 : 1000.0, power);
    }
  }
  if (!(value >= 1) || value > 9.0e18) {
    throw ConfigError(str(flag, " '", text, "' is not a size: give bytes (e.g. 1000000000) or a number with KB, MB, "
                          "GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB or 2GiB"));
  }
  return static_cast<int64_t>(value);
}

void check_export_space(const std::string& path, int64_t bytes) {
  struct statvfs fsinfo {};
  const std::string folder = written_in(path);
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
