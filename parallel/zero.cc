#include "parallel/zero.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>

#include "parallel/grad_norm.h"
#include "parallel/sharding_strategy.h"
#include "runtime/communicator.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel {

ZeroModel::ZeroModel(torch::nn::Module& model,
                     const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                     std::shared_ptr<Communicator> dp_group, const ZeroOptions& config,
                     const Bf16Options& bf16, std::vector<at::Tensor> sharded_tp)
    : stage_(config.stage), model_(model), sharded_tp_(std::move(sharded_tp)) {
  if (std::string bad = check_bf16_options(bf16, config); !bad.empty()) throw ConfigError(bad);
  const std::string invalid = check_zero_options(config);
  if (!invalid.empty()) throw ConfigError("config error: " + invalid);
  const int dp = dp_group->size(), rank = dp_group->rank();
  DpGroups groups{dp_group, dp_group, nullptr};
  const int hybrid = config.hybrid_shard_size;
  if (std::string bad = check_hybrid_shard_size(config, dp); !bad.empty()) throw ConfigError(bad);
  if (hybrid > 0 && hybrid < dp) {
    // Groups of `hybrid` consecutive data-parallel ranks shard; the ranks at
    // the same place in each group replicate.
    groups.shard = dp_group->split(rank / hybrid, rank);
    groups.replicate = dp_group->split(rank % hybrid, rank);
    log_rank0().info("zero stage {}: hybrid sharding, data-parallel size {} = shard {} x replicate {} "
                     "(sharded within consecutive ranks, replicated across groups)",
                     config.stage, dp, hybrid, dp / hybrid);
  }
  // Every replica starts from data-parallel rank 0's weights, whatever each
  // rank initialised (another seed, another file): a rank that built its
  // model differently would otherwise train its own model.
  if (dp > 1) {
    c10::NoGradGuard no_grad;
    std::vector<std::shared_ptr<Work>> pending;
    std::vector<at::Tensor> tensors;
    for (const auto& p : model.parameters()) tensors.push_back(p.detach());
    for (const auto& b : model.buffers()) tensors.push_back(b.detach());
    for (auto& t : tensors) {
      REMAT_CHECK(t.is_contiguous(), "ZeroModel: a parameter or buffer is not contiguous");
      pending.push_back(dp_group->broadcast(t, {0}));
    }
    for (auto& w : pending) w->wait();
  }
  shard_group_ = groups.shard;
  replicate_group_ = groups.replicate;
  const int64_t bucket = std::max<int64_t>(config.reduce_bucket_size, 1);
  switch (config.stage) {
    case 0:
      strategy_ = make_data_parallel(model, dp_group, {bucket, config.overlap_comm, config.progress_in_hooks});
      break;
    case 1:
    case 2: {
      Stage12Settings s;
      s.stage = config.stage;
      s.reduce_bucket_size = bucket;
      s.allgather_bucket_size = std::max<int64_t>(config.allgather_bucket_size, 1);
      s.reduce_scatter = config.reduce_scatter;
      s.allgather_partitions = config.allgather_partitions;
      s.overlap_comm = config.overlap_comm;
      s.contiguous_gradients = config.contiguous_gradients;
      s.progress_in_hooks = config.progress_in_hooks;
      strategy_ = make_stage12(model, groups, sharded_tp_, s);
      break;
    }
    default: {
      Stage3Settings s;
      s.param_persistence_threshold = config.stage3_param_persistence_threshold;
      s.reduce_bucket_size = bucket;
      s.prefetch_bucket_size = config.stage3_prefetch_bucket_size;
      s.bf16 = bf16.enabled;
      strategy_ = make_stage3(model, units, groups, sharded_tp_, s);
      break;
    }
  }
  arrivals_ = std::make_unique<Arrivals>(model);
}

// A flag per model parameter, set by a post hook on its gradient
// accumulator (autograd may run it on a device thread: atomics).
struct ZeroModel::Arrivals {
  explicit Arrivals(torch::nn::Module& model)
      : flags(model.parameters().size()), hooks([this](size_t, size_t k) { flags[k] = true; }) {
    const auto params = model.parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].requires_grad()) hooks.add(params[k], 0, k);
    }
  }
  std::vector<std::atomic<bool>> flags;
  GradientHooks hooks;
};

ZeroModel::~ZeroModel() = default;

at::Tensor ZeroModel::take_gradient_arrivals() {
  at::Tensor out = at::zeros({static_cast<int64_t>(arrivals_->flags.size())}, at::kFloat);
  float* data = out.data_ptr<float>();
  for (size_t k = 0; k < arrivals_->flags.size(); ++k) data[k] = arrivals_->flags[k].exchange(false) ? 1.0f : 0.0f;
  return out;
}

std::vector<at::Tensor> ZeroModel::parameters() const { return strategy_->parameters(); }
std::vector<ShardLayout> ZeroModel::layout() const { return strategy_->layout(); }
int ZeroModel::shard_size() const { return shard_group_->size(); }
int ZeroModel::replicate_size() const { return replicate_group_ ? replicate_group_->size() : 1; }

std::vector<std::pair<std::string, at::Tensor>> ZeroModel::full_parameters() {
  std::map<std::string, at::Tensor> full = strategy_->full_parameters();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model_.named_parameters()) out.emplace_back(item.key(), full.at(item.key()));
  return out;
}

void ZeroModel::begin_forward() { strategy_->begin_forward(); }
at::Tensor ZeroModel::finish_forward(const at::Tensor& loss) { return strategy_->finish_forward(loss); }
void ZeroModel::begin_backward(bool synchronize) { strategy_->begin_backward(synchronize); }

void ZeroModel::finish_backward(bool synchronize) { strategy_->finish_backward(synchronize); }
void ZeroModel::end_evaluation() { strategy_->end_evaluation(); }

void ZeroModel::abandon_backward() {
  strategy_->abandon_backward();
  for (auto& p : strategy_->parameters()) p.mutable_grad() = at::Tensor();
  for (auto& p : model_.parameters()) p.mutable_grad() = at::Tensor();
  take_gradient_arrivals();
}

double ZeroModel::clip_grad_norm(double max_norm, const std::shared_ptr<Communicator>& tp_group) {
  return parallel::clip_grad_norm(strategy_->grad_groups(sharded_tp_, tp_group), max_norm);
}

ZeroStats ZeroModel::stats() const { return strategy_->stats(); }
void ZeroModel::reset_peak() { strategy_->reset_peak(); }
std::map<std::string, int64_t> ZeroModel::gather_counts() const { return strategy_->gather_counts(); }
std::map<std::string, int64_t> ZeroModel::unit_numels() const { return strategy_->unit_numels(); }
std::map<std::string, int64_t> ZeroModel::unit_padded_numels() const {
  return strategy_->unit_padded_numels();
}

}  // namespace remat::parallel
