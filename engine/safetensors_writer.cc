// SafetensorsWriter (engine/safetensors.h): each file's header is fixed from
// the plan at construction and written first, so that tensors go to their
// places as they come, in any order, with nothing held but the one written.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/safetensors.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/output_file.h"

namespace remat {
namespace fs = std::filesystem;

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";

// Whether `s` is well-formed UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF).
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned c = *p;
    int n = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (n < 0 || end - p <= n) return n == 0;
    uint32_t cp = n == 0 ? c : c & (0x3F >> n);
    for (int i = 1; i <= n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    static constexpr uint32_t kLeast[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += n + 1;
  }
  return true;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += str(i ? ", " : "", shape[i]);
  return s + "]";
}

// A new sharded export's id: 128 random bits in hex, so that a shard of
// another export (left by one that stopped half-way) is told apart.
std::string new_export_id() {
  std::random_device device;
  std::mt19937_64 mix((static_cast<uint64_t>(device()) << 32) ^ device() ^
                      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                      (static_cast<uint64_t>(::getpid()) << 17));
  char id[33];
  std::snprintf(id, sizeof id, "%016llx%016llx", static_cast<unsigned long long>(mix()),
                static_cast<unsigned long long>(mix()));
  return id;
}

// The k-th rename of a sharded finish() (from 1) under the test seams of
// runtime/env_knobs.h: killed before it, or failed with EIO.
int rename_under_seams(const char* from, const char* to, int64_t k) {
  if (knobs::fault_export_rename(knobs::kFaultExportRenameKill) == k) ::raise(SIGKILL);
  if (knobs::fault_export_rename(knobs::kFaultExportRenameFail) == k) {
    errno = EIO;
    return -1;
  }
  return ::rename(from, to);
}

void fsync_folder(const std::string& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes all `size` bytes at `offset`, through EINTR and short writes; errno on failure.
bool pwrite_all(int fd, const char* data, int64_t size, int64_t offset) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, static_cast<size_t>(std::min<int64_t>(size, 1 << 30)), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = ENOSPC;
      return false;
    }
    data += n, size -= n, offset += n;
  }
  return true;
}

}  // namespace

struct SafetensorsWriter::Impl {
  struct Shard {
    std::string path, tmp;  // final and temporary names
    int fd = -1;
    int64_t bytes = 0;      // the whole file's
    bool renamed = false;
  };
  struct Tensor {
    SafetensorsPlanned planned;
    size_t shard = 0;
    int64_t offset = 0, bytes = 0;  // in its file
    bool written = false;
  };
  std::string path;
  SafetensorsWriteOptions options;
  std::vector<Shard> shards;
  std::vector<Tensor> tensors;
  std::map<std::string, size_t> by_name;
  std::string failed;  // why the writer can go no further, once a write failed
  bool finished = false;

  ~Impl() {
    // Before finish(), or after it failed: no file is left half-written.
    for (auto& shard : shards) {
      if (shard.fd < 0) continue;
      if (!shard.renamed) ::unlink(shard.tmp.c_str());
      ::close(shard.fd);
    }
  }
  [[noreturn]] void fail(const std::string& file, const std::string& what) const {
    throw Error(str("safetensors writer '", path, "': ", file.empty() ? "" : "file '" + file + "': ", what));
  }
  void check_plan(const std::vector<SafetensorsPlanned>& plan);
  void lay_out();
  void open_shards();
  std::string header(size_t shard) const;
  void remove_old_index();
  int64_t write_index() const;
};

