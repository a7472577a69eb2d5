#include "engine/train_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <set>
#include <thread>

#include "engine/optim.h"
#include "parallel/layers.h"
#include "rng/rng_state_io.h"
#include "rng/rng_tracker.h"
#include "runtime/communicator.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/outcome.h"

namespace remat {
namespace fs = std::filesystem;

namespace {

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes `bytes` to `path` atomically: temporary file, flush, fsync, rename.
void write_atomically(const std::string& path, const std::string& bytes) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(str("save: cannot write '", tmp, "': check that the save directory is writable"));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw Error(str("save: writing '", tmp, "' failed (disk full?)"));
  }
  fsync_path(tmp, false);
  if (auto pause = knobs::fault_save_pause()) std::this_thread::sleep_for(*pause);
  fs::rename(tmp, path);
  fsync_path(fs::path(path).parent_path().string(), true);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(str("resume: cannot read '", path, "' (", std::strerror(errno), ")"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string step_folder(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

int64_t crc32_of(const std::string& bytes) {
  return static_cast<int64_t>(
      ::crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

// The step a folder name "step_00000010" stands for, or -1.
int64_t step_of(const std::string& name) {
  if (name.size() <= 5 || name.rfind("step_", 0) != 0) return -1;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos || name.size() > 5 + 18) return -1;
  return std::stoll(name.substr(5));
}

// The step folders under `root`, newest first.
std::vector<std::pair<int64_t, fs::path>> step_folders(const std::string& root) {
  std::vector<std::pair<int64_t, fs::path>> folders;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && entry.is_directory(ec)) folders.emplace_back(step, entry.path());
  }
  std::sort(folders.begin(), folders.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return folders;
}

// The save root a step folder lies in.
std::string root_of(const std::string& folder) {
  fs::path p(folder);
  if (p.filename().empty()) p = p.parent_path();  // "root/step_00000004/"
  return p.parent_path().string();
}

// Formats of the manifest and the rank files this remat writes and reads: 3
// adds the manifest's own checksum and each rank file's ranks and layout, 4
// the parameters and client state, 5 each parameter's tensor-parallel split
// (a format 4 save resumes at its own tensor-parallel size only).
constexpr int64_t kFormat = 5;
constexpr int64_t kOldestFormat = 4;

using Splits = std::vector<std::pair<std::string, parallel::TensorSplit>>;

// [[name, {"split": "column", "dim": 0, "stride": 3, "shape": [48, 16]}], ...]
nlohmann::json splits_json(const Splits& splits) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [name, split] : splits) {
    out.push_back({name,
                   {{"split", parallel::split_kind_name(split.kind)},
                    {"dim", split.dim},
                    {"stride", split.stride},
                    {"shape", split.full_sizes}}});
  }
  return out;
}

// What splits_json wrote, or nullopt when `j` is not that.
std::optional<Splits> parse_splits(const nlohmann::json& j) {
  if (!j.is_array()) return std::nullopt;
  Splits out;
  for (const auto& entry : j) {
    if (!entry.is_array() || entry.size() != 2 || !entry[0].is_string() || !entry[1].is_object()) return std::nullopt;
    const auto& o = entry[1];
    if (!o.contains("split") || !o["split"].is_string() || !o.contains("dim") || !o["dim"].is_number_integer() ||
        !o.contains("stride") || !o["stride"].is_number_integer() || !o.contains("shape") || !o["shape"].is_array()) {
      return std::nullopt;
    }
    const auto kind = parallel::split_kind_from_name(o["split"].get<std::string>());
    if (!kind) return std::nullopt;
    parallel::TensorSplit split{*kind, o["dim"].get<int64_t>(), o["stride"].get<int64_t>(), {}};
    for (const auto& d : o["shape"]) {
      if (!d.is_number_integer()) return std::nullopt;
      split.full_sizes.push_back(d.get<int64_t>());
    }
    try {
      parallel::check_split(split);
    } catch (const Error&) {
      return std::nullopt;
    }
    out.emplace_back(entry[0].get<std::string>(), std::move(split));
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& sizes) { return str(c10::IntArrayRef(sizes)); }

struct Manifest;
Manifest read_manifest(const std::string& path);
bool save_verifies(const fs::path& folder);

// The newest step folder under `root` other than `skip` whose manifest and
// every rank file verify (sizes and CRC-32s), or "".
std::string newest_intact_step(const std::string& root, const std::string& skip) {
  const fs::path skipped = fs::path(skip).lexically_normal();
  for (const auto& [step, folder] : step_folders(root)) {
    if (!skip.empty() && folder.lexically_normal() == skipped) continue;
    if (save_verifies(folder)) return folder.string();
  }
  return "";
}

// The sentence an error about a save in `root` ends with: the newest save
// (other than the broken `skip`) that can be resumed.
std::string offer_newest(const std::string& root, const std::string& skip = "") {
  const std::string newest = newest_intact_step(root, skip);
  return newest.empty() ? str(" No ", skip.empty() ? "" : "other ", "save in '", root,
                              "' verifies (a manifest and every rank file intact).")
                        : str(" The newest intact save is '", newest, "' (its manifest and every rank file "
                              "verify): load it with Engine::load_checkpoint(\"", newest, "\").");
}

// The step folder to load: `dir` itself when it holds a manifest, else the
// one its `latest` names.
std::string resolve_save(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "manifest.json")) return dir;
  if (!fs::exists(dir)) {
    throw ConfigError(str("resume: '", dir, "' does not exist: pass a folder written by Engine::save_checkpoint"));
  }
  if (!fs::is_directory(dir)) {
    throw ConfigError(str("resume: '", dir, "' is not a folder: pass a save root or a step folder"));
  }
  const fs::path latest_path = fs::path(dir) / "latest";
  if (!fs::exists(latest_path)) {
    throw ConfigError(str("resume: '", dir, "' holds no manifest.json and no 'latest' file.",
                          offer_newest(dir)));
  }
  std::string latest = read_file(latest_path.string());
  latest.erase(latest.find_last_not_of(" \n\r\t") + 1);
  const fs::path folder = fs::path(dir) / latest;
  if (latest.empty() || latest.find('/') != std::string::npos || !fs::exists(folder / "manifest.json")) {
    throw ConfigError(str("resume: '", latest_path.string(), "' names '", latest, "', which ",
                          fs::exists(folder) ? "holds no manifest.json (an interrupted save)"
                                             : "does not exist",
                          ".", offer_newest(dir)));
  }
  return folder.string();
}

// A manifest read with its checksum and every field checked: a hand-edited
// or damaged one is an error naming manifest.json.
struct Manifest {
  int64_t format = 1;  // 2: rank files hold shards with their layout here
  int64_t step = 0;
  int64_t world_size = 0;
  int64_t tp_size = 1, dp_size = 0;
  std::string model;
  std::string run_id;  // empty: saved before run ids were recorded
  std::map<std::string, std::string> settings;
  // The model's parameters as [name, shape] pairs (format 4), the shapes of
  // the saved tensor-parallel size's shares.
  nlohmann::json parameters = nlohmann::json::array();
  // Each parameter's tensor-parallel split (format 5; empty before).
  Splits splits;
  std::string client_state = "{}";  // JSON text (format 4)
  struct File {
    std::string name;
    int64_t bytes = -1, crc32 = -1;  // -1: not recorded (an older save)
    int64_t tp_rank = 0, dp_rank = 0;
    std::vector<parallel::ShardLayout> tensors;  // what each saved tensor holds
  };
  std::vector<File> files;
};

Manifest read_manifest(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(str("resume: '", path, "' is not valid JSON (", e.what(),
                          "): the manifest was edited or damaged; resume from another step"));
  }
  auto bad = [&](const std::string& key, const char* want) {
    return ConfigError(str("resume: '", path, "': '", key, "' must be ", want,
                           "; the manifest was edited or damaged"));
  };
  if (!j.is_object()) throw bad("the top level", "an object");
  auto integer = [&](const nlohmann::json& o, const char* key, const std::string& where) {
    if (!o.contains(key) || !o[key].is_number_integer()) throw bad(where + key, "an integer");
    return o[key].get<int64_t>();
  };
  Manifest m;
  if (j.contains("format")) m.format = integer(j, "format", "");
  if (m.format >= 3) {
    // Its own checksum first: any edit, even one that keeps every field
    // well-formed (two parameter names swapped), stops here.
    if (!j.contains("manifest_crc32") || !j["manifest_crc32"].is_number_integer()) {
      throw ConfigError(str("resume: '", path, "' records no manifest_crc32 (its checksum): it was "
                            "modified or damaged after it was saved; remat resumes only from an unmodified "
                            "manifest"));
    }
    const int64_t recorded = j["manifest_crc32"].get<int64_t>();
    j.erase("manifest_crc32");
    const int64_t actual = crc32_of(j.dump());
    if (actual != recorded) {
      throw ConfigError(str("resume: '", path, "' was modified or damaged after it was saved: its content has "
                            "CRC-32 ", actual, " but it records ", recorded,
                            ". remat resumes only from an unmodified manifest; restore it from a copy or "
                            "resume from another step"));
    }
  }
  m.step = integer(j, "step", "");
  m.world_size = integer(j, "world_size", "");
  if (!j.contains("model") || !j["model"].is_string()) throw bad("model", "a string");
  m.model = j["model"].get<std::string>();
  if (j.contains("run_id")) {
    if (!j["run_id"].is_string()) throw bad("run_id", "a string");
    m.run_id = j["run_id"].get<std::string>();
  }
  if (j.contains("settings")) {
    if (!j["settings"].is_object()) throw bad("settings", "an object of strings");
    for (const auto& [key, value] : j["settings"].items()) {
      if (!value.is_string()) throw bad("settings." + key, "a string");
      m.settings[key] = value.get<std::string>();
    }
  }
  if (j.contains("parameters")) {
    if (!j["parameters"].is_array()) throw bad("parameters", "an array of [name, shape] pairs");
    m.parameters = j["parameters"];
  }
  if (j.contains("client_state")) m.client_state = j["client_state"].dump();
  if (m.format >= 5) {
    const auto splits = j.contains("splits") ? parse_splits(j["splits"]) : std::nullopt;
    if (!splits) {
      throw bad("splits", "an array of [name, {split, dim, stride, shape}] pairs, one per model parameter");
    }
    m.splits = *splits;
  }
  if (!j.contains("files") || !j["files"].is_array()) throw bad("files", "an array");
  if (m.format >= 2) {
    m.tp_size = integer(j, "tp_size", "");
    m.dp_size = integer(j, "dp_size", "");
  }
  for (const auto& f : j["files"]) {
    Manifest::File file;
    if (f.is_string()) {
      file.name = f.get<std::string>();
    } else if (f.is_object() && f.contains("name") && f["name"].is_string()) {
      file.name = f["name"].get<std::string>();
      file.bytes = integer(f, "bytes", "files[].");
      file.crc32 = integer(f, "crc32", "files[].");
    } else {
      throw bad("files[]", "a {name, bytes, crc32} object");
    }
    if (m.format >= 2) {
      file.tp_rank = integer(f, "tp_rank", "files[].");
      file.dp_rank = integer(f, "dp_rank", "files[].");
      if (!f.contains("tensors") || !f["tensors"].is_array()) throw bad("files[].tensors", "an array");
      for (const auto& t : f["tensors"]) {
        if (!t.is_array()) throw bad("files[].tensors[]", "an array of [name, parameter offset, offset, length]");
        parallel::ShardLayout layout;
        for (const auto& seg : t) {
          if (!seg.is_array() || seg.size() != 4 || !seg[0].is_string() || !seg[1].is_number_integer() ||
              !seg[2].is_number_integer() || !seg[3].is_number_integer() || seg[3].get<int64_t>() < 0) {
            throw bad("files[].tensors[][]", "[name, parameter offset, offset, length]");
          }
          layout.segments.push_back({seg[0].get<std::string>(), seg[1].get<int64_t>(), seg[2].get<int64_t>(),
                                     seg[3].get<int64_t>()});
        }
        file.tensors.push_back(std::move(layout));
      }
    }
    m.files.push_back(file);
  }
  if (m.world_size < 1 || static_cast<int64_t>(m.files.size()) != m.world_size) {
    throw bad("files", str("one entry per rank (world_size ", m.world_size, ")").c_str());
  }
  if (m.format >= 2 && (m.tp_size < 1 || m.dp_size < 1 || m.tp_size * m.dp_size != m.world_size)) {
    throw bad("tp_size", "a divisor of world_size with dp_size = world_size / tp_size");
  }
  return m;
}

