#include "runtime/output_file.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace fs = std::filesystem;

namespace {

// The folder a file path lies in ("." for a bare name).
fs::path folder_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// The symbolic link's target, for the hint of where to write instead.
std::string link_target(const std::string& path) {
  std::error_code ec;
  const fs::path target = fs::read_symlink(path, ec);
  return ec ? std::string() : target.string();
}

}  // namespace

std::string shown_path(const std::string& path) {
  constexpr size_t kHead = 80, kTail = 120;
  if (path.size() <= kHead + kTail + 40) return path;
  return str(path.substr(0, kHead), "...(", path.size() - kHead - kTail, " characters)...",
             path.substr(path.size() - kTail));
}

std::string not_a_regular_file(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return "";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISLNK(st.st_mode)) return "a symbolic link";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISFIFO(st.st_mode)) return "a fifo";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

namespace {

constexpr const char* kTemporaryMark = ".remat-tmp.";  // PATH.remat-tmp.XXXXXX

// Whether `name` is a temporary of `base` remat would make: the mark and
// mkstemp's six letters or digits, nothing else.
bool temporary_of(const std::string& name, const std::string& base) {
  const std::string prefix = base + kTemporaryMark;
  if (name.size() != prefix.size() + 6 || name.compare(0, prefix.size(), prefix) != 0) return false;
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(),
                     [](unsigned char c) { return std::isalnum(c) != 0; });
}

}  // namespace

int remove_stale_temporaries(const std::string& path) {
  const std::string base = fs::path(path).filename().string();
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder_of(path), ec)) {
    if (!temporary_of(entry.path().filename().string(), base)) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    // Held by a writer at work, or a file with other names (so someone's
    // data, not a temporary): left alone.
    const bool stale = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
                       ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (stale && ::unlink(entry.path().c_str()) == 0) {
      ++removed;
      log().info("removed '{}' ({} bytes), the temporary file of an earlier write of '{}' that did not finish",
                 shown_path(entry.path().string()), st.st_size, shown_path(path));
    }
    ::close(fd);
  }
  return removed;
}

int open_temporary_beside(const std::string& path, std::string& name) {
  remove_stale_temporaries(path);
  name = path + kTemporaryMark + "XXXXXX";
  const int fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd >= 0) {
    // mkstemp creates the file 0600; the output gets the mode a new file gets here.
    const mode_t mask = ::umask(0);
    ::umask(mask);
    ::fchmod(fd, 0666 & ~mask);
    ::flock(fd, LOCK_EX | LOCK_NB);  // "being written": the next writer leaves it alone
  }
  return fd;
}

void check_output_file(const OutputFile& out) {
  const std::string shown = shown_path(out.path);
  if (out.path.empty()) throw ConfigError(str(out.flag, " is empty: give the path of the file to write"));
  if (out.path.size() >= PATH_MAX || fs::path(out.path).filename().string().size() > NAME_MAX) {
    throw ConfigError(str(out.flag, " '", shown, "' is ", out.path.size(), " characters long, more than a path "
                          "may have here (", PATH_MAX - 1, ", a name ", NAME_MAX, "): give a shorter path"));
  }
  const std::string what = not_a_regular_file(out.path);
  if (what == "a directory") {
    throw ConfigError(str(out.flag, " '", shown, "' is a directory: give a file path (e.g. ",
                          shown_path((fs::path(out.path) / out.example).string()), ")"));
  }
  if (!what.empty()) {
    const std::string target = what == "a symbolic link" ? link_target(out.path) : std::string();
    throw ConfigError(str(out.flag, " '", shown, "' is ", what,
                          ", not a regular file: the output is written beside it and renamed to that path, "
                          "which would replace it. Give the path of a regular file or of a new one",
                          target.empty() ? std::string() : str(" (to write where the link points: '",
                                                                shown_path(target), "')")));
  }
  std::error_code ec;
  const fs::path folder = folder_of(out.path);
  if (!fs::is_directory(folder, ec)) {
    throw ConfigError(str(out.flag, " '", shown, "': its folder '", shown_path(folder.string()), "' ",
                          fs::exists(folder, ec) ? "is not a directory" : "does not exist",
                          ": create it first, or give a path in an existing folder"));
  }
  std::string probe;
  const int fd = open_temporary_beside(out.path, probe);
  if (fd < 0) {
    throw ConfigError(str(out.flag, " '", shown, "' cannot be written (", std::strerror(errno),
                          "): give a file path in a writable folder"));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

std::string output_identity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return str("inode ", st.st_dev, ":", st.st_ino);
  std::error_code ec;
  const fs::path folder = fs::canonical(folder_of(path), ec);
  if (ec) return "";
  return (folder / fs::path(path).filename()).string();
}

void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::map<std::string, const std::pair<std::string, std::string>*> seen;
  for (const auto& output : outputs) {
    if (output.second.empty()) continue;
    const std::string id = output_identity(output.second);
    if (id.empty()) continue;  // its own check names the folder
    const auto [it, added] = seen.emplace(id, &output);
    if (added) continue;
    const auto& [flag, path] = *it->second;
    throw ConfigError(str(output.first, " '", shown_path(output.second), "' and ", flag, " '", shown_path(path),
                          "' are the same file, so one would overwrite the other: give each its own path"));
  }
}