void SafetensorsWriter::Impl::check_plan(const std::vector<SafetensorsPlanned>& plan) {
  if (options.max_shard_bytes < 0) fail("", str("max_shard_bytes is ", options.max_shard_bytes, ": give 0 or more"));
  for (const auto& [key, value] : options.metadata) {
    if (!valid_utf8(key) || !valid_utf8(value)) fail("", str("the metadata '", key, "' is not valid UTF-8"));
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto& p = plan[i];
    const std::string who = str("planned tensor ", i, " '", p.name, "'");
    if (p.name.empty()) fail("", str("planned tensor ", i, " has an empty name: give every tensor a name"));
    if (!valid_utf8(p.name)) fail("", str(who, ": the name is not valid UTF-8, which the format's JSON requires"));
    if (p.name == "__metadata__") fail("", str(who, ": the name is the format's own key; rename the tensor"));
    if (!by_name.emplace(p.name, i).second) fail("", str(who, " is planned twice: each name once"));
    Tensor t;
    t.planned = p;
    t.bytes = static_cast<int64_t>(c10::elementSize(p.dtype));
    try {
      safetensors_dtype_name(p.dtype);
    } catch (const ConfigError& e) {
      fail("", str(who, ": ", e.what()));
    }
    for (int64_t d : p.shape) {
      if (d < 0 || __builtin_mul_overflow(t.bytes, d, &t.bytes)) {
        fail("", str(who, " has the shape ", shape_text(p.shape), ": sizes must be >= 0 and the bytes fit 64 bits"));
      }
    }
    tensors.push_back(std::move(t));
  }
}

// Each tensor's shard and offset: one file, or shards filled in plan order up
// to max_shard_bytes of data each (a tensor larger than that alone in its own).
void SafetensorsWriter::Impl::lay_out() {
  size_t shard = 0;
  int64_t filled = 0;
  for (auto& t : tensors) {
    if (options.max_shard_bytes > 0 && filled > 0 && filled + t.bytes > options.max_shard_bytes) ++shard, filled = 0;
    t.shard = shard;
    t.offset = filled;  // from the data's start, until the header is known
    filled += t.bytes;
  }
  shards.resize(shard + 1);
  const size_t k = shards.size();
  for (size_t i = 0; i < k; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, k);
    shards[i].path = options.max_shard_bytes > 0 ? (fs::path(path) / name).string() : path;
  }
}

