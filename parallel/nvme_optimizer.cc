#include "parallel/nvme_optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <map>
#include <optional>

#include "optim/optimizer.h"
#include "parallel/internal/nvme_folder.h"
#include "parallel/internal/nvme_optimizer_store.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel {

namespace {

// The state on disk, for AdamW and Adam alike.
class NvmeState : public optim::ExternalState {
 public:
  NvmeState(const std::vector<at::Tensor>& params, const NvmeOptimizerOptions& nvme)
      : folder_(nvme.nvme_path, nvme.rank, "offload_optimizer", "optimizer", "its optimizer state", nvme.world_size) {
    internal::NvmeStoreOptions options;
    options.folder = folder_.path();
    options.rank = nvme.rank;
    options.sub_group_size = nvme.sub_group_size;
    options.buffer_count = nvme.buffer_count;
    options.io = nvme.io;
    options.kill_at_step = knobs::fault_nvme_step(knobs::kFaultNvmeKill).value_or(0);
    options.fail_at_step = knobs::fault_nvme_step(knobs::kFaultNvmeFail).value_or(0);
    for (const at::Tensor& p : params) {
      if (!p.requires_grad()) continue;  // frozen: never stepped
      if (!(p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() && p.layout() == at::kStrided)) {
        throw ConfigError(str("offload_optimizer.device \"nvme\" steps float32 host masters, but a trained parameter "
                              "is ", p.scalar_type(), " on ", p.device(), ": offload_optimizer needs zero_optimization "
                              "stage 1, 2 or 3 (its masters are then made on the host)"));
      }
      index_[p.unsafeGetTensorImpl()] = trained_.size();
      trained_.push_back(p);
      options.sizes.push_back(p.numel());
    }
    store_ = std::make_unique<internal::NvmeOptimizerStore>(options);
    store_->initialize();
    log_rank0().info("offload_optimizer nvme: the Adam moments of {} elements ({} bytes) in '{}' on each rank, "
                     "streamed through {} host buffers of {} bytes ({}, {} I/O)", options_elements(), store_->state_bytes(), folder_.path(),
                     store_->buffer_count(), store_->host_buffer_bytes() / store_->buffer_count(),
                     io_backend_name(store_->backend()), store_->direct() ? "direct" : "buffered");
    warn_of_padding(nvme);
  }

  void step_all(const optim::HostAdamStep& adam) {
    c10::NoGradGuard no_grad;
    store_->step(trained_, adam);
  }

  std::map<std::string, at::Tensor> external_state_of(const at::Tensor& param) const override {
    std::map<std::string, at::Tensor> out;
    const auto it = index_.find(param.unsafeGetTensorImpl());
    if (it == index_.end() || store_->steps(it->second) == 0) return out;
    const at::Tensor& p = trained_[it->second];
    at::Tensor m = at::empty({p.numel()}, at::kFloat), v = at::empty({p.numel()}, at::kFloat);
    store_->read_state(it->second, m, v);
    out["step"] = at::scalar_tensor(store_->steps(it->second), at::kLong);
    out["exp_avg"] = m.view(p.sizes());
    out["exp_avg_sq"] = v.view(p.sizes());
    return out;
  }

  void set_external_state(const at::Tensor& param, const std::map<std::string, at::Tensor>& state) override {
    const auto it = index_.find(param.unsafeGetTensorImpl());
    if (it == index_.end()) {
      REMAT_CHECK(state.empty(), "set_optimizer_state: a parameter the NVMe optimizer does not step (frozen) "
                                 "given optimizer state");
      return;
    }
    if (state.empty()) {
      store_->write_state(it->second, at::Tensor(), at::Tensor(), 0);
      return;
    }
    for (const auto& [name, value] : state) {
      if (name != "step" && name != "exp_avg" && name != "exp_avg_sq") {
        throw Error(str("set_optimizer_state: '", name, "' is not a state this optimizer keeps (a save made with "
                        "another optimizer.type, or amsgrad)"));
      }
    }
    auto flat = [&](const char* name) {
      auto found = state.find(name);
      REMAT_CHECK(found != state.end(), "set_optimizer_state: the NVMe optimizer's state needs '", name, "'");
      return found->second.detach().to(at::kCPU, at::kFloat).contiguous().view({-1});
    };
    const auto step = state.find("step");
    store_->write_state(it->second, flat("exp_avg"), flat("exp_avg_sq"),
                        step == state.end() ? 0 : step->second.item<int64_t>());
  }

