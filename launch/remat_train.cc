// remat-train: a GPT trained on the embedded corpus (or data.path) through
// remat::Engine, with the parallelism and activation checkpointing the config
// asks for.
//
//   remat-run -np 2 -- remat-train --config configs/default.json [--set key=value ...]
//       [--steps N] [--seed S] [--device D] [--backend B] [--metrics FILE]
//       [--save-dir DIR [--overwrite-saves]] [--resume DIR | --pretrained PATH]
//       [--export PATH [--export-max-shard-size SIZE]] [--plan-report DIR]
//       [--memory-trace FILE [--memory-trace-samples N]] [--print-config]
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include "data/dataset.h"
#include "engine/engine.h"
#include "engine/export.h"
#include "engine/save_dir.h"
#include "launch/plan_report.h"
#include "launch/train_tools.h"
#include "models/gpt.h"
#include "runtime/agreement.h"
#include "runtime/communicator.h"
#include "runtime/device_memory.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"
#include "runtime/output_file.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

namespace fs = std::filesystem;

// The path flags: "" is refused, not taken for "not given" (`--resume ""`
// with --overwrite-saves would remove the saves it was meant to resume).
void refuse_empty_paths(const CLI::App& app, const std::vector<std::pair<std::string, const std::string*>>& paths) {
  for (const auto& [flag, value] : paths) {
    if (app.count(flag) > 0 && value->empty()) {
      throw ConfigError(str(flag, " is empty: give it a path, or leave ", flag, " out"));
    }
  }
}

// A path flag as the ranks compare it: as written (a cluster's nodes may
// spell one shared folder alike and mean it, or spell alike per-node folders;
// only the spelling is the same everywhere). A long path is compared by its
// hash and shown cut.
std::string as_compared(const std::string& path) {
  if (path.empty()) return "not given";
  if (path.size() <= 200) return "'" + path + "'";
  return str("'", shown_path(path), "' (hash ", std::hash<std::string>{}(path), ")");
}

// Whether the save `resume` (a step folder or a save root) lies in `save_dir`.
bool resumes_from(const std::string& resume, const std::string& save_dir) {
  std::error_code ec;
  const fs::path save = fs::canonical(resume, ec);
  if (ec) return false;
  return fs::equivalent(save, save_dir, ec) || fs::equivalent(save.parent_path(), save_dir, ec);
}

// The save root `resume` names (its folder when it names a step folder):
// what the run's outputs must stay out of.
std::string resume_root(const std::string& resume) {
  fs::path p(resume);
  if (p.filename().empty()) p = p.parent_path();  // "root/step_00000004/"
  static const std::regex step_folder("step_[0-9]+");
  if (!std::regex_match(p.filename().string(), step_folder)) return resume;
  return p.parent_path().empty() ? std::string(".") : p.parent_path().string();
}

// What is left to resume from when a save fails (`after_save`: free space
// first) or the job ends half-way.
std::string intact_save_note(const std::string& save_dir, const std::string& resume_dir, bool after_save = true) {
  const std::string free_first = after_save ? "free space there, then " : "";
  const int64_t newest = save_dir.empty() ? -1 : latest_step(save_dir);
  if (newest >= 0) {
    return str("The newest complete save is step ", newest, " in '", shown_path(save_dir), "' (its 'latest'): ",
               free_first, "run again with the same settings and --resume ", shown_path(save_dir));
  }
  if (!resume_dir.empty()) {
    return str("No save of this run is complete; the save it resumed, '", shown_path(resume_dir), "', is as it was");
  }
  if (save_dir.empty()) return "Nothing of this run is kept: no --save-dir was given";
  return after_save
             ? "No save of this run is complete: free space there, or give --save-dir a folder on a disk with room"
             : "No save of this run is complete";
}

// A communication failure that ends the training (a peer that stopped or
// exited), rethrown with what is left to resume from, its type kept.
[[noreturn]] void rethrow_naming_saves(const CommError& e, const std::string& save_dir, const std::string& resume_dir) {
  const std::string text = str(e.what(), ". ", intact_save_note(save_dir, resume_dir, false));
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr) throw TimeoutError(text);
  throw CommError(text);
}

// Engine::save_checkpoint, its failure (a full disk) naming what is left to
// resume from.
void save_naming_intact(Engine& engine, const std::string& save_dir, const std::string& resume_dir,
                        int64_t window) {
  try {
    engine.save_checkpoint(save_dir, {{"data_window", window}});
  } catch (const CommError&) {
    throw;  // another rank's failure: its own message says what
  } catch (const ConfigError& e) {
    throw ConfigError(str(e.what(), ". ", intact_save_note(save_dir, resume_dir)));
  } catch (const Error& e) {
    throw Error(str(e.what(), ". ", intact_save_note(save_dir, resume_dir)));
  }
}

// Engine::wait_for_saves: a background save's failure names what is left
// to resume from, as save_naming_intact does.
void wait_naming_intact(Engine& engine, const std::string& save_dir, const std::string& resume_dir) {
  try {
    engine.wait_for_saves();
  } catch (const CommError&) {
    throw;
  } catch (const ConfigError& e) {
    throw ConfigError(str(e.what(), ". ", intact_save_note(save_dir, resume_dir)));
  } catch (const Error& e) {
    throw Error(str(e.what(), ". ", intact_save_note(save_dir, resume_dir)));
  }
}