std::string SafetensorsWriter::Impl::header(size_t shard) const {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  if (!options.metadata.empty()) {
    json["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : options.metadata) json["__metadata__"][key] = value;
  }
  for (const auto& t : tensors) {
    if (t.shard != shard) continue;
    json[t.planned.name] = {{"dtype", safetensors_dtype_name(t.planned.dtype)},
                            {"shape", t.planned.shape},
                            {"data_offsets", {t.offset, t.offset + t.bytes}}};
  }
  std::string text = json.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  return text;
}

void SafetensorsWriter::Impl::open_shards() {
  for (size_t s = 0; s < shards.size(); ++s) {
    Shard& shard = shards[s];
    const std::string text = header(s);
    const int64_t data_start = 8 + static_cast<int64_t>(text.size());
    shard.bytes = data_start;
    for (auto& t : tensors) {
      if (t.shard != s) continue;
      t.offset += data_start;
      shard.bytes += t.bytes;
    }
    const std::string what = not_a_regular_file(shard.path);
    if (!what.empty()) fail(shard.path, str("it is ", what, ": give the path of a regular file or of a new one"));
    shard.fd = open_temporary_beside(shard.path, shard.tmp);
    if (shard.fd < 0) {
      const std::string why = std::strerror(errno);
      fail(shard.path, str("cannot create a file beside it (", why, "): give a path in a writable folder"));
    }
    // The whole file's room up front: a full disk is found before any tensor is gathered.
    if (::fallocate(shard.fd, 0, 0, shard.bytes) != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
      const std::string why = std::strerror(errno);
      fail(shard.path, str("cannot reserve its ", shard.bytes, " bytes (", why, "): free space there, or write elsewhere"));
    }
    char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xFF);
    if (!pwrite_all(shard.fd, length, 8, 0) || !pwrite_all(shard.fd, text.data(), static_cast<int64_t>(text.size()), 8)) {
      const std::string why = std::strerror(errno);
      fail(shard.path, str("writing its header failed (", why, "): free space there, or write elsewhere"));
    }
  }
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsPlanned> plan,
                                     SafetensorsWriteOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__) {
    throw Error(str("safetensors writer '", path, "': remat writes safetensors (little-endian) on little-endian "
                    "hosts only"));
  }
  impl_->path = std::move(path);
  impl_->options = std::move(options);
  if (impl_->options.max_shard_bytes > 0) impl_->options.metadata.emplace(kSafetensorsExportIdKey, new_export_id());
  impl_->check_plan(plan);
  if (impl_->options.max_shard_bytes > 0) {
    std::error_code ec;
    const std::string& folder = impl_->path;
    if (!fs::is_directory(folder, ec) && !fs::create_directory(folder, ec)) {
      impl_->fail("", str("cannot create the folder (", ec ? ec.message() : "it exists and is not a directory",
                          "): give a folder whose parent exists"));
    }
  }
  impl_->lay_out();
  impl_->open_shards();  // on a failure, ~Impl removes what was created
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const std::string& name, const at::Tensor& value) {
  Impl& w = *impl_;
  if (w.finished) w.fail("", str("write('", name, "') after finish()"));
  if (!w.failed.empty()) w.fail("", str("write('", name, "') after a failed write (", w.failed, ")"));
  auto it = w.by_name.find(name);
  if (it == w.by_name.end()) w.fail("", str("tensor '", name, "' is not in the plan: plan every tensor at construction"));
  Impl::Tensor& t = w.tensors[it->second];
  const Impl::Shard& shard = w.shards[t.shard];
  if (t.written) w.fail(shard.path, str("tensor '", name, "' is written twice: write each once"));
  if (!value.defined()) w.fail(shard.path, str("tensor '", name, "' is an undefined tensor"));
  if (value.scalar_type() != t.planned.dtype) {
    w.fail(shard.path, str("tensor '", name, "' is ", c10::toString(value.scalar_type()), " but planned as ",
                           c10::toString(t.planned.dtype), " (", safetensors_dtype_name(t.planned.dtype),
                           "): convert it before writing, nothing is converted silently"));
  }
  if (value.sizes().vec() != t.planned.shape) {
    w.fail(shard.path, str("tensor '", name, "' has the shape ", shape_text(value.sizes().vec()),
                           " but is planned as ", shape_text(t.planned.shape)));
  }
  if (value.layout() != at::kStrided) {
    w.fail(shard.path, str("tensor '", name, "' is not a dense tensor (layout ", value.layout(),
                           "): write value.to_dense()"));
  }
  // Any device, any strides (views, expanded tensors): host bytes, row-major.
  const at::Tensor host = value.detach().resolve_neg().to(at::kCPU).contiguous();
  if (!pwrite_all(shard.fd, static_cast<const char*>(host.data_ptr()), t.bytes, t.offset)) {
    const std::string why = std::strerror(errno);
    w.failed = str("tensor '", name, "': ", why);
    w.fail(shard.path, str("writing tensor '", name, "' (", t.bytes, " bytes) to '", shard.tmp, "' failed (", why,
                           "): free space there, or write elsewhere"));
  }
  t.written = true;
}

