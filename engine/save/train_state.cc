#include "engine/save/train_state.h"

#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <exception>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "optim/optimizer.h"
#include "engine/save/manifest.h"
#include "engine/save/rank_file.h"
#include "engine/save/reslice.h"
#include "engine/save/storage.h"
#include "engine/save_dir.h"
#include "parallel/layers.h"
#include "rng/rng_state_io.h"
#include "rng/rng_tracker.h"
#include "runtime/communicator.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/outcome.h"

namespace remat {
namespace fs = std::filesystem;
using save::Manifest;
using save::RankFile;

std::string new_run_id(Communicator& world) {
  constexpr int64_t kLength = 64;
  at::Tensor bytes = at::zeros({kLength}, at::kLong);
  if (world.rank() == 0) {
    const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    const std::string id = str(save::host_name(), "-", ::getpid(), "-", now).substr(0, kLength - 1);
    for (size_t i = 0; i < id.size(); ++i) bytes[static_cast<int64_t>(i)] = static_cast<int64_t>(id[i]);
  }
  if (world.size() > 1) world.broadcast(bytes, {0})->wait();
  std::string id;
  for (int64_t i = 0; i < kLength && bytes[i].item<int64_t>() != 0; ++i) {
    id.push_back(static_cast<char>(bytes[i].item<int64_t>()));
  }
  return id;
}

TrainShards train_shards(const parallel::ZeroModel& zero, const ParallelLayout& layout,
                         const torch::nn::Module& model) {
  TrainShards s;
  s.tensors = zero.parameters();
  s.layout = zero.layout();
  s.splits = parallel::parameter_splits(model);
  s.tp_rank = layout.tp_rank();
  s.tp_size = layout.dims().tp;
  s.dp_rank = layout.dp_rank();
  s.dp_size = layout.dims().dp;
  return s;
}

namespace {

// Each rank's `mine`, on every rank (collective over `world`).
std::vector<std::string> gather_text(const std::string& mine, Communicator& world) {
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  at::Tensor lengths = at::empty({world.size()}, at::kLong);
  world.allGather(lengths, length)->wait();
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world.size() * longest}, at::kByte);
  world.allGather(all, bytes)->wait();
  std::vector<std::string> out;
  const char* data = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < world.size(); ++r) out.emplace_back(data + r * longest, lengths[r].item<int64_t>());
  return out;
}

// Rank 0: the manifest of the save (every rank's file listed from `all`,
// each rank's size, CRC-32, tensor- and data-parallel rank, and `layouts`)
// in its staging folder, the save put in place of its step folder, then
// `latest`; a save it replaced is removed last.
void write_manifest(const std::string& dir, const std::string& staging, const TrainPosition& position,
                    const TrainShards& shards, const SaveIdentity& identity, Communicator& world,
                    const at::Tensor& all, const std::vector<std::string>& layouts) {
  std::vector<save::ListedFile> files;
  for (int r = 0; r < world.size(); ++r) {
    files.push_back({all[4 * r].item<int64_t>(), all[4 * r + 1].item<int64_t>(), all[4 * r + 2].item<int64_t>(),
                     all[4 * r + 3].item<int64_t>(), layouts[r]});
  }
  const nlohmann::json manifest = save::manifest_json(position, shards, identity, world.size(), files);
  save::write_atomically((fs::path(staging) / "manifest.json").string(), manifest.dump(1));
  const std::string folder = (fs::path(dir) / save::step_folder(position.step)).string();
  const bool replaced = save::install_save(staging, folder);
  const int64_t current = latest_step(dir);
  if (current > position.step) {
    // A later save of an earlier run this one resumed before: the newest
    // save stays the one resumed by default.
    log().info("saved step {} to '{}'; 'latest' still names step {}, which is later", position.step, dir,
               current);
  } else {
    save::write_atomically((fs::path(dir) / "latest").string(), save::step_folder(position.step) + "\n");
  }
  if (replaced) fs::remove_all(staging);  // the save this one replaced, now that `latest` is written
}