// The files of this run's outputs (and those written beside them), for
// check_distinct_outputs.
std::vector<std::pair<std::string, std::string>> output_files(const std::string& metrics, const std::string& trace,
                                                              const std::string& export_path,
                                                              const std::string& plan_report) {
  std::vector<std::pair<std::string, std::string>> files{{"--metrics", metrics}, {"--export", export_path}};
  if (!trace.empty()) {
    files.push_back({"--memory-trace", trace});
    files.push_back({"the plot of --memory-trace", memory_plot_path(trace)});
    files.push_back({"the plot script beside --memory-trace", memory_plot_script_path(trace)});
  }
  if (!plan_report.empty()) {
    for (const char* name : {"frontier.csv", "frontier.png", "plot_frontier.py"}) {
      files.push_back({str("--plan-report's ", name), (fs::path(plan_report) / name).string()});
    }
  }
  return files;
}

// Rank 0's outputs, checked before anything trains: none lands on what the
// run reads (`inputs`) or inside its save folder, each follows the one rule
// (runtime/output_file.h), and no two are one file.
void check_outputs(const std::string& metrics, const std::string& trace, const std::string& export_path,
                   const std::string& plan_report, const std::vector<RunInput>& inputs) {
  const auto files = output_files(metrics, trace, export_path, plan_report);
  std::vector<std::pair<std::string, std::string>> named = files;
  named.push_back({"--plan-report", plan_report});
  check_outputs_spare_inputs(named, inputs);
  if (!metrics.empty()) check_output_file({"--metrics", metrics, "metrics.jsonl"});
  if (!export_path.empty()) check_export_path(export_path);
  if (!trace.empty()) {
    check_trace_path(trace, "--memory-trace");
    check_output_file({"the plot of --memory-trace", memory_plot_path(trace), "memory.png"});
    check_plot_script_path(trace);
  }
  if (!plan_report.empty()) check_plan_report_dir(plan_report);
  for (const auto& [flag, path] : files) {
    if (flag.rfind("--plan-report", 0) == 0) check_output_file({flag, path});
  }
  check_distinct_outputs(files);
}

// --memory-trace-samples, read as --steps is (a JSON number: 4000, 4e3);
// without --memory-trace it has nothing to bound and is refused.
int64_t memory_trace_samples(const std::optional<std::string>& flag, const std::string& trace) {
  if (!flag) return 4000;
  if (trace.empty()) {
    throw ConfigError("--memory-trace-samples bounds the samples of --memory-trace, which is not given: add "
                      "--memory-trace FILE, or leave --memory-trace-samples out");
  }
  const auto j = nlohmann::json::parse(*flag, nullptr, /*allow_exceptions=*/false);
  const bool number = j.is_number() && std::isfinite(j.get<double>());
  const double n = number ? j.get<double>() : 0;
  if (!number || n != std::floor(n) || n < 4 || n > (1 << 30)) {
    throw ConfigError(str("--memory-trace-samples '", shown_path(*flag), "' is ",
                          number ? "out of range" : "not a number",
                          ": give a whole number from 4 (the first, the last, and the lowest and highest between "
                          "them) to 1073741824, e.g. 4000 or 1e4"));
  }
  return static_cast<int64_t>(n);
}

// The file's identity (device and inode; 0 when it does not exist): a
// temporary file renamed over a path gives it a new one.
std::pair<dev_t, ino_t> identity_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {0, 0};
  return {st.st_dev, st.st_ino};
}

// --print-config: the configuration this launch trains with, every "auto"
// decided, as JSON that --config reads (rank 0); no training.
int print_and_exit(const Config& config, Communicator& world) {
  if (world.rank() == 0) std::printf("%s\n", config.to_json().c_str());
  std::fflush(stdout);
  world.barrier()->wait();
  return 0;
}

// What initialize() measures an "auto" micro-batch with: the candidates up to
// what the GPT's estimate fits, each timed on this rank's training stream's
// first window (any batch of that size times alike; the data stream itself
// is not advanced).
MicroBatchProbe gpt_probe(const Config& config, const GptAutoFacts& facts, const data::Dataset& data,
                          models::Gpt model, const ParallelLayout& layout, at::Device device) {
  MicroBatchProbe probe;
  probe.fit = gpt_micro_batch_fit(config, facts);
  probe.tokens_per_sample = config.model.seq_len;
  const auto seed = static_cast<uint64_t>(config.train.seed);
  const int dp_rank = layout.dp_rank();
  probe.loss = [&data, gpt = model.ptr(), seed, dp_rank, device](int64_t micro) {
    auto [x, y] = data.train_batch(seed, dp_rank, 0, micro);
    return gpt->loss(x.to(device), y.to(device));
  };
  return probe;
}

// remat-train's flags as given.
struct TrainFlags {
  std::string config_path, metrics_path, save_dir, resume_dir, export_path, memory_trace, plan_report;
  std::string pretrained;  // safetensors weights to fine-tune from
  std::optional<std::string> export_shard_size;  // default 50GB (ExportOptions::max_shard_bytes)
  std::string backend = "auto";
  std::vector<std::string> overrides;
  size_t typed_overrides = 0;  // the --set ones, before those --steps, --seed and --device add
  std::optional<std::string> steps, seed, device, samples;
  bool overwrite_saves = false, print_config = false;
};