// The index of a sharded set, {"metadata": {"total_size"}, "weight_map"},
// written atomically beside the shards. Returns its bytes.
int64_t SafetensorsWriter::Impl::write_index() const {
  const std::string index = (fs::path(path) / kIndexName).string();
  nlohmann::json json;
  int64_t total = 0;
  json["weight_map"] = nlohmann::json::object();
  for (const auto& t : tensors) {
    total += t.bytes;
    json["weight_map"][t.planned.name] = fs::path(shards[t.shard].path).filename().string();
  }
  json["metadata"] = {{"total_size", total}, {kSafetensorsExportIdKey, options.metadata.at(kSafetensorsExportIdKey)}};
  const std::string text = json.dump(2) + "\n";
  std::string tmp;
  const int fd = open_temporary_beside(index, tmp);
  if (fd < 0) {
    const std::string why = std::strerror(errno);
    fail(index, str("cannot create a file beside it (", why, ")"));
  }
  if (!pwrite_all(fd, text.data(), static_cast<int64_t>(text.size()), 0) || ::fsync(fd) != 0 ||
      !not_a_regular_file(index).empty() || ::rename(tmp.c_str(), index.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(index, str("writing it failed (", why, "); the shards are in place, the index is not, so the folder is "
                    "refused by readers: write again"));
  }
  ::close(fd);
  return static_cast<int64_t>(text.size());
}

int64_t SafetensorsWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) w.fail("", "finish() called twice");
  if (!w.failed.empty()) w.fail("", str("finish() after a failed write (", w.failed, "); nothing is kept"));
  std::string missing;
  int n_missing = 0;
  for (const auto& t : w.tensors) {
    if (t.written) continue;
    if (++n_missing <= 8) missing += str(n_missing > 1 ? ", '" : "'", t.planned.name, "'");
  }
  if (n_missing > 0) {
    w.fail("", str(n_missing, " of ", w.tensors.size(), " planned tensors were not written (", missing,
                   n_missing > 8 ? ", ..." : "", "): write every planned tensor before finish()"));
  }
  const bool sharded = w.options.max_shard_bytes > 0;
  for (auto& shard : w.shards) {
    if (::fsync(shard.fd) != 0) {
      const std::string why = std::strerror(errno);
      w.failed = why;
      w.fail(shard.path, str("cannot flush the file (", why, "); its temporary file is removed"));
    }
  }
  // A sharded set replacing another: the old index goes first (and its
  // removal reaches the disk) before any shard is renamed over an old one,
  // so that a folder left half-replaced (a failure or a kill below) has no
  // index and is refused by readers, never read as a mix of two exports.
  if (sharded) w.remove_old_index();
  int64_t bytes = 0, k = 0;
  for (auto& shard : w.shards) {
    // Renamed while open (and so locked): a writer at work is never taken for a stale one.
    const std::string what = not_a_regular_file(shard.path);
    if (!what.empty() || rename_under_seams(shard.tmp.c_str(), shard.path.c_str(), ++k) != 0) {
      const std::string why = what.empty() ? std::string(std::strerror(errno)) : "it is " + what + " now";
      w.failed = why;
      w.fail(shard.path, str("cannot put the file in place (", why, "); its temporary file is removed",
                             sharded ? "; the folder has no index now, so readers refuse it: export again" : ""));
    }
    shard.renamed = true;
    bytes += shard.bytes;
  }
  w.finished = true;
  if (sharded) {
    fsync_folder(w.path);  // the shards' names on disk before the index names them
    bytes += w.write_index();
    fsync_folder(w.path);
  } else {
    const fs::path parent = fs::path(w.path).parent_path();
    fsync_folder(parent.empty() ? "." : parent.string());
  }
  return bytes;
}

// An earlier set's index in the folder, removed and the removal fsynced.
void SafetensorsWriter::Impl::remove_old_index() {
  const std::string index = (fs::path(path) / kIndexName).string();
  if (::unlink(index.c_str()) != 0 && errno != ENOENT) {
    const std::string why = std::strerror(errno);
    failed = why;
    fail(index, str("cannot remove the earlier export's index before replacing its shards (", why,
                    "); nothing was replaced: check the folder's permissions"));
  }
  fsync_folder(path);
}

std::vector<std::string> SafetensorsWriter::paths() const {
  std::vector<std::string> all;
  for (const auto& shard : impl_->shards) all.push_back(shard.path);
  if (impl_->options.max_shard_bytes > 0) all.push_back((fs::path(impl_->path) / kIndexName).string());
  return all;
}

}  // namespace remat
