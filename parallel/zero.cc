#include "parallel/zero.h"

#include <torch/nn/module.h>

#include <algorithm>

#include "parallel/grad_norm.h"
#include "parallel/sharding_strategy.h"
#include "runtime/config.h"
#include "runtime/error.h"

namespace remat::parallel {

ZeroModel::ZeroModel(torch::nn::Module& model,
                     const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                     std::shared_ptr<Communicator> dp_group, const ZeroConfig& config,
                     const Bf16Config& bf16, std::vector<at::Tensor> sharded_tp)
    : stage_(config.stage), sharded_tp_(std::move(sharded_tp)) {
  if (bf16.enabled && config.stage != 3) {
    throw ConfigError("bf16.enabled computes in bf16 from fp32 master shards: it needs "
                      "zero_optimization.stage 3 (set it, or turn bf16 off)");
  }
  const int64_t bucket = std::max<int64_t>(config.reduce_bucket_size, 1);
  switch (config.stage) {
    case 0:
      strategy_ = make_data_parallel(model, std::move(dp_group), bucket);
      break;
    case 3: {
      Stage3Settings s;
      s.param_persistence_threshold = config.stage3_param_persistence_threshold;
      s.reduce_bucket_size = bucket;
      s.prefetch_bucket_size = config.stage3_prefetch_bucket_size;
      s.bf16 = bf16.enabled;
      strategy_ = make_stage3(model, units, std::move(dp_group), sharded_tp_, s);
      break;
    }
    default:
      throw ConfigError(str("zero_optimization.stage ", config.stage,
                            " is not implemented: use 0 (data parallel, all-reduce) or 3 "
                            "(parameters, gradients and optimizer state sharded)"));
  }
}

ZeroModel::~ZeroModel() = default;

std::vector<at::Tensor> ZeroModel::parameters() const { return strategy_->parameters(); }
torch::nn::Module& ZeroModel::state() { return strategy_->state(); }
void ZeroModel::begin_forward() { strategy_->begin_forward(); }
at::Tensor ZeroModel::finish_forward(const at::Tensor& loss) { return strategy_->finish_forward(loss); }
void ZeroModel::finish_backward(bool synchronize) { strategy_->finish_backward(synchronize); }
void ZeroModel::end_evaluation() { strategy_->end_evaluation(); }

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