bool save_verifies(const fs::path& folder) {
  try {
    const Manifest m = read_manifest((folder / "manifest.json").string());
    if (m.format < kOldestFormat || m.format > kFormat) return false;
    for (const auto& file : m.files) {
      const std::string bytes = read_file((folder / file.name).string());
      if (static_cast<int64_t>(bytes.size()) != file.bytes || crc32_of(bytes) != file.crc32) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

std::string new_run_id(Communicator& world) {
  constexpr int64_t kLength = 64;
  at::Tensor bytes = at::zeros({kLength}, at::kLong);
  if (world.rank() == 0) {
    const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    const std::string id = str(host_name(), "-", ::getpid(), "-", now).substr(0, kLength - 1);
    for (size_t i = 0; i < id.size(); ++i) bytes[static_cast<int64_t>(i)] = static_cast<int64_t>(id[i]);
  }
  if (world.size() > 1) world.broadcast(bytes, {0})->wait();
  std::string id;
  for (int64_t i = 0; i < kLength && bytes[i].item<int64_t>() != 0; ++i) {
    id.push_back(static_cast<char>(bytes[i].item<int64_t>()));
  }
  return id;
}

int64_t latest_step(const std::string& dir) {
  const fs::path path = fs::path(dir) / "latest";
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(path, ec))) return -1;
  std::ifstream in(path);
  std::string name;
  in >> name;
  const int64_t step = step_of(name);
  return step >= 0 && fs::is_directory(fs::path(dir) / name, ec) ? step : -1;
}

namespace {

// What a save root must not hold at the start of a run (rank 0, under the lock).
void check_save_root(const std::string& dir, const SaveDirOptions& options) {
  // `latest` is replaced (renamed over) at every save: anything but a
  // regular file there would fail the first save, after training.
  const fs::path latest = fs::path(dir) / "latest";
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(latest, ec);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    throw ConfigError(str("save folder '", dir, "': '", latest.string(), "' is ",
                          fs::is_directory(status)  ? "a directory"
                          : fs::is_symlink(status)  ? "a symbolic link"
                                                    : "not a regular file",
                          ", where remat keeps the name of the latest save (a one-line file it replaces at "
                          "every save): move it away, or give another save folder"));
  }
  // Another run's saves are not overwritten unless asked: a new run would
  // replace its step folders one by one and leave `latest` on its last.
  const auto saves = step_folders(dir);
  if (!options.resuming && !options.overwrite && (!saves.empty() || fs::exists(status))) {
    const int64_t newest = latest_step(dir);
    throw ConfigError(str("save folder '", dir, "' holds the saves of another run (",
                          saves.size(), " step folder(s)",
                          newest >= 0 ? str(", latest step ", newest) : std::string(),
                          "): a new run would overwrite them. Resume that run with Engine::load_checkpoint(\"", dir,
                          "\"), give this run another save folder, or pass SaveDirOptions::overwrite = true to "
                          "Engine::use_save_dir to replace them"));
  }
}

// This rank's part of SaveDirLock's constructor: checks every rank makes;
// rank 0 locks (into `fd`) and checks what the folder holds.
void take_save_dir(const std::string& dir, const std::string& run_id, Communicator& world,
                   const SaveDirOptions& options, int& fd) {
  // Every rank writes its files there: each checks it can, before training.
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw ConfigError(str("save folder '", dir, "' cannot be created (",
                          ec ? ec.message() : "a file of that name exists",
                          "): give a writable folder"));
  }
  const std::string probe = (fs::path(dir) / str(".probe_rank_", world.rank())).string();
  {
    std::ofstream out(probe, std::ios::trunc);
    out << run_id << "\n";
    out.flush();
    if (!out) {
      throw ConfigError(str("save folder '", dir, "' is not writable (", std::strerror(errno),
                            "): give a folder this job can write, or fix its permissions"));
    }
  }
  fs::remove(probe, ec);
  if (world.rank() == 0) {
    const std::string path = (fs::path(dir) / ".lock").string();
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw ConfigError(str("save folder '", dir, "': cannot create '", path, "' (", std::strerror(errno), ")"));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      std::string holder(256, '\0');
      const ssize_t n = ::pread(fd, holder.data(), holder.size() - 1, 0);
      holder.resize(n > 0 ? static_cast<size_t>(n) : 0);
      holder.erase(holder.find_last_not_of(" \n") + 1);
      ::close(fd);
      fd = -1;
      throw ConfigError(str("save folder '", dir, "' is in use by another job (",
                            holder.empty() ? std::string("its lock holder is unknown") : holder,
                            "): two jobs saving to one folder overwrite each other; give this one "
                            "another save folder, or wait for the other to end"));
    }
    const std::string me = str("pid ", ::getpid(), " on ", host_name(), ", run ", run_id, "\n");
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
      log().warn("save folder '{}': could not record this job in its lock file", dir);
    }
    check_save_root(dir, options);
  }
}

}  // namespace

