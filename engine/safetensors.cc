// The safetensors reader (SafetensorsFile, SafetensorsSet) and the dtype
// names; the writer is engine/safetensors_writer.cc.
#include "engine/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace fs = std::filesystem;

namespace {

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kDouble, "F64"}, {at::kLong, "I64"},
    {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},       {at::kByte, "U8"},    {at::kBool, "BOOL"},
};

std::string known_dtype_names() {
  std::string all;
  for (const auto& d : kDtypes) all += std::string(all.empty() ? "" : ", ") + d.name;
  return all;
}

// What every refusal of a file ends with.
constexpr const char* kRemedy =
    ": the file is damaged or is not a safetensors file; write it again (or download it again)";

[[noreturn]] void refuse(const std::string& path, const std::string& what, const char* remedy = kRemedy) {
  throw ConfigError(str("safetensors file '", path, "': ", what, remedy));
}

// The JSON of a header or an index, with every object checked for a key given
// twice (the parser would keep the last one silently) and nesting held to
// `max_depth` (a header is at most 3 deep: file, tensor, shape). Returns the
// fault in `fault` ("does not parse as JSON (...)") and a null value when the
// text is not acceptable.
nlohmann::json parse_strict(const std::string& text, int max_depth, std::string& fault) {
  struct Refused {
    std::string why;
  };
  std::vector<std::set<std::string>> open_objects;
  auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if ((event == Event::object_start || event == Event::array_start) && depth >= max_depth) {
      throw Refused{str("nests deeper than ", max_depth, " levels")};
    }
    if (event == Event::object_start) open_objects.emplace_back();
    if (event == Event::object_end && !open_objects.empty()) open_objects.pop_back();
    if (event == Event::key && !open_objects.empty() &&
        !open_objects.back().insert(parsed.get<std::string>()).second) {
      throw Refused{str("has the key '", parsed.get<std::string>(), "' twice in one object")};
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text, check);
  } catch (const Refused& r) {
    fault = r.why;
  } catch (const nlohmann::json::exception& e) {
    // Ill-formed UTF-8 is one of these: the parser checks every string. Its
    // message quotes the bytes last read: any not printable ASCII is shown
    // as \xNN, so that the error is valid UTF-8 wherever it goes.
    std::string shown;
    for (const char c : std::string(e.what())) {
      const auto u = static_cast<unsigned char>(c);
      if (u >= 0x20 && u < 0x7F) {
        shown += c;
      } else {
        char hex[8];
        std::snprintf(hex, sizeof hex, "\\x%02x", u);
        shown += hex;
      }
    }
    fault = str("does not parse as JSON (", shown, ")");
  }
  return nullptr;
}

// A non-negative integer of the JSON that fits int64, else -1.
int64_t non_negative(const nlohmann::json& v) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) return -1;
  const uint64_t u = v.get<uint64_t>();
  return u > static_cast<uint64_t>(INT64_MAX) ? -1 : static_cast<int64_t>(u);
}

