// Writing the RNG snapshot (default generators and every tracker state, CPU
// and CUDA parts) into a LibTorch archive and reading it back, so that a
// resumed run draws exactly what the uninterrupted one would have.
//
//   torch::serialize::OutputArchive rng;
//   remat::write_rng_snapshot(rng, remat::capture_rng());
//   ...
//   remat::restore_rng(remat::read_rng_snapshot(rng_in));
//
// Keys: default/cpu, default/cuda, tracker_names (one name a line),
// tracker/<name>/cpu, tracker/<name>/cuda; the CUDA keys only where the
// snapshot has a CUDA part.
#pragma once

#include "rng/rng_tracker.h"

namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace remat {

void write_rng_snapshot(torch::serialize::OutputArchive& archive, const RngSnapshot& snapshot);

// Reads what write_rng_snapshot wrote; a missing CPU key is a c10::Error from
// the archive (the caller names the file).
RngSnapshot read_rng_snapshot(torch::serialize::InputArchive& archive);

}  // namespace remat