void add_flags(CLI::App& app, TrainFlags& f) {
  app.add_option("--config", f.config_path, "JSON configuration (default: the embedded one)");
  app.add_option("--set", f.overrides, "override a key: --set model.n_layer=8 (repeatable)");
  app.add_option("--steps", f.steps, "optimizer steps (train.steps)");
  app.add_option("--seed", f.seed, "seed (train.seed)");
  app.add_option("--device", f.device, "where each rank trains: auto (its local rank's CUDA device where CUDA "
                 "is available, else the CPU), cpu, cuda or cuda:N (train.device)");
  app.add_option("--metrics", f.metrics_path, "write one JSON object per step (rank 0)");
  app.add_option("--save-dir", f.save_dir, "save the training state here (a folder holding another run's "
                 "saves is refused unless --resume continues them or --overwrite-saves is given)");
  app.add_flag("--overwrite-saves", f.overwrite_saves, "let this run replace the saves in --save-dir: those "
               "after the step it starts from (all of them without --resume) are removed once it has started");
  app.add_option("--resume", f.resume_dir, "resume from a save (a step folder or the save root), at any "
                 "tensor-parallel size, data-parallel size and ZeRO stage");
  app.add_option("--pretrained", f.pretrained, "fine-tune from these weights: a safetensors file, a sharded "
                 "set's model.safetensors.index.json or its folder, with the GPT's parameter names (a safetensors "
                 "--export); loaded after initialize, each rank reading its share, and its held-out loss logged");
  app.add_option("--export", f.export_path, "after training (and the final save), write the whole model (full "
                 "parameters by state-dict name), streamed: PATH.safetensors one safetensors file; a folder (an "
                 "existing directory or PATH/) safetensors shards and model.safetensors.index.json; any other "
                 "path a file for torch.load and torch::pickle_load. Checked at start: a regular file or a new "
                 "one (a folder: new, empty or a previous export's), with room for it");
  app.add_option("--export-max-shard-size", f.export_shard_size, "a folder --export's shards hold at most this "
                 "much each: bytes, or e.g. 500MB, 5GB (powers of 1000), 2GiB (powers of 1024); default 50GB, "
                 "as transformers' save_pretrained max_shard_size");
  app.add_option("--memory-trace", f.memory_trace, "write rank 0's memory timeline of one step (the run's second, "
                 "or its only one) to this file in Chrome's Trace Event JSON (Perfetto, chrome://tracing) and "
                 "its plot beside it (.png, with matplotlib); docs/memory.md");
  app.add_option("--memory-trace-samples", f.samples, "at most this many samples in --memory-trace (runs "
                 "of consecutive samples kept by their lowest and highest; default 4000)");
  app.add_option("--backend", f.backend, "communication backend: auto, mpi or nccl");
  app.add_flag("--print-config", f.print_config, "print the configuration this run would train with (every key, "
               "defaults filled in and each \"auto\" decided for this launch) as JSON that --config reads, then "
               "exit without training");
  app.add_option("--plan-report", f.plan_report, "variant auto: write the planner's frontier (every plan a budget "
                 "gets: predicted peak, extra time, plan) to DIR/frontier.csv, the plan in effect and the knee "
                 "marked, and draw it as DIR/frontier.png (with python3 and matplotlib)");
}

// The configuration the flags give: the file or the embedded one, with the
// overrides and the flags that are overrides (validated the same way).
Config load_train_config(TrainFlags& f) {
  f.typed_overrides = f.overrides.size();
  if (f.steps) f.overrides.push_back("train.steps=" + *f.steps);
  if (f.seed) f.overrides.push_back("train.seed=" + *f.seed);
  if (f.device) {
    // Named as the flag the user typed, not as the override it becomes.
    if (const std::string why = device_spec_problem(*f.device, "--device"); !why.empty()) throw ConfigError(why);
    f.overrides.push_back("train.device=" + *f.device);
  }
  Config config = f.config_path.empty() ? parse_config(default_config_text(), "<embedded default>", f.overrides)
                                        : load_config(f.config_path, f.overrides);
  knobs::fault_save_pause();  // a bad value stops the run now, not at its first save
  if (f.overwrite_saves && f.save_dir.empty()) {
    throw ConfigError("--overwrite-saves without --save-dir: give the --save-dir whose saves this run may replace");
  }
  return config;
}

// One line for each key the command line sets more than once with different
// values (--set twice, or --set and the flag that is its override): the last
// is used, and said to be, so that no value changes without a word.
std::vector<std::string> repeated_settings(const TrainFlags& f) {
  std::map<std::string, std::vector<size_t>> by_key;  // key -> the overrides setting it, in order
  std::vector<std::string> keys;
  for (size_t i = 0; i < f.overrides.size(); ++i) {
    const std::string key = f.overrides[i].substr(0, f.overrides[i].find('='));
    if (by_key[key].empty()) keys.push_back(key);
    by_key[key].push_back(i);
  }
  auto value_of = [&](size_t i) { return f.overrides[i].substr(f.overrides[i].find('=') + 1); };
  auto source = [&](size_t i) {
    if (i < f.typed_overrides) return "--set " + shown_path(f.overrides[i]);
    const std::string key = f.overrides[i].substr(0, f.overrides[i].find('='));  // train.steps -> --steps
    return str("--", key.substr(key.find('.') + 1), " ", shown_path(value_of(i)));
  };
  std::vector<std::string> lines;
  for (const std::string& key : keys) {
    const std::vector<size_t>& given = by_key[key];
    std::set<std::string> values;
    for (size_t i : given) values.insert(value_of(i));
    if (values.size() < 2) continue;
    std::string listed;
    for (size_t j = 0; j < given.size(); ++j) listed += (j == 0 ? "" : ", ") + source(given[j]);
    lines.push_back(str(shown_path(key), " is given ", given.size(), " times with different values (", listed,
                        "): the last, ", source(given.back()), ", is used"));
  }
  return lines;
}

