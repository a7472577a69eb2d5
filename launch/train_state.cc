#include "launch/train_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "rng/rng_state_io.h"
#include "rng/rng_tracker.h"
#include "runtime/communicator.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/logging.h"

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
  if (!in) throw ConfigError(str("resume: cannot read '", path, "'"));
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

// The newest step folder under `root` that holds a manifest, or "".
std::string newest_complete_step(const std::string& root) {
  std::string best;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) == 0 && fs::exists(entry.path() / "manifest.json") && name > best) {
      best = name;
    }
  }
  return best;
}

std::string offer_newest(const std::string& root) {
  const std::string newest = newest_complete_step(root);
  return newest.empty() ? std::string(" No step folder there holds a complete save.")
                        : str(" The newest complete save is '", (fs::path(root) / newest).string(),
                              "': pass --resume ", (fs::path(root) / newest).string(), ".");
}

// The step folder to load: `dir` itself when it holds a manifest, else the
// one its `latest` names.
std::string resolve_save(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "manifest.json")) return dir;
  if (!fs::exists(dir)) {
    throw ConfigError(str("resume: '", dir, "' does not exist: pass a folder written by --save-dir"));
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

// A manifest read with every field checked: a hand-edited or damaged one is
// an error naming the field.
struct Manifest {
  int64_t step = 0;
  int64_t world_size = 0;
  std::string model;
  std::string run_id;  // empty: saved before run ids were recorded
  std::map<std::string, std::string> settings;
  struct File {
    std::string name;
    int64_t bytes = -1, crc32 = -1;  // -1: not recorded (an older save)
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
  if (!j.contains("files") || !j["files"].is_array()) throw bad("files", "an array");
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
    m.files.push_back(file);
  }
  if (m.world_size < 1 || static_cast<int64_t>(m.files.size()) != m.world_size) {
    throw bad("files", str("one entry per rank (world_size ", m.world_size, ")").c_str());
  }
  return m;
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

SaveDirLock::SaveDirLock(const std::string& dir, const std::string& run_id, Communicator& world) {
  // Every rank writes its files there: each checks it can, before training.
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw ConfigError(str("--save-dir '", dir, "' cannot be created (",
                          ec ? ec.message() : "a file of that name exists",
                          "): give a writable folder"));
  }
  const std::string probe = (fs::path(dir) / str(".probe_rank_", world.rank())).string();
  {
    std::ofstream out(probe, std::ios::trunc);
    out << run_id << "\n";
    out.flush();
    if (!out) {
      throw ConfigError(str("--save-dir '", dir, "' is not writable (", std::strerror(errno),
                            "): give a folder this job can write, or fix its permissions"));
    }
  }
  fs::remove(probe, ec);
  if (world.rank() == 0) {
    const std::string path = (fs::path(dir) / ".lock").string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      throw ConfigError(str("--save-dir '", dir, "': cannot create '", path, "' (", std::strerror(errno), ")"));
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      std::string holder(256, '\0');
      const ssize_t n = ::pread(fd_, holder.data(), holder.size() - 1, 0);
      holder.resize(n > 0 ? static_cast<size_t>(n) : 0);
      holder.erase(holder.find_last_not_of(" \n") + 1);
      ::close(fd_);
      fd_ = -1;
      throw ConfigError(str("--save-dir '", dir, "' is in use by another job (",
                            holder.empty() ? std::string("its lock holder is unknown") : holder,
                            "): two jobs saving to one folder overwrite each other; give this one "
                            "another --save-dir, or wait for the other to end"));
    }
    const std::string me = str("pid ", ::getpid(), " on ", host_name(), ", run ", run_id, "\n");
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
      log().warn("--save-dir '{}': could not record this job in its lock file", dir);
    }
  }
  world.barrier()->wait();
}

SaveDirLock::~SaveDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

void save_train_state(const std::string& dir, const TrainPosition& position,
                      torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                      const SaveIdentity& identity, Communicator& world) {
  const std::string folder = (fs::path(dir) / step_folder(position.step)).string();
  fs::create_directories(folder);

  torch::serialize::OutputArchive archive, model_archive, optimizer_archive, rng_archive;
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  write_rng_snapshot(rng_archive, capture_rng());
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("rng", rng_archive);
  archive.write("step", c10::IValue(position.step));
  archive.write("window", c10::IValue(position.window));
  archive.write("rank", c10::IValue(static_cast<int64_t>(world.rank())));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(world.size())));
  archive.write("model_signature", c10::IValue(identity.model_signature));
  archive.write("run_id", c10::IValue(identity.run_id));
  std::ostringstream out;
  archive.save_to(out);
  const std::string bytes = out.str();
  write_atomically((fs::path(folder) / str("rank_", world.rank(), ".pt")).string(), bytes);

  // Every rank's file is in place (and its size and checksum known) before the manifest.
  at::Tensor mine = at::tensor({static_cast<int64_t>(bytes.size()), crc32_of(bytes)}, at::kLong);
  at::Tensor all = at::empty({2 * world.size()}, at::kLong);
  world.allGather(all, mine)->wait();
  if (world.rank() == 0) {
    nlohmann::json manifest = {{"step", position.step},
                               {"world_size", world.size()},
                               {"model", identity.model_signature},
                               {"run_id", identity.run_id},
                               {"settings", identity.settings},
                               {"files", nlohmann::json::array()}};
    for (int r = 0; r < world.size(); ++r) {
      manifest["files"].push_back({{"name", str("rank_", r, ".pt")},
                                   {"bytes", all[2 * r].item<int64_t>()},
                                   {"crc32", all[2 * r + 1].item<int64_t>()}});
    }
    write_atomically((fs::path(folder) / "manifest.json").string(), manifest.dump(2));
    write_atomically((fs::path(dir) / "latest").string(), step_folder(position.step) + "\n");
  }
  world.barrier()->wait();
}

