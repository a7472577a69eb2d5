// Transitional: the optimizer's factory and state access are optim/'s
// (optim/optimizer.h). engine.cc and internal/step_meter.cc, which another
// part of issue 51 edits, still include this header: repoint them at
// optim/optimizer.h (optim:: names), then delete it.
#pragma once

#include "optim/optimizer.h"

namespace remat {

using optim::optimizer_state_bytes;
using optim::optimizer_state_of;
using optim::optimizer_state_tensors;
using optim::set_learning_rate;
using optim::set_optimizer_state;

}  // namespace remat
