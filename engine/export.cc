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
#include <limits>
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

// Whether `path` ends in `tail`, letters compared in any case.
bool ends_with_nocase(const std::string& path, const std::string& tail) {
  if (path.size() <= tail.size()) return false;
  return std::equal(tail.begin(), tail.end(), path.end() - static_cast<std::ptrdiff_t>(tail.size()),
                    [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) ==
                                                std::tolower(static_cast<unsigned char>(b)); });
}

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

void remove_stale_export_temporaries(const std::string& path);  // below

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
  return ends_with_nocase(path, ".safetensors") ? ExportFormat::kSafetensors : ExportFormat::kPickle;
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
    if (!writes) return;
    remove_stale_export_temporaries(path);
    sink = open_sink(path, plan, dtype, options);
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

// What kind of safetensors file `file` is, from its header (bounded, parsed,
// never trusted): kRemat where its __metadata__ has remat's "remat_dtype".
enum class SafetensorsKind { kNone, kOther, kRemat };
SafetensorsKind safetensors_kind(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  unsigned char length[8] = {};
  if (!in.read(reinterpret_cast<char*>(length), 8)) return SafetensorsKind::kNone;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  std::error_code ec;
  const uint64_t size = fs::file_size(file, ec);
  if (ec || n > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes) || n + 8 > size) return SafetensorsKind::kNone;
  std::string header(n, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) return SafetensorsKind::kNone;
  const auto json = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) return SafetensorsKind::kNone;
  const bool remat = json.contains("__metadata__") && json["__metadata__"].is_object() &&
                     json["__metadata__"].contains("remat_dtype");
  return remat ? SafetensorsKind::kRemat : SafetensorsKind::kOther;
}

bool is_remat_shard(const fs::path& file) { return safetensors_kind(file) == SafetensorsKind::kRemat; }

// What an existing file at an export's path is when the export may not
// replace it ("" when it may: empty, a pickle archive, which is a zip, or a
// safetensors file of remat's export), so that nothing else is overwritten
// by a file of another format.
std::string unreplaceable_file(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || fs::file_size(path, ec) == 0 || ec) return "";
  char magic[4] = {};
  std::ifstream(path, std::ios::binary).read(magic, 4);
  if (std::string(magic, 4) == std::string("PK\x03\x04", 4)) return "";
  switch (safetensors_kind(path)) {
    case SafetensorsKind::kRemat:
      return "";
    case SafetensorsKind::kOther:
      return "a safetensors file that remat's export did not write (its __metadata__ has no remat_dtype)";
    default:
      break;
  }
  if (magic[0] == '{' || magic[0] == '[') return "a JSON file";
  return str("a file of ", fs::file_size(path, ec), " bytes that is neither a pickle archive (a zip, which starts "
             "'PK\\x03\\x04') nor a safetensors file of remat's export");
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

// A sharded export's temporary files (the writer's PATH.remat-tmp.XXXXXX
// beside its shards and index): the name it will have in group 1.
const std::regex& folder_temporary() {
  static const std::regex re(R"((model-[0-9]{5}-of-[0-9]{5}\.safetensors|model\.safetensors\.index\.json))"
                             R"(\.remat-tmp\.[A-Za-z0-9]{6})");
  return re;
}

// The temporary files an export at `path` would leave if stopped: beside a
// file path its PATH.remat-tmp.XXXXXX, in a folder those of its shards and
// index; each with its size.
std::vector<std::pair<fs::path, int64_t>> export_temporaries(const std::string& path) {
  std::vector<std::pair<fs::path, int64_t>> found;
  const bool folder = export_format(path) == ExportFormat::kSafetensorsShards;
  const fs::path where = folder ? fs::path(path) : fs::path(folder_of(path));
  const std::string prefix = fs::path(path).filename().string() + ".remat-tmp.";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(where, ec)) {
    const std::string name = entry.path().filename().string();
    const bool mine = folder ? std::regex_match(name, folder_temporary())
                             : name.size() == prefix.size() + 6 && name.compare(0, prefix.size(), prefix) == 0;
    std::error_code size_ec;
    const auto size = entry.file_size(size_ec);
    if (mine && entry.is_regular_file(size_ec) && !entry.is_symlink(size_ec)) {
      found.emplace_back(entry.path(), size_ec ? 0 : static_cast<int64_t>(size));
    }
  }
  return found;
}

// Removes the temporaries of an earlier export at `path` that no writer
// holds (runtime/output_file.h's rule; each removal logged with its bytes).
void remove_stale_export_temporaries(const std::string& path) {
  std::set<std::string> finals;
  for (const auto& [file, bytes] : export_temporaries(path)) {
    const std::string name = file.filename().string();
    finals.insert((file.parent_path() / name.substr(0, name.size() - std::string(".remat-tmp.XXXXXX").size())).string());
  }
  for (const auto& final_path : finals) remove_stale_temporaries(final_path);
}