// What one rank wrote of a save: its file's size, CRC-32 and layout's JSON.
struct WrittenFile {
  int64_t bytes = 0, crc32 = 0;
  std::string layout;
};

// This rank's file of `snapshot`, written into `staging` (any thread: no
// collective). `fail` (REMAT_FAULT_SAVE_FAIL) makes it fail as a write does.
WrittenFile write_rank_file(const std::string& staging, const save::RankSnapshot& snapshot, bool fail) {
  if (!fs::is_directory(staging)) {
    throw Error(str("save: rank ", snapshot.rank, " does not see the folder '", staging, "' rank 0 created: the "
                    "save folder must be one folder every rank shares"));
  }
  if (fail) {
    throw Error(str("save: writing the rank file of step ", snapshot.position.step, " failed on rank ",
                    snapshot.rank, " (", knobs::kFaultSaveFail, " injected this failure)"));
  }
  WrittenFile written;
  const save::WrittenBytes file = save::write_atomically_streamed(
      (fs::path(staging) / str("rank_", snapshot.rank, ".pt")).string(),
      [&](const save::Sink& sink) { save::write_rank_file_bytes(snapshot, written.layout, sink); });
  written.bytes = file.bytes;
  written.crc32 = file.crc32;
  return written;
}

// Once every rank's file is in place: each rank's size, checksum and layout
// gathered, then (rank 0) the manifest, the save put in place and `latest`.
void finish_staged_save(const std::string& dir, const std::string& staging, const TrainPosition& position,
                        const TrainShards& shards, const SaveIdentity& identity, Communicator& world,
                        const WrittenFile& written) {
  at::Tensor mine = at::tensor({written.bytes, written.crc32, static_cast<int64_t>(shards.tp_rank),
                                static_cast<int64_t>(shards.dp_rank)},
                               at::kLong);
  at::Tensor all = at::empty({4 * world.size()}, at::kLong);
  world.allGather(all, mine)->wait();
  const std::vector<std::string> layouts = gather_text(written.layout, world);
  agree_on_outcome(world, str("the save of step ", position.step), [&] {
    if (world.rank() == 0) write_manifest(dir, staging, position, shards, identity, world, all, layouts);
  });
}

// The staging folder of a save of `position.step`, made afresh by rank 0
// (collective: a rank 0 that cannot make it stops every rank).
std::string make_staging(const std::string& dir, int64_t step, Communicator& world) {
  const std::string staging = (fs::path(dir) / save::staging_folder(step)).string();
  agree_on_outcome(world, str("the save of step ", step), [&] {
    if (world.rank() != 0) return;
    fs::remove_all(staging);  // what a failed save of this step left
    fs::create_directories(staging);
  });
  return staging;
}

// A save that failed leaves nothing of itself (a full disk keeps no partial rank file).
void remove_failed(const std::string& staging, Communicator& world) {
  std::error_code ec;
  if (world.rank() == 0) fs::remove_all(staging, ec);
}

}  // namespace

void save_train_state(const std::string& dir, const TrainPosition& position, const TrainShards& shards,
                      torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                      Communicator& world) {
  REMAT_CHECK(shards.tensors.size() == shards.layout.size(),
              "save_train_state: one layout per tensor (ZeroModel::parameters() and layout())");
  // Written in a staging folder of its own, put in place once complete.
  const std::string staging = make_staging(dir, position.step, world);
  try {
    // The same path as a background save: the snapshot (here referring to
    // the host tensors, not copying them), then the file from it. A rank
    // that cannot write its file stops every rank here.
    WrittenFile written;
    agree_on_outcome(world, str("the save of step ", position.step), [&] {
      const save::RankSnapshot snapshot =
          save::snapshot_rank(position, shards, optimizer, identity, world.rank(), world.size(), /*copy=*/false);
      written = write_rank_file(staging, snapshot, save::fault_fail(world.rank()));
    });
    finish_staged_save(dir, staging, position, shards, identity, world, written);
  } catch (...) {
    remove_failed(staging, world);
    throw;
  }
}