// One header entry `name`: {"dtype", "shape", "data_offsets"}, checked alone.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& e) {
  const std::string who = str("tensor '", name, "'");
  if (!e.is_object()) refuse(path, str(who, " is described by ", e.type_name(), ", not an object"));
  for (const auto& item : e.items()) {
    if (item.key() != "dtype" && item.key() != "shape" && item.key() != "data_offsets") {
      refuse(path, str(who, " has the key '", item.key(), "', not one of dtype, shape, data_offsets"));
    }
  }
  SafetensorsEntry entry;
  entry.name = name;
  if (!e.contains("dtype") || !e["dtype"].is_string()) refuse(path, str(who, " has no dtype string"));
  const std::string dtype = e["dtype"].get<std::string>();
  bool known = false;
  for (const auto& d : kDtypes) {
    if (dtype == d.name) entry.dtype = d.dtype, known = true;
  }
  if (!known) {
    refuse(path, str(who, " has dtype '", dtype, "', which remat does not read (it reads ", known_dtype_names(), ")"),
           ": convert the file's tensors to one of those dtypes (in Python: safetensors.torch with tensor.to(...))");
  }
  if (!e.contains("shape") || !e["shape"].is_array()) refuse(path, str(who, " has no shape array"));
  // The bytes, and their bound with each 0 taken as 1: a tensor's strides are
  // products of its sizes so taken, and must fit 64 bits too.
  const int64_t item = static_cast<int64_t>(c10::elementSize(entry.dtype));
  int64_t bytes = item, bound = item;
  for (const auto& d : e["shape"]) {
    const int64_t size = non_negative(d);
    if (size < 0) refuse(path, str(who, " has the shape ", e["shape"].dump(), ": each size must be an integer >= 0"));
    entry.shape.push_back(size);
    if (__builtin_mul_overflow(bound, std::max<int64_t>(size, 1), &bound)) {
      refuse(path, str(who, " has the shape ", e["shape"].dump(), ", more elements than a 64-bit size holds"));
    }
    bytes *= size;  // <= bound: no overflow
  }
  const nlohmann::json* offsets = e.contains("data_offsets") ? &e["data_offsets"] : nullptr;
  if (!offsets || !offsets->is_array() || offsets->size() != 2 || non_negative((*offsets)[0]) < 0 ||
      non_negative((*offsets)[1]) < 0) {
    refuse(path, str(who, " has data_offsets ", offsets ? offsets->dump() : std::string("missing"),
                     ": they must be two integers [begin, end], 0 <= begin <= end"));
  }
  entry.begin = non_negative((*offsets)[0]);
  entry.end = non_negative((*offsets)[1]);
  if (entry.begin > entry.end) {
    refuse(path, str(who, " has data_offsets [", entry.begin, ", ", entry.end, "]: begin is past end"));
  }
  if (entry.end - entry.begin != bytes) {
    refuse(path, str(who, " of dtype ", dtype, " and shape ", e["shape"].dump(), " is ", bytes,
                     " bytes, but its data_offsets [", entry.begin, ", ", entry.end, "] hold ", entry.end - entry.begin));
  }
  return entry;
}

// The entries in data order, checked to tile the data exactly: the first at
// 0, each starting where the one before ends, the last ending at the data's
// end (the format's own reader demands the same: no overlap, no gap).
void check_tiling(const std::string& path, std::vector<SafetensorsEntry>& entries, int64_t data_bytes) {
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  int64_t at = 0;
  const SafetensorsEntry* before = nullptr;
  for (const auto& e : entries) {
    if (e.end > data_bytes) {
      refuse(path, str("tensor '", e.name, "' has data_offsets [", e.begin, ", ", e.end, "], past the end of the data (",
                       data_bytes, " bytes): the file is truncated or its header is wrong"));
    }
    if (e.begin < at) {
      refuse(path, str("tensor '", e.name, "' at [", e.begin, ", ", e.end, ") overlaps tensor '", before->name,
                       "' at [", before->begin, ", ", before->end, ")"));
    }
    if (e.begin > at) {
      refuse(path, str("the data has a gap of ", e.begin - at, " bytes at [", at, ", ", e.begin, ") before tensor '",
                       e.name, "': every byte of the data must belong to a tensor"));
    }
    at = e.end;
    before = &e;
  }
  if (at != data_bytes) {
    refuse(path, str("the tensors cover ", at, " bytes of data but the file holds ", data_bytes,
                     " after its header: the last ", data_bytes - at, " bytes belong to no tensor"));
  }
}

struct Header {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  int64_t data_start = 0;
};

