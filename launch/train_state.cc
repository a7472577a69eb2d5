#include "launch/train_state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdio>
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
  if (auto pause = knobs::get(knobs::kFaultSavePauseMs)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::stoll(*pause)));
  }
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

}  // namespace

void save_train_state(const std::string& dir, const TrainPosition& position,
                      torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                      const std::string& model_signature, Communicator& world) {
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
  archive.write("world_size", c10::IValue(static_cast<int64_t>(world.size())));
  archive.write("model_signature", c10::IValue(model_signature));
  std::ostringstream bytes;
  archive.save_to(bytes);
  write_atomically((fs::path(folder) / str("rank_", world.rank(), ".pt")).string(), bytes.str());

  world.barrier()->wait();  // every rank's file is in place before the manifest
  if (world.rank() == 0) {
    nlohmann::json manifest = {{"step", position.step},
                               {"world_size", world.size()},
                               {"model", model_signature},
                               {"files", nlohmann::json::array()}};
    for (int r = 0; r < world.size(); ++r) manifest["files"].push_back(str("rank_", r, ".pt"));
    write_atomically((fs::path(folder) / "manifest.json").string(), manifest.dump(2));
    write_atomically((fs::path(dir) / "latest").string(), step_folder(position.step) + "\n");
  }
  world.barrier()->wait();
}

TrainPosition load_train_state(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer,
                               const std::string& model_signature, const Communicator& world) {
  std::string folder = dir;
  if (!fs::exists(fs::path(folder) / "manifest.json") && fs::exists(fs::path(dir) / "latest")) {
    std::string latest = read_file((fs::path(dir) / "latest").string());
    latest.erase(latest.find_last_not_of(" \n\r\t") + 1);
    folder = (fs::path(dir) / latest).string();
  }
  const std::string manifest_path = (fs::path(folder) / "manifest.json").string();
  if (!fs::exists(manifest_path)) {
    throw ConfigError(str("resume: '", dir, "' holds no complete save (no manifest.json",
                          fs::exists(dir) ? "; the save may have been interrupted" : "; it does not exist",
                          "): pass a folder written by --save-dir"));
  }
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_file(manifest_path));
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(str("resume: '", manifest_path, "' is corrupt: ", e.what()));
  }
  if (manifest.value("world_size", -1) != world.size()) {
    throw ConfigError(str("resume: the save in '", folder, "' was made by ",
                          manifest.value("world_size", -1), " ranks but this run has ", world.size(),
                          "; resume with -np ", manifest.value("world_size", -1)));
  }
  if (manifest.value("model", std::string()) != model_signature) {
    throw ConfigError(str("resume: the save in '", folder, "' holds a model with ",
                          manifest.value("model", std::string("?")), " but this run builds ",
                          model_signature, "; use the config the save was made with"));
  }
  const std::string file = (fs::path(folder) / str("rank_", world.rank(), ".pt")).string();
  TrainPosition position;
  try {
    torch::serialize::InputArchive archive, model_archive, optimizer_archive, rng_archive;
    archive.load_from(file);
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    archive.read("rng", rng_archive);
    c10::IValue step, window;
    archive.read("step", step);
    archive.read("window", window);
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
    throw ConfigError(str("resume: cannot read '", file, "': the file is corrupt or truncated (",
                          e.what_without_backtrace(), ")"));
  }
  return position;
}

}  // namespace remat