struct BackgroundSave::Writer {
  std::thread thread;
  std::atomic<bool> done{false};
  WrittenFile written;
  std::exception_ptr error;
};

BackgroundSave::BackgroundSave(const std::string& dir, const TrainPosition& position, const TrainShards& shards,
                               torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                               Communicator& world)
    : dir_(dir),
      position_(position),
      shards_(shards),
      identity_(identity),
      started_(std::chrono::steady_clock::now()),
      writer_(std::make_unique<Writer>()) {
  REMAT_CHECK(shards.tensors.size() == shards.layout.size(),
              "BackgroundSave: one layout per tensor (ZeroModel::parameters() and layout())");
  shards_.tensors.clear();  // the snapshot holds the values; the live tensors train on
  staging_ = make_staging(dir, position.step, world);
  std::shared_ptr<save::RankSnapshot> snapshot;
  try {
    agree_on_outcome(world, str("the save of step ", position.step), [&] {
      snapshot = std::make_shared<save::RankSnapshot>(
          save::snapshot_rank(position, shards, optimizer, identity, world.rank(), world.size(), /*copy=*/true));
    });
  } catch (...) {
    remove_failed(staging_, world);
    throw;
  }
  host_bytes_ = snapshot->host_bytes;
  save::count_snapshot_host_bytes(host_bytes_);
  Writer* writer = writer_.get();
  const std::string staging = staging_;
  const int64_t held = host_bytes_;
  const bool fail = save::fault_fail(world.rank());
  writer_->thread = std::thread([writer, staging, snapshot, held, fail]() mutable {
    try {
      writer->written = write_rank_file(staging, *snapshot, fail);
    } catch (...) {
      writer->error = std::current_exception();
    }
    snapshot.reset();  // its host memory goes as soon as it is written
    save::count_snapshot_host_bytes(-held);
    writer->done.store(true);
  });
}

BackgroundSave::~BackgroundSave() {
  if (writer_->thread.joinable()) writer_->thread.join();
  if (!finished_) {
    log().warn("the save of step {} to '{}' was not completed (the engine went away before its next step or "
               "save): the previous save stays the latest; its staging folder '{}' is removed by the next run "
               "in that folder", position_.step, dir_, staging_);
  }
}

bool BackgroundSave::poll(Communicator& world) {
  if (finished_) return true;
  at::Tensor done = at::tensor({writer_->done.load() ? int64_t{1} : int64_t{0}}, at::kLong);
  if (world.size() > 1) world.allReduce(done, {ReduceOp::kMin})->wait();
  if (done.item<int64_t>() == 0) return false;
  complete(world);
  return true;
}

void BackgroundSave::finish(Communicator& world) {
  if (finished_) return;
  if (writer_->thread.joinable()) writer_->thread.join();
  const bool all = poll(world);
  REMAT_CHECK(all, "BackgroundSave::finish: every rank's writer is joined");
}

void BackgroundSave::complete(Communicator& world) {
  if (writer_->thread.joinable()) writer_->thread.join();
  finished_ = true;  // done or failed: never completed twice
  try {
    // A rank whose background write failed stops every rank here, with the same error.
    const std::string what = str("the background save of step ", position_.step);
    if (world.size() == 1 && writer_->error) {
      // One rank: no agreement to make, but the same message as at more ranks.
      try {
        std::rethrow_exception(writer_->error);
      } catch (const std::exception& e) {
        throw Error(str(e.what(), " (", what, " failed on rank 0 of 1)"));
      }
    }
    agree_on_outcome(world, what, [&] {
      if (writer_->error) std::rethrow_exception(writer_->error);
    });
    finish_staged_save(dir_, staging_, position_, shards_, identity_, world, writer_->written);
    const auto after = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                             started_);
    log_rank0().info("saved step {} to '{}' (written in the background; {} ms after the step)", position_.step,
                     dir_, after.count());
  } catch (...) {
    remove_failed(staging_, world);
    throw;
  }
}

