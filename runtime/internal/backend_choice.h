// Which backend a job's world communicator uses, decided from what every rank
// reports: a pure function, so that each rank reaches the same answer from
// the same reports and tests can state cases without GPUs.
//
// NCCL allows one rank per GPU. So `auto` picks nccl only where every rank has
// a GPU of its own (no two ranks on one node use the same device), and mpi
// otherwise: it carries CUDA tensors through host memory, so ranks may share
// a GPU.
#pragma once

#include <string>
#include <vector>

namespace remat::internal {

// One rank's report.
struct RankDevices {
  std::string node;    // its host name
  int gpus = 0;        // CUDA devices it sees
  std::string device;  // the one it uses (PCI bus id), empty without one
};

// "2|0000:3b:00.0|node-a" and back: how a report travels between ranks.
std::string encode(const RankDevices& r);
RankDevices decode_rank_devices(const std::string& text);

struct BackendChoice {
  bool nccl = false;
  std::string reason;  // why, for the log: "2 ranks share 1 GPU on node a; ..."
};

// `auto`'s choice for ranks reporting `ranks` (index = rank), in a build that
// has the nccl backend or not.
BackendChoice choose_auto_backend(bool nccl_built, const std::vector<RankDevices>& ranks);

// An explicit nccl backend: a ConfigError, naming the ranks, where some rank
// has no GPU or shares one with another rank.
void check_nccl_fits(const std::vector<RankDevices>& ranks);

}  // namespace remat::internal
