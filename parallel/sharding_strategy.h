// The interface ZeroModel drives, one implementation per ZeRO stage
// (internal to parallel/): plain data parallelism (stage 0,
// data_parallel.cc), optimizer state and gradient sharding (stages 1 and 2,
// zero_stage12.cc) and full sharding (stage 3, zero_stage3.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/grad_norm.h"
#include "parallel/zero.h"

namespace torch::nn {
class Module;
}
namespace torch::autograd {
struct Node;
}

namespace remat {
class Work;
}  // namespace remat

namespace remat::parallel {

// The data-parallel ranks, and how sharding splits them (hybrid sharding:
// `shard` a group of hybrid_shard_size ranks, `replicate` the ranks holding
// the same shard; without it `shard` is `dp` and `replicate` has size 1).
struct DpGroups {
  std::shared_ptr<Communicator> dp, shard, replicate;
};

class ShardingStrategy {
 public:
  virtual ~ShardingStrategy() = default;

  // For each of parameters(): the model parameter elements it holds.
  virtual std::vector<ShardLayout> layout() const = 0;
  // Copies of the model's parameters, whole and current, in float32, by
  // state-dict name (collective over the data-parallel group; between steps).
  virtual std::map<std::string, at::Tensor> full_parameters() = 0;

  // What the optimizer steps.
  virtual std::vector<at::Tensor> parameters() const = 0;

  virtual void begin_forward() {}
  virtual at::Tensor finish_forward(const at::Tensor& loss) { return loss; }
  // Before a backward: whether the finish_backward after it synchronizes
  // (the last micro-step of an accumulation window). Stages 0 and 1 with
  // overlap_comm reduce during that backward only.
  virtual void begin_backward(bool /*synchronize*/) {}
  virtual void finish_backward(bool synchronize) = 0;
  virtual void end_evaluation() {}
  // After a backward that failed half-way: waits for what is in flight and
  // drops every gradient and partial reduction, ready for a new forward.
  virtual void abandon_backward() {}

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

// Calls `arrived(bucket, index)` each time a backward has accumulated the
// gradient of a parameter added with that bucket and index (a post hook on
// the parameter's gradient accumulator). Once it is destroyed the hooks do
// nothing, so a graph that outlives the strategy is harmless.
class GradientHooks {
 public:
  using Arrived = std::function<void(size_t bucket, size_t index)>;
  explicit GradientHooks(Arrived arrived);
  ~GradientHooks();
  GradientHooks(const GradientHooks&) = delete;
  GradientHooks& operator=(const GradientHooks&) = delete;
  void add(const at::Tensor& param, size_t bucket, size_t index);
  struct Target;  // what the hooks call (data_parallel.cc)

 private:
  std::shared_ptr<Target> target_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

// Stage 0: gradients all-reduced (averaged) in buckets of reduce_bucket_size
// elements at the last micro-step; with overlap_comm each bucket starts as
// soon as its gradients are accumulated, during that micro-step's backward.
struct DataParallelSettings {
  int64_t reduce_bucket_size = 1;  // elements
  bool overlap_comm = false;
  bool progress_in_hooks = true;   // ZeroOptions::progress_in_hooks
};
std::unique_ptr<ShardingStrategy> make_data_parallel(torch::nn::Module& model,
                                                     std::shared_ptr<Communicator> dp,
                                                     const DataParallelSettings& settings);

// Stages 1 and 2: see zero.h.
struct Stage12Settings {
  int stage = 1;
  int64_t reduce_bucket_size = 1;     // elements per gradient bucket
  int64_t allgather_bucket_size = 1;  // elements per parameter all-gather
  bool reduce_scatter = true;
  bool allgather_partitions = true;
  bool overlap_comm = false;
  bool contiguous_gradients = true;
  bool progress_in_hooks = true;  // ZeroOptions::progress_in_hooks
};
std::unique_ptr<ShardingStrategy> make_stage12(torch::nn::Module& model, const DpGroups& groups,
                                               const std::vector<at::Tensor>& sharded_tp,
                                               const Stage12Settings& settings);

// Stage 3: see zero.h.
struct Stage3Settings {
  int64_t param_persistence_threshold = 0;  // elements
  int64_t reduce_bucket_size = 1;           // elements per reduce collective
  int64_t prefetch_bucket_size = 0;         // prefetch a unit of at most this many elements
  bool bf16 = false;                        // gathered parameters in bf16, shards in fp32
};
std::unique_ptr<ShardingStrategy> make_stage3(
    torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
    const DpGroups& groups, const std::vector<at::Tensor>& sharded_tp,
    const Stage3Settings& settings);

// Averages the gradients of `params` over `dp` in buckets of at most
// `bucket_size` elements (a parameter without a gradient takes part with
// zeros; a frozen one, requires_grad false, is left out and keeps no
// gradient); adds 2 x the bytes reduced to `bytes`.
void all_reduce_gradients(const std::vector<at::Tensor>& params, Communicator& dp,
                          int64_t bucket_size, int64_t& bytes);

// Each parameter's state-dict name in `model`, by TensorImpl.
std::map<const void*, std::string> parameter_names(const torch::nn::Module& model);

// The segments of a flat buffer's [begin, begin + length) that hold
// parameters laid out at `offsets` (padding skipped).
ShardLayout flat_layout(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                        const std::map<const void*, std::string>& names, int64_t begin,
                        int64_t length);

// Waits for `work`, adding the milliseconds it blocked to `ms`.
void timed_wait(Work& work, double& ms);

// Tensors of `params` that are in `subset` (by identity), in order; and the rest.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split_by(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& subset);

}  // namespace remat::parallel