namespace {

// What a rank loads from a save, read and checked but not yet put into the
// run: the values of each of its tensors (on the host), their optimizer
// state, the random state and the position.
struct StagedLoad {
  TrainPosition position;
  std::string run_id;
  std::vector<at::Tensor> tensors;
  std::vector<std::map<std::string, at::Tensor>> states;
  RngSnapshot rng;
  std::optional<uint64_t> model_parallel_seed;  // at another tensor-parallel size: the stream seeded afresh
};

using OpenFiles = std::map<size_t, std::unique_ptr<RankFile>>;

// The manifest of the save in `folder`, read and checked; an error offers
// the newest intact save.
Manifest read_checked_manifest(const std::string& folder) {
  try {
    return save::read_manifest((fs::path(folder) / "manifest.json").string());
  } catch (const ConfigError& e) {
    throw ConfigError(str(e.what(), ".", save::offer_newest(save::root_of(folder), folder)));
  }
}

// Fills staged.tensors (this rank's current values, on the host) and
// staged.states through `copies` from the opened `files`.
void stage_values(const std::vector<save::Copy>& copies, const OpenFiles& files, const TrainShards& shards,
                  StagedLoad& staged) {
  for (const auto& t : shards.tensors) staged.tensors.push_back(t.is_cpu() ? t.detach().clone() : t.detach().cpu());
  std::vector<std::map<std::string, at::Tensor>> states(shards.tensors.size());
  std::vector<std::set<int64_t>> steps(shards.tensors.size());
  std::map<std::pair<size_t, std::string>, at::Tensor> cache;
  auto cached = [&](size_t f, const std::string& key) -> const at::Tensor& {
    auto k = std::make_pair(f, key);
    auto it = cache.find(k);
    if (it == cache.end()) {
      at::Tensor t;
      it = cache.emplace(k, files.at(f)->tensors.try_read(key, t) ? t.reshape({-1}) : at::Tensor()).first;
    }
    return it->second;
  };
  for (const auto& c : copies) {
    at::Tensor target = staged.tensors[c.target].view({-1});
    const at::Tensor& values = cached(c.file, save::tensor_key(c.source));
    if (!values.defined() || values.numel() < c.source_offset + c.length) {
      throw ConfigError(str("resume: '", files.at(c.file)->path, "' lacks tensor ", c.source,
                            " as the manifest describes it; the save was edited or damaged"));
    }
    target.narrow(0, c.target_offset, c.length).copy_(values.narrow(0, c.source_offset, c.length));
    const auto saved_fields = files.at(c.file)->fields.find(save::tensor_key(c.source));
    if (saved_fields == files.at(c.file)->fields.end()) continue;
    for (const std::string& field : saved_fields->second) {
      const at::Tensor& value = cached(c.file, save::state_key(c.source, field));
      if (field == "step") {
        steps[c.target].insert(value.item<int64_t>());
        continue;
      }
      auto& into = states[c.target][field];
      if (!into.defined()) into = at::zeros({target.numel()}, value.options());
      into.narrow(0, c.target_offset, c.length).copy_(value.narrow(0, c.source_offset, c.length));
    }
  }
  for (size_t i = 0; i < shards.tensors.size(); ++i) {
    if (steps[i].size() > 1) {
      throw ConfigError(str("resume: the saved shards making up tensor ", i, " of this rank were stepped ",
                            *steps[i].begin(), " and ", *steps[i].rbegin(),
                            " times: the save mixes optimizer states; resume from another step"));
    }
    std::map<std::string, at::Tensor> state;
    for (auto& [field, value] : states[i]) state[field] = value.view(shards.tensors[i].sizes());
    if (!steps[i].empty()) state["step"] = at::scalar_tensor(*steps[i].begin(), at::kLong);
    staged.states.push_back(std::move(state));
  }
}

// The random state of saved file `own` (rank `own_index`), into staged.rng;
// at another tensor-parallel size (`reslice_tp`) the model-parallel stream
// is seeded afresh for this rank.
void stage_rng(const std::string& folder, RankFile& own, size_t own_index, bool reslice_tp,
               const TrainShards& shards, const SaveIdentity& identity, StagedLoad& staged) {
  torch::serialize::InputArchive rng_archive;
  own.archive.read("rng", rng_archive);
  RngSnapshot& rng = staged.rng;
  rng = read_rng_snapshot(rng_archive);
  const at::Tensor cuda_now = capture_default_generators().cuda;
  const bool cuda_here = cuda_now.defined();
  // LibTorch versions lay out the CUDA generator state differently (1.13
  // and 2.x disagree on its size): such a state cannot be restored.
  if (cuda_here && rng.defaults.cuda.defined() && rng.defaults.cuda.numel() != cuda_now.numel()) {
    log().warn("resume: the CUDA generator states in '{}' have {} bytes but this LibTorch's have "
               "{} (saved by another LibTorch version): GPU random draws restart from this "
               "process's state and do not continue bitwise",
               folder, rng.defaults.cuda.numel(), cuda_now.numel());
    rng.defaults.cuda = at::Tensor();
    for (auto& [name, states_of] : rng.tracker) states_of.cuda = at::Tensor();
  } else if (rng.defaults.cuda.defined() != cuda_here) {
    log().warn("resume: the save in '{}' {} CUDA generator states but this process {} a GPU: "
               "random draws on the GPU do not continue bitwise",
               folder, rng.defaults.cuda.defined() ? "holds" : "holds no",
               cuda_here ? "has" : "has no");
  }
  // The model-parallel stream differs per tensor-parallel rank (dropout
  // inside tensor-parallel regions): at another size no saved rank's stream
  // is this rank's, so it starts afresh as model_parallel_manual_seed starts it.
  if (reslice_tp) {
    rng.tracker.erase(kModelParallelRng);
    const uint64_t seed = identity.seed + kModelParallelSeedOffset + static_cast<uint64_t>(shards.tp_rank);
    staged.model_parallel_seed = seed;
    log().info("resume: the model-parallel RNG stream is seeded afresh with {} (train.seed {} + {} + "
               "tensor-parallel rank {}); the default generators continue those of saved rank {}",
               seed, identity.seed, kModelParallelSeedOffset, shards.tp_rank, own_index);
  }
}

// Rank 0 says how a save made at other sizes is re-sliced (read from
// `files_read` files).
void log_reslice(const std::string& folder, const Manifest& manifest, const TrainShards& shards,
                 size_t files_read) {
  if (manifest.tp_size != shards.tp_size) {
    log_rank0().warn("resume: the save in '{}' was made at tensor-parallel size {} x data-parallel size {}; this "
                     "run has {} x {}. Parameters and optimizer state are re-sliced exactly through each "
                     "parameter's whole shape (read from {} saved file(s) on rank 0); each rank continues the "
                     "default random state of the saved rank at its tensor- and data-parallel ranks modulo {} and "
                     "{}, and its model-parallel RNG stream is seeded afresh for its tensor-parallel rank, so the "
                     "run does not repeat an uninterrupted one bitwise (float sums also run in another order at "
                     "another tensor-parallel size)",
                     folder, manifest.tp_size, manifest.dp_size, shards.tp_size, shards.dp_size, files_read,
                     manifest.tp_size, manifest.dp_size);
  } else if (manifest.dp_size != shards.dp_size) {
    log_rank0().warn("resume: the save in '{}' was made at data-parallel size {}; this run has {}. Parameters "
                     "and optimizer state are re-sliced exactly (read from {} saved file(s) on rank 0); each rank "
                     "continues the random state of the saved rank at its data-parallel "
                     "place modulo {}, so the run does not repeat an uninterrupted one bitwise",
                     folder, manifest.dp_size, shards.dp_size, files_read, manifest.dp_size);
  }
}

// This rank's part of load_train_state: everything that can fail, touching
// nothing of the run.
StagedLoad stage_train_state(const std::string& dir, const TrainShards& shards, const SaveIdentity& identity) {
  StagedLoad staged;
  const std::string folder = save::resolve_save(dir);
  const Manifest manifest = read_checked_manifest(folder);
  save::check_manifest_fits(folder, manifest, shards, identity);
  const std::vector<size_t> candidates =
      save::files_to_read(manifest, shards, (fs::path(folder) / "manifest.json").string());
  // This rank's own file first: it verifies the manifest's account of it.
  OpenFiles files;
  files[candidates[0]] = save::open_rank_file(folder, manifest, candidates[0]);
  save::check_same_model(folder, manifest, shards, identity);
  const std::vector<save::Copy> copies = save::plan_copies(manifest, shards, candidates, folder);
  for (const auto& c : copies) {
    if (!files.count(c.file)) files[c.file] = save::open_rank_file(folder, manifest, c.file);
  }
  {
    torch::NoGradGuard no_grad;
    stage_values(copies, files, shards, staged);
    stage_rng(folder, *files.at(candidates[0]), candidates[0], manifest.tp_size != shards.tp_size, shards,
              identity, staged);
    staged.position.step = manifest.step;
    staged.position.skipped_steps = manifest.skipped_steps;
    staged.position.client_state = manifest.client_state;
    staged.position.loss_scaler = manifest.loss_scaler;
    staged.position.decisions = manifest.decisions;
    staged.run_id = manifest.run_id;
  }
  log_reslice(folder, manifest, shards, files.size());
  return staged;
}

// Puts a staged load of the save in `dir` into the run: values, optimizer
// state, random state.
void apply_load(const std::string& dir, const StagedLoad& staged, const TrainShards& shards,
                torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < shards.tensors.size(); ++i) {
    shards.tensors[i].detach().copy_(staged.tensors[i]);
    try {
      optim::set_optimizer_state(optimizer, shards.tensors[i], staged.states[i]);
    } catch (const Error& e) {
      throw ConfigError(str("resume: the save in '", dir, "' does not fit this run's optimizer: ", e.what()));
    }
  }
  restore_rng(staged.rng);
  if (staged.model_parallel_seed) get_rng_tracker().add(kModelParallelRng, *staged.model_parallel_seed);
}

}  // namespace