SaveDirLock::SaveDirLock(const std::string& dir, const std::string& run_id, Communicator& world,
                         SaveDirOptions options) {
  // Every rank checks, rank 0 locks; then the ranks agree, so a folder one
  // rank cannot use is the same error on every rank (none waits for it).
  try {
    agree_on_outcome(world, "the save folder check", [&] { take_save_dir(dir, run_id, world, options, fd_); });
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SaveDirLock::~SaveDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

int discard_saves_after(const std::string& dir, int64_t step, Communicator& world, int64_t except) {
  int64_t removed = 0;
  if (world.rank() == 0) {
    std::string keep;  // the newest complete save kept
    for (const auto& [s, folder] : step_folders(dir)) {
      if (s > step && s != except) {
        fs::remove_all(folder);
        ++removed;
      } else if (keep.empty() && fs::exists(folder / "manifest.json")) {
        keep = folder.filename().string();
      }
    }
    const fs::path latest = fs::path(dir) / "latest";
    std::error_code ec;
    const int64_t named = latest_step(dir);
    if (named < 0 || (named > step && named != except)) {
      if (keep.empty()) {
        fs::remove(latest, ec);
      } else {
        write_atomically(latest.string(), keep + "\n");
      }
    }
    if (removed > 0) {
      log().warn("--overwrite-saves: removed {} save(s) after step {} from '{}'; 'latest' {}", removed, step, dir,
                 keep.empty() ? std::string("removed") : "names " + keep);
    }
  }
  at::Tensor count = at::full({1}, removed, at::kLong);
  if (world.size() > 1) world.broadcast(count, {0})->wait();
  world.barrier()->wait();
  return static_cast<int>(count.item<int64_t>());
}

namespace {

// Each rank's `mine`, on every rank (collective over `world`).
std::vector<std::string> gather_text(const std::string& mine, Communicator& world) {
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  at::Tensor lengths = at::empty({world.size()}, at::kLong);
  world.allGather(lengths, length)->wait();
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world.size() * longest}, at::kByte);
  world.allGather(all, bytes)->wait();
  std::vector<std::string> out;
  const char* data = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < world.size(); ++r) out.emplace_back(data + r * longest, lengths[r].item<int64_t>());
  return out;
}

nlohmann::json layout_json(const std::vector<parallel::ShardLayout>& layout) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : layout) {
    nlohmann::json segments = nlohmann::json::array();
    for (const auto& s : t.segments) segments.push_back({s.name, s.param_offset, s.shard_offset, s.length});
    tensors.push_back(segments);
  }
  return tensors;
}

// Rank file keys: "t<i>" a tensor's values, "t<i>__<field>" its optimizer state.
nlohmann::json parameters_json(const std::vector<std::pair<std::string, std::vector<int64_t>>>& parameters) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [name, shape] : parameters) out.push_back({name, shape});
  return out;
}

std::string tensor_key(size_t i) { return str("t", i); }
std::string state_key(size_t i, const std::string& field) { return str("t", i, "__", field); }

// One rank file, read, verified against the manifest and parsed.
struct RankFile {
  std::string path;
  torch::serialize::InputArchive archive, tensors;
  std::map<std::string, std::vector<std::string>> fields;  // tensor key -> optimizer state fields saved
};

