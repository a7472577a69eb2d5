// ZeRO stage 0: every rank holds every parameter, gradients are averaged.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <unordered_set>

#include "parallel/sharding_strategy.h"
#include "runtime/communicator.h"
#include "runtime/memory_trace.h"

namespace remat::parallel {

void all_reduce_gradients(const std::vector<at::Tensor>& all_params, Communicator& dp,
                          int64_t bucket_size, int64_t& bytes) {
  // A frozen parameter (requires_grad false) never gets a gradient: one of
  // zeros would let weight decay or momentum move it.
  std::vector<at::Tensor> trainable;
  for (const auto& p : all_params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  const std::vector<at::Tensor>& params = trainable;
  size_t start = 0;
  while (start < params.size()) {
    std::vector<at::Tensor> bucket;
    int64_t elements = 0;
    size_t end = start;
    while (end < params.size() && (bucket.empty() || elements + params[end].numel() <= bucket_size)) {
      auto& p = params[end];
      // A parameter without a gradient on this rank takes part with zeros,
      // so every rank reduces the same buffer.
      if (!p.grad().defined()) {
        MemoryCategoryScope gradients(MemoryCategory::kGradients);
        p.mutable_grad() = at::zeros_like(p);
      }
      bucket.push_back(p.grad().reshape({-1}));
      elements += p.numel();
      ++end;
    }
    MemoryCategoryScope buffers(MemoryCategory::kCommunication);
    at::Tensor flat = at::cat(bucket);
    if (dp.size() > 1) {
      dp.allReduce(flat, {ReduceOp::kAvg})->wait();
      bytes += 2 * static_cast<int64_t>(flat.nbytes());
    }
    int64_t offset = 0;
    for (size_t i = start; i < end; ++i) {
      auto& p = params[i];
      p.mutable_grad().view(-1).copy_(flat.narrow(0, offset, p.numel()));
      offset += p.numel();
    }
    start = end;
  }
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split_by(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& subset) {
  std::unordered_set<const void*> in;
  for (const auto& p : subset) in.insert(p.unsafeGetTensorImpl());
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> out;
  for (const auto& p : params) (in.count(p.unsafeGetTensorImpl()) ? out.first : out.second).push_back(p);
  return out;
}

std::map<const void*, std::string> parameter_names(const torch::nn::Module& model) {
  std::map<const void*, std::string> out;
  for (const auto& item : model.named_parameters()) out.emplace(item.value().unsafeGetTensorImpl(), item.key());
  return out;
}

ShardLayout flat_layout(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                        const std::map<const void*, std::string>& names, int64_t begin,
                        int64_t length) {
  ShardLayout out;
  for (size_t k = 0; k < params.size(); ++k) {
    const int64_t lo = std::max(begin, offsets[k]);
    const int64_t hi = std::min(begin + length, offsets[k] + params[k].numel());
    if (lo >= hi) continue;
    out.segments.push_back({names.at(params[k].unsafeGetTensorImpl()), lo - offsets[k], lo - begin, hi - lo});
  }
  return out;
}

namespace {

class DataParallel final : public ShardingStrategy {
 public:
  DataParallel(torch::nn::Module& model, std::shared_ptr<Communicator> dp, int64_t bucket)
      : model_(model), dp_(std::move(dp)), params_(model.parameters()), bucket_(bucket) {}

  std::vector<at::Tensor> parameters() const override { return params_; }

  std::map<std::string, at::Tensor> full_parameters() override {
    std::map<std::string, at::Tensor> out;
    for (const auto& item : model_.named_parameters()) out[item.key()] = item.value().detach().to(at::kFloat).clone();
    return out;
  }

  std::vector<ShardLayout> layout() const override {
    const auto names = parameter_names(model_);
    std::vector<ShardLayout> out;
    for (const auto& p : params_) out.push_back(flat_layout({p}, {0}, names, 0, p.numel()));
    return out;
  }

  void finish_backward(bool synchronize) override {
    if (synchronize) all_reduce_gradients(params_, *dp_, bucket_, allreduce_bytes_);
  }

  std::vector<GradGroup> grad_groups(const std::vector<at::Tensor>& sharded_tp,
                                     const std::shared_ptr<Communicator>& tp) const override {
    auto [sharded, replicated] = split_by(params_, sharded_tp);
    return {{sharded, {tp}}, {replicated, {}}};
  }

  ZeroStats stats() const override {
    ZeroStats s;
    for (const auto& p : params_) {
      s.param_bytes += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) s.grad_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    s.allreduce_bytes = allreduce_bytes_;
    s.peak_grad_bytes = s.grad_bytes;
    return s;
  }

 private:
  torch::nn::Module& model_;
  std::shared_ptr<Communicator> dp_;
  std::vector<at::Tensor> params_;
  int64_t bucket_;
  int64_t allreduce_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ShardingStrategy> make_data_parallel(torch::nn::Module& model,
                                                     std::shared_ptr<Communicator> dp,
                                                     int64_t reduce_bucket_size) {
  return std::make_unique<DataParallel>(model, std::move(dp), reduce_bucket_size);
}

}  // namespace remat::parallel
