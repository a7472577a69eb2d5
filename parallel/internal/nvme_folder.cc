#include "parallel/internal/nvme_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel::internal {

namespace fs = std::filesystem;

namespace {

// The files removed when a signal ends the process: a fixed table the
// handler reads without locks (a slot's path is read only while it is live).
constexpr int kMaxFiles = 64;
enum SlotState : int { kFree, kClaimed, kLive };
struct FileSlot {
  std::atomic<int> state{kFree};
  char path[4096];
};
FileSlot g_files[kMaxFiles];
// The signals that end a process from outside and that remat sees through:
// a scheduler's or mpirun's stop (SIGTERM, SIGINT, SIGHUP; SIGUSR1 and
// SIGUSR2, which mpirun forwards to the ranks and which end a process that
// does not handle them), a CPU-time limit (SIGXCPU), a closed output
// (SIGPIPE: mpirun gone), a quit (SIGQUIT). Their handlers before remat's.
constexpr int kEndingSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGXCPU, SIGPIPE, SIGQUIT};
struct sigaction g_previous[NSIG];

void on_stop(int sig, siginfo_t* info, void* context) {
  remove_on_exit_now();
  const struct sigaction& previous = g_previous[sig];
  // A handler of the program's (either kind): it decides what follows.
  if ((previous.sa_flags & SA_SIGINFO) != 0) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

int track(const std::string& file) {
  static const bool installed = [] {
    for (const int sig : kEndingSignals) {
      // A signal the process ignores (SIGINT in a background job, SIGQUIT
      // under mpirun) stays ignored.
      ::sigaction(sig, nullptr, &g_previous[sig]);
      if (g_previous[sig].sa_handler == SIG_IGN) continue;
      // The program's handler keeps what it asked for: its mask, and the
      // flags that change the process around it (SA_RESTART: its system
      // calls go on after the handler returns).
      struct sigaction action = g_previous[sig];
      action.sa_sigaction = on_stop;
      action.sa_flags =
          SA_SIGINFO | (g_previous[sig].sa_flags & (SA_RESTART | SA_ONSTACK | SA_NODEFER | SA_RESETHAND));
      ::sigaction(sig, &action, nullptr);
    }
    return true;
  }();
  (void)installed;
  if (file.size() >= sizeof g_files[0].path) return -1;
  for (int i = 0; i < kMaxFiles; ++i) {
    int expected = kFree;
    if (!g_files[i].state.compare_exchange_strong(expected, kClaimed)) continue;
    std::memcpy(g_files[i].path, file.c_str(), file.size() + 1);
    g_files[i].state.store(kLive);
    return i;
  }
  return -1;
}

// Why the rank's folder `path` (`ec`: making it failed) or its `lock` file
// (`err`: opening it failed) cannot be used, naming the one at fault.
std::string unwritable(const std::string& path, const std::string& lock, const std::error_code& ec, int err) {
  std::error_code ignored;
  if (!ec) return str("cannot open its lock file '", lock, "' (", std::strerror(err), ")");
  if (fs::is_symlink(fs::symlink_status(path, ignored)) && !fs::exists(path, ignored)) {
    return str("cannot write its folder '", path, "': it is a symbolic link to '",
               fs::read_symlink(path, ignored).string(), "', which does not exist");
  }
  return str("cannot write its folder '", path, "' (", ec.message(), ")");
}

// Removes the files of `file_name` (and names it begins) in `folder`, saying
// so; folders and anything else there are the user's and stay.
void remove_leftovers(const std::string& folder, const std::string& file_name, const std::string& section) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    if (entry.path().filename().string().rfind(file_name, 0) != 0) continue;
    std::error_code size_ec;
    if (fs::is_directory(entry.symlink_status(size_ec))) continue;  // never made by remat
    const auto bytes = entry.is_regular_file(size_ec) ? entry.file_size(size_ec) : 0;
    fs::remove(entry.path(), size_ec);
    log().warn("{} nvme: removed '{}' ({} bytes), left by a run that ended without cleaning up", section,
               entry.path().string(), bytes);
  }
}

// The folders rank<K> (K >= world_size) under `kind_folder`: a crashed run
// of more ranks left them; their files go under each one's lock.
void sweep_ranks_beyond(const fs::path& kind_folder, int world_size, const std::string& kind,
                        const std::string& section) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(kind_folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank", 0) != 0 || name.size() == 4 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos || name.size() > 12) {
      continue;
    }
    if (std::stoll(name.substr(4)) < world_size || !fs::is_directory(entry.symlink_status(ec))) continue;
    const int fd = ::open((entry.path() / "lock").c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) remove_leftovers(entry.path().string(), name + "." + kind, section);
    ::close(fd);
  }
}

}  // namespace

void remove_on_exit_now() {
  for (auto& slot : g_files) {
    if (slot.state.load() == kLive) ::unlink(slot.path);
  }
}

NvmeFolder::NvmeFolder(const std::string& nvme_path, int rank, const std::string& section, const std::string& kind,
                       const std::string& holds, int world_size) {
  const std::string key = "zero_optimization." + section + ".nvme_path";
  std::error_code ec;
  const fs::file_status status = fs::status(nvme_path, ec);
  if (!fs::is_directory(status)) {
    const std::string what = status.type() == fs::file_type::not_found ? "does not exist"
                             : fs::exists(status)                       ? "is not a folder"
                                                                        : "cannot be opened (" + ec.message() + ")";
    const bool tilde = !nvme_path.empty() && nvme_path[0] == '~';
    throw ConfigError(str(key, " '", nvme_path, "' ", what, " on rank ", rank, ": give a folder on a fast local "
                          "disk (each rank keeps ", holds, " under it)",
                          tilde ? "; remat does not expand '~': write the home folder out" : ""));
  }
  const std::string name = "rank" + std::to_string(rank);
  path_ = (fs::path(nvme_path) / ("remat-" + kind) / name).string();
  file_name_ = name + "." + kind;
  fs::create_directories(path_, ec);
  const std::string lock = (fs::path(path_) / "lock").string();
  fd_ = ec ? -1 : ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) {
    const int err = errno;
    throw ConfigError(str(key, " '", nvme_path, "': rank ", rank, " ", unwritable(path_, lock, ec, err),
                          ": give a folder this job can write"));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(str(key, " '", nvme_path, "' is in use by another job: rank ", rank, "'s folder '", path_,
                          "' is locked by it. Give each job its own nvme_path (two jobs sharing one would overwrite "
                          "each other's ", holds.substr(holds.find(' ') + 1), ")"));
  }
  // Only what a run of this rank writes here (rank<R>.<kind>, and names it
  // begins): anything else in the folder is the user's and stays.
  remove_leftovers(path_, file_name_, section);
  if (rank == 0 && world_size > 0) sweep_ranks_beyond(fs::path(path_).parent_path(), world_size, kind, section);
  slot_ = track((fs::path(path_) / file_name_).string());
}

NvmeFolder::~NvmeFolder() {
  if (slot_ >= 0) g_files[slot_].state.store(kFree);
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace remat::parallel::internal