std::unique_ptr<RankFile> open_rank_file(const std::string& folder, const Manifest& manifest, size_t index) {
  const auto& entry = manifest.files[index];
  auto file = std::make_unique<RankFile>();
  file->path = (fs::path(folder) / entry.name).string();
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(file->path, ec))) {
    throw ConfigError(str("resume: '", file->path, "' is missing: the manifest of the step ", manifest.step,
                          " save in '", folder, "' lists it as the file of rank ", index, " of ",
                          manifest.world_size, " but it is not there (deleted, or not copied with the "
                          "folder). Put it back, or resume from another step.",
                          offer_newest(root_of(folder), folder)));
  }
  const std::string bytes = read_file(file->path);
  const int64_t crc = crc32_of(bytes);
  if (static_cast<int64_t>(bytes.size()) != entry.bytes || crc != entry.crc32) {
    // Intact but another rank's file of this save (renamed or swapped by hand): not damage.
    const auto other = std::find_if(manifest.files.begin(), manifest.files.end(), [&](const auto& f) {
      return f.bytes == static_cast<int64_t>(bytes.size()) && f.crc32 == crc;
    });
    if (other != manifest.files.end()) {
      throw ConfigError(str("resume: '", file->path, "' is intact but holds the file the manifest lists as '",
                            other->name, "' (rank ", other - manifest.files.begin(), "; same ", bytes.size(),
                            " bytes and CRC-32 ", crc, "), not rank ", index,
                            "'s: the rank files of this save were renamed or swapped. Give each its own name "
                            "back (this one is '", other->name, "'), or resume from another step.", offer_newest(root_of(folder), folder)));
    }
    throw ConfigError(str("resume: '", file->path, "' is damaged: ", bytes.size(), " bytes with CRC-32 ", crc,
                          " where the manifest recorded ", entry.bytes, " bytes with CRC-32 ", entry.crc32,
                          ". It changed after it was saved; resume from another step.",
                          offer_newest(root_of(folder), folder)));
  }
  try {
    std::istringstream in(bytes);
    file->archive.load_from(in);
    c10::IValue step, rank, run_id, world_size, tp_rank, dp_rank, layout;
    file->archive.read("step", step);
    file->archive.read("rank", rank);
    file->archive.read("world_size", world_size);
    file->archive.read("run_id", run_id);
    file->archive.read("tp_rank", tp_rank);
    file->archive.read("dp_rank", dp_rank);
    file->archive.read("layout", layout);
    // The file's own ranks and layout: a manifest edited to describe it
    // otherwise (and its checksum recomputed) stops here.
    const nlohmann::json own = nlohmann::json::parse(layout.toStringRef()), listed = layout_json(entry.tensors);
    if (tp_rank.toInt() != entry.tp_rank || dp_rank.toInt() != entry.dp_rank || own != listed) {
      std::string differs = str("tensor-parallel rank ", tp_rank.toInt(), " and data-parallel rank ",
                                dp_rank.toInt(), " where it lists ", entry.tp_rank, " and ", entry.dp_rank);
      for (size_t i = 0; i < std::max(own.size(), listed.size()); ++i) {
        const nlohmann::json a = i < own.size() ? own[i] : nlohmann::json();
        const nlohmann::json b = i < listed.size() ? listed[i] : nlohmann::json();
        if (a != b) {
          differs = str("saved tensor ", i, " holding the [name, parameter offset, offset, length] segments ",
                        a.dump(), " where it lists ", b.dump());
          break;
        }
      }
      throw ConfigError(str("resume: '", file->path, "' records ", differs, ": '",
                            (fs::path(folder) / "manifest.json").string(),
                            "' was modified or damaged after it was saved; resume from another step.",
                            offer_newest(root_of(folder), folder)));
    }
    // Its record of the tensor-parallel splits (format 5) is the manifest's.
    if (manifest.format >= 5) {
      c10::IValue splits;
      file->archive.read("splits", splits);
      const nlohmann::json own = nlohmann::json::parse(splits.toStringRef()), listed = splits_json(manifest.splits);
      for (size_t i = 0; i < std::max(own.size(), listed.size()); ++i) {
        const nlohmann::json a = i < own.size() ? own[i] : nlohmann::json();
        const nlohmann::json b = i < listed.size() ? listed[i] : nlohmann::json();
        if (a == b) continue;
        throw ConfigError(str("resume: '", file->path, "' records the tensor-parallel split ", a.dump(), " where '",
                              (fs::path(folder) / "manifest.json").string(), "' lists ", b.dump(),
                              ": the manifest was modified or damaged after it was saved; resume from another step.",
                              offer_newest(root_of(folder), folder)));
      }
    }
    // Files from another step, rank, world size or run (copied or swapped by
    // hand) stop here.
    if (step.toInt() != manifest.step || world_size.toInt() != manifest.world_size ||
        rank.toInt() != static_cast<int64_t>(index) ||
        (!manifest.run_id.empty() && run_id.toStringRef() != manifest.run_id)) {
      // Only what differs is named ("step 8 ... step 8" says nothing).
      std::vector<std::string> differs;
      if (step.toInt() != manifest.step) differs.push_back(str("step ", step.toInt(), " (not ", manifest.step, ")"));
      if (world_size.toInt() != manifest.world_size) {
        differs.push_back(str("a save of ", world_size.toInt(), " ranks (not ", manifest.world_size, ")"));
      }
      if (!manifest.run_id.empty() && run_id.toStringRef() != manifest.run_id) {
        differs.push_back(str("run ", run_id.toStringRef(), " (not ", manifest.run_id, ")"));
      }
      std::string what;
      for (const auto& d : differs) what += (what.empty() ? "" : ", ") + d;
      throw ConfigError(str(
          "resume: '", file->path, "' holds rank ", rank.toInt(), "'s state", what.empty() ? "" : " of ", what,
          " but the manifest of '", folder, "' (step ", manifest.step, ") lists it as rank ", index, "'s",
          differs.empty() ? ": the rank files of this save were renamed or swapped. Give each its own name back, "
                            "or resume from another step"
                          : ": the folder mixes files of different saves; resume from a folder written as a "
                            "whole by Engine::save_checkpoint"));
    }
    file->archive.read("tensors", file->tensors);
    for (const std::string& key : file->tensors.keys()) {
      const auto sep = key.find("__");
      if (sep != std::string::npos) file->fields[key.substr(0, sep)].push_back(key.substr(sep + 2));
    }
  } catch (const c10::Error& e) {
    throw ConfigError(str("resume: '", file->path, "' is intact but not a remat rank file this version reads (",
                          e.what_without_backtrace(), ")"));
  }
  return file;
}

// Elements to copy from a saved tensor into one of this rank's.
struct Copy {
  size_t file, source;
  int64_t source_offset;
  size_t target;
  int64_t target_offset, length;
};

