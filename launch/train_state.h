// Saving and resuming remat-train's full state: parameters, optimizer state,
// RNG (default generators and tracker states), data position and step.
//
// Layout: DIR/step_00000010/rank_<r>.pt (one per rank), then manifest.json
// written by rank 0 after every rank finished, then DIR/latest naming the step
// folder. Each file is written to a temporary name, flushed, fsynced and
// renamed, so a crash leaves either the old or the new file, never half of one.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

namespace remat {

class Communicator;

struct TrainPosition {
  int64_t step = 0;    // completed optimizer steps
  int64_t window = 0;  // next training window of this rank's data stream
};

// Writes this rank's state for `position.step` (collective over `world`).
void save_train_state(const std::string& dir, const TrainPosition& position,
                      torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                      const std::string& model_signature, Communicator& world);

// Loads a save made by save_train_state: `dir` is a step folder or the save
// root (then DIR/latest). A missing, incomplete or corrupt save, or one made
// with another world size or model shape, is a ConfigError saying which.
TrainPosition load_train_state(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer,
                               const std::string& model_signature, const Communicator& world);

}  // namespace remat