// The header of the `size` bytes at `bytes`, checked whole before any tensor is read.
Header read_header(const std::string& path, const char* bytes, int64_t size) {
  if (size < 8) {
    refuse(path, str("it is ", size, " bytes, shorter than the 8-byte header length every safetensors file starts with"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  if (n > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes)) {
    refuse(path, str("its header length is ", n, " bytes, more than the ", kMaxSafetensorsHeaderBytes,
                     " a safetensors reader accepts"));
  }
  if (n > static_cast<uint64_t>(size - 8)) {
    refuse(path, str("its header length is ", n, " bytes but only ", size - 8,
                     " follow the length: the file is truncated"));
  }
  Header header;
  header.data_start = 8 + static_cast<int64_t>(n);
  std::string fault;
  const nlohmann::json json = parse_strict(std::string(bytes + 8, n), 3, fault);
  if (!fault.empty()) refuse(path, str("its header ", fault));
  if (!json.is_object()) refuse(path, str("its header is a JSON ", json.type_name(), ", not an object"));
  for (const auto& item : json.items()) {
    if (item.key() != "__metadata__") {
      header.entries.push_back(parse_entry(path, item.key(), item.value()));
      continue;
    }
    if (!item.value().is_object()) refuse(path, "its __metadata__ is not an object of strings");
    for (const auto& m : item.value().items()) {
      if (!m.value().is_string()) {
        refuse(path, str("its __metadata__ '", m.key(), "' is a ", m.value().type_name(), ", not a string"));
      }
      header.metadata[m.key()] = m.value().get<std::string>();
    }
  }
  check_tiling(path, header.entries, size - header.data_start);
  return header;
}

bool little_endian_host() { return __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__; }

void refuse_big_endian(const std::string& what) {
  if (!little_endian_host()) {
    throw ConfigError(str(what, ": remat reads and writes safetensors files (little-endian) on little-endian "
                                "hosts only; convert the file on such a host"));
  }
}

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  throw ConfigError(str("dtype ", c10::toString(dtype), " has no safetensors name remat writes (it writes ",
                        known_dtype_names(), "): convert the tensor first"));
}

at::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  throw ConfigError(str("safetensors dtype '", name, "' is not one remat reads (", known_dtype_names(), ")"));
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  refuse_big_endian(str("safetensors file '", path, "'"));
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  // O_NONBLOCK: a fifo given by mistake is refused below instead of waiting for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    refuse(path, str("cannot open it (", std::strerror(err), ")"),
           err == ENOENT ? ": check the path" : ": check the path and its permissions");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    refuse(path, S_ISDIR(st.st_mode) ? "it is a directory" : "it is not a regular file",
           ": give a .safetensors file (SafetensorsSet::open takes a folder)");
  }
  file->file_bytes_ = static_cast<int64_t>(st.st_size);
  if (file->file_bytes_ > 0) {
    void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      refuse(path, str("cannot map its ", st.st_size, " bytes (", std::strerror(err), ")"),
             ": check the memory limits (ulimit -v) and that the file is on a local disk");
    }
    file->map_ = map;
  }
  ::close(fd);  // the mapping keeps the file
  Header header = read_header(path, static_cast<const char*>(file->map_), file->file_bytes_);
  file->data_start_ = header.data_start;
  file->entries_ = std::move(header.entries);
  file->metadata_ = std::move(header.metadata);
  for (size_t i = 0; i < file->entries_.size(); ++i) file->by_name_[file->entries_[i].name] = i;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, static_cast<size_t>(file_bytes_));
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) {
    throw ConfigError(str("safetensors file '", path_, "' has no tensor '", name, "' (it has ", entries_.size(),
                          " tensors): check the name, or the name map given to the loader"));
  }
  const auto options = at::TensorOptions().dtype(e->dtype).device(at::kCPU);
  if (e->begin == e->end) return at::empty(e->shape, options);  // zero-size: no bytes to map
  const char* bytes = static_cast<const char*>(map_) + data_start_ + e->begin;
  if (e->dtype == at::kBool) {
    // A bool holds 0 or 1; any other byte would read as neither true nor false.
    const void* odd = nullptr;
    for (int64_t i = 0; i < e->end - e->begin && !odd; ++i) {
      if (static_cast<unsigned char>(bytes[i]) > 1) odd = bytes + i;
    }
    if (odd) {
      throw ConfigError(str("safetensors file '", path_, "': tensor '", name, "' of dtype BOOL holds the byte ",
                            int(*static_cast<const unsigned char*>(odd)), " at ",
                            static_cast<const char*>(odd) - bytes, ", not 0 or 1", kRemedy));
    }
  }
  // The format does not align data offsets: a tensor whose bytes do not sit
  // at a multiple of its element size is copied into an aligned one, so that
  // no kernel reads a misaligned element (undefined behaviour, and a fault
  // on some hosts). Aligned tensors, every one remat writes, are views.
  if (reinterpret_cast<uintptr_t>(bytes) % c10::elementSize(e->dtype) != 0) {
    at::Tensor copy = at::empty(e->shape, options);
    std::memcpy(copy.data_ptr(), bytes, static_cast<size_t>(e->end - e->begin));
    return copy;
  }
  // A view of the read-only mapping: writing into it is a fault (SIGSEGV).
  return at::from_blob(const_cast<char*>(bytes), e->shape, options);
}

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Whether `name` is a sharded set's shard name, model-00001-of-00003.safetensors.
bool is_shard_name(const std::string& name) {
  const std::string form = "model-#####-of-#####.safetensors";
  if (name.size() != form.size()) return false;
  for (size_t i = 0; i < form.size(); ++i) {
    if (form[i] == '#' ? !std::isdigit(static_cast<unsigned char>(name[i])) : name[i] != form[i]) return false;
  }
  return true;
}

