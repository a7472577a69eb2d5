// Transitional: the learning-rate schedule is optim/'s (optim/lr_schedule.h).
// engine.cc, which another part of issue 51 edits, still includes this
// header: repoint it at optim/lr_schedule.h (optim::learning_rate), then
// delete it.
#pragma once

#include "optim/lr_schedule.h"

namespace remat {

using optim::learning_rate;

}  // namespace remat