// The files --pretrained reads, which no output may be: the file; an index
// and the shard files its weight_map names (beside it); or the whole folder.
std::vector<RunInput> pretrained_inputs(const std::string& path) {
  if (path.empty()) return {};
  std::error_code ec;
  if (fs::is_directory(path, ec)) return {{"--pretrained", path, true, "which holds the weights this run loads"}};
  std::vector<RunInput> inputs{{"--pretrained", path}};
  if (fs::path(path).extension() != ".json") return inputs;
  std::ifstream in(path);
  const nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) return inputs;
  std::set<std::string> shards;
  for (const auto& item : index["weight_map"].items()) {
    if (item.value().is_string()) shards.insert(item.value().get<std::string>());
  }
  // An unreadable index is the loader's to refuse; here only its shards are named.
  for (const std::string& shard : shards) {
    inputs.push_back({"--pretrained", (fs::path(path).parent_path() / shard).string()});
  }
  return inputs;
}

// The folders the run writes in (--save-dir, a sharded --export) against
// what it reads (`read`) lying in them, and a sharded export's folder
// against the run's other outputs: the export takes only its own files there.
void check_output_folders(const TrainFlags& f, const std::vector<RunInput>& read) {
  check_inputs_outside({"--save-dir", f.save_dir, save_folder_entries(),
                        "where remat writes its lock, 'latest' and step folders, replacing or removing them as it "
                        "saves"},
                       read);
  if (f.export_path.empty() || export_format(f.export_path) != ExportFormat::kSafetensorsShards) return;
  check_inputs_outside({"--export", f.export_path, {}, "the folder the sharded export fills with its own files"},
                       read);
  auto others = output_files(f.metrics_path, f.memory_trace, "", f.plan_report);
  others.push_back({"--save-dir", f.save_dir});
  check_outputs_spare_inputs(others, {{"--export", f.export_path, true, "the sharded export's folder", {},
                                       "where the export, finding a file not its own, would be refused after "
                                       "training"}});
}

// Every rank runs with the flags the others have (the engine compares the
// configs), the paths as written; --plan-report needs the planner; what the
// run writes is checked before anything trains.
void check_run_flags(const TrainFlags& f, const Config& config, Communicator& world) {
  std::map<std::string, std::string> flags{{"--backend", f.backend},
                                           {"--overwrite-saves", f.overwrite_saves ? "given" : "not given"},
                                           {"--export-max-shard-size", f.export_shard_size.value_or("not given")}};
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--save-dir", &f.save_dir},
                                    {"--resume", &f.resume_dir}, {"--export", &f.export_path},
                                    {"--pretrained", &f.pretrained},
                                    {"--metrics", &f.metrics_path}, {"--memory-trace", &f.memory_trace},
                                    {"--plan-report", &f.plan_report}}) {
    flags[flag] = as_compared(*value);
  }
  require_same_settings(world, flags, "flags (paths are compared as written, so one folder spelled two ways "
                                      "differs: spell each path the same on every rank)");
  for (const std::string& line : repeated_settings(f)) log_rank0().warn("{}", line);
  if (!f.pretrained.empty() && !f.resume_dir.empty()) {
    throw ConfigError("--pretrained with --resume: a save holds its weights already. Fine-tune from --pretrained "
                      "once, then --resume that run's saves");
  }
  if (f.export_shard_size) {
    parse_byte_size(*f.export_shard_size, "--export-max-shard-size");
    if (f.export_path.empty() || export_format(f.export_path) != ExportFormat::kSafetensorsShards) {
      throw ConfigError(str("--export-max-shard-size bounds the shards of a folder --export, but ",
                            f.export_path.empty() ? str("--export is not given")
                                                  : str("--export '", shown_path(f.export_path),
                                                        "' is one file, not a folder"),
                            ": give --export a folder (an existing directory, or a path ending in '/'), or "
                            "leave --export-max-shard-size out"));
    }
  }
  if (config.train.async_save && f.save_dir.empty() && world.rank() == 0) {
    log_rank0().warn("train.async_save is true but no --save-dir is given: this run saves nothing, so it has "
                     "no effect");
  }
  if (!f.plan_report.empty() && config.activation_checkpointing.variant != CheckpointVariant::kAuto) {
    throw ConfigError(str("--plan-report writes the memory planner's frontier, but activation_checkpointing.variant "
                          "is \"", checkpoint_variant_name(config.activation_checkpointing.variant),
                          "\": set it to \"auto\" (with a memory_budget_fraction, \"knee\" for instance) or "
                          "leave --plan-report out"));
  }
  // Written after training or beside it: a path one cannot be written to stops the run now.
  // The save folder may be the save root resumed (continuing it), not a folder inside its entries.
  std::error_code same_root;
  if (!f.save_dir.empty() && !f.resume_dir.empty() &&
      !fs::equivalent(resume_root(f.resume_dir), f.save_dir, same_root)) {
    check_outputs_spare_inputs({{"--save-dir", f.save_dir}}, {{"--resume", resume_root(f.resume_dir), true,
                                                              "the save this run reads", save_folder_entries()}});
  }
  if (world.rank() == 0) {
    std::vector<RunInput> inputs{
        {"--config", f.config_path},
        {"data.path", config.data.path},
        {"--save-dir", f.save_dir, true, "which holds this run's saves and their lock", save_folder_entries()},
        {"--resume", resume_root(f.resume_dir), true, "the save this run reads", save_folder_entries()}};
    for (RunInput& in : pretrained_inputs(f.pretrained)) inputs.push_back(std::move(in));
    check_outputs(f.metrics_path, f.memory_trace, f.export_path, f.plan_report, inputs);
    std::vector<RunInput> read = inputs;  // what the run reads, not writes
    read.erase(std::remove_if(read.begin(), read.end(), [](const RunInput& in) { return in.what == "--save-dir"; }),
               read.end());
    check_output_folders(f, read);
  }
}

