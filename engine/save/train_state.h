// Saving and resuming remat-train's full state: parameters, optimizer state,
// RNG (default generators and tracker states), step and the caller's client
// state (its data position, epoch, ... as JSON).
//
// Layout: DIR/step_00000010/rank_<r>.pt (one per rank), then manifest.json
// written by rank 0 after every rank finished, then DIR/latest naming the step
// folder. Each file is written to a temporary name, flushed, fsynced and
// renamed, so a crash leaves either the old or the new file, never half of one.
//
// A rank file holds the tensors its optimizer steps (ZeroModel::parameters():
// shards, or whole parameters at stage 0) with their optimizer state. The
// manifest records the run that wrote the save (run id), the model, every
// setting that shapes the saved state, the tensor- and data-parallel sizes,
// each model parameter's tensor-parallel split (column with its stride, row,
// vocabulary or replicated, and its whole shape: parallel/tensor_split.h),
// and for each rank file its size, CRC-32, tensor- and data-parallel rank and
// layout: which elements of which model parameter each saved tensor holds,
// and a CRC-32 of its own content (any edit of the manifest is refused); each
// rank file repeats its own ranks, layout and the splits, checked against the
// manifest. Resuming maps this rank's layout onto the saved ones, so a save
// resumes at any data-parallel size, ZeRO stage and tensor-parallel size:
// each element comes from a file that holds it (this rank's own file when the
// layout is unchanged; at another tensor-parallel size, through the whole
// parameter's indices, from the files of every saved tensor-parallel rank
// whose share holds it). Every file read is checked against its size and
// CRC-32 and its recorded rank, step and run id, so a damaged file, files
// mixed from two steps or two runs, or a changed setting is an error naming
// what differs.
//
// The parts, one file each in engine/save/: storage.h (atomic files, CRC-32,
// step folder names), manifest.h (the manifest written, read and checked),
// rank_file.h (a rank file written, read and checked), reslice.h (the pure
// plan of which saved elements fill which of this rank's), dir_lock.h (the
// save root's lock), types.h (what they share); engine/save_dir.h is the
// public part (SaveDirOptions, latest_step, discard_saves_after).
//
// Internal to engine/: only the engine's sources and their tests include it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/save/types.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace remat {

class Communicator;
class ParallelLayout;

// What this rank of `layout` holds of `zero`'s sharding of `model`.
TrainShards train_shards(const parallel::ZeroModel& zero, const ParallelLayout& layout,
                         const torch::nn::Module& model);

// A new id for this run, the same on every rank: rank 0's host, pid and start
// time (collective over `world`).
std::string new_run_id(Communicator& world);

// Writes this rank's state for `position.step` (collective over `world`; a
// rank that cannot write its file stops every rank with the same error).
// `latest` moves to it unless it names a later step (of an earlier run this
// one resumed before its end): it never moves backwards.
void save_train_state(const std::string& dir, const TrainPosition& position, const TrainShards& shards,
                      torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                      Communicator& world);

// A save written by a background thread while training goes on (Engine's
// train.async_save). The constructor (collective) has rank 0 make the
// staging folder, takes this rank's snapshot (its tensors and optimizer
// state copied to host memory, its random state) and starts a thread that
// writes and fsyncs this rank's file into the staging folder: nothing else
// of the save is written from that thread. Completing it is collective and
// in the caller's thread: poll() (one all-reduce of "my file is written")
// completes it once every rank's file is written, exactly as
// save_train_state ends (the manifest, the folder put in place, `latest`);
// finish() waits for it. A rank whose write failed stops every rank there
// with the same error, naming the rank and the step; the staging folder is
// then removed. Until it completes, the previous save stays the latest and
// resumable: a kill leaves only the staging folder, which the next run's
// remove_save_leftovers removes.
class BackgroundSave {
 public:
  BackgroundSave(const std::string& dir, const TrainPosition& position, const TrainShards& shards,
                 torch::optim::Optimizer& optimizer, const SaveIdentity& identity, Communicator& world);
  // Waits for this rank's thread; not collective, so a save not completed
  // stays incomplete (a warning names its step).
  ~BackgroundSave();
  BackgroundSave(const BackgroundSave&) = delete;
  BackgroundSave& operator=(const BackgroundSave&) = delete;

  // Collective: true once the save is complete (completing it when every
  // rank's file is written); false while some rank still writes.
  bool poll(Communicator& world);
  // Collective: waits for this rank's file, then completes the save.
  void finish(Communicator& world);

  int64_t step() const { return position_.step; }
  // The host bytes this rank's snapshot copied.
  int64_t host_bytes() const { return host_bytes_; }

 private:
  void complete(Communicator& world);

  std::string dir_, staging_;
  TrainPosition position_;
  TrainShards shards_;  // without its tensors: what the manifest records
  SaveIdentity identity_;
  std::chrono::steady_clock::time_point started_;  // the step boundary it snapshot
  int64_t host_bytes_ = 0;
  bool finished_ = false;
  struct Writer;
  std::unique_ptr<Writer> writer_;
};

// Loads a save made by save_train_state into `shards.tensors` and their
// optimizer state: `dir` is a step folder or the save root (then DIR/latest).
// The random state is that of the saved rank at this rank's tensor- and
// data-parallel ranks modulo the saved sizes (its own, when the sizes are
// unchanged: the run continues bitwise); at another tensor-parallel size the
// model-parallel RNG stream is seeded afresh (identity.seed) for this rank's
// tensor-parallel rank. A missing, incomplete, damaged or inconsistent save,
// one made with another model (a parameter whose whole shape differs is
// named with both shapes) or setting, or a save without the tensor-parallel
// splits (an earlier remat's) at another tensor-parallel size, is a
// ConfigError saying which (and, for a save that is unusable, naming the
// newest step whose manifest and rank files all verify). Collective over
// `world`: every rank loads the same step; every rank reads and checks its
// files before any changes its state, so an error on one rank is the same
// error on every rank and no rank has loaded anything.
TrainPosition load_train_state(const std::string& dir, const TrainShards& shards,
                               torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                               Communicator& world);

}  // namespace remat