TrainPosition load_train_state(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                               Communicator& world) {
  const std::string folder = resolve_save(dir);
  const std::string manifest_path = (fs::path(folder) / "manifest.json").string();
  const Manifest manifest = read_manifest(manifest_path);
  if (manifest.world_size != world.size()) {
    throw ConfigError(str("resume: the save in '", folder, "' was made by ", manifest.world_size,
                          " ranks but this run has ", world.size(), "; resume with -np ",
                          manifest.world_size));
  }
  if (manifest.model != identity.model_signature) {
    throw ConfigError(str("resume: the save in '", folder, "' holds a model with ", manifest.model,
                          " but this run builds ", identity.model_signature,
                          "; use the config the save was made with"));
  }
  for (const auto& [key, value] : identity.settings) {
    auto saved = manifest.settings.find(key);
    if (saved != manifest.settings.end() && saved->second != value) {
      throw ConfigError(str("resume: the save in '", folder, "' was made with ", key, " = ",
                            saved->second, " but this run has ", value,
                            ": the saved state is laid out for the former; resume with --set ", key,
                            "=", saved->second, " (the file itself is fine)"));
    }
  }

  const auto& entry = manifest.files[world.rank()];
  const std::string file = (fs::path(folder) / entry.name).string();
  const std::string bytes = read_file(file);
  if (entry.crc32 >= 0) {
    const int64_t crc = crc32_of(bytes);
    if (static_cast<int64_t>(bytes.size()) != entry.bytes || crc != entry.crc32) {
      throw ConfigError(str("resume: '", file, "' is damaged: ", bytes.size(), " bytes with CRC-32 ",
                            crc, " where the manifest recorded ", entry.bytes, " bytes with CRC-32 ",
                            entry.crc32, ". It changed after it was saved; resume from another step",
                            offer_newest(fs::path(folder).parent_path().string())));
    }
  } else {
    log_rank0().warn("resume: '{}' records no checksums (an older save): its files are not verified",
                     manifest_path);
  }

  TrainPosition position;
  try {
    torch::serialize::InputArchive archive, model_archive, optimizer_archive, rng_archive;
    std::istringstream in(bytes);
    archive.load_from(in);
    c10::IValue step, window, rank, run_id, world_size;
    archive.read("step", step);
    archive.read("window", window);
    // Files from another step, rank, world size or run (copied or swapped by
    // hand) stop here.
    if (step.toInt() != manifest.step ||
        (archive.try_read("world_size", world_size) && world_size.toInt() != manifest.world_size) ||
        (archive.try_read("rank", rank) && rank.toInt() != world.rank()) ||
        (!manifest.run_id.empty() && archive.try_read("run_id", run_id) &&
         run_id.toStringRef() != manifest.run_id)) {
      throw ConfigError(str("resume: '", file, "' holds step ", step.toInt(),
                            rank.isInt() ? str(" of rank ", rank.toInt()) : std::string(),
                            world_size.isInt() ? str(" of ", world_size.toInt(), " ranks") : std::string(),
                            run_id.isString() ? " of run " + run_id.toStringRef() : std::string(),
                            " but the manifest of '", folder, "' is step ", manifest.step, " of run ",
                            manifest.run_id, " and this is rank ", world.rank(),
                            ": the folder mixes files of different saves; resume from a folder "
                            "written as a whole by --save-dir"));
    }
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    archive.read("rng", rng_archive);
    model.load(model_archive);
    optimizer.load(optimizer_archive);
    RngSnapshot rng = read_rng_snapshot(rng_archive);
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
      for (auto& [name, states] : rng.tracker) states.cuda = at::Tensor();
    } else if (rng.defaults.cuda.defined() != cuda_here) {
      log().warn("resume: the save in '{}' {} CUDA generator states but this process {} a GPU: "
                 "random draws on the GPU do not continue bitwise",
                 folder, rng.defaults.cuda.defined() ? "holds" : "holds no",
                 cuda_here ? "has" : "has no");
    }
    restore_rng(rng);
    position.step = step.toInt();
    position.window = window.toInt();
  } catch (const c10::Error& e) {
    // The bytes are what was saved (or the save predates checksums): what
    // does not fit is this run's model or optimizer.
    throw ConfigError(str("resume: '", file, "' ",
                          entry.crc32 >= 0 ? "is intact but does not fit this run's model or optimizer"
                                           : "is corrupt, truncated or made for another model or optimizer",
                          " (", e.what_without_backtrace(), ")"));
  }

  // Every rank resumes at the same step of the same run, or none does.
  at::Tensor mine = at::tensor({position.step, crc32_of(manifest.run_id)}, at::kLong);
  at::Tensor all = at::empty({2 * world.size()}, at::kLong);
  world.allGather(all, mine)->wait();
  for (int r = 1; r < world.size(); ++r) {
    if (!at::equal(all.narrow(0, 2 * r, 2), all.narrow(0, 0, 2))) {
      throw ConfigError(str("resume: rank ", r, " loaded step ", all[2 * r].item<int64_t>(),
                            " but rank 0 loaded step ", all[0].item<int64_t>(),
                            " (from different saves): resume every rank from the same step folder"));
    }
  }
  return position;
}

}  // namespace remat