// What the "auto" values are decided from on this launch.
GptAutoFacts auto_facts(const ParallelLayout& layout, const data::Dataset& data, at::Device device) {
  const bool cuda = device.is_cuda();
  return {layout.dims().dp, layout.world()->size(), data.vocab_size(), data.train_size(), device,
          cuda && cuda_computes_bf16(device.has_index() ? device.index() : 0), memory_per_rank(device),
          knobs::memory_per_rank_bytes() ? "REMAT_MEMORY_PER_RANK_BYTES"
          : cuda ? "its GPU's capacity over the ranks sharing it"
                 : "this host's physical memory over its ranks"};
}

models::Gpt build_gpt(const Config& config, const data::Dataset& data, const ParallelLayout& layout) {
  models::GptOptions options;
  options.shape = config.model;
  options.vocab_size = data.vocab_size();
  if (layout.dims().tp_enabled()) options.tensor_parallel = layout.tp_group();
  options.sequence_parallel = config.tensor_parallel.sequence_parallel;
  options.sequence_parallel_dropout = config.tensor_parallel.sequence_parallel_dropout;
  return models::Gpt(options);
}

// Everything one training run holds once it is set up.
struct TrainRun {
  TrainFlags flags;
  Config config;
  std::shared_ptr<ParallelLayout> layout;
  std::optional<data::Dataset> data;
  std::optional<models::Gpt> model;
  std::unique_ptr<Engine> engine;
  BatchSizes batch;
  at::Device device = at::kCPU;
  int64_t resumed = 0;  // the step the run starts after
  int64_t window = 0;   // the next training window of this rank's data stream
  std::optional<Progress> progress;  // rank 0's lines, from the first step on
  bool rank0() const { return layout->world()->rank() == 0; }
};

// Builds the GPT and its engine, deciding the "auto" values (the micro-batch
// measured at initialize); false: --print-config printed and nothing trains.
bool set_up_engine(TrainRun& run, MemoryTracker& memory) {
  Config& config = run.config;
  auto& world = *run.layout->world();
  const int dp = run.layout->dims().dp;
  run.data.emplace(data::Dataset::load(config.data.path, config.data.train_fraction, config.model.seq_len));
  run.device = training_device(config);
  // A resumed run goes on with what its save's run decided.
  if (!run.flags.resume_dir.empty() && !config.auto_values.empty()) keep_saved_decisions(config, run.flags.resume_dir, dp);
  const GptAutoFacts facts = auto_facts(*run.layout, *run.data, run.device);
  // An "auto" micro-batch is measured at initialize; the rest is decided here.
  const bool measured = decide_gpt_autos(config, facts);
  run.batch = measured ? BatchSizes{} : config.resolve_batch(dp);
  if (run.flags.print_config && !measured) {
    print_and_exit(config, world);
    return false;
  }
  if (!measured) check_memory_estimate(config, run.batch, run.data->vocab_size(), world.size(), run.device);

  run.model.emplace(build_gpt(config, *run.data, *run.layout));
  EngineOptions options;
  options.layout = run.layout;
  options.memory = &memory;
  options.blocks = "blocks";
  options.model_signature = (*run.model)->options().to_string();
  options.plan_report_dir = run.flags.plan_report;
  if (measured) options.micro_batch = gpt_probe(config, facts, *run.data, *run.model, *run.layout, run.device);
  run.engine = initialize(*run.model, config, options);
  if (measured) {
    config = run.engine->config();  // the micro-batch decided
    run.batch = config.resolve_batch(dp);
    if (run.flags.print_config) {
      print_and_exit(config, world);
      return false;
    }
    check_memory_estimate(config, run.batch, run.data->vocab_size(), world.size(), run.device);
  }
  return true;
}

// The save folder checked, created and locked, the export's room checked,
// and the resumed state loaded, before anything trains: a run must not find
// out at its first save that it cannot keep its work.
void prepare_saves_and_resume(TrainRun& run) {
  const TrainFlags& f = run.flags;
  Engine& engine = *run.engine;
  // Resuming lets a folder hold saves only when they are the ones resumed.
  const bool resumes_here = !f.resume_dir.empty() && !f.save_dir.empty() && resumes_from(f.resume_dir, f.save_dir);
  if (!f.save_dir.empty()) engine.use_save_dir(f.save_dir, {resumes_here, f.overwrite_saves});
  if (!f.export_path.empty() && run.rank0()) {
    check_export_space(f.export_path, estimated_export_bytes(**run.model, engine.export_dtype()));
  }
  if (!f.resume_dir.empty()) {
    run.window = engine.load_checkpoint(f.resume_dir).value("data_window", int64_t{0});
    log_rank0().info("resumed from '{}' at step {}", f.resume_dir, engine.global_steps());
  }
  run.resumed = engine.global_steps();
  if (!f.save_dir.empty() && !f.overwrite_saves && run.rank0() && latest_step(f.save_dir) > run.resumed) {
    log_rank0().warn("--save-dir '{}' holds saves up to step {} and this run starts at step {}: its saves "
                     "replace those of the same steps, and 'latest' stays on step {} until this run passes "
                     "it; pass --overwrite-saves to remove the later saves instead",
                     f.save_dir, latest_step(f.save_dir), run.resumed, latest_step(f.save_dir));
  }
  log_rank0().info("data {} ({} bytes, vocabulary {}), model {} ({} parameters on this rank), checkpointing {}, "
                   "batch {} = micro {} x accumulation {} x dp {}",
                   run.data->source(), run.data->train_size() + run.data->val_size(), run.data->vocab_size(),
                   (*run.model)->options().to_string(), (*run.model)->num_parameters(),
                   checkpoint_variant_name(run.config.activation_checkpointing.variant), run.batch.train_batch_size,
                   run.batch.micro_batch_per_gpu, run.batch.gradient_accumulation_steps, run.layout->dims().dp);
}