// A save of another model is refused naming what differs: each parameter's
// whole shape (format 5, any tensor-parallel size), and at the saved
// tensor-parallel size each share's shape (identity.parameters).
void check_same_model(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                      const SaveIdentity& identity) {
  if (!manifest.splits.empty() && !shards.splits.empty()) {
    const Splits& theirs = manifest.splits;
    const Splits& mine = shards.splits;
    std::string differs;
    for (size_t i = 0; i < std::max(mine.size(), theirs.size()) && differs.empty(); ++i) {
      if (i >= theirs.size()) {
        differs = str("this model has parameter '", mine[i].first, "' (", shape_text(mine[i].second.full_sizes),
                      ") which the saved one has not");
      } else if (i >= mine.size()) {
        differs = str("the saved model has parameter '", theirs[i].first, "' (",
                      shape_text(theirs[i].second.full_sizes), ") which this one has not");
      } else if (mine[i].first != theirs[i].first) {
        differs = str("its parameter ", i, " is '", theirs[i].first, "' where this model's is '", mine[i].first, "'");
      } else if (mine[i].second.full_sizes != theirs[i].second.full_sizes) {
        differs = str("parameter '", mine[i].first, "' has the whole shape ", shape_text(theirs[i].second.full_sizes),
                      " in the save but ", shape_text(mine[i].second.full_sizes), " in this model");
      }
    }
    if (!differs.empty()) {
      throw ConfigError(str("resume: the save in '", folder, "' holds another model: ", differs,
                            "; resume with the model settings it was saved with"));
    }
  }
  if (manifest.tp_size != shards.tp_size || identity.parameters.empty() ||
      manifest.parameters == parameters_json(identity.parameters)) {
    return;
  }
  const nlohmann::json mine = parameters_json(identity.parameters);
  const auto& theirs = manifest.parameters;
  std::string differs;
  for (size_t i = 0; i < std::max(mine.size(), theirs.size()) && differs.empty(); ++i) {
    if (i >= theirs.size()) {
      differs = str("this model has parameter ", mine[i].dump(), " which the saved one has not");
    } else if (i >= mine.size()) {
      differs = str("the saved model has parameter ", theirs[i].dump(), " which this one has not");
    } else if (mine[i] != theirs[i]) {
      differs = str("its parameter ", i, " is ", theirs[i].dump(), " where this model's is ", mine[i].dump());
    }
  }
  throw ConfigError(str("resume: the save in '", folder, "' holds another model: ", differs,
                        " ([name, shape]); load it into the model it was saved from"));
}

// Where the saved segments of each parameter lie.
struct Source {
  size_t file, tensor;
  int64_t param_offset, offset, length;
};
std::map<std::string, std::vector<Source>> sources_by_name(const Manifest& manifest,
                                                           const std::vector<size_t>& candidates) {
  std::map<std::string, std::vector<Source>> by_name;
  for (size_t f : candidates) {
    const auto& tensors = manifest.files[f].tensors;
    for (size_t j = 0; j < tensors.size(); ++j) {
      for (const auto& s : tensors[j].segments) by_name[s.name].push_back({f, j, s.param_offset, s.shard_offset, s.length});
    }
  }
  return by_name;
}

// The same tensor-parallel size: a parameter's flattened share is indexed
// alike in the save and here, so each of this rank's segments is filled by
// ranges of the saved segments of its tensor-parallel rank (the first file
// holding an element provides it).
std::vector<Copy> same_split_copies(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                                    const std::vector<size_t>& candidates) {
  const auto by_name = sources_by_name(manifest, candidates);
  std::vector<Copy> copies;
  for (size_t i = 0; i < shards.layout.size(); ++i) {
    for (const auto& seg : shards.layout[i].segments) {
      std::vector<std::pair<int64_t, int64_t>> open{{seg.param_offset, seg.param_offset + seg.length}};
      auto found = by_name.find(seg.name);
      if (found != by_name.end()) {
        for (const auto& src : found->second) {
          std::vector<std::pair<int64_t, int64_t>> still;
          for (const auto& [lo, hi] : open) {
            const int64_t a = std::max(lo, src.param_offset), b = std::min(hi, src.param_offset + src.length);
            if (a >= b) {
              still.emplace_back(lo, hi);
              continue;
            }
            copies.push_back({src.file, src.tensor, src.offset + a - src.param_offset, i,
                              seg.shard_offset + a - seg.param_offset, b - a});
            if (lo < a) still.emplace_back(lo, a);
            if (b < hi) still.emplace_back(b, hi);
          }
          open = std::move(still);
          if (open.empty()) break;
        }
      }
      if (!open.empty()) {
        throw ConfigError(str("resume: the save in '", folder, "' holds no values for elements [", open[0].first,
                              ", ", open[0].second, ") of parameter '", seg.name, "' (tensor-parallel rank ",
                              shards.tp_rank, "): it was made for another model; use the config it was made with"));
      }
    }
  }
  return copies;
}

// Another tensor-parallel size: each element of this rank's segments is
// found by its index in the whole parameter (this rank's split), then in the
// share of each saved tensor-parallel rank (the saved split), then in that
// rank's saved segments; runs of consecutive elements become one copy. Index
// tensors (a few int64 per element) are built for at most kChunk elements at
// a time.
std::vector<Copy> resliced_copies(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                                  const std::vector<size_t>& candidates) {
  constexpr int64_t kChunk = int64_t{1} << 22;
  const auto by_name = sources_by_name(manifest, candidates);
  const std::map<std::string, parallel::TensorSplit> mine(shards.splits.begin(), shards.splits.end());
  const std::map<std::string, parallel::TensorSplit> theirs(manifest.splits.begin(), manifest.splits.end());
  // Saved tensor-parallel ranks in the order their copies are preferred
  // (a replicated parameter is read from the first).
  std::vector<int64_t> tp_order;
  for (size_t f : candidates) {
    const int64_t t = manifest.files[f].tp_rank;
    if (std::find(tp_order.begin(), tp_order.end(), t) == tp_order.end()) tp_order.push_back(t);
  }
  std::vector<Copy> copies;
  for (size_t i = 0; i < shards.layout.size(); ++i) {
    for (const auto& seg : shards.layout[i].segments) {
      auto my_split = mine.find(seg.name);
      auto saved_split = theirs.find(seg.name);
      auto found = by_name.find(seg.name);
      if (my_split == mine.end() || saved_split == theirs.end() || found == by_name.end()) {
        throw ConfigError(str("resume: the save in '", folder, "' holds no values for parameter '", seg.name,
                              "' (tensor-parallel rank ", shards.tp_rank, " of ", shards.tp_size,
                              "): it was made for another model; use the config it was made with"));
      }
      for (int64_t done = 0; done < seg.length; done += kChunk) {
        const int64_t n = std::min(kChunk, seg.length - done);
        const at::Tensor whole = parallel::full_indices(my_split->second, shards.tp_size, shards.tp_rank,
                                                        seg.param_offset + done, n);
        at::Tensor source = at::full({n}, -1, at::kLong);  // index into `origins`
        at::Tensor offset = at::zeros({n}, at::kLong);       // in that saved tensor
        at::Tensor filled = at::zeros({n}, at::kBool);
        std::vector<std::pair<size_t, size_t>> origins;  // (file, tensor)
        for (int64_t t : tp_order) {
          const at::Tensor theirs_at = parallel::share_indices(saved_split->second, static_cast<int>(manifest.tp_size),
                                                               static_cast<int>(t), whole);
          at::Tensor open = theirs_at.ge(0).logical_and(filled.logical_not());
          for (const auto& src : found->second) {
            if (manifest.files[src.file].tp_rank != t || !open.any().item<bool>()) continue;
            const at::Tensor here = open.logical_and(theirs_at.ge(src.param_offset))
                                        .logical_and(theirs_at.lt(src.param_offset + src.length));
            if (!here.any().item<bool>()) continue;
            source.masked_fill_(here, static_cast<int64_t>(origins.size()));
            offset = at::where(here, theirs_at - src.param_offset + src.offset, offset);
            origins.emplace_back(src.file, src.tensor);
            open.logical_and_(here.logical_not());
            filled.logical_or_(here);
          }
        }
        if (!filled.all().item<bool>()) {
          const int64_t first = filled.logical_not().nonzero()[0][0].item<int64_t>();
          throw ConfigError(str("resume: the save in '", folder, "' holds no values for element ",
                                whole[first].item<int64_t>(), " of parameter '", seg.name, "' (whole shape ",
                                shape_text(my_split->second.full_sizes), "), needed by tensor-parallel rank ",
                                shards.tp_rank, " of ", shards.tp_size, ": no saved file of its ", manifest.tp_size,
                                " tensor-parallel ranks holds it; the save is incomplete or was made for "
                                "another model"));
        }
        // Runs: the same saved tensor, consecutive offsets.
        at::Tensor breaks = at::ones({n}, at::kBool);
        if (n > 1) {
          breaks.narrow(0, 1, n - 1)
              .copy_(source.narrow(0, 1, n - 1).ne(source.narrow(0, 0, n - 1))
                         .logical_or(offset.narrow(0, 1, n - 1).ne(offset.narrow(0, 0, n - 1) + 1)));
        }
        const at::Tensor starts = breaks.nonzero().reshape({-1}).contiguous();
        const auto start = starts.accessor<int64_t, 1>();
        const auto from = source.accessor<int64_t, 1>();
        const auto at_offset = offset.accessor<int64_t, 1>();
        for (int64_t r = 0; r < starts.numel(); ++r) {
          const int64_t a = start[r], b = r + 1 < starts.numel() ? start[r + 1] : n;
          const auto [file, tensor] = origins[static_cast<size_t>(from[a])];
          copies.push_back({file, tensor, at_offset[a], i, seg.shard_offset + done + a, b - a});
        }
      }
    }
  }
  return copies;
}
}  // namespace

