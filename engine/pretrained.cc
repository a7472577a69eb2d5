// Engine::load_pretrained: a model's weights from safetensors, each rank
// reading only what it holds. The file's names are mapped to the model's,
// every mismatch is collected and agreed on by every rank before anything is
// written, then each of this rank's tensors (ZeroModel::parameters(): its
// shards, masters or whole parameters as the stage holds them) takes the
// elements its layout names, through the parameter's tensor-parallel split,
// from the mapped file; after_load() then makes the model's copies from them
// as a resume does.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/internal/engine_impl.h"
#include "engine/safetensors.h"
#include "parallel/tensor_split.h"
#include "parallel/zero.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/outcome.h"

namespace remat {

namespace {

constexpr const char* kWhere = "remat::Engine::load_pretrained";
constexpr size_t kNamedPerKind = 8;      // mismatches named per kind; the rest counted
constexpr int64_t kChunk = int64_t{1} << 22;  // elements gathered at once through a split

std::optional<std::regex> compile(const std::string& option, const std::string& pattern) {
  if (pattern.empty()) return std::nullopt;
  try {
    return std::regex(pattern);
  } catch (const std::regex_error& e) {
    throw ConfigError(str(kWhere, ": PretrainedOptions::", option, " '", pattern,
                          "' is not a regular expression (ECMAScript): ", e.what()));
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

bool converts(at::ScalarType from, at::ScalarType to) {
  if (at::isFloatingType(to)) return at::isFloatingType(from);
  return from == to;  // an integer or bool buffer takes its own dtype only
}

// One model tensor the file provides: the file's name and entry.
struct Source {
  std::string file_name;
  const SafetensorsEntry* entry = nullptr;
};

// The file's tensors matched to the model's names, and what does not fit.
struct Match {
  std::map<std::string, Source> parameters, buffers;  // by the model's name
  int64_t kept = 0, ignored = 0;
  std::vector<std::string> missing, unexpected, shape, dtype, twice;

  size_t faults() const { return missing.size() + unexpected.size() + shape.size() + dtype.size() + twice.size(); }
  std::string message(const std::string& path) const;
};

void list(std::string& out, const std::vector<std::string>& items, const std::string& kind, const std::string& fix) {
  if (items.empty()) return;
  out += str("\n  ", items.size(), " ", kind, ": ");
  for (size_t i = 0; i < std::min(items.size(), kNamedPerKind); ++i) out += (i ? ", " : "") + items[i];
  if (items.size() > kNamedPerKind) out += str(" and ", items.size() - kNamedPerKind, " more");
  out += " (" + fix + ")";
}

std::string Match::message(const std::string& path) const {
  std::string out = str(kWhere, ": '", path, "' does not fit the model (", faults(),
                        " mismatches; nothing was loaded):");
  list(out, missing, "model parameters the file lacks",
       "map the file's names onto them with PretrainedOptions::rename, or keep them as initialised with "
       "allow_missing");
  list(out, unexpected, "file tensors the model has no parameter or buffer for",
       "rename them onto the model's names, or leave them unread with PretrainedOptions::ignore");
  list(out, twice, "model names more than one file tensor maps to", "make the rename rules tell them apart");
  list(out, shape, "shapes that differ from the parameter's whole shape",
       "the file is of another model size, or a name maps onto the wrong parameter");
  list(out, dtype, "dtypes that do not convert",
       "an integer or bool tensor cannot become a float parameter, nor a buffer take another integer dtype");
  return out;
}

std::string file_dtype(const SafetensorsEntry& e) { return safetensors_dtype_name(e.dtype); }

// The model's name for each file tensor, and what is missing or left over.
Match match_names(const SafetensorsSet& set, const PretrainedOptions& options, torch::nn::Module& model,
                  const Splits& splits) {
  std::vector<std::pair<std::regex, std::string>> rules;
  for (const auto& [pattern, replacement] : options.rename) rules.emplace_back(*compile("rename", pattern), replacement);
  const auto allow_missing = compile("allow_missing", options.allow_missing);
  const auto ignore = compile("ignore", options.ignore);
  std::map<std::string, at::Tensor> buffers;
  for (const auto& b : model.named_buffers()) buffers.emplace(b.key(), b.value());
  std::set<std::string> parameter_names;
  for (const auto& item : splits) parameter_names.insert(item.first);
  Match m;
  std::map<std::string, Source> mapped;
  for (const std::string& name : set.names()) {
    if (ignore && std::regex_match(name, *ignore)) {
      ++m.ignored;
      continue;
    }
    std::string to = name;
    for (const auto& [re, replacement] : rules) {
      if (std::regex_match(name, re)) {
        to = std::regex_replace(name, re, replacement);
        break;
      }
    }
    const std::string shown = to == name ? str("'", name, "'") : str("'", name, "' (as '", to, "')");
    if (!mapped.emplace(to, Source{name, set.find(name)}).second) {
      m.twice.push_back(str("'", to, "' (from '", mapped.at(to).file_name, "' and '", name, "')"));
    } else if (!parameter_names.count(to) && !buffers.count(to)) {
      m.unexpected.push_back(shown);
    }
  }
  auto check = [&](const std::string& name, const Source& source, const std::vector<int64_t>& shape,
                   at::ScalarType dtype) {
    const std::string who = source.file_name == name ? str("'", name, "'") : str("'", source.file_name, "' as '", name, "'");
    if (source.entry->shape != shape) {
      m.shape.push_back(str(who, " is ", shape_text(source.entry->shape), " in the file, the model's ", shape_text(shape)));
      return false;
    }
    if (!converts(source.entry->dtype, dtype)) {
      m.dtype.push_back(str(who, " is ", file_dtype(*source.entry), " in the file, the model's ", c10::toString(dtype)));
      return false;
    }
    return true;
  };
  const auto parameters = model.named_parameters();
  for (const auto& [name, split] : splits) {
    const auto it = mapped.find(name);
    if (it == mapped.end()) {
      if (allow_missing && std::regex_match(name, *allow_missing)) {
        ++m.kept;
      } else {
        m.missing.push_back(str("'", name, "'"));
      }
    } else if (check(name, it->second, split.full_sizes, parameters[name].scalar_type())) {
      m.parameters.emplace(name, it->second);
    }
  }
  for (const auto& [name, buffer] : buffers) {
    const auto it = mapped.find(name);
    if (it != mapped.end() && check(name, it->second, buffer.sizes().vec(), buffer.scalar_type())) {
      m.buffers.emplace(name, it->second);
    }
  }
  return m;
}

// `length` elements from `offset` of this rank's share of the whole tensor
// `whole` (flattened, the file's mapped bytes) under `split`: a view where
// they are one run, else gathered (index_select touches only their pages).
at::Tensor read_share(const at::Tensor& whole, const parallel::TensorSplit& split, int parts, int rank,
                      int64_t offset, int64_t length) {
  if (split.kind == parallel::SplitKind::kReplicated || parts == 1) return whole.narrow(0, offset, length);
  std::vector<at::Tensor> pieces;
  for (int64_t done = 0; done < length; done += kChunk) {
    const int64_t n = std::min(kChunk, length - done);
    const at::Tensor index = parallel::full_indices(split, parts, rank, offset + done, n);
    const int64_t first = index[0].item<int64_t>(), last = index[n - 1].item<int64_t>();
    pieces.push_back(last - first == n - 1 ? whole.narrow(0, first, n) : whole.index_select(0, index));
  }
  return pieces.size() == 1 ? pieces[0] : at::cat(pieces);
}

struct Counts {
  int64_t bytes_read = 0;
  std::map<std::string, int64_t> conversions;  // "BF16 -> float": tensors
};

void note_conversion(Counts& counts, const SafetensorsEntry& e, at::ScalarType to) {
  if (e.dtype != to) ++counts.conversions[str(file_dtype(e), " -> ", c10::toString(to))];
}

// Writes this rank's elements of every matched parameter into its tensors
// (`shards`: parameters() and their layout), and the matched buffers whole.
Counts install(const SafetensorsSet& set, const Match& m, const TrainShards& shards, torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  Counts counts;
  std::map<std::string, const parallel::TensorSplit*> splits;
  for (const auto& [name, split] : shards.splits) splits[name] = &split;
  std::set<std::string> converted;
  for (size_t i = 0; i < shards.tensors.size(); ++i) {
    at::Tensor target = shards.tensors[i].detach();
    for (const auto& seg : shards.layout[i].segments) {
      const auto it = m.parameters.find(seg.name);
      if (it == m.parameters.end() || seg.length == 0) continue;  // kept as initialised
      const at::Tensor whole = set.tensor(it->second.file_name).view({-1});
      const at::Tensor values =
          read_share(whole, *splits.at(seg.name), shards.tp_size, shards.tp_rank, seg.param_offset, seg.length);
      counts.bytes_read += seg.length * static_cast<int64_t>(whole.element_size());
      if (target.is_contiguous()) {
        target.view({-1}).narrow(0, seg.shard_offset, seg.length).copy_(values);
      } else {  // a whole parameter (stage 0) that is not contiguous
        target.copy_(values.view(target.sizes()));
      }
      if (converted.insert(seg.name).second) note_conversion(counts, *it->second.entry, target.scalar_type());
    }
  }
  for (auto& b : model.named_buffers()) {
    const auto it = m.buffers.find(b.key());
    if (it == m.buffers.end()) continue;
    const at::Tensor value = set.tensor(it->second.file_name);
    b.value().copy_(value);
    counts.bytes_read += value.numel() * static_cast<int64_t>(value.element_size());
    note_conversion(counts, *it->second.entry, b.value().scalar_type());
  }
  return counts;
}

// What is not safetensors at all, said before the reader sees it: a zip
// archive (a PyTorch pickle, remat's own pickle export among them) or a path
// that is neither a file nor a folder (/dev/null, a pipe).
void check_is_safetensors(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status) || fs::is_directory(status)) return;  // the reader's own messages
  if (!fs::is_regular_file(status)) {
    throw ConfigError(str(kWhere, ": '", path, "' is not a file nor a folder: give a .safetensors file, a "
                          "model.safetensors.index.json or the folder holding them"));
  }
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  if (in.read(magic, sizeof magic) && std::memcmp(magic, "PK\x03\x04", 4) == 0) {
    throw ConfigError(str(kWhere, ": '", path, "' is a zip archive (a PyTorch pickle such as torch.save's, or "
                          "remat's own export to a path not ending in .safetensors), not safetensors: pretrained "
                          "weights are read from safetensors only. export_model writes one to a path ending in "
                          ".safetensors (remat-train --export model.safetensors)"));
  }
}

}  // namespace

PretrainedReport Engine::load_pretrained(const std::string& path, const PretrainedOptions& options) {
  Impl& s = *impl_;
  if (micro_steps_ != 0 || s.phase != internal::Phase::kIdle || s.gathered_scopes > 0) {
    throw Error(str(kWhere, ": called inside a step or a GatheredParameters scope: load pretrained weights "
                    "between steps, before the first forward"));
  }
  if (global_steps_ != 0) {
    throw Error(str(kWhere, ": the engine has taken ", global_steps_, " optimizer steps: pretrained weights load "
                    "before the first one only (the optimizer's state was made for the weights it stepped). Load "
                    "them right after initialize(), or resume a save with load_checkpoint"));
  }
  const auto t0 = std::chrono::steady_clock::now();
  ContextScope scope(s.context);
  const TrainShards shards = s.shards(*model_);
  std::optional<SafetensorsSet> set;
  Match m;
  // Every rank opens and checks the files and matches the names; a fault on
  // any rank stops every rank, with the same error, before anything is written.
  agree_on_outcome(*s.world, str("loading pretrained weights from '", path, "'"), [&] {
    check_is_safetensors(path);
    set.emplace(SafetensorsSet::open(path));
    m = match_names(*set, options, *model_, shards.splits);
    if (m.faults() > 0) throw ConfigError(m.message(path));
  });
  Counts counts;
  agree_on_outcome(*s.world, str("loading pretrained weights from '", path, "'"),
                   [&] { counts = install(*set, m, shards, *model_); });
  s.zero->after_load();  // the model's parameters (16-bit copies, device copies, gathered shards) from them
  PretrainedReport report;
  report.loaded = static_cast<int64_t>(m.parameters.size() + m.buffers.size());
  report.kept = m.kept;
  report.ignored = m.ignored;
  report.bytes_read = counts.bytes_read;
  report.file_bytes = set->total_bytes();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string conversions;
  for (const auto& [what, n] : counts.conversions) {
    conversions += str(conversions.empty() ? "" : ", ", n, n == 1 ? " tensor " : " tensors ", what);
  }
  // The names are every rank's; the bytes and conversions are rank 0's own
  // share (its shards, its tensor-parallel split), said as such.
  log_rank0().info("loaded pretrained weights from '{}' ({} files, {} bytes): {} parameters and {} buffers, {} kept "
                   "as initialised, {} file tensors ignored; rank 0 of {}, for its own share, read {} bytes in "
                   "{:.3f} s and converted {}",
                   path, set->files().size(), report.file_bytes, m.parameters.size(), m.buffers.size(), m.kept,
                   m.ignored, s.world->size(), report.bytes_read, report.seconds,
                   conversions.empty() ? "no tensor" : conversions);
  return report;
}

}  // namespace remat