  int64_t external_state_bytes() const override { return static_cast<int64_t>(store_->state_bytes()); }

  NvmeOptimizerStats stats() const {
    NvmeOptimizerStats s;
    s.file_bytes = static_cast<int64_t>(store_->file_bytes());
    s.buffer_bytes = static_cast<int64_t>(store_->host_buffer_bytes());
    s.bytes_read = static_cast<int64_t>(store_->last_step().bytes_read);
    s.bytes_written = static_cast<int64_t>(store_->last_step().bytes_written);
    s.seconds = store_->last_step().seconds;
    return s;
  }

 private:
  int64_t options_elements() const { return static_cast<int64_t>(store_->state_bytes() / 8); }

  // Each sub-group's two arrays are padded to the I/O alignment: sub-groups
  // smaller than that make the file (and each step's I/O) many times the state.
  void warn_of_padding(const NvmeOptimizerOptions& nvme) const {
    const int64_t floats = static_cast<int64_t>(nvme.io.alignment / sizeof(float));
    if (nvme.sub_group_size >= floats || options_elements() <= nvme.sub_group_size) return;
    log_rank0().warn("zero_optimization.sub_group_size {} is below {} elements (the I/O alignment, {} bytes, of "
                     "float32): each sub-group's moments are padded to it, and the state file is {} bytes for {} "
                     "bytes of moments, all of it read and written each step. Give sub_group_size {} or more "
                     "(a multiple of {} pads nothing but the last)", nvme.sub_group_size, floats, nvme.io.alignment,
                     store_->file_bytes(), store_->state_bytes(), floats, floats);
  }

  internal::NvmeFolder folder_;
  std::vector<at::Tensor> trained_;
  std::map<const void*, size_t> index_;
  std::unique_ptr<internal::NvmeOptimizerStore> store_;  // after folder_: removed while the lock is held
};

// LibTorch's AdamW or Adam (options, groups, rate) stepping through NvmeState.
template <typename Base, typename Options>
class NvmeAdam final : public Base, public NvmeState {
 public:
  NvmeAdam(std::vector<at::Tensor> params, Options defaults, bool decoupled, const NvmeOptimizerOptions& nvme)
      : Base(params, defaults), NvmeState(params, nvme), decoupled_(decoupled) {}

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    at::Tensor loss;
    if (closure) {
      c10::AutoGradMode grad(true);
      loss = closure();
    }
    REMAT_CHECK(this->param_groups().size() == 1, "offload_optimizer nvme steps one parameter group, not ",
                this->param_groups().size());
    const auto& o = static_cast<const Options&>(this->param_groups()[0].options());
    REMAT_CHECK(!o.amsgrad(), "offload_optimizer nvme: amsgrad is not supported");
    step_all({o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), decoupled_});
    return loss;
  }

 private:
  bool decoupled_;
};

}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_nvme_optimizer(const optim::OptimizerOptions& c,
                                                             std::vector<at::Tensor> params,
                                                             const NvmeOptimizerOptions& nvme) {
  switch (optim::optimizer_kind(c)) {
    case optim::OptimizerKind::kAdamW:
      return std::make_unique<NvmeAdam<torch::optim::AdamW, torch::optim::AdamWOptions>>(
          params, torch::optim::AdamWOptions(c.lr).betas({c.betas[0], c.betas[1]}).eps(c.eps).weight_decay(
                      c.weight_decay),
          true, nvme);
    case optim::OptimizerKind::kAdam:
      return std::make_unique<NvmeAdam<torch::optim::Adam, torch::optim::AdamOptions>>(
          params, torch::optim::AdamOptions(c.lr).betas({c.betas[0], c.betas[1]}).eps(c.eps).weight_decay(
                      c.weight_decay),
          false, nvme);
    case optim::OptimizerKind::kSGD:
      break;
  }
  throw ConfigError(str("zero_optimization.offload_optimizer.device \"nvme\" keeps Adam's moments on disk, and "
                        "optimizer.type is \"", c.type, "\": use AdamW or Adam with it, or offload_optimizer.device "
                        "\"cpu\" (which steps any optimizer in host memory)"));
}

std::optional<NvmeOptimizerStats> nvme_optimizer_stats(const torch::optim::Optimizer& optimizer) {
  if (const auto* state = dynamic_cast<const NvmeState*>(&optimizer)) return state->stats();
  return std::nullopt;
}

}  // namespace remat::parallel
