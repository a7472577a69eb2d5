#include "parallel/internal/master_policy.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "parallel/internal/zero_offload.h"
#include "parallel/nvme_tensor_file.h"
#include "runtime/memory_trace.h"

namespace remat::parallel {

MasterPolicy::MasterPolicy(const ZeroOptions& options, const MixedPrecision& mixed, const NvmeFiles& nvme)
    : mixed_(mixed),
      masters_on_host_(parallel::masters_on_host(options, mixed)),
      masters_pinned_(masters_on_host_ && options.offload_optimizer.pin_memory && can_pin_host_memory()),
      params_on_host_(options.stage == 3 && options.offload_param.enabled()),
      params_pinned_(params_on_host_ && options.offload_param.pin_memory && can_pin_host_memory()),
      nvme_params_(params_on_host_ ? nvme.parameters : nullptr),
      nvme_masters_(nvme.masters) {}

MasterPolicy::~MasterPolicy() = default;

at::Tensor MasterPolicy::host_master(const at::Tensor& values) const {
  if (nvme_masters_) {
    if (at::Tensor mapped = nvme_masters_->place(values); mapped.defined()) return mapped.view(values.sizes());
  }
  return host_copy(values, masters_pinned_);
}

at::Tensor MasterPolicy::stage3_shard(const at::Tensor& mine) const {
  if (nvme_params_) {
    if (at::Tensor mapped = nvme_params_->place(mine); mapped.defined()) return mapped;
  }
  if (params_on_host_) return host_copy(mine, params_pinned_);
  return masters_on_host_ ? mine.to(compute_dtype()) : mine.clone();
}

void MasterPolicy::prefetch(const at::Tensor& shard) const {
  if (nvme_params_) nvme_params_->prefetch(shard);
}
void MasterPolicy::release(const at::Tensor& shard) const {
  if (nvme_params_) nvme_params_->release(shard);
}
void MasterPolicy::release_all() const {
  if (nvme_params_) nvme_params_->release_all();
}
bool MasterPolicy::on_disk(const at::Tensor& shard) const { return nvme_params_ && nvme_params_->on_disk(shard); }

void MasterPolicy::fold_gradient(at::Tensor& copy, at::Tensor& master) const {
  if (!mixed() || !copy.grad().defined()) return;
  c10::NoGradGuard no_grad;
  MemoryCategoryScope gradients(MemoryCategory::kGradients);
  if (master.grad().defined()) {
    master.mutable_grad().add_(copy.grad());
  } else {
    master.mutable_grad() = copy.grad().to(at::kFloat);
  }
  copy.mutable_grad() = at::Tensor();
}

void MasterPolicy::start_host_mode(std::vector<at::Tensor> stepped, const OffloadOptimizerOptions& options,
                                   const std::vector<at::Tensor>& host_shards,
                                   const std::vector<at::Tensor>& masters) {
  host_ = std::make_unique<OptimizerOffload>(std::move(stepped), options, host_shards, masters, nvme_masters_.get());
}

std::vector<at::Tensor> MasterPolicy::optimizer_tensors(std::vector<at::Tensor> stepped, bool settle) const {
  if (!host_) return stepped;
  if (settle) host_->settle();
  return host_->parameters();
}

at::Tensor MasterPolicy::host_of(const at::Tensor& device) const { return host_ ? host_->host_of(device) : device; }
void MasterPolicy::push(bool force) {
  if (host_) host_->push(force);
  if (nvme_masters_) nvme_masters_->release_all();  // the copies made, the masters go back to disk
}
void MasterPolicy::settle() {
  if (host_) host_->settle();
}
void MasterPolicy::take_gradients() {
  if (host_) host_->take_gradients();
}
void MasterPolicy::drop_gradients() {
  if (host_) host_->drop_gradients();
}
int64_t MasterPolicy::host_bytes() const { return host_ ? host_->host_bytes() : 0; }

void MasterPolicy::gradient_reduced(const at::Tensor& shard) const {
  if (host_ && last_micro_step_) host_->take_gradient(shard);
}
void MasterPolicy::before_read(const at::Tensor& t) const {
  if (host_) host_->ready(t);
}

void WholeCopies::install(const MasterPolicy& policy, std::vector<at::Tensor> params,
                          std::map<const void*, std::string>& names) {
  params_ = std::move(params);
  if (!policy.mixed()) {
    masters_ = params_;
    return;
  }
  policy_ = &policy;
  c10::NoGradGuard no_grad;
  for (auto& p : params_) {
    if (policy.masters_on_host()) {
      // The optimizer steps the copy (host mode copies the master into it):
      // its version says when the copy changed.
      host_.push_back(policy.host_master(p));
      p.set_data(p.detach().to(policy.compute_dtype()));
      masters_.push_back(p);
      versions_.push_back(p._version());
      continue;
    }
    at::Tensor m = p.detach().clone().requires_grad_(p.requires_grad());
    names.emplace(m.unsafeGetTensorImpl(), names.at(p.unsafeGetTensorImpl()));
    p.set_data(p.detach().to(policy.compute_dtype()));
    masters_.push_back(m);
    versions_.push_back(m._version());
  }
}

bool WholeCopies::changed() const {
  for (size_t i = 0; i < versions_.size(); ++i) {
    if (masters_[i]._version() != versions_[i]) return true;
  }
  return false;
}

void WholeCopies::refresh() {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < versions_.size(); ++i) {
    if (host_.empty()) params_[i].detach().copy_(masters_[i].detach());
    versions_[i] = masters_[i]._version();
  }
}

void WholeCopies::leave_whole() {
  if (policy_ == nullptr) return;
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].set_data(host_.empty() ? masters_[i].detach()
                                      : host_[i].to(params_[i].device(), at::kFloat, /*non_blocking=*/false,
                                                    /*copy=*/true));
  }
}

}  // namespace remat::parallel
