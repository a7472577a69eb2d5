// engine/save_dir.h, the public part of the save format, on the format's
// storage (engine/save/storage.h): save/ depends on save_dir.h, never the
// reverse.
#include "engine/save_dir.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "engine/save/storage.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace fs = std::filesystem;

int64_t latest_step(const std::string& dir) {
  const fs::path path = fs::path(dir) / "latest";
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(path, ec))) return -1;
  std::ifstream in(path);
  std::string name;
  in >> name;
  const int64_t step = save::step_of(name);
  return step >= 0 && fs::is_directory(fs::path(dir) / name, ec) ? step : -1;
}

int discard_saves_after(const std::string& dir, int64_t step, Communicator& world, int64_t except) {
  int64_t removed = 0;
  if (world.rank() == 0) {
    std::string keep;  // the newest complete save kept
    std::vector<fs::path> doomed;
    for (const auto& [s, folder] : save::step_folders(dir)) {
      if (s > step && s != except) {
        doomed.push_back(folder);
      } else if (keep.empty() && fs::exists(folder / "manifest.json")) {
        keep = folder.filename().string();
      }
    }
    // `latest` first: a crash while the folders go leaves it naming a save that is there.
    const fs::path latest = fs::path(dir) / "latest";
    std::error_code ec;
    const int64_t named = latest_step(dir);
    if (named < 0 || (named > step && named != except)) {
      if (keep.empty()) {
        fs::remove(latest, ec);
      } else {
        save::write_atomically(latest.string(), keep + "\n");
      }
    }
    // Each out of sight in one rename, then removed: a kill half-way through a
    // removal leaves a hidden folder the next run removes, never a step
    // folder with some of its files.
    for (const fs::path& folder : doomed) {
      const std::string hidden = save::removed_folder(folder.string());
      fs::remove_all(hidden, ec);
      save::fault_pause(hidden);
      fs::rename(folder, hidden);
      fs::remove_all(hidden);
    }
    removed = static_cast<int64_t>(doomed.size());
    if (removed > 0) {
      // Step 0: the run did not resume from this folder, and every save there was another run's.
      log().warn("--overwrite-saves: removed {} save(s) {} from '{}'; 'latest' {}", removed,
                 step == 0 ? std::string("of an earlier run") : str("after step ", step, ", where this run resumed"),
                 dir, keep.empty() ? std::string("removed") : "names " + keep);
    }
  }
  at::Tensor count = at::full({1}, removed, at::kLong);
  if (world.size() > 1) world.broadcast(count, {0})->wait();
  world.barrier()->wait();
  return static_cast<int>(count.item<int64_t>());
}

}  // namespace remat
