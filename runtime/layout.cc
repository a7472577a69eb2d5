#include "runtime/layout.h"

#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace {

std::string divisors_of(int n) {
  std::string out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
  }
  return out;
}

}  // namespace

ParallelDims::ParallelDims(int dp_, int tp_, int world_) : dp(dp_), tp(tp_), world(world_) {
  if (dp < 1 || tp < 1 || world < 1 || dp * tp != world) {
    throw ConfigError(str("parallel layout dp=", dp, " x tp=", tp, " = ", dp * tp,
                          " does not match the world size ", world,
                          ": dp x tp must equal the number of ranks; tensor_parallel.size "
                          "can be one of ",
                          world >= 1 ? divisors_of(world) : "(none)", " for world size ",
                          world));
  }
}

ParallelDims ParallelDims::from_world(int world, int tp) {
  if (tp < 1 || world % tp != 0) {
    throw ConfigError(str("tensor_parallel.size=", tp, " does not divide the world size ", world,
                          ": choose one of ", divisors_of(world),
                          ", or launch a multiple of ", std::max(tp, 1), " ranks"));
  }
  return ParallelDims(world / tp, tp, world);
}

std::string ParallelDims::to_string() const {
  return str("dp=", dp, " x tp=", tp, " (world ", world, ")");
}

ParallelLayout::ParallelLayout(std::shared_ptr<Communicator> world, ParallelDims dims)
    : dims_(dims), world_(std::move(world)) {
  REMAT_CHECK_EQ(world_->size(), dims_.world,
                 "ParallelLayout: the communicator's size must be the layout's world size");
  int r = world_->rank();
  // Same color = same group; the key keeps ranks in world order.
  tp_group_ = world_->split(/*color=*/r / dims_.tp, /*key=*/r);
  dp_group_ = world_->split(/*color=*/r % dims_.tp, /*key=*/r);
  set_log_layout(tp_rank(), dims_.tp, dp_rank(), dims_.dp);
  log_rank0().info("parallel layout {}", dims_.to_string());
}

}  // namespace remat