TrainShards train_shards(const parallel::ZeroModel& zero, const ParallelLayout& layout,
                         const torch::nn::Module& model) {
  TrainShards s;
  s.tensors = zero.parameters();
  s.layout = zero.layout();
  s.splits = parallel::parameter_splits(model);
  s.tp_rank = layout.tp_rank();
  s.tp_size = layout.dims().tp;
  s.dp_rank = layout.dp_rank();
  s.dp_size = layout.dims().dp;
  return s;
}

namespace {

// This rank's file of a save: its tensors with their optimizer state, its
// random state, and what identifies it; `layout` gets its layout's JSON.
std::string rank_file_bytes(const TrainPosition& position, const TrainShards& shards,
                            torch::optim::Optimizer& optimizer, const SaveIdentity& identity, Communicator& world,
                            std::string& layout) {
  torch::serialize::OutputArchive archive, tensors, rng_archive;
  for (size_t i = 0; i < shards.tensors.size(); ++i) {
    tensors.write(tensor_key(i), shards.tensors[i].detach());
    for (const auto& [field, value] : optimizer_state_of(optimizer, shards.tensors[i])) {
      tensors.write(state_key(i, field), value.detach());
    }
  }
  write_rng_snapshot(rng_archive, capture_rng());
  layout = layout_json(shards.layout).dump();
  archive.write("format", c10::IValue(kFormat));
  archive.write("tensors", tensors);
  archive.write("rng", rng_archive);
  archive.write("step", c10::IValue(position.step));
  archive.write("rank", c10::IValue(static_cast<int64_t>(world.rank())));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(world.size())));
  archive.write("model_signature", c10::IValue(identity.model_signature));
  archive.write("run_id", c10::IValue(identity.run_id));
  archive.write("tp_rank", c10::IValue(static_cast<int64_t>(shards.tp_rank)));
  archive.write("dp_rank", c10::IValue(static_cast<int64_t>(shards.dp_rank)));
  archive.write("layout", c10::IValue(layout));
  archive.write("splits", c10::IValue(splits_json(shards.splits).dump()));
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

// Rank 0: the manifest of the step folder (every rank's file listed from
// `all`, each rank's size, CRC-32, tensor- and data-parallel rank, and
// `layouts`), then `latest`.
void write_manifest(const std::string& dir, const std::string& folder, const TrainPosition& position,
                    const TrainShards& shards, const SaveIdentity& identity, Communicator& world,
                    const at::Tensor& all, const std::vector<std::string>& layouts) {
  nlohmann::json manifest = {{"format", kFormat},
                             {"step", position.step},
                             {"world_size", world.size()},
                             {"tp_size", shards.tp_size},
                             {"dp_size", shards.dp_size},
                             {"model", identity.model_signature},
                             {"run_id", identity.run_id},
                             {"settings", identity.settings},
                             {"parameters", parameters_json(identity.parameters)},
                             {"splits", splits_json(shards.splits)},
                             {"client_state", nlohmann::json::parse(position.client_state)},
                             {"files", nlohmann::json::array()}};
  for (int r = 0; r < world.size(); ++r) {
    manifest["files"].push_back({{"name", str("rank_", r, ".pt")},
                                 {"bytes", all[4 * r].item<int64_t>()},
                                 {"crc32", all[4 * r + 1].item<int64_t>()},
                                 {"tp_rank", all[4 * r + 2].item<int64_t>()},
                                 {"dp_rank", all[4 * r + 3].item<int64_t>()},
                                 {"tensors", nlohmann::json::parse(layouts[r])}});
  }
  // Its own checksum, over its compact form without this field.
  manifest["manifest_crc32"] = crc32_of(manifest.dump());
  write_atomically((fs::path(folder) / "manifest.json").string(), manifest.dump(1));
  const int64_t current = latest_step(dir);
  if (current > position.step) {
    // A later save of an earlier run this one resumed before: the newest
    // save stays the one resumed by default.
    log().info("saved step {} to '{}'; 'latest' still names step {}, which is later", position.step, dir,
               current);
  } else {
    write_atomically((fs::path(dir) / "latest").string(), step_folder(position.step) + "\n");
  }
}

}  // namespace

void save_train_state(const std::string& dir, const TrainPosition& position, const TrainShards& shards,
                      torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                      Communicator& world) {
  REMAT_CHECK(shards.tensors.size() == shards.layout.size(),
              "save_train_state: one layout per tensor (ZeroModel::parameters() and layout())");
  const std::string folder = (fs::path(dir) / step_folder(position.step)).string();
  std::string bytes, layout;
  // Each rank's file; a rank that cannot write it stops every rank here.
  agree_on_outcome(world, str("the save of step ", position.step), [&] {
    fs::create_directories(folder);
    bytes = rank_file_bytes(position, shards, optimizer, identity, world, layout);
    write_atomically((fs::path(folder) / str("rank_", world.rank(), ".pt")).string(), bytes);
  });

  // Every rank's file is in place (and its size, checksum and layout known)
  // before the manifest.
  at::Tensor mine = at::tensor({static_cast<int64_t>(bytes.size()), crc32_of(bytes),
                                static_cast<int64_t>(shards.tp_rank), static_cast<int64_t>(shards.dp_rank)},
                               at::kLong);
  at::Tensor all = at::empty({4 * world.size()}, at::kLong);
  world.allGather(all, mine)->wait();
  const std::vector<std::string> layouts = gather_text(layout, world);
  agree_on_outcome(world, str("the save of step ", position.step), [&] {
    if (world.rank() == 0) write_manifest(dir, folder, position, shards, identity, world, all, layouts);
  });
}