namespace {

// Where `path` leads (through `..` and symbolic links of the part that exists).
fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? fs::absolute(path).lexically_normal() : p;
}

// Whether `inner` lies inside `outer` (or is it), in an entry `owned` names
// (every entry when it is empty).
bool within(const fs::path& inner, const fs::path& outer, const std::vector<std::string>& owned) {
  auto o = outer.begin();
  auto i = inner.begin();
  for (; o != outer.end(); ++i, ++o) {
    if (o->empty() && std::next(o) == outer.end()) break;  // "dir/"
    if (i == inner.end() || *i != *o) return false;
  }
  if (i == inner.end() || owned.empty()) return true;
  const std::string entry = i->string();
  for (const std::string& name : owned) {
    const bool prefix = !name.empty() && name.back() == '*';
    if (prefix ? entry.compare(0, name.size() - 1, name, 0, name.size() - 1) == 0 : entry == name) return true;
  }
  return false;
}

// Whether a file in `folder`'s entries `owned` names (every entry when it is
// empty), at any depth, is the file `out` names by another name (a hard link).
bool linked_inside(const std::string& out, const fs::path& folder, const std::vector<std::string>& owned) {
  struct stat target {};
  if (::stat(out.c_str(), &target) != 0 || !S_ISREG(target.st_mode) || target.st_nlink < 2) return false;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(folder, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it.depth() == 0 && !within(it->path(), folder, owned)) {
      it.disable_recursion_pending();
      continue;
    }
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && st.st_dev == target.st_dev && st.st_ino == target.st_ino) return true;
  }
  return false;
}

}  // namespace

const std::vector<std::string>& save_folder_entries() {
  static const std::vector<std::string> entries{".lock",       "latest",      "latest.tmp", "step_*",
                                                ".staging_*",  ".replaced_*", ".removed_*", ".probe_rank_*"};
  return entries;
}

void check_outputs_spare_inputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                                const std::vector<RunInput>& inputs) {
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    const fs::path out = resolved(path);
    const std::string id = output_identity(path);
    for (const RunInput& in : inputs) {
      if (in.path.empty()) continue;
      const bool same = (!id.empty() && id == output_identity(in.path)) || out == resolved(in.path);
      const bool inside = in.folder && within(out, resolved(in.path), in.owned);
      const bool linked = in.folder && !same && !inside && linked_inside(path, resolved(in.path), in.owned);
      if (!same && !inside && !linked) continue;
      const std::string shown = str(flag, " '", shown_path(path), "'");
      if (!in.folder) {
        throw ConfigError(str(shown, " is the ", in.what, " file '", shown_path(in.path), "' this run reads, so "
                              "writing it would destroy an input: give ", flag, " its own path"));
      }
      throw ConfigError(str(shown, same ? " is " : linked ? " is a hard link to a file inside " : " lies inside ",
                            in.what, " '", shown_path(in.path), "', ",
                            in.role, ", ", in.harm, ": give ", flag,
                            " a path outside that folder"));
    }
  }
}

void check_inputs_outside(const OutputFolder& out, const std::vector<RunInput>& inputs) {
  if (out.path.empty()) return;
  const fs::path folder = resolved(out.path);
  for (const RunInput& in : inputs) {
    if (in.path.empty()) continue;
    const fs::path path = resolved(in.path);
    const bool inside = path != folder && within(path, folder, out.owned);
    if (!inside && (in.folder || !linked_inside(in.path, folder, out.owned))) continue;
    const std::string what = in.folder ? "folder" : "file";
    throw ConfigError(str(in.what, " '", shown_path(in.path), "' ",
                          inside ? "lies inside " : "is a hard link to a file inside ", out.flag, " '",
                          shown_path(out.path), "', ", out.does, ", so the run would destroy the ", what,
                          " it reads: move it out of that folder, or give ", out.flag, " another one"));
  }
}

}  // namespace remat