// What `path` names: an index, a file, or the one of them a folder holds, in
// from_pretrained's order: model.safetensors, else the index (else the
// folder's one .safetensors file).
std::string resolve_set_path(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  const fs::path single = fs::path(path) / "model.safetensors", index = fs::path(path) / kIndexName;
  if (fs::exists(single, ec)) {
    if (fs::exists(index, ec)) {
      log().warn("safetensors folder '{}' holds both model.safetensors and {}: reading model.safetensors (as "
                 "Hugging Face's from_pretrained does) and ignoring the index and its shards; give the index's "
                 "path to read the shards",
                 path, kIndexName);
    }
    return single.string();
  }
  if (fs::exists(index, ec)) return index.string();
  std::vector<std::string> files;
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    const std::string name = entry.path().filename().string();
    if (ends_with(name, ".safetensors")) files.push_back(entry.path().string());
    shards += is_shard_name(name);
  }
  std::sort(files.begin(), files.end());
  if (files.size() == 1 && shards == 0) return files[0];
  if (files.empty()) {
    throw ConfigError(str("safetensors folder '", path, "' holds neither ", kIndexName,
                          " nor a .safetensors file: give the folder of a model, or a file's path"));
  }
  if (shards > 0) {
    throw ConfigError(str("safetensors folder '", path, "' holds ", shards, " shards (model-0000i-of-0000K."
                          "safetensors) and no ", kIndexName, ": an export into it was interrupted or failed before "
                          "writing its index (remat removes the index before replacing shards, so that a half-"
                          "replaced folder is never read), and its shards may be of two exports: export again"));
  }
  std::string listed;
  for (const auto& f : files) listed += str(listed.empty() ? "" : ", ", fs::path(f).filename().string());
  throw ConfigError(str("safetensors folder '", path, "' holds ", files.size(), " .safetensors files (", listed,
                        ") and no ", kIndexName, " saying which tensor is where: give one file's path, or add the index"));
}

// The weight_map of the index at `path`: {tensor: file name in its folder};
// its metadata's kSafetensorsExportIdKey in `export_id` ("" when none).
std::map<std::string, std::string> read_index(const std::string& path, std::string& export_id) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (!ec && size > static_cast<uintmax_t>(kMaxSafetensorsHeaderBytes)) {
    throw ConfigError(str("safetensors index '", path, "' is ", size, " bytes, more than the ",
                          kMaxSafetensorsHeaderBytes, " an index may be: give the index of a model"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError(str("safetensors index '", path, "': cannot read it (", std::strerror(errno),
                          "): check the path and its permissions"));
  }
  std::stringstream text;
  text << in.rdbuf();
  auto bad = [&](const std::string& what) {
    return ConfigError(str("safetensors index '", path, "': ", what,
                           "; it must be {\"metadata\": {..}, \"weight_map\": {tensor: file}}: write it again"));
  };
  std::string fault;
  const nlohmann::json json = parse_strict(text.str(), 8, fault);
  if (!fault.empty()) throw bad(str("it ", fault));
  if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object()) {
    throw bad("it has no weight_map object");
  }
  if (json.contains("metadata") && json["metadata"].is_object() && json["metadata"].contains(kSafetensorsExportIdKey)) {
    const auto& id = json["metadata"][kSafetensorsExportIdKey];
    if (!id.is_string()) throw bad(str("its metadata's ", kSafetensorsExportIdKey, " is not a string"));
    export_id = id.get<std::string>();
  }
  std::map<std::string, std::string> map;
  for (const auto& item : json["weight_map"].items()) {
    if (!item.value().is_string()) throw bad(str("the weight_map's '", item.key(), "' is not a file name"));
    const std::string file = item.value().get<std::string>();
    const fs::path p(file);
    if (file.empty() || p.is_absolute() || std::find(p.begin(), p.end(), "..") != p.end()) {
      throw bad(str("the weight_map puts '", item.key(), "' in '", file,
                    "', not a file of the index's folder (an absolute path or one through '..')"));
    }
    map[item.key()] = file;
  }
  return map;
}

}  // namespace

