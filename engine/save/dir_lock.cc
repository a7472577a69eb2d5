#include "engine/save/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "engine/save/manifest.h"
#include "engine/save/storage.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/outcome.h"

namespace remat {
namespace fs = std::filesystem;

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
  const auto saves = save::step_folders(dir);
  if (!options.resuming && !options.overwrite && (!saves.empty() || fs::exists(status))) {
    const int64_t newest = latest_step(dir);
    // Where `latest` names no save (a run killed before writing it), the step folder that verifies.
    const std::string resume = newest >= 0 ? dir : save::newest_intact_step(dir);
    throw ConfigError(str("save folder '", dir, "' holds the saves of another run (",
                          saves.size(), " step folder(s)",
                          newest >= 0 ? str(", latest step ", newest) : std::string(),
                          "): a new run would overwrite them. ",
                          resume.empty() ? std::string("None of them verifies, so none can be resumed")
                                         : str("Resume that run with Engine::load_checkpoint(\"", resume, "\")"),
                          ", give this run another save folder, or pass SaveDirOptions::overwrite = true to "
                          "Engine::use_save_dir to replace them"));
  }
}

// Every rank writes its files there: each checks it can, before training.
void check_writable(const std::string& dir, const std::string& run_id, int rank) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw ConfigError(str("save folder '", dir, "' cannot be created (",
                          ec ? ec.message() : "a file of that name exists",
                          "): give a writable folder"));
  }
  const std::string probe = (fs::path(dir) / str(".probe_rank_", rank)).string();
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
}

// Rank 0: locks the folder's .lock file (into `fd`) and records this job in it.
void lock_save_dir(const std::string& dir, const std::string& run_id, int& fd) {
  const std::string path = (fs::path(dir) / ".lock").string();
  // Not through a link: the lock and its record are this folder's own.
  fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0 && errno == ELOOP) {
    throw ConfigError(str("save folder '", dir, "': '", path, "' is a symbolic link, where remat keeps the folder's "
                          "lock: remove it, or give another save folder"));
  }
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
  const std::string me = str("pid ", ::getpid(), " on ", save::host_name(), ", run ", run_id, "\n");
  // Synced: the other ranks read it (check_shared), some through another node's view of the folder.
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size()) ||
      ::fsync(fd) != 0) {
    log().warn("save folder '{}': could not record this job in its lock file", dir);
  }
}

// This rank's part of SaveDirLock's constructor: checks every rank makes;
// rank 0 locks (into `fd`), removes what killed saves left, and checks what
// the folder holds.
void take_save_dir(const std::string& dir, const std::string& run_id, Communicator& world,
                   const SaveDirOptions& options, int& fd) {
  check_writable(dir, run_id, world.rank());
  if (world.rank() != 0) return;
  lock_save_dir(dir, run_id, fd);
  const std::vector<std::string> left = save::remove_save_leftovers(dir);
  if (!left.empty()) {
    log().info("save folder '{}': removed {} left by a save that did not finish ({}{})", dir, left.size(), left[0],
               left.size() > 1 ? ", ..." : "");
  }
  check_save_root(dir, options);
}

// Every rank finds rank 0's lock record of this run in the folder: one
// spelling may name a different folder on each node (a node-local disk, a
// per-rank working directory), and a save split over such folders cannot be
// resumed.
void check_shared(const std::string& dir, const std::string& run_id, int rank) {
  if (rank == 0) return;
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(fs::path(dir) / ".lock", ec))) {
    throw ConfigError(str("save folder '", dir, "': its '.lock' is a symbolic link on rank ", rank, ", so this rank "
                          "may see another folder than rank 0 does: remove the link, and give a save folder every "
                          "rank shares"));
  }
  std::ifstream in(fs::path(dir) / ".lock");
  std::string record((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (record.find("run " + run_id) == std::string::npos) {
    throw ConfigError(str("save folder '", dir, "' is not the folder rank 0 has: rank ", rank, " does not find "
                          "rank 0's record of this run in its '.lock' (",
                          record.empty() ? "no such file" : "another run's",
                          "), so the spelling names another folder here (a node-local disk or another working "
                          "directory). A save is one folder every rank writes into: give a path on a file system "
                          "all ranks share, the same on each"));
  }
}

}  // namespace

SaveDirLock::SaveDirLock(const std::string& dir, const std::string& run_id, Communicator& world,
                         SaveDirOptions options) {
  // Every rank checks, rank 0 locks; then the ranks agree, so a folder one
  // rank cannot use is the same error on every rank (none waits for it).
  try {
    agree_on_outcome(world, "the save folder check", [&] { take_save_dir(dir, run_id, world, options, fd_); });
    agree_on_outcome(world, "the save folder check", [&] { check_shared(dir, run_id, world.rank()); });
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SaveDirLock::~SaveDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace remat