// Rank 0's --metrics file: a resumed run keeps the lines through its step.
std::ofstream open_metrics(const TrainRun& run) {
  std::ofstream metrics;
  const std::string& path = run.flags.metrics_path;
  if (!run.rank0() || path.empty()) return metrics;
  if (run.resumed > 0) keep_metrics_through(path, run.resumed);
  metrics.open(path, run.resumed > 0 ? std::ios::app : std::ios::trunc);
  if (!metrics) {
    throw ConfigError(str("cannot write --metrics file '", shown_path(path), "' (", std::strerror(errno),
                          "): give a writable file path"));
  }
  return metrics;
}

// One metrics line; an auxiliary output whose failure must not cost the
// training or its saves.
void write_metrics_line(std::ofstream& metrics, const StepMetrics& m, double tokens_per_s, int64_t step,
                        const std::string& path) {
  if (!metrics.is_open()) return;
  nlohmann::json line = m.to_json();
  line["tokens_per_s"] = tokens_per_s;
  metrics << line.dump() << "\n" << std::flush;
  if (!metrics) {
    log_rank0().warn("writing the --metrics file '{}' failed at step {} ({}; disk full?): it holds the steps "
                     "before, no more lines are written, and training goes on",
                     shown_path(path), step, std::strerror(errno));
    metrics.close();
  }
}

// What the steps leave for the run's last lines.
struct TrainOutcome {
  double first_loss = 0, last_loss = 0;
  int64_t max_peak = 0, traced_peak = 0, trace_step = 0;
  std::pair<dev_t, ino_t> trace_before{0, 0};
};

void train_step(TrainRun& run);

// train_step, where a background save's failure (raised by the step that
// completes it) names what is left to resume from, as save_naming_intact does.
void step_naming_intact(TrainRun& run) {
  const bool pending = run.engine->save_pending();
  try {
    train_step(run);
  } catch (const CommError&) {
    throw;
  } catch (const Error& e) {
    const std::string what = e.what();
    if (!pending || what.find("(the background save of step ") == std::string::npos) throw;
    const std::string note = intact_save_note(run.flags.save_dir, run.flags.resume_dir);
    if (dynamic_cast<const ConfigError*>(&e) != nullptr) throw ConfigError(str(what, ". ", note));
    throw Error(str(what, ". ", note));
  }
}

// One optimizer step: its micro-batches through the engine.
void train_step(TrainRun& run) {
  const int64_t seed = run.config.train.seed;
  for (int64_t micro = 0; micro < run.batch.gradient_accumulation_steps; ++micro) {
    auto [host_x, host_y] = run.data->train_batch(static_cast<uint64_t>(seed), run.layout->dp_rank(), run.window,
                                                  run.batch.micro_batch_per_gpu);
    run.window += run.batch.micro_batch_per_gpu;
    // The batch goes where the model is (the engine placed it: train.device).
    const at::Tensor x = run.engine->to_device(host_x), y = run.engine->to_device(host_y);
    models::Gpt& model = *run.model;
    at::Tensor loss = run.engine->forward([&, x = x, y = y] { return model->loss(x, y); }, x.sizes().vec());
    run.engine->backward(loss);
    run.engine->step();
  }
}

double held_out_loss(TrainRun& run) {
  double val = 0;
  const int64_t batches = run.config.train.eval_batches;
  for (int64_t i = 0; i < batches; ++i) {
    auto [host_x, host_y] = run.data->val_batch(i, run.batch.micro_batch_per_gpu);
    const at::Tensor x = run.engine->to_device(host_x), y = run.engine->to_device(host_y);
    models::Gpt& model = *run.model;
    val += run.engine->evaluate([&, x = x, y = y] { return model->loss(x, y).item<double>(); });
  }
  return val / std::max<int64_t>(batches, 1);
}

// --pretrained: the weights loaded before the first step, and the held-out
// loss they give (%.17g: runs at other sizes compare it).
void load_pretrained_weights(TrainRun& run) {
  if (run.flags.pretrained.empty()) return;
  try {
    run.engine->load_pretrained(run.flags.pretrained);
  } catch (const ConfigError& e) {
    // The engine speaks of its options; remat-train's users have flags only.
    const std::string what = e.what();
    const bool mismatch = what.find("does not fit the model") != std::string::npos;
    throw ConfigError(str("--pretrained '", shown_path(run.flags.pretrained), "': ", what,
                          mismatch ? str("\nremat-train loads files with the GPT's own parameter names, as its "
                                         "--export x.safetensors writes them (from a run of the same model "
                                         "settings): it has no name map. A file of another model needs a program "
                                         "of one's own calling Engine::load_pretrained with PretrainedOptions "
                                         "(docs/engine.md, \"load_pretrained(path, options): fine-tuning from "
                                         "safetensors\")")
                                   : std::string()));
  }
  if (run.config.train.eval_batches == 0) return;
  const double loss = held_out_loss(run);
  if (run.rank0()) std::printf("pretrained '%s': held-out loss %.17g\n", run.flags.pretrained.c_str(), loss);
}

