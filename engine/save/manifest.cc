#include "engine/save/manifest.h"

#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <optional>

#include "engine/save/storage.h"
#include "runtime/error.h"

namespace remat::save {
namespace fs = std::filesystem;

nlohmann::json splits_json(const Splits& splits) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [name, split] : splits) {
    out.push_back({name,
                   {{"split", parallel::split_kind_name(split.kind)},
                    {"dim", split.dim},
                    {"stride", split.stride},
                    {"shape", split.full_sizes}}});
  }
  return out;
}

nlohmann::json layout_json(const std::vector<parallel::ShardLayout>& layout) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : layout) {
    nlohmann::json segments = nlohmann::json::array();
    for (const auto& s : t.segments) segments.push_back({s.name, s.param_offset, s.shard_offset, s.length});
    tensors.push_back(segments);
  }
  return tensors;
}

nlohmann::json parameters_json(const std::vector<std::pair<std::string, std::vector<int64_t>>>& parameters) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [name, shape] : parameters) out.push_back({name, shape});
  return out;
}

nlohmann::json manifest_json(const TrainPosition& position, const TrainShards& shards,
                             const SaveIdentity& identity, int world_size, const std::vector<ListedFile>& files) {
  nlohmann::json manifest = {{"format", kFormat},
                             {"step", position.step},
                             {"skipped_steps", position.skipped_steps},
                             {"world_size", world_size},
                             {"tp_size", shards.tp_size},
                             {"dp_size", shards.dp_size},
                             {"model", identity.model_signature},
                             {"run_id", identity.run_id},
                             {"settings", identity.settings},
                             {"parameters", parameters_json(identity.parameters)},
                             {"splits", splits_json(shards.splits)},
                             {"client_state", nlohmann::json::parse(position.client_state)},
                             {"files", nlohmann::json::array()}};
  // Only when there is one: a save without fp16 is as before.
  if (!position.loss_scaler.empty()) manifest["loss_scaler"] = nlohmann::json::parse(position.loss_scaler);
  if (!position.decisions.empty()) manifest["decisions"] = nlohmann::json::parse(position.decisions);
  for (size_t r = 0; r < files.size(); ++r) {
    manifest["files"].push_back({{"name", str("rank_", r, ".pt")},
                                 {"bytes", files[r].bytes},
                                 {"crc32", files[r].crc32},
                                 {"tp_rank", files[r].tp_rank},
                                 {"dp_rank", files[r].dp_rank},
                                 {"tensors", nlohmann::json::parse(files[r].layout)}});
  }
  // Its own checksum, over its compact form without this field.
  manifest["manifest_crc32"] = crc32_of(manifest.dump());
  return manifest;
}