TrainPosition load_train_state(const std::string& dir, const TrainShards& shards,
                               torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                               Communicator& world) {
  REMAT_CHECK(shards.tensors.size() == shards.layout.size(),
              "load_train_state: one layout per tensor (ZeroModel::parameters() and layout())");
  // Every rank reads and checks its part first; a rank that cannot stops
  // every rank before any of them changes its state.
  StagedLoad staged;
  agree_on_outcome(world, str("loading the save in '", dir, "'"),
                   [&] { staged = stage_train_state(dir, shards, identity); });
  const TrainPosition& position = staged.position;
  // Every rank resumes at the same step of the same run, or none does.
  at::Tensor mine = at::tensor({position.step, save::crc32_of(staged.run_id)}, at::kLong);
  at::Tensor all = at::empty({2 * world.size()}, at::kLong);
  world.allGather(all, mine)->wait();
  for (int r = 1; r < world.size(); ++r) {
    if (!at::equal(all.narrow(0, 2 * r, 2), all.narrow(0, 0, 2))) {
      const int64_t step_r = all[2 * r].item<int64_t>(), step_0 = all[0].item<int64_t>();
      throw ConfigError(str("resume: rank ", r, " loaded ",
                            step_r != step_0 ? str("step ", step_r, " but rank 0 loaded step ", step_0)
                                             : str("step ", step_r, " of another run than rank 0 did"),
                            " (from different saves): resume every rank from the same step folder"));
    }
  }
  agree_on_outcome(world, str("loading the save in '", dir, "'"), [&] { apply_load(dir, staged, shards, optimizer); });
  return position;
}

}  // namespace remat