// What in `folder` is not a previous remat export's ("" when nothing is).
std::string foreign_entry(const fs::path& folder) {
  const std::regex& temporary = folder_temporary();
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
    if (other == "model.safetensors" && is_remat_shard(folder / other)) {
      throw ConfigError(str(flag, " '", shown, "' is a folder holding 'model.safetensors', a single-file export of "
                            "remat's: readers (Hugging Face's from_pretrained, remat's) take it before a sharded "
                            "export's index, so the new shards would not be read. Move it away, or give another "
                            "folder"));
    }
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
  const std::string shown = shown_path(path);
  if (ends_with_nocase(path, ".json")) {
    throw ConfigError(str(flag, " '", shown, "' ends in .json: an export writes weights, never an index alone. "
                          "For a sharded safetensors export give its folder (e.g. '", shown_path(folder_of(path)),
                          "/'); for one file, a *.safetensors path or a pickle's (model.pt)"));
  }
  check_output_file({flag, path, "model.safetensors"});
  const std::string what = unreplaceable_file(path);
  if (!what.empty()) {
    throw ConfigError(str(flag, " '", shown, "' exists and is ", what, ": the export would overwrite it with ",
                          export_format(path) == ExportFormat::kPickle ? "a pickle archive" : "a safetensors file",
                          ". Move it away, or give another path"));
  }
  // A file in a sharded export's folder: readers (from_pretrained, remat's)
  // take a model.safetensors there before the index, and the next export of
  // the folder would refuse the file as not its own.
  std::error_code ec;
  const fs::path folder(folder_of(path));
  if (fs::exists(folder / kIndexName, ec)) {
    throw ConfigError(str(flag, " '", shown, "' is in '", shown_path(folder.string()), "', which holds ", kIndexName,
                          ", a sharded export: a file there would be read instead of its shards (model.safetensors "
                          "comes first for Hugging Face's from_pretrained and remat) or make the folder refused by "
                          "its next export. Give a path outside that folder, or the folder itself for shards"));
  }
}

int64_t parse_byte_size(const std::string& text, const std::string& flag) {
  static const std::regex form(R"(\s*([0-9]+)(\.([0-9]+))?\s*(([KMGTPE])(i?)B)?\s*)", std::regex::icase);
  const std::string forms = "give bytes (e.g. 1000000000) or a number with KB, MB, GB, TB (powers of 1000) or KiB, "
                            "MiB, GiB, TiB (powers of 1024), e.g. 5GB, 1.5GB or 2GiB";
  std::smatch m;
  if (!std::regex_match(text, m, form)) throw ConfigError(str(flag, " '", text, "' is not a size: ", forms));
  // Exactly: digits * unit / 10^(fraction digits), in 128 bits.
  const std::string digits = m[1].str() + m[3].str();
  const size_t fraction = m[3].length();
  const __int128 kMax = std::numeric_limits<int64_t>::max();
  const std::string too_large = str(flag, " '", text, "' is too large: a size is at most ", static_cast<int64_t>(kMax),
                                    " bytes (8 EiB less one); give a smaller size");
  if (fraction > 18) throw ConfigError(str(flag, " '", text, "' has more than 18 decimals; ", forms));
  __int128 value = 0, unit = 1, scale = 1;
  for (char c : digits) {
    value = value * 10 + (c - '0');
    if (value > kMax * 1'000'000'000'000'000'000) throw ConfigError(too_large);  // past any scale's reach
  }
  for (size_t i = 0; i < fraction; ++i) scale *= 10;
  if (m[5].matched) {
    const int power = static_cast<int>(std::string("KMGTPE").find(static_cast<char>(std::toupper(m[5].str()[0])))) + 1;
    for (int i = 0; i < power; ++i) unit *= m[6].length() ? 1024 : 1000;
  }
  if (value == 0) throw ConfigError(str(flag, " '", text, "' is zero: a size must be positive; ", forms));
  if (value > kMax * scale / unit + 1) throw ConfigError(too_large);
  const __int128 bytes = value * unit;  // <= (kMax * scale + unit) : fits
  if (bytes % scale != 0) {
    throw ConfigError(str(flag, " '", text, "' is not a whole number of bytes (it is ",
                          static_cast<double>(bytes) / static_cast<double>(scale),
                          "): give a size that is, e.g. 1.5KB (1500 bytes)"));
  }
  if (bytes / scale > kMax) throw ConfigError(too_large);
  return static_cast<int64_t>(bytes / scale);
}

void check_export_space(const std::string& path, int64_t bytes) {
  // An earlier export stopped half-way left its temporaries (their whole size
  // reserved): they are not counted against this one.
  remove_stale_export_temporaries(path);
  struct statvfs fsinfo {};
  const std::string folder = written_in(path);
  if (::statvfs(folder.c_str(), &fsinfo) != 0) return;  // unknown: the write will tell
  const int64_t free_bytes = static_cast<int64_t>(fsinfo.f_bavail) * static_cast<int64_t>(fsinfo.f_frsize);
  if (free_bytes < bytes) {
    std::string held;
    int64_t held_bytes = 0;
    const auto left = export_temporaries(path);
    for (const auto& [file, size] : left) {
      held_bytes += size;
      if (held.size() < 400) held += str(held.empty() ? "" : ", ", "'", shown_path(file.string()), "'");
    }
    if (!left.empty()) {
      held = str(" (and ", left.size(), " temporary files of an export there, which remat did not remove because a "
                 "process holds them or they have other names, take ", held_bytes, " bytes: ", held, ")");
    }
    throw ConfigError(str("export file '", path, "' needs about ", bytes, " bytes (", (bytes + 1023) / 1024,
                          " KiB) but '", folder, "' has ", free_bytes, " bytes (", free_bytes / 1024, " KiB) free",
                          held, ": free space there, or export to a disk with room"));
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
