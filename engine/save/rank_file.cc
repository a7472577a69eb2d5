#include "engine/save/rank_file.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "optim/optimizer.h"
#include "engine/save/manifest.h"
#include "engine/save/storage.h"
#include "rng/rng_state_io.h"
#include "rng/rng_tracker.h"
#include "runtime/error.h"

namespace remat::save {
namespace fs = std::filesystem;

std::string tensor_key(size_t i) { return str("t", i); }
std::string state_key(size_t i, const std::string& field) { return str("t", i, "__", field); }

namespace {

// `t` on the host, as the snapshot keeps it: copied (`copy`), or the tensor
// itself where it is on the host already. A device tensor's copy goes into
// pinned memory without blocking (`copied` says one is in flight).
at::Tensor host_tensor(const at::Tensor& t, bool copy, bool& copied) {
  const at::Tensor v = t.detach();
  if (!v.is_cuda()) return copy ? v.clone() : v.cpu();
  at::Tensor host = at::empty(v.sizes(), v.options().device(at::kCPU).pinned_memory(true));
  host.copy_(v, /*non_blocking=*/true);
  copied = true;
  return host;
}

}  // namespace

RankSnapshot snapshot_rank(const TrainPosition& position, const TrainShards& shards,
                           torch::optim::Optimizer& optimizer, const SaveIdentity& identity, int rank,
                           int world_size, bool copy) {
  RankSnapshot s;
  s.position = position;
  s.model_signature = identity.model_signature;
  s.run_id = identity.run_id;
  s.layout = shards.layout;
  s.splits = shards.splits;
  s.rank = rank;
  s.world_size = world_size;
  s.tp_rank = shards.tp_rank;
  s.dp_rank = shards.dp_rank;
  bool copied = false;
  for (const at::Tensor& t : shards.tensors) {
    s.tensors.push_back(host_tensor(t, copy, copied));
    std::map<std::string, at::Tensor> state;
    for (const auto& [field, value] : optim::optimizer_state_of(optimizer, t)) {
      state[field] = host_tensor(value, copy, copied);
    }
    s.states.push_back(std::move(state));
  }
  if (copied) torch::cuda::synchronize();  // the copies into pinned memory are complete
  s.rng = capture_rng();
  if (copy) {
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      s.host_bytes += static_cast<int64_t>(s.tensors[i].nbytes());
      for (const auto& [field, value] : s.states[i]) s.host_bytes += static_cast<int64_t>(value.nbytes());
    }
  }
  return s;
}

void write_rank_file_bytes(const RankSnapshot& snapshot, std::string& layout, const Sink& sink) {
  torch::serialize::OutputArchive archive, tensors, rng_archive;
  // Host tensors only: a save from a CUDA run loads on a machine without one.
  for (size_t i = 0; i < snapshot.tensors.size(); ++i) {
    tensors.write(tensor_key(i), snapshot.tensors[i]);
    for (const auto& [field, value] : snapshot.states[i]) tensors.write(state_key(i, field), value);
  }
  write_rng_snapshot(rng_archive, snapshot.rng);
  layout = layout_json(snapshot.layout).dump();
  archive.write("format", c10::IValue(kFormat));
  archive.write("tensors", tensors);
  archive.write("rng", rng_archive);
  archive.write("step", c10::IValue(snapshot.position.step));
  archive.write("rank", c10::IValue(static_cast<int64_t>(snapshot.rank)));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(snapshot.world_size)));
  archive.write("model_signature", c10::IValue(snapshot.model_signature));
  archive.write("run_id", c10::IValue(snapshot.run_id));
  archive.write("tp_rank", c10::IValue(static_cast<int64_t>(snapshot.tp_rank)));
  archive.write("dp_rank", c10::IValue(static_cast<int64_t>(snapshot.dp_rank)));
  archive.write("layout", c10::IValue(layout));
  archive.write("splits", c10::IValue(splits_json(snapshot.splits).dump()));
  archive.save_to([&](const void* data, size_t size) -> size_t {
    sink(data, size);
    return size;
  });
}

namespace {

// The bytes of file `index`, present and matching the manifest's size and
// CRC-32; an intact file listed under another rank's name is told apart
// from damage.
std::string checked_bytes(const std::string& folder, const std::string& path, const Manifest& manifest,
                          size_t index) {
  const auto& entry = manifest.files[index];
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) {
    throw ConfigError(str("resume: '", path, "' is missing: the manifest of the step ", manifest.step,
                          " save in '", folder, "' lists it as the file of rank ", index, " of ",
                          manifest.world_size, " but it is not there (deleted, or not copied with the "
                          "folder). Put it back, or resume from another step.",
                          offer_newest(root_of(folder), folder)));
  }
  std::string bytes = read_file(path);
  const int64_t crc = crc32_of(bytes);
  if (static_cast<int64_t>(bytes.size()) == entry.bytes && crc == entry.crc32) return bytes;
  // Intact but another rank's file of this save (renamed or swapped by hand): not damage.
  const auto other = std::find_if(manifest.files.begin(), manifest.files.end(), [&](const auto& f) {
    return f.bytes == static_cast<int64_t>(bytes.size()) && f.crc32 == crc;
  });
  if (other != manifest.files.end()) {
    throw ConfigError(str("resume: '", path, "' is intact but holds the file the manifest lists as '",
                          other->name, "' (rank ", other - manifest.files.begin(), "; same ", bytes.size(),
                          " bytes and CRC-32 ", crc, "), not rank ", index,
                          "'s: the rank files of this save were renamed or swapped. Give each its own name "
                          "back (this one is '", other->name, "'), or resume from another step.", offer_newest(root_of(folder), folder)));
  }
  throw ConfigError(str("resume: '", path, "' is damaged: ", bytes.size(), " bytes with CRC-32 ", crc,
                        " where the manifest recorded ", entry.bytes, " bytes with CRC-32 ", entry.crc32,
                        ". It changed after it was saved; resume from another step.",
                        offer_newest(root_of(folder), folder)));
}

