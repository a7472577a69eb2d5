#include "runtime/internal/backend_choice.h"

#include <cstdlib>
#include <map>
#include <optional>
#include <utility>

#include "runtime/error.h"

namespace remat::internal {

std::string encode(const RankDevices& r) { return str(r.gpus, "|", r.device, "|", r.node); }

RankDevices decode_rank_devices(const std::string& text) {
  const size_t a = text.find('|');
  const size_t b = a == std::string::npos ? a : text.find('|', a + 1);
  REMAT_CHECK(b != std::string::npos, "a rank's device report '", text, "' is not GPUS|DEVICE|NODE");
  RankDevices r;
  r.gpus = std::atoi(text.substr(0, a).c_str());
  r.device = text.substr(a + 1, b - a - 1);
  r.node = text.substr(b + 1);
  return r;
}

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += str(i == 0 ? "" : ", ", ranks[i]);
  return out;
}

struct Shortfall {
  std::string why;
  bool shared;  // ranks share a GPU (else one has none)
};

// Why nccl cannot carry this job, or nothing when every rank has a GPU of
// its own: the first rank without a GPU, else the first device shared.
std::optional<Shortfall> shortfall(const std::vector<RankDevices>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].gpus <= 0 || ranks[r].device.empty()) {
      return Shortfall{str("rank ", r, " on node ", ranks[r].node, " sees no GPU"), false};
    }
  }
  std::map<std::pair<std::string, std::string>, std::vector<int>> users;  // (node, device) -> ranks
  for (size_t r = 0; r < ranks.size(); ++r) users[{ranks[r].node, ranks[r].device}].push_back(static_cast<int>(r));
  for (const auto& [where, on] : users) {
    if (on.size() < 2) continue;
    int node_ranks = 0;
    for (const auto& rank : ranks) node_ranks += rank.node == where.first;
    return Shortfall{str(node_ranks, " ranks share ", ranks[on[0]].gpus, " GPU", ranks[on[0]].gpus == 1 ? "" : "s",
                         " on node ", where.first, " (ranks ", rank_list(on), " on device ", where.second, ")"),
                     true};
  }
  return std::nullopt;
}

}  // namespace

BackendChoice choose_auto_backend(bool nccl_built, const std::vector<RankDevices>& ranks) {
  if (!nccl_built) return {false, "this remat was built without NCCL"};
  bool any_gpu = false;
  for (const auto& r : ranks) any_gpu = any_gpu || r.gpus > 0;
  if (!any_gpu) return {false, "no rank sees a GPU"};
  if (auto s = shortfall(ranks)) return {false, str(s->why, "; nccl needs one GPU per rank")};
  return {true, str(ranks.size() == 1 ? "the rank has" : str("each of the ", ranks.size(), " ranks has"),
                    " a GPU of its own")};
}

void check_nccl_fits(const std::vector<RankDevices>& ranks) {
  auto s = shortfall(ranks);
  if (!s) return;
  if (!s->shared) {
    throw ConfigError(str("the nccl backend needs one GPU per rank, but ", s->why,
                          ": use the mpi backend (--backend mpi or auto)"));
  }
  throw ConfigError(str("the nccl backend needs one GPU per rank, but ", s->why,
                        ": use the mpi backend (--backend mpi or auto), which carries CUDA tensors through host "
                        "memory so ranks can share a GPU, or start at most as many ranks on each node as it has "
                        "GPUs"));
}

}  // namespace remat::internal