// The training steps, with their metrics, held-out losses and saves.
TrainOutcome train_steps(TrainRun& run, int64_t trace_samples) {
  const TrainFlags& f = run.flags;
  const auto& tc = run.config.train;
  TrainOutcome out;
  std::ofstream metrics = open_metrics(run);
  if (run.resumed >= tc.steps && run.rank0()) {
    std::printf("nothing to train: train.steps is %lld and the run %s\n", static_cast<long long>(tc.steps),
                run.resumed > 0 ? str("resumed at step ", run.resumed).c_str() : "starts at step 0");
  }
  Progress& progress = run.progress.emplace(run.resumed, tc.steps, run.config.steps_per_print, run.rank0());
  // The memory timeline: the run's second step (the optimizer state exists then), or its only one.
  out.trace_step = f.memory_trace.empty() || run.resumed >= tc.steps ? 0 : std::min(run.resumed + 2, tc.steps);
  if (!f.memory_trace.empty() && out.trace_step == 0) {
    log_rank0().warn("--memory-trace: this run trains no step, so no memory timeline is written");
  }
  // Saves of an earlier run later than where this one starts (all of them
  // when it resumes from elsewhere): replaced when asked, once this run's
  // first save is complete; else kept (`latest` stays on them until this run
  // passes them).
  const bool resumes_here = !f.resume_dir.empty() && !f.save_dir.empty() && resumes_from(f.resume_dir, f.save_dir);
  const int64_t replace_after = resumes_here ? run.resumed : 0;
  bool replaced = !f.overwrite_saves;
  const int64_t tokens_per_step = run.batch.train_batch_size * run.config.model.seq_len;
  try {
    for (int64_t step = run.resumed + 1; step <= tc.steps; ++step) {
      (*run.model)->train();
      if (step == out.trace_step && run.rank0()) {
        out.trace_before = identity_of(f.memory_trace);
        run.engine->trace_memory(f.memory_trace, static_cast<int>(trace_samples));
      }
      step_naming_intact(run);
      const StepMetrics& m = run.engine->last_metrics();
      if (run.rank0() && !f.plan_report.empty() && m.plan.contains("act_plan_ms")) plot_frontier(f.plan_report);
      const double tokens_per_s = tokens_per_step / (m.step_ms / 1000.0);
      out.max_peak = std::max(out.max_peak, m.mem_peak_bytes - m.mem_base_bytes);
      if (step == out.trace_step) out.traced_peak = m.mem_peak_bytes;
      if (step == run.resumed + 1) out.first_loss = m.loss;
      out.last_loss = m.loss;
      write_metrics_line(metrics, m, tokens_per_s, step, f.metrics_path);
      progress.step(step, tokens_per_s, m);
      if (tc.eval_interval > 0 && (step % tc.eval_interval == 0 || step == tc.steps)) {
        progress.line(str("step ", step, ": held-out loss ", held_out_loss(run)));
      }
      if (!f.save_dir.empty() && ((tc.save_interval > 0 && step % tc.save_interval == 0) || step == tc.steps)) {
        save_naming_intact(*run.engine, f.save_dir, f.resume_dir, run.window);
        progress.line(str(run.engine->save_pending() ? "saving step " : "saved step ", step, " to ", f.save_dir,
                          run.engine->save_pending() ? " in the background" : ""));
        if (!replaced) {
          // The later saves go only once this one is complete.
          wait_naming_intact(*run.engine, f.save_dir, f.resume_dir);
          discard_saves_after(f.save_dir, replace_after, *run.layout->world(), step);  // --overwrite-saves, now that one is complete
          replaced = true;
        }
      }
    }
    // The last background save completes before the run reports and exports.
    if (!f.save_dir.empty()) wait_naming_intact(*run.engine, f.save_dir, f.resume_dir);
  } catch (const CommError& e) {
    rethrow_naming_saves(e, f.save_dir, f.resume_dir);
  }
  return out;
}

// The losses, the peak and the memory timeline's plot (rank 0).
void report_outcome(TrainRun& run, const TrainOutcome& out) {
  if (!run.rank0()) return;
  const std::string& trace = run.flags.memory_trace;
  Progress& progress = *run.progress;
  if (run.config.train.steps > run.resumed) {
    std::printf("loss: first %.4f, last %.4f; peak activation memory per step %s\n", out.first_loss, out.last_loss,
                human_bytes(static_cast<double>(out.max_peak)).c_str());
  }
  if (out.trace_step > 0 && identity_of(trace) == out.trace_before) {
    progress.line(str("no memory timeline of step ", out.trace_step, " was written to ", trace,
                      " (the warning above says why)"));
  } else if (out.trace_step > 0) {
    const std::string png = memory_plot_path(trace);
    const std::string plot = plot_memory_trace(trace, png);
    progress.line(str("memory timeline of step ", out.trace_step, " (peak ",
                      human_bytes(static_cast<double>(out.traced_peak)), ") in ", trace,
                      ": open it in https://ui.perfetto.dev or chrome://tracing; ", plot.empty() ? "its plot: " + png : plot));
  }
}

