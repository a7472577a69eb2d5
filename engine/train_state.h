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
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/tensor_split.h"
#include "parallel/zero.h"

namespace torch::nn {
class Module;
}

namespace remat {

class Communicator;
class ParallelLayout;

// What one rank saves and resumes: the tensors its optimizer steps and which
// model parameter elements each holds (ZeroModel::parameters() and layout()),
// how each model parameter is split across the tensor-parallel group, and
// where the rank sits.
struct TrainShards {
  std::vector<at::Tensor> tensors;
  std::vector<parallel::ShardLayout> layout;
  // Every model parameter by state-dict name, in the model's order, with its
  // split (parallel::parameter_splits): a layout's offsets index this rank's
  // share of the parameter, flattened.
  std::vector<std::pair<std::string, parallel::TensorSplit>> splits;
  int tp_rank = 0, tp_size = 1, dp_rank = 0, dp_size = 1;
};

// What this rank of `layout` holds of `zero`'s sharding of `model`.
TrainShards train_shards(const parallel::ZeroModel& zero, const ParallelLayout& layout,
                         const torch::nn::Module& model);

struct TrainPosition {
  int64_t step = 0;  // completed optimizer steps
  // The caller's own data (data position, epoch, ...) as JSON text: rank 0's
  // is saved, every rank gets it back.
  std::string client_state = "{}";
};

// What a save must agree with to be resumed.
struct SaveIdentity {
  std::string model_signature;
  // Each setting that shapes the saved state, by config key
  // ({"zero_optimization.stage", "3"}, {"optimizer.type", "AdamW"}, ...).
  std::map<std::string, std::string> settings;
  std::string run_id;  // this run's (new_run_id)
  // The model's parameters by state-dict name and shape: a save of another
  // model is refused naming the first that differs (empty: not compared).
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameters;
  // train.seed: a resume at another tensor-parallel size seeds the
  // model-parallel RNG stream afresh from it (model_parallel_manual_seed's
  // rule, at this rank's tensor-parallel rank).
  uint64_t seed = 0;
};

// A new id for this run, the same on every rank: rank 0's host, pid and start
// time (collective over `world`).
std::string new_run_id(Communicator& world);

struct SaveDirOptions {
  // The run resumes (it loaded a save from this folder; remat-train's
  // --resume): saves already in the folder may be continued.
  bool resuming = false;
  // A new run may take a folder holding another run's saves
  // (discard_saves_after removes them once its first save is complete;
  // remat-train's --overwrite-saves).
  bool overwrite = false;
};

// The save root of one run, held for the run's lifetime: created, checked
// writable by every rank (a probe file), and locked by rank 0 so that a second
// job given the same directory stops at its start naming the first one's pid
// and host (collective over `world`). A `latest` that is not a regular file,
// or (neither resuming nor overwriting) saves of another run there, are a
// ConfigError before anything is trained, the same on every rank whichever
// rank found it (runtime/outcome.h). Released when destroyed or the process
// ends.
class SaveDirLock {
 public:
  SaveDirLock(const std::string& dir, const std::string& run_id, Communicator& world,
              SaveDirOptions options = {});
  ~SaveDirLock();
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;

 private:
  int fd_ = -1;
};

// Removes the saves in `dir` later than `step` (every one for step 0), but
// the one of step `except`, and points `latest` at the newest complete save
// left, or removes it: what --overwrite-saves does once a run's first save
// (`except`) is complete, so that a run which fails before it leaves the old
// saves as they were. Rank 0 removes; collective over `world`. Returns the
// number of step folders removed.
int discard_saves_after(const std::string& dir, int64_t step, Communicator& world, int64_t except = -1);

// The step `latest` in `dir` names, or -1 when there is none (or it names no
// step folder).
int64_t latest_step(const std::string& dir);

// Writes this rank's state for `position.step` (collective over `world`; a
// rank that cannot write its file stops every rank with the same error).
// `latest` moves to it unless it names a later step (of an earlier run this
// one resumed before its end): it never moves backwards.
void save_train_state(const std::string& dir, const TrainPosition& position, const TrainShards& shards,
                      torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                      Communicator& world);

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
