#include "parallel/internal/nvme_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel::internal {

namespace fs = std::filesystem;

NvmeFolder::NvmeFolder(const std::string& nvme_path, int rank, const std::string& section, const std::string& kind,
                       const std::string& holds) {
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
    const std::string why = ec ? ec.message() : std::strerror(errno);
    throw ConfigError(str(key, " '", nvme_path, "': rank ", rank, " cannot write its folder '", path_, "' (", why,
                          "): give a folder this job can write"));
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
  for (const auto& entry : fs::directory_iterator(path_, ec)) {
    if (entry.path().filename().string().rfind(file_name_, 0) != 0) continue;
    std::error_code size_ec;
    if (fs::is_directory(entry.symlink_status(size_ec))) continue;  // never made by remat
    const auto bytes = entry.is_regular_file(size_ec) ? entry.file_size(size_ec) : 0;
    fs::remove(entry.path(), size_ec);
    log().warn("{} nvme: removed '{}' ({} bytes), left by a run that ended without cleaning up", section,
               entry.path().string(), bytes);
  }
}

NvmeFolder::~NvmeFolder() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace remat::parallel::internal