// What a rank file records of its own place in the save.
struct OwnRecord {
  c10::IValue step, rank, run_id, world_size, tp_rank, dp_rank, layout;
};

OwnRecord read_own_record(torch::serialize::InputArchive& archive) {
  OwnRecord r;
  archive.read("step", r.step);
  archive.read("rank", r.rank);
  archive.read("world_size", r.world_size);
  archive.read("run_id", r.run_id);
  archive.read("tp_rank", r.tp_rank);
  archive.read("dp_rank", r.dp_rank);
  archive.read("layout", r.layout);
  return r;
}

// The file's own ranks and layout: a manifest edited to describe it
// otherwise (and its checksum recomputed) stops here.
void check_own_layout(const std::string& folder, const std::string& path, const OwnRecord& record,
                      const Manifest::File& entry) {
  const c10::IValue &tp_rank = record.tp_rank, &dp_rank = record.dp_rank, &layout = record.layout;
  const nlohmann::json own = nlohmann::json::parse(layout.toStringRef()), listed = layout_json(entry.tensors);
  if (tp_rank.toInt() == entry.tp_rank && dp_rank.toInt() == entry.dp_rank && own == listed) return;
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
  throw ConfigError(str("resume: '", path, "' records ", differs, ": '",
                        (fs::path(folder) / "manifest.json").string(),
                        "' was modified or damaged after it was saved; resume from another step.",
                        offer_newest(root_of(folder), folder)));
}

// Its record of the tensor-parallel splits (format 5) is the manifest's.
void check_own_splits(const std::string& folder, RankFile& file, const Manifest& manifest) {
  if (manifest.format < 5) return;
  c10::IValue splits;
  file.archive.read("splits", splits);
  const nlohmann::json own = nlohmann::json::parse(splits.toStringRef()), listed = splits_json(manifest.splits);
  for (size_t i = 0; i < std::max(own.size(), listed.size()); ++i) {
    const nlohmann::json a = i < own.size() ? own[i] : nlohmann::json();
    const nlohmann::json b = i < listed.size() ? listed[i] : nlohmann::json();
    if (a == b) continue;
    throw ConfigError(str("resume: '", file.path, "' records the tensor-parallel split ", a.dump(), " where '",
                          (fs::path(folder) / "manifest.json").string(), "' lists ", b.dump(),
                          ": the manifest was modified or damaged after it was saved; resume from another step.",
                          offer_newest(root_of(folder), folder)));
  }
}

// Files from another step, rank, world size or run (copied or swapped by
// hand) stop here.
void check_own_place(const std::string& folder, const std::string& path, const OwnRecord& record,
                     const Manifest& manifest, size_t index) {
  const c10::IValue &step = record.step, &rank = record.rank, &run_id = record.run_id;
  const c10::IValue& world_size = record.world_size;
  if (step.toInt() == manifest.step && world_size.toInt() == manifest.world_size &&
      rank.toInt() == static_cast<int64_t>(index) &&
      (manifest.run_id.empty() || run_id.toStringRef() == manifest.run_id)) {
    return;
  }
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
      "resume: '", path, "' holds rank ", rank.toInt(), "'s state", what.empty() ? "" : " of ", what,
      " but the manifest of '", folder, "' (step ", manifest.step, ") lists it as rank ", index, "'s",
      differs.empty() ? ": the rank files of this save were renamed or swapped. Give each its own name back, "
                        "or resume from another step"
                      : ": the folder mixes files of different saves; resume from a folder written as a "
                        "whole by Engine::save_checkpoint"));
}

}  // namespace

std::unique_ptr<RankFile> open_rank_file(const std::string& folder, const Manifest& manifest, size_t index) {
  auto file = std::make_unique<RankFile>();
  file->path = (fs::path(folder) / manifest.files[index].name).string();
  const std::string bytes = checked_bytes(folder, file->path, manifest, index);
  try {
    std::istringstream in(bytes);
    file->archive.load_from(in, at::Device(at::kCPU));  // staged on the host; the load copies to the device
    const OwnRecord record = read_own_record(file->archive);
    check_own_layout(folder, file->path, record, manifest.files[index]);
    check_own_splits(folder, *file, manifest);
    check_own_place(folder, file->path, record, manifest, index);
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

}  // namespace remat::save
