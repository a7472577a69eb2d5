// The parallel layout: data parallel x tensor parallel over the world.
//
// Tensor-parallel ranks are adjacent: with tp=2 on 4 ranks, {0,1} and {2,3}
// are tensor-parallel groups, {0,2} and {1,3} data-parallel groups.
//
//   ParallelDims dims = ParallelDims::from_world(world->size(), cfg.tensor_parallel.size);
//   ParallelLayout layout(world, dims);
//   layout.tp_group()->allReduce(partial_sum);
#pragma once

#include <memory>
#include <string>

#include "runtime/communicator.h"

namespace remat {

// Validated at construction: dp * tp == world, each at least 1.
struct ParallelDims {
  int dp = 1;
  int tp = 1;
  int world = 1;

  ParallelDims(int dp, int tp, int world);
  // dp derived from the world size; ConfigError when tp does not divide it.
  static ParallelDims from_world(int world, int tp);

  bool dp_enabled() const { return dp > 1; }
  bool tp_enabled() const { return tp > 1; }
  std::string to_string() const;  // "dp=2 x tp=2 (world 4)"
};

class ParallelLayout {
 public:
  // Collective over `world`: builds the tensor- and data-parallel groups and
  // tags the log prefix with tp/dp coordinates.
  ParallelLayout(std::shared_ptr<Communicator> world, ParallelDims dims);

  const ParallelDims& dims() const { return dims_; }
  int rank() const { return world_->rank(); }
  int tp_rank() const { return rank() % dims_.tp; }
  int dp_rank() const { return rank() / dims_.tp; }

  const std::shared_ptr<Communicator>& world() const { return world_; }
  const std::shared_ptr<Communicator>& tp_group() const { return tp_group_; }
  const std::shared_ptr<Communicator>& dp_group() const { return dp_group_; }

  // The accessor set DeepSpeed's configure(mpu) expects.
  int get_model_parallel_rank() const { return tp_rank(); }
  int get_model_parallel_world_size() const { return dims_.tp; }
  const std::shared_ptr<Communicator>& get_model_parallel_group() const { return tp_group_; }
  int get_data_parallel_rank() const { return dp_rank(); }
  int get_data_parallel_world_size() const { return dims_.dp; }
  const std::shared_ptr<Communicator>& get_data_parallel_group() const { return dp_group_; }

 private:
  ParallelDims dims_;
  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> tp_group_;
  std::shared_ptr<Communicator> dp_group_;
};

}  // namespace remat
