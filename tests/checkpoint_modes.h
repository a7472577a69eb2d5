// Test support: runs a suite's cases once with non-reentrant and once with
// reentrant regions. Cases call checkpoint() (the default options) or start
// their options from mode_options().
//
//   class Checkpoint : public CheckpointModes {};
//   TEST_P(Checkpoint, SingleLinear) { ... }
//   INSTANTIATE_CHECKPOINT_MODES(Checkpoint);
#pragma once

#include <gtest/gtest.h>

#include "checkpointing/checkpoint.h"

namespace remat {

class CheckpointModes : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    saved_ = default_checkpoint_options().reentrant;
    default_checkpoint_options().reentrant = GetParam();
  }
  void TearDown() override { default_checkpoint_options().reentrant = saved_; }

 private:
  bool saved_ = false;
};

// Options of the mode the case runs in (else the defaults of CheckpointOptions).
inline CheckpointOptions mode_options() {
  CheckpointOptions options;
  options.reentrant = default_checkpoint_options().reentrant;
  return options;
}

inline CheckpointOptions reentrant_options() {
  CheckpointOptions options;
  options.reentrant = true;
  return options;
}

}  // namespace remat

#define INSTANTIATE_CHECKPOINT_MODES(Suite)                                                   \
  INSTANTIATE_TEST_SUITE_P(Modes, Suite, ::testing::Values(false, true),                     \
                           [](const ::testing::TestParamInfo<bool>& info) {                  \
                             return std::string(info.param ? "Reentrant" : "NonReentrant"); \
                           })