namespace {

// What a rank loads from a save, read and checked but not yet put into the
// run: the values of each of its tensors (on the host), their optimizer
// state, the random state and the position.
struct StagedLoad {
  TrainPosition position;
  std::string run_id;
  std::vector<at::Tensor> tensors;
  std::vector<std::map<std::string, at::Tensor>> states;
  RngSnapshot rng;
  std::optional<uint64_t> model_parallel_seed;  // at another tensor-parallel size: the stream seeded afresh
};

// This rank's part of load_train_state: everything that can fail, touching
// nothing of the run.
StagedLoad stage_train_state(const std::string& dir, const TrainShards& shards, const SaveIdentity& identity) {
  StagedLoad staged;
  const std::string folder = resolve_save(dir);
  const std::string manifest_path = (fs::path(folder) / "manifest.json").string();
  const Manifest manifest = [&] {
    try {
      return read_manifest(manifest_path);
    } catch (const ConfigError& e) {
      throw ConfigError(str(e.what(), ".", offer_newest(root_of(folder), folder)));
    }
  }();
  if (manifest.format < kOldestFormat || manifest.format > kFormat) {
    throw ConfigError(str("resume: the save in '", folder, "' was written by ",
                          manifest.format < kOldestFormat ? "an earlier" : "a later", " remat (format ",
                          manifest.format, "; this one reads ", kOldestFormat, " to ", kFormat,
                          "), or its manifest was modified: resume it with the remat that wrote it"));
  }
  if (!identity.model_signature.empty() && manifest.model != identity.model_signature) {
    throw ConfigError(str("resume: the save in '", folder, "' holds a model with ", manifest.model,
                          " but this run builds ", identity.model_signature,
                          "; use the config the save was made with"));
  }
  for (const auto& [key, value] : identity.settings) {
    auto saved = manifest.settings.find(key);
    if (saved != manifest.settings.end() && saved->second != value) {
      throw ConfigError(str("resume: the save in '", folder, "' was made with ", key, " = ",
                            saved->second, " but this run has ", value,
                            ": a resumed run keeps the settings its saved state depends on; resume with the "
                            "override \"", key, "=", saved->second, "\" (EngineOptions::overrides; the save "
                            "itself is fine), or start a new run"));
    }
  }
  const bool reslice_tp = manifest.tp_size != shards.tp_size;
  if (reslice_tp && manifest.splits.empty()) {
    throw ConfigError(str("resume: the save in '", folder, "' was made with tensor_parallel.size ",
                          manifest.tp_size, " but this run has ", shards.tp_size,
                          ", and it does not record how its parameters are split across tensor-parallel ranks "
                          "(format ", manifest.format, ", written by an earlier remat): it resumes only at "
                          "tensor_parallel.size ", manifest.tp_size, ". Resume with the override "
                          "\"tensor_parallel.size=", manifest.tp_size, "\" (EngineOptions::overrides; any "
                          "data-parallel size and ZeRO stage works); a save this run makes from there resumes at "
                          "any tensor-parallel size"));
  }
  REMAT_CHECK(!reslice_tp || !shards.splits.empty(),
              "load_train_state: TrainShards::splits is empty; build the shards with train_shards()");

  // The files to read from: the one at this rank's tensor- and data-parallel
  // place modulo the saved sizes first (its random state is taken), then the
  // others of that tensor-parallel rank, then (at another tensor-parallel
  // size) every other file.
  const int64_t source_tp = shards.tp_rank % manifest.tp_size;
  const int64_t source_dp = shards.dp_rank % manifest.dp_size;
  std::vector<size_t> candidates;
  for (size_t f = 0; f < manifest.files.size(); ++f) {
    const auto& e = manifest.files[f];
    if (e.tp_rank == source_tp && e.dp_rank == source_dp) candidates.insert(candidates.begin(), f);
    else if (e.tp_rank == source_tp) candidates.push_back(f);
  }
  if (candidates.empty() || manifest.files[candidates[0]].dp_rank != source_dp) {
    throw ConfigError(str("resume: '", manifest_path, "' lists no file of tensor-parallel rank ", source_tp,
                          " and data-parallel rank ", source_dp, "; the manifest was edited or damaged"));
  }
  if (reslice_tp) {
    for (size_t f = 0; f < manifest.files.size(); ++f) {
      if (manifest.files[f].tp_rank != source_tp) candidates.push_back(f);
    }
  }

  // This rank's own file first: it verifies the manifest's account of it.
  std::map<size_t, std::unique_ptr<RankFile>> files;
  files[candidates[0]] = open_rank_file(folder, manifest, candidates[0]);
  check_same_model(folder, manifest, shards, identity);
  const std::vector<Copy> copies = reslice_tp ? resliced_copies(folder, manifest, shards, candidates)
                                              : same_split_copies(folder, manifest, shards, candidates);

  for (const auto& c : copies) {
    if (!files.count(c.file)) files[c.file] = open_rank_file(folder, manifest, c.file);
  }
  auto saved = [&](size_t f, const std::string& key) {
    at::Tensor t;
    if (!files.at(f)->tensors.try_read(key, t)) return at::Tensor();
    return t.reshape({-1});
  };

  {
    torch::NoGradGuard no_grad;
    for (const auto& t : shards.tensors) {
      staged.tensors.push_back(t.is_cpu() ? t.detach().clone() : t.detach().cpu());
    }
    std::vector<std::map<std::string, at::Tensor>> states(shards.tensors.size());
    std::vector<std::set<int64_t>> steps(shards.tensors.size());
    std::map<std::pair<size_t, std::string>, at::Tensor> cache;
    auto cached = [&](size_t f, const std::string& key) -> const at::Tensor& {
      auto k = std::make_pair(f, key);
      auto it = cache.find(k);
      if (it == cache.end()) it = cache.emplace(k, saved(f, key)).first;
      return it->second;
    };
    for (const auto& c : copies) {
      at::Tensor target = staged.tensors[c.target].view({-1});
      const at::Tensor& values = cached(c.file, tensor_key(c.source));
      if (!values.defined() || values.numel() < c.source_offset + c.length) {
        throw ConfigError(str("resume: '", files.at(c.file)->path, "' lacks tensor ", c.source,
                              " as the manifest describes it; the save was edited or damaged"));
      }
      target.narrow(0, c.target_offset, c.length).copy_(values.narrow(0, c.source_offset, c.length));
      const auto saved_fields = files.at(c.file)->fields.find(tensor_key(c.source));
      if (saved_fields == files.at(c.file)->fields.end()) continue;
      for (const std::string& field : saved_fields->second) {
        const at::Tensor& value = cached(c.file, state_key(c.source, field));
        if (field == "step") {
          steps[c.target].insert(value.item<int64_t>());
          continue;
        }
        auto& into = states[c.target][field];
        if (!into.defined()) into = at::zeros({target.numel()}, value.options());
        into.narrow(0, c.target_offset, c.length).copy_(value.narrow(0, c.source_offset, c.length));
      }
    }
    for (size_t i = 0; i < shards.tensors.size(); ++i) {
      if (steps[i].size() > 1) {
        throw ConfigError(str("resume: the saved shards making up tensor ", i, " of this rank were stepped ",
                              *steps[i].begin(), " and ", *steps[i].rbegin(),
                              " times: the save mixes optimizer states; resume from another step"));
      }
      std::map<std::string, at::Tensor> state;
      for (auto& [field, value] : states[i]) state[field] = value.view(shards.tensors[i].sizes());
      if (!steps[i].empty()) state["step"] = at::scalar_tensor(*steps[i].begin(), at::kLong);
      staged.states.push_back(std::move(state));
    }

    RankFile& own = *files.at(candidates[0]);
    torch::serialize::InputArchive rng_archive;
    own.archive.read("rng", rng_archive);
    RngSnapshot& rng = staged.rng;
    rng = read_rng_snapshot(rng_archive);
    const at::Tensor cuda_now = capture_default_generators().cuda;
    const bool cuda_here = cuda_now.defined();
    // LibTorch versions lay out the CUDA generator state differently (1.13
    // and 2.x disagree on its size): such a state cannot be restored.
    if (cuda_here && rng.defaults.cuda.defined() && rng.defaults.cuda.numel() != cuda_now.numel()) {
      log().warn("resume: the CUDA generator states in '{}' have {} bytes but this LibTorch's have "
                 "{} (saved by another LibTorch version): GPU random draws restart from this "
                 "process's state and do not continue bitwise",
                 folder, rng.defaults.cuda.numel(), cuda_now.numel());
      rng.defaults.cuda = at::Tensor();
      for (auto& [name, states_of] : rng.tracker) states_of.cuda = at::Tensor();
    } else if (rng.defaults.cuda.defined() != cuda_here) {
      log().warn("resume: the save in '{}' {} CUDA generator states but this process {} a GPU: "
                 "random draws on the GPU do not continue bitwise",
                 folder, rng.defaults.cuda.defined() ? "holds" : "holds no",
                 cuda_here ? "has" : "has no");
    }
    // The model-parallel stream differs per tensor-parallel rank (dropout
    // inside tensor-parallel regions): at another size no saved rank's stream
    // is this rank's, so it starts afresh as model_parallel_manual_seed starts it.
    if (reslice_tp) {
      rng.tracker.erase(kModelParallelRng);
      const uint64_t seed = identity.seed + kModelParallelSeedOffset + static_cast<uint64_t>(shards.tp_rank);
      staged.model_parallel_seed = seed;
      log().info("resume: the model-parallel RNG stream is seeded afresh with {} (train.seed {} + {} + "
                 "tensor-parallel rank {}); the default generators continue those of saved rank {}",
                 seed, identity.seed, kModelParallelSeedOffset, shards.tp_rank, candidates[0]);
    }
    staged.position.step = manifest.step;
    staged.position.client_state = manifest.client_state;
    staged.run_id = manifest.run_id;
  }
  if (reslice_tp) {
    log_rank0().warn("resume: the save in '{}' was made at tensor-parallel size {} x data-parallel size {}; this "
                     "run has {} x {}. Parameters and optimizer state are re-sliced exactly through each "
                     "parameter's whole shape (read from {} saved file(s) on rank 0); each rank continues the "
                     "default random state of the saved rank at its tensor- and data-parallel ranks modulo {} and "
                     "{}, and its model-parallel RNG stream is seeded afresh for its tensor-parallel rank, so the "
                     "run does not repeat an uninterrupted one bitwise (float sums also run in another order at "
                     "another tensor-parallel size)",
                     folder, manifest.tp_size, manifest.dp_size, shards.tp_size, shards.dp_size, files.size(),
                     manifest.tp_size, manifest.dp_size);
  } else if (manifest.dp_size != shards.dp_size) {
    log_rank0().warn("resume: the save in '{}' was made at data-parallel size {}; this run has {}. Parameters "
                     "and optimizer state are re-sliced exactly (read from {} saved file(s) on rank 0); each rank "
                     "continues the random state of the saved rank at its data-parallel "
                     "place modulo {}, so the run does not repeat an uninterrupted one bitwise",
                     folder, manifest.dp_size, shards.dp_size, files.size(), manifest.dp_size);
  }

  return staged;
}

// Puts a staged load of the save in `dir` into the run: values, optimizer
// state, random state.
void apply_load(const std::string& dir, const StagedLoad& staged, const TrainShards& shards,
                torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < shards.tensors.size(); ++i) {
    shards.tensors[i].detach().copy_(staged.tensors[i]);
    try {
      set_optimizer_state(optimizer, shards.tensors[i], staged.states[i]);
    } catch (const Error& e) {
      throw ConfigError(str("resume: the save in '", dir, "' does not fit this run's optimizer: ", e.what()));
    }
  }
  restore_rng(staged.rng);
  if (staged.model_parallel_seed) get_rng_tracker().add(kModelParallelRng, *staged.model_parallel_seed);
}

}  // namespace

