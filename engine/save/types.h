// The types the parts of a save share: what one rank saves and resumes
// (TrainShards), where the run is (TrainPosition), what a save must agree
// with (SaveIdentity), and what a save holds as its manifest records it
// (save::Manifest), which the re-slicing plan reads without any file.
//
// Internal to engine/: only the save format (engine/save/), the engine's
// sources and their tests include it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "parallel/tensor_split.h"
#include "parallel/zero.h"

namespace remat {

// Every model parameter by state-dict name, in the model's order, with its
// tensor-parallel split (parallel::parameter_splits).
using Splits = std::vector<std::pair<std::string, parallel::TensorSplit>>;

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
  Splits splits;
  int tp_rank = 0, tp_size = 1, dp_rank = 0, dp_size = 1;
};

struct TrainPosition {
  int64_t step = 0;  // completed optimizer steps
  // The caller's own data (data position, epoch, ...) as JSON text: rank 0's
  // is saved, every rank gets it back.
  std::string client_state = "{}";
  // fp16's loss scaler state as JSON text (engine/internal/loss_scaling.h);
  // empty: none (fp16 off, or a save made before it was kept).
  std::string loss_scaler;
  // What the run decided for itself, as JSON text (engine/engine.h,
  // keep_saved_decisions: its "auto" values, its batch sizes, the micro-batch
  // search); empty: none recorded (a save made before they were kept).
  std::string decisions;
  // Of the steps, those skipped for a non-finite gradient (an fp16
  // overflow): the learning-rate schedule did not advance over them.
  int64_t skipped_steps = 0;
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

namespace save {

// Formats of the manifest and the rank files this remat writes and reads: 3
// adds the manifest's own checksum and each rank file's ranks and layout, 4
// the parameters and client state, 5 each parameter's tensor-parallel split
// (a format 4 save resumes at its own tensor-parallel size only).
constexpr int64_t kFormat = 5;
constexpr int64_t kOldestFormat = 4;

// What a save holds, as its manifest records it (read and checked by
// read_manifest, engine/save/manifest.h).
struct Manifest {
  int64_t format = 1;  // 2: rank files hold shards with their layout here
  int64_t step = 0;
  int64_t skipped_steps = 0;  // 0 where not recorded (saves before it was kept)
  int64_t world_size = 0;
  int64_t tp_size = 1, dp_size = 0;
  std::string model;
  std::string run_id;  // empty: saved before run ids were recorded
  std::map<std::string, std::string> settings;
  // The model's parameters as [name, shape] pairs (format 4), the shapes of
  // the saved tensor-parallel size's shares.
  nlohmann::json parameters = nlohmann::json::array();
  // Each parameter's tensor-parallel split (format 5; empty before).
  Splits splits;
  std::string client_state = "{}";  // JSON text (format 4)
  std::string loss_scaler;          // JSON text; empty: none saved
  std::string decisions;            // JSON text (TrainPosition::decisions); empty: none saved
  struct File {
    std::string name;
    int64_t bytes = -1, crc32 = -1;  // -1: not recorded (an older save)
    int64_t tp_rank = 0, dp_rank = 0;
    std::vector<parallel::ShardLayout> tensors;  // what each saved tensor holds
  };
  std::vector<File> files;
};

}  // namespace save
}  // namespace remat