namespace {

// What splits_json wrote, or nullopt when `j` is not that.
std::optional<Splits> parse_splits(const nlohmann::json& j) {
  if (!j.is_array()) return std::nullopt;
  Splits out;
  for (const auto& entry : j) {
    if (!entry.is_array() || entry.size() != 2 || !entry[0].is_string() || !entry[1].is_object()) return std::nullopt;
    const auto& o = entry[1];
    if (!o.contains("split") || !o["split"].is_string() || !o.contains("dim") || !o["dim"].is_number_integer() ||
        !o.contains("stride") || !o["stride"].is_number_integer() || !o.contains("shape") || !o["shape"].is_array()) {
      return std::nullopt;
    }
    const auto kind = parallel::split_kind_from_name(o["split"].get<std::string>());
    if (!kind) return std::nullopt;
    parallel::TensorSplit split{*kind, o["dim"].get<int64_t>(), o["stride"].get<int64_t>(), {}};
    for (const auto& d : o["shape"]) {
      if (!d.is_number_integer()) return std::nullopt;
      split.full_sizes.push_back(d.get<int64_t>());
    }
    try {
      parallel::check_split(split);
    } catch (const Error&) {
      return std::nullopt;
    }
    out.emplace_back(entry[0].get<std::string>(), std::move(split));
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& sizes) { return str(c10::IntArrayRef(sizes)); }

// The field checks of one manifest file: each error names the file and the key.
struct Fields {
  std::string path;

  ConfigError bad(const std::string& key, const char* want) const {
    return ConfigError(str("resume: '", path, "': '", key, "' must be ", want,
                           "; the manifest was edited or damaged"));
  }
  int64_t integer(const nlohmann::json& o, const char* key, const std::string& where) const {
    if (!o.contains(key) || !o[key].is_number_integer()) throw bad(where + key, "an integer");
    return o[key].get<int64_t>();
  }
};

// The manifest's own checksum (format 3 and later), checked first: any
// edit, even one that keeps every field well-formed (two parameter names
// swapped), stops here. Removes the field from `j`.
void check_manifest_crc(const std::string& path, nlohmann::json& j) {
  if (!j.contains("manifest_crc32") || !j["manifest_crc32"].is_number_integer()) {
    throw ConfigError(str("resume: '", path, "' records no manifest_crc32 (its checksum): it was "
                          "modified or damaged after it was saved; remat resumes only from an unmodified "
                          "manifest"));
  }
  const int64_t recorded = j["manifest_crc32"].get<int64_t>();
  j.erase("manifest_crc32");
  const int64_t actual = crc32_of(j.dump());
  if (actual != recorded) {
    throw ConfigError(str("resume: '", path, "' was modified or damaged after it was saved: its content has "
                          "CRC-32 ", actual, " but it records ", recorded,
                          ". remat resumes only from an unmodified manifest; restore it from a copy or "
                          "resume from another step"));
  }
}

// One entry of "files": a name (format 1) or {name, bytes, crc32}, with its
// ranks and layout from format 2.
Manifest::File read_file_entry(const nlohmann::json& f, int64_t format, const Fields& fields) {
  Manifest::File file;
  if (f.is_string()) {
    file.name = f.get<std::string>();
  } else if (f.is_object() && f.contains("name") && f["name"].is_string()) {
    file.name = f["name"].get<std::string>();
    file.bytes = fields.integer(f, "bytes", "files[].");
    file.crc32 = fields.integer(f, "crc32", "files[].");
  } else {
    throw fields.bad("files[]", "a {name, bytes, crc32} object");
  }
  if (format < 2) return file;
  file.tp_rank = fields.integer(f, "tp_rank", "files[].");
  file.dp_rank = fields.integer(f, "dp_rank", "files[].");
  if (!f.contains("tensors") || !f["tensors"].is_array()) throw fields.bad("files[].tensors", "an array");
  for (const auto& t : f["tensors"]) {
    if (!t.is_array()) throw fields.bad("files[].tensors[]", "an array of [name, parameter offset, offset, length]");
    parallel::ShardLayout layout;
    for (const auto& seg : t) {
      if (!seg.is_array() || seg.size() != 4 || !seg[0].is_string() || !seg[1].is_number_integer() ||
          !seg[2].is_number_integer() || !seg[3].is_number_integer() || seg[3].get<int64_t>() < 0) {
        throw fields.bad("files[].tensors[][]", "[name, parameter offset, offset, length]");
      }
      layout.segments.push_back({seg[0].get<std::string>(), seg[1].get<int64_t>(), seg[2].get<int64_t>(),
                                 seg[3].get<int64_t>()});
    }
    file.tensors.push_back(std::move(layout));
  }
  return file;
}

// The fields that describe the run: step, world size, model, run id,
// settings, parameters, client state and (format 5) the splits.
void read_run_fields(const nlohmann::json& j, const Fields& fields, Manifest& m) {
  m.step = fields.integer(j, "step", "");
  if (j.contains("skipped_steps")) {
    m.skipped_steps = fields.integer(j, "skipped_steps", "");
    if (m.skipped_steps < 0 || m.skipped_steps > m.step) throw fields.bad("skipped_steps", "a count from 0 to step");
  }
  m.world_size = fields.integer(j, "world_size", "");
  if (!j.contains("model") || !j["model"].is_string()) throw fields.bad("model", "a string");
  m.model = j["model"].get<std::string>();
  if (j.contains("run_id")) {
    if (!j["run_id"].is_string()) throw fields.bad("run_id", "a string");
    m.run_id = j["run_id"].get<std::string>();
  }
  if (j.contains("settings")) {
    if (!j["settings"].is_object()) throw fields.bad("settings", "an object of strings");
    for (const auto& [key, value] : j["settings"].items()) {
      if (!value.is_string()) throw fields.bad("settings." + key, "a string");
      m.settings[key] = value.get<std::string>();
    }
  }
  if (j.contains("parameters")) {
    if (!j["parameters"].is_array()) throw fields.bad("parameters", "an array of [name, shape] pairs");
    m.parameters = j["parameters"];
  }
  if (j.contains("client_state")) m.client_state = j["client_state"].dump();
  if (j.contains("loss_scaler")) {
    if (!j["loss_scaler"].is_object()) throw fields.bad("loss_scaler", "an object (fp16's loss scaler state)");
    m.loss_scaler = j["loss_scaler"].dump();
  }
  if (j.contains("decisions")) {
    if (!j["decisions"].is_object()) throw fields.bad("decisions", "an object (the run's decided values)");
    m.decisions = j["decisions"].dump();
  }
  if (m.format >= 5) {
    const auto splits = j.contains("splits") ? parse_splits(j["splits"]) : std::nullopt;
    if (!splits) {
      throw fields.bad("splits", "an array of [name, {split, dim, stride, shape}] pairs, one per model parameter");
    }
    m.splits = *splits;
  }
}

}  // namespace

Manifest read_manifest(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(str("resume: '", path, "' is not valid JSON (", e.what(),
                          "): the manifest was edited or damaged; resume from another step"));
  }
  const Fields fields{path};
  if (!j.is_object()) throw fields.bad("the top level", "an object");
  Manifest m;
  if (j.contains("format")) m.format = fields.integer(j, "format", "");
  if (m.format >= 3) check_manifest_crc(path, j);
  read_run_fields(j, fields, m);
  if (!j.contains("files") || !j["files"].is_array()) throw fields.bad("files", "an array");
  if (m.format >= 2) {
    m.tp_size = fields.integer(j, "tp_size", "");
    m.dp_size = fields.integer(j, "dp_size", "");
  }
  for (const auto& f : j["files"]) m.files.push_back(read_file_entry(f, m.format, fields));
  if (m.world_size < 1 || static_cast<int64_t>(m.files.size()) != m.world_size) {
    throw fields.bad("files", str("one entry per rank (world_size ", m.world_size, ")").c_str());
  }
  if (m.format >= 2 && (m.tp_size < 1 || m.dp_size < 1 || m.tp_size * m.dp_size != m.world_size)) {
    throw fields.bad("tp_size", "a divisor of world_size with dp_size = world_size / tp_size");
  }
  return m;
}