// The export comes after the final save: a failed export loses no trained
// state a save could keep.
void export_after_training(TrainRun& run) {
  const TrainFlags& f = run.flags;
  if (f.export_path.empty()) return;
  Engine& engine = *run.engine;
  int64_t bytes = 0;
  try {
    ExportOptions options;
    if (f.export_shard_size) options.max_shard_bytes = parse_byte_size(*f.export_shard_size, "--export-max-shard-size");
    bytes = engine.export_model(f.export_path, options);
  } catch (const Error& e) {
    const std::string kept_in = run.config.train.steps > run.resumed ? f.save_dir : f.resume_dir;
    const int64_t at = engine.global_steps();
    throw Error(str(e.what(), ". ",
                    kept_in.empty()
                        ? str("The model of step ", at, " is not kept anywhere (no --save-dir was given): run "
                              "again with --save-dir to keep the trained state")
                        : str("The trained state of step ", at, " is in the save in '", kept_in, "': once the "
                              "export can be written, run again with the same settings, --resume ", kept_in,
                              " and --export (there is nothing left to train)")));
  }
  const at::ScalarType dtype = engine.export_dtype();
  run.progress->line(str("exported the model at step ", engine.global_steps(), " to ", f.export_path, " (",
                dtype == at::kFloat ? std::string() : str(c10::toString(dtype), ", "),
                human_bytes(static_cast<double>(bytes)), ")"));
}

// Every rank samples (tensor-parallel ranks compute the logits together,
// sharded ones gather parameters together); rank 0 prints.
void print_sample(TrainRun& run, double last_loss) {
  const auto& tc = run.config.train;
  if (tc.sample_chars <= 0) return;
  Engine& engine = *run.engine;
  models::Gpt& model = *run.model;
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(tc.seed));
  at::Tensor prompt = engine.to_device(run.data->encode("The ").unsqueeze(0));
  at::Tensor text;
  try {
    text = engine.evaluate([&] { return model->generate(prompt, tc.sample_chars, 0.8, gen); });
  } catch (const CommError&) {
    throw;
  } catch (const Error& e) {
    throw Error(str("the end-of-run sample cannot be drawn at step ", engine.global_steps(), " (last loss ",
                    last_loss, "): ", e.what(), ". What training wrote (saves, export, metrics) is kept; set "
                    "train.sample_chars=0 to skip the sample"));
  }
  if (run.rank0()) std::printf("--- sample ---\n%s\n--------------\n", run.data->decode(text.cpu()).c_str());
}

int train(int argc, char** argv) {
  CLI::App app{"remat-train: train a GPT with remat's activation checkpointing"};
  TrainRun run;
  TrainFlags& f = run.flags;
  add_flags(app, f);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  refuse_empty_paths(app, {{"--config", &f.config_path}, {"--metrics", &f.metrics_path}, {"--save-dir", &f.save_dir},
                           {"--resume", &f.resume_dir}, {"--export", &f.export_path},
                           {"--memory-trace", &f.memory_trace}, {"--plan-report", &f.plan_report}});
  const int64_t trace_samples = memory_trace_samples(f.samples, f.memory_trace);

  // First: everything allocated from here on is counted (and, for a memory
  // trace, kept by allocation).
  MemoryTracker memory(MemoryTrackerOptions{!f.memory_trace.empty()});
  Runtime::init();
  // Not const: its "auto" values are decided once the layout, data and device are known.
  run.config = load_train_config(f);
  run.layout = init_distributed(run.config, f.backend);
  check_run_flags(f, run.config, *run.layout->world());
  if (!set_up_engine(run, memory)) return 0;
  prepare_saves_and_resume(run);
  load_pretrained_weights(run);
  const TrainOutcome out = train_steps(run, trace_samples);
  report_outcome(run, out);
  export_after_training(run);
  print_sample(run, out.last_loss);
  std::fflush(stdout);
  run.layout->world()->barrier()->wait();
  return 0;
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

// The engine's errors name its API (Engine::load_checkpoint("DIR"),
// SaveDirOptions::overwrite, ...); remat-train's user has flags for them.
std::string in_flag_terms(std::string text) {
  static const std::vector<std::pair<std::regex, std::string>> terms = {
      {std::regex("another save folder"), "another --save-dir"},
      {std::regex("save folder '"), "--save-dir '"},
      {std::regex("SaveDirOptions::overwrite = true to Engine::use_save_dir"), "--overwrite-saves"},
      {std::regex(R"re(Engine::load_checkpoint\("([^"]*)"\))re"), "--resume $1"},
      {std::regex("Engine::save_checkpoint"), "--save-dir"},
      {std::regex(R"re(the override "([^"]*)" \(EngineOptions::overrides; )re"), "--set $1 ("},
      {std::regex("export file '"), "--export '"}};
  for (const auto& [pattern, flag] : terms) text = std::regex_replace(text, pattern, flag);
  return text;
}

int with_flag_terms(const std::function<int()>& run) {
  try {
    return run();
  } catch (const CommError&) {
    throw;
  } catch (const ConfigError& e) {
    throw ConfigError(in_flag_terms(e.what()));
  } catch (const Error& e) {
    throw Error(in_flag_terms(e.what()));
  }
}

}  // namespace
}  // namespace remat

int main(int argc, char** argv) {
  return remat::run_main([&] { return remat::with_flag_terms([&] { return remat::train(argc, argv); }); });
}
