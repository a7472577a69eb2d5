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
#include "parallel/internal/master_policy.h"
#include "parallel/zero.h"
#include "parallel/zero_memory.h"

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

// Each strategy keeps its buckets or units and their collectives; where the
// float32 masters live and how the 16-bit compute copies are made it asks
// the policy ZeroModel made (master_policy.h), which outlives it.
class ShardingStrategy {
 public:
  explicit ShardingStrategy(MasterPolicy& policy) : policy_(policy) {}
  virtual ~ShardingStrategy() = default;

  // For each of parameters(): the model parameter elements it holds.
  virtual std::vector<ShardLayout> layout() const = 0;
  // The model's parameters, whole and current, in float32, one unit at a
  // time (ZeroModel::for_each_full_unit): each source names its parameters
  // (known without gathering) and gathers them when called (collective over
  // the data-parallel group; between steps). Every parameter in one source.
  struct FullUnitSource {
    std::vector<std::string> names;
    std::function<ZeroModel::FullUnit()> gather;
  };
  virtual std::vector<FullUnitSource> full_units() = 0;

  // What the optimizer steps.
  virtual std::vector<at::Tensor> parameters() const = 0;
  // masters_on_host (zero_options.h): for each of parameters(), a 16-bit
  // device tensor then, the float32 host tensor holding its value (the
  // optimizer's master, which the policy's host mode copies into it);
  // empty otherwise (parameters() hold their own values).
  virtual std::vector<at::Tensor> host_masters() const { return {}; }

  // The model's parameters brought up to date with what the optimizer
  // stepped or a load wrote into parameters() (stages 1 and 2 gather the
  // shards; stage 0 steps the parameters themselves and stage 3 gathers
  // them at each use: nothing to do).
  virtual void sync_parameters() {}
  // After each rank wrote its pieces of parameters() (ZeroModel's
  // write_back_parameters; collective): the model's parameters brought up to
  // date on every rank alike, whichever ranks' pieces changed.
  virtual void after_write() { sync_parameters(); }
  // Whether the model's parameters are views of the units gathered around
  // each use, empty between uses (stage 3): reading them between steps needs
  // their whole values put in (ZeroModel::install_whole_parameters). The
  // other stages keep them whole.
  virtual bool parameters_gathered_on_use() const { return false; }
  // The model's parameters left whole, current and float32 for use without
  // the strategy (where bf16 compute copies were installed, the masters go
  // back in). Stage 3 is left whole by ZeroModel.
  virtual void leave_whole() { sync_parameters(); }
  // The gradients this rank holds (the stage's rule, zero_memory.h).
  virtual GradientHold gradient_hold(int64_t trainable, int64_t local_trainable) const = 0;

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

 protected:
  const MasterPolicy& policy() const { return policy_; }
  // With one of parameters() each time its reduced gradient was updated
  // (stages 1-3: as each bucket's or unit's reduction ends), so that a
  // gradient complete for the window can move on at once (offload_optimizer).
  void gradient_reduced(const at::Tensor& t) const { policy_.gradient_reduced(t); }
  // With one of parameters() just before the strategy reads it on the
  // current stream (a gather; a forward that reads it directly), so that a
  // copy into it still in flight is waited for (offload_optimizer's copies
  // back, zero_offload.h).
  void before_read(const at::Tensor& t) const { policy_.before_read(t); }

 private:
  MasterPolicy& policy_;
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

// Each strategy takes ZeroModel's options as they are (zero_options.h,
// validated there): the defaults live there alone.
//
// Stage 0: gradients all-reduced (averaged) in buckets of reduce_bucket_size
// elements at the last micro-step; with overlap_comm each bucket starts as
// soon as its gradients are accumulated, during that micro-step's backward.
// With mixed precision (stages 0-2): the model holds bf16 or fp16 copies of
// float32 masters (what parameters() returns), made again once per step;
// each micro-step's 16-bit gradients are added into float32 ones.
std::unique_ptr<ShardingStrategy> make_data_parallel(torch::nn::Module& model,
                                                     std::shared_ptr<Communicator> dp,
                                                     const ZeroOptions& options, MasterPolicy& policy);

// Stages 1 and 2: see zero.h.
std::unique_ptr<ShardingStrategy> make_stage12(torch::nn::Module& model, const DpGroups& groups,
                                               const std::vector<at::Tensor>& sharded_tp,
                                               const ZeroOptions& options, MasterPolicy& policy);

// Stage 3: see zero.h. With mixed precision the units are gathered in the compute dtype from float32
// shards, and every parameter is sharded (none persistent).
std::unique_ptr<ShardingStrategy> make_stage3(
    torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
    const DpGroups& groups, const std::vector<at::Tensor>& sharded_tp, const ZeroOptions& options,
    MasterPolicy& policy);

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