namespace {

bool save_verifies(const fs::path& folder) {
  try {
    const Manifest m = read_manifest((folder / "manifest.json").string());
    if (m.format < kOldestFormat || m.format > kFormat) return false;
    for (const auto& file : m.files) {
      const std::string bytes = read_file((folder / file.name).string());
      if (static_cast<int64_t>(bytes.size()) != file.bytes || crc32_of(bytes) != file.crc32) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

std::string newest_intact_step(const std::string& root, const std::string& skip) {
  const fs::path skipped = fs::path(skip).lexically_normal();
  for (const auto& [step, folder] : step_folders(root)) {
    if (!skip.empty() && folder.lexically_normal() == skipped) continue;
    if (save_verifies(folder)) return folder.string();
  }
  return "";
}

std::string offer_newest(const std::string& root, const std::string& skip) {
  const std::string newest = newest_intact_step(root, skip);
  return newest.empty() ? str(" No ", skip.empty() ? "" : "other ", "save in '", root,
                              "' verifies (a manifest and every rank file intact).")
                        : str(" The newest intact save is '", newest, "' (its manifest and every rank file "
                              "verify): load it with Engine::load_checkpoint(\"", newest, "\").");
}

std::string resolve_save(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "manifest.json")) return dir;
  if (!fs::exists(dir)) {
    throw ConfigError(str("resume: '", dir, "' does not exist: pass a folder written by Engine::save_checkpoint"));
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

void check_manifest_fits(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                         const SaveIdentity& identity) {
  if (manifest.format < kOldestFormat || manifest.format > kFormat) {
    throw ConfigError(str("resume: the save in '", folder, "' was written by ",
                          manifest.format < kOldestFormat ? "an earlier" : "a later", " remat (format ",
                          manifest.format, "; this one reads ", kOldestFormat, " to ", kFormat,
                          "), or its manifest was modified: resume it with the remat that wrote it"));
  }
  if (!identity.model_signature.empty() && manifest.model != identity.model_signature) {
    throw ConfigError(str("resume: the save in '", folder, "' holds a model with ", manifest.model,
                          " but this run builds ", identity.model_signature,
                          "; use the config the save was made with"));
  }
  for (const auto& [key, value] : identity.settings) {
    auto saved = manifest.settings.find(key);
    if (saved != manifest.settings.end() && saved->second != value) {
      throw ConfigError(str("resume: the save in '", folder, "' was made with ", key, " = ",
                            saved->second, " but this run has ", value,
                            ": a resumed run keeps the settings its saved state depends on; resume with the "
                            "override \"", key, "=", saved->second, "\" (EngineOptions::overrides; the save "
                            "itself is fine), or start a new run"));
    }
  }
  const bool reslice_tp = manifest.tp_size != shards.tp_size;
  if (reslice_tp && manifest.splits.empty()) {
    throw ConfigError(str("resume: the save in '", folder, "' was made with tensor_parallel.size ",
                          manifest.tp_size, " but this run has ", shards.tp_size,
                          ", and it does not record how its parameters are split across tensor-parallel ranks "
                          "(format ", manifest.format, ", written by an earlier remat): it resumes only at "
                          "tensor_parallel.size ", manifest.tp_size, ". Resume with the override "
                          "\"tensor_parallel.size=", manifest.tp_size, "\" (EngineOptions::overrides; any "
                          "data-parallel size and ZeRO stage works); a save this run makes from there resumes at "
                          "any tensor-parallel size"));
  }
  REMAT_CHECK(!reslice_tp || !shards.splits.empty(),
              "load_train_state: TrainShards::splits is empty; build the shards with train_shards()");
}

namespace {

// The first parameter whose name or whole shape differs, or "".
std::string whole_shape_difference(const Splits& mine, const Splits& theirs) {
  std::string differs;
  for (size_t i = 0; i < std::max(mine.size(), theirs.size()) && differs.empty(); ++i) {
    if (i >= theirs.size()) {
      differs = str("this model has parameter '", mine[i].first, "' (", shape_text(mine[i].second.full_sizes),
                    ") which the saved one has not");
    } else if (i >= mine.size()) {
      differs = str("the saved model has parameter '", theirs[i].first, "' (",
                    shape_text(theirs[i].second.full_sizes), ") which this one has not");
    } else if (mine[i].first != theirs[i].first) {
      differs = str("its parameter ", i, " is '", theirs[i].first, "' where this model's is '", mine[i].first, "'");
    } else if (mine[i].second.full_sizes != theirs[i].second.full_sizes) {
      differs = str("parameter '", mine[i].first, "' has the whole shape ", shape_text(theirs[i].second.full_sizes),
                    " in the save but ", shape_text(mine[i].second.full_sizes), " in this model");
    }
  }
  return differs;
}

}  // namespace

void check_same_model(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                      const SaveIdentity& identity) {
  if (!manifest.splits.empty() && !shards.splits.empty()) {
    const std::string differs = whole_shape_difference(shards.splits, manifest.splits);
    if (!differs.empty()) {
      throw ConfigError(str("resume: the save in '", folder, "' holds another model: ", differs,
                            "; resume with the model settings it was saved with"));
    }
  }
  if (manifest.tp_size != shards.tp_size || identity.parameters.empty() ||
      manifest.parameters == parameters_json(identity.parameters)) {
    return;
  }
  const nlohmann::json mine = parameters_json(identity.parameters);
  const auto& theirs = manifest.parameters;
  std::string differs;
  for (size_t i = 0; i < std::max(mine.size(), theirs.size()) && differs.empty(); ++i) {
    if (i >= theirs.size()) {
      differs = str("this model has parameter ", mine[i].dump(), " which the saved one has not");
    } else if (i >= mine.size()) {
      differs = str("the saved model has parameter ", theirs[i].dump(), " which this one has not");
    } else if (mine[i] != theirs[i]) {
      differs = str("its parameter ", i, " is ", theirs[i].dump(), " where this model's is ", mine[i].dump());
    }
  }
  throw ConfigError(str("resume: the save in '", folder, "' holds another model: ", differs,
                        " ([name, shape]); load it into the model it was saved from"));
}

}  // namespace remat::save