SafetensorsSet SafetensorsSet::open(const std::string& path) {
  SafetensorsSet set;
  const std::string target = resolve_set_path(path);
  if (!ends_with(target, ".json")) {
    set.files_.push_back(SafetensorsFile::open(target));
    for (const auto& e : set.files_[0]->entries()) set.file_by_name_[e.name] = 0;
    return set;
  }
  std::string export_id;
  const auto weight_map = read_index(target, export_id);
  const fs::path folder = fs::path(target).parent_path();
  std::map<std::string, size_t> file_index;  // each file opened once
  for (const auto& [name, file] : weight_map) {
    auto it = file_index.find(file);
    if (it == file_index.end()) {
      it = file_index.emplace(file, set.files_.size()).first;
      try {
        set.files_.push_back(SafetensorsFile::open((folder / file).string()));
      } catch (const ConfigError& e) {
        throw ConfigError(str(e.what(), " (named by the index '", target, "')"));
      }
    }
    const auto& meta = set.files_[it->second]->metadata();
    const auto id = meta.find(kSafetensorsExportIdKey);
    if (!export_id.empty() && id != meta.end() && id->second != export_id) {
      throw ConfigError(str("safetensors index '", target, "' is of the export ", export_id, " but its file '", file,
                            "' is of the export ", id->second, ": the folder mixes two exports (one stopped half-"
                            "way); export again"));
    }
    if (!set.files_[it->second]->find(name)) {
      throw ConfigError(str("safetensors index '", target, "' puts tensor '", name, "' in '", file,
                            "', which does not hold it: the index and its files do not match; write them again"));
    }
    set.file_by_name_[name] = it->second;
  }
  // A tensor in a file that the index puts elsewhere, or nowhere, makes the set ambiguous.
  for (const auto& [file, i] : file_index) {
    for (const auto& e : set.files_[i]->entries()) {
      auto where = weight_map.find(e.name);
      if (where == weight_map.end() || where->second != file) {
        throw ConfigError(str("safetensors index '", target, "': '", file, "' holds tensor '", e.name,
                              "', which the index ", where == weight_map.end() ? std::string("does not list")
                                                                               : "puts in '" + where->second + "'",
                              ": the index and its files do not match; write them again"));
      }
    }
  }
  return set;
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> all;
  for (const auto& item : file_by_name_) all.push_back(item.first);
  return all;  // a std::map's keys: sorted
}

const SafetensorsFile* SafetensorsSet::file_of(const std::string& name) const {
  auto it = file_by_name_.find(name);
  return it == file_by_name_.end() ? nullptr : files_[it->second].get();
}

const SafetensorsEntry* SafetensorsSet::find(const std::string& name) const {
  const SafetensorsFile* file = file_of(name);
  return file ? file->find(name) : nullptr;
}

at::Tensor SafetensorsSet::tensor(const std::string& name) const {
  const SafetensorsFile* file = file_of(name);
  if (!file) {
    throw ConfigError(str("safetensors: no file of the set (", files_.size(), " files, ", file_by_name_.size(),
                          " tensors, the first '", files_.empty() ? std::string() : files_[0]->path(),
                          "') holds tensor '", name, "': check the name, or the name map given to the loader"));
  }
  return file->tensor(name);
}

int64_t SafetensorsSet::total_bytes() const {
  int64_t total = 0;
  for (const auto& f : files_) total += f->file_bytes();
  return total;
}

}  // namespace remat
