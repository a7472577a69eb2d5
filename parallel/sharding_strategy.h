// The interface ZeroModel drives, one implementation per ZeRO stage
// (internal to parallel/). Plain data parallelism (stage 0,
// data_parallel.cc) and full sharding (stage 3, zero_stage3.cc) live apart;
// a stage that shards less (optimizer state, gradients) is another
// implementation of the same calls.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/grad_norm.h"
#include "parallel/zero.h"

namespace torch::nn {
class Module;
}

namespace remat::parallel {

class ShardingStrategy {
 public:
  virtual ~ShardingStrategy() = default;

  // What the optimizer steps, and the same tensors as a module for saving.
  virtual std::vector<at::Tensor> parameters() const = 0;
  virtual torch::nn::Module& state() = 0;

  virtual void begin_forward() {}
  virtual at::Tensor finish_forward(const at::Tensor& loss) { return loss; }
  virtual void finish_backward(bool synchronize) = 0;
  virtual void end_evaluation() {}

  // The gradients for the global norm, each group with the communicators its
  // squares are summed over (`sharded_tp`: which tensors differ across the
  // tensor-parallel group `tp`).
  virtual std::vector<GradGroup> grad_groups(const std::vector<at::Tensor>& sharded_tp,
                                             const std::shared_ptr<Communicator>& tp) const = 0;

  // Bytes gathered and moved; the per-unit views are empty where there are no units.
  virtual ZeroStats stats() const = 0;
  virtual void reset_peak() {}
  virtual std::map<std::string, int64_t> gather_counts() const { return {}; }
  virtual std::map<std::string, int64_t> unit_numels() const { return {}; }
  virtual std::map<std::string, int64_t> unit_padded_numels() const { return {}; }
};

// Stage 0: gradients all-reduced (averaged) in buckets at the last micro-step.
std::unique_ptr<ShardingStrategy> make_data_parallel(torch::nn::Module& model,
                                                     std::shared_ptr<Communicator> dp,
                                                     int64_t reduce_bucket_size);

// Stage 3: see zero.h.
struct Stage3Settings {
  int64_t param_persistence_threshold = 0;  // elements
  int64_t reduce_bucket_size = 1;           // elements per reduce collective
  int64_t prefetch_bucket_size = 0;         // prefetch a unit of at most this many elements
  bool bf16 = false;                        // gathered parameters in bf16, shards in fp32
};
std::unique_ptr<ShardingStrategy> make_stage3(
    torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
    std::shared_ptr<Communicator> dp, const std::vector<at::Tensor>& sharded_tp,
    const Stage3Settings& settings);

// Averages the gradients of `params` over `dp` in buckets of at most
// `bucket_size` elements (a parameter without a gradient takes part with
// zeros); adds 2 x the bytes reduced to `bytes`.
void all_reduce_gradients(const std::vector<at::Tensor>& params, Communicator& dp,
                          int64_t bucket_size, int64_t& bytes);

// Tensors of `params` that are in `subset` (by identity), in order; and the rest.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split_by(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& subset);

}  // namespace remat::parallel
