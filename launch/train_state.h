// Saving and resuming remat-train's full state: parameters, optimizer state,
// RNG (default generators and tracker states), data position and step.
//
// Layout: DIR/step_00000010/rank_<r>.pt (one per rank), then manifest.json
// written by rank 0 after every rank finished, then DIR/latest naming the step
// folder. Each file is written to a temporary name, flushed, fsynced and
// renamed, so a crash leaves either the old or the new file, never half of one.
//
// The manifest records the run that wrote the save (run id), the model, every
// setting that shapes the saved state, and each rank file's size and CRC-32;
// each rank file records its rank, step and run id. Resuming checks all of
// them before loading anything, so a damaged file, files mixed from two
// steps or two runs, or a changed setting is an error naming what differs.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace remat {

class Communicator;

struct TrainPosition {
  int64_t step = 0;    // completed optimizer steps
  int64_t window = 0;  // next training window of this rank's data stream
};

// What a save must agree with to be resumed.
struct SaveIdentity {
  std::string model_signature;
  // Each setting that shapes the saved state, by config key
  // ({"zero_optimization.stage", "3"}, {"optimizer.type", "AdamW"}, ...).
  std::map<std::string, std::string> settings;
  std::string run_id;  // this run's (new_run_id)
};

// A new id for this run, the same on every rank: rank 0's host, pid and start
// time (collective over `world`).
std::string new_run_id(Communicator& world);

// The save root of one run, held for the run's lifetime: created, checked
// writable by every rank (a probe file), and locked by rank 0 so that a second
// job given the same directory stops at its start naming the first one's pid
// and host (collective over `world`). Released when destroyed or the process ends.
class SaveDirLock {
 public:
  SaveDirLock(const std::string& dir, const std::string& run_id, Communicator& world);
  ~SaveDirLock();
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;

 private:
  int fd_ = -1;
};

// Writes this rank's state for `position.step` (collective over `world`).
void save_train_state(const std::string& dir, const TrainPosition& position,
                      torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                      const SaveIdentity& identity, Communicator& world);

// Loads a save made by save_train_state: `dir` is a step folder or the save
// root (then DIR/latest). A missing, incomplete, damaged or inconsistent save,
// or one made with another world size, model or setting, is a ConfigError
// saying which (and, for a root whose latest save is unusable, naming the
// newest complete step). Collective over `world`: every rank loads the same step.
TrainPosition load_train_state(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer, const SaveIdentity& identity,
                               Communicator& world);

}  // namespace remat