TrainPosition load_train_state(const std::string& dir, const TrainShards& shards,
                               torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                               Communicator& world) {
  REMAT_CHECK(shards.tensors.size() == shards.layout.size(),
              "load_train_state: one layout per tensor (ZeroModel::parameters() and layout())");
  // Every rank reads and checks its part first; a rank that cannot stops
  // every rank before any of them changes its state.
  StagedLoad staged;
  agree_on_outcome(world, str("loading the save in '", dir, "'"),
                   [&] { staged = stage_train_state(dir, shards, identity); });
  const TrainPosition& position = staged.position;
  // Every rank resumes at the same step of the same run, or none does.
  at::Tensor mine = at::tensor({position.step, crc32_of(staged.run_id)}, at::kLong);
  at::Tensor all = at::empty({2 * world.size()}, at::kLong);
  world.allGather(all, mine)->wait();
  for (int r = 1; r < world.size(); ++r) {
    if (!at::equal(all.narrow(0, 2 * r, 2), all.narrow(0, 0, 2))) {
      const int64_t step_r = all[2 * r].item<int64_t>(), step_0 = all[0].item<int64_t>();
      throw ConfigError(str("resume: rank ", r, " loaded ",
                            step_r != step_0 ? str("step ", step_r, " but rank 0 loaded step ", step_0)
                                             : str("step ", step_r, " of another run than rank 0 did"),
                            " (from different saves): resume every rank from the same step folder"));
    }
  }
  agree_on_outcome(world, str("loading the save in '", dir, "'"), [&] { apply_load(dir, staged, shards, optimizer); });
  return position;
}

}  // namespace remat
