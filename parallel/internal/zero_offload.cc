#include "parallel/internal/zero_offload.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <set>

#include "parallel/nvme_tensor_file.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::parallel {

// Pinning needs a CUDA build of LibTorch with a device present.
bool can_pin_host_memory() {
  try {
    return at::globalContext().hasCUDA();
  } catch (...) {
    return false;
  }
}

at::Tensor host_copy(const at::Tensor& t, bool pinned) {
  c10::NoGradGuard no_grad;
  at::Tensor h = at::empty(t.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(pinned));
  h.copy_(t.detach());
  return h;
}

void log_offload_param(const OffloadParamOptions& options, const std::vector<at::Tensor>& shards,
                       const NvmeTensorFile* file) {
  int64_t elements = 0, on_disk = 0;
  for (const auto& t : shards) {
    elements += t.numel();
    if (file != nullptr && file->on_disk(t)) on_disk += t.numel();
  }
  const bool pinned = options.pin_memory && can_pin_host_memory();  // as the master policy decides
  if (file != nullptr) {
    log_rank0().info("offload_param nvme: {} of {} float32 parameter shard elements in '{}' on rank 0 ({} bytes "
                     "on disk), read ahead of each unit's gather and dropped from memory once gathered; {} in host "
                     "memory (max_in_cpu {}){}", on_disk, elements, file->path(), file->file_bytes(),
                     elements - on_disk, options.max_in_cpu,
                     on_disk == 0 && elements > 0 ? ": every shard fits within max_in_cpu, so none is on disk; "
                                                    "lower offload_param.max_in_cpu to put them there"
                                                  : "");
  } else {
    log_rank0().info("offload_param: {} float32 parameter shard elements ({} bytes) in host memory{}, copied to the "
                     "device for each unit's gather", elements, 4 * elements,
                     pinned                 ? ", pinned"
                     : options.pin_memory ? " (pin_memory asked, but this LibTorch cannot pin: no CUDA; ordinary host memory)"
                                          : "");
  }
  if (elements == 0) {
    log_rank0().warn("offload_param has nothing to offload: no parameter is sharded (each is below "
                     "zero_optimization.stage3_param_persistence_threshold and stays whole on the device); lower "
                     "the threshold (0 shards every parameter) to keep the shards {}",
                     file != nullptr ? "on disk (past offload_param.max_in_cpu)" : "in host memory");
  }
  const OffloadParamOptions d;
  if (options.buffer_count != d.buffer_count || options.buffer_size != d.buffer_size ||
      (file == nullptr && options.max_in_cpu != d.max_in_cpu)) {
    log_rank0().info("offload_param: buffer_count {}, buffer_size {}{} tune DeepSpeed's own buffers and change "
                     "nothing here ({})", options.buffer_count, options.buffer_size,
                     file == nullptr ? str(", max_in_cpu ", options.max_in_cpu) : std::string(),
                     file == nullptr ? "every shard lives on the host"
                                     : "the shards on disk are mapped: the kernel's page cache stands for the buffers");
  }
}

// The start's line: where the masters are, how many, pinned or not.
void OptimizerOffload::log_masters(const OffloadOptimizerOptions& options, int64_t elements, int64_t frozen,
                                   bool beside_shards, const NvmeTensorFile* file) const {
  if (file != nullptr) {
    log_rank0().info("offload_optimizer nvme: {} float32 master elements ({} bytes) in '{}' on rank 0 ({} bytes on "
                     "disk{}), read by the step and by the copies to the device, then dropped from memory; their "
                     "gradients in host memory", elements + frozen, 4 * (elements + frozen), file->path(),
                     file->file_bytes(), !beside_shards ? "" : "; offload_param's shards are masters of their own");
  } else {
    log_rank0().info("offload_optimizer: {} float32 master elements ({} bytes){}, their gradients and the optimizer "
                     "state in host memory{}{}", elements, 4 * elements,
                     !beside_shards ? "" : " beside offload_param's host shards (stepped where they are)",
                     pinned_ ? ", pinned"
                     : options.pin_memory ? " (pin_memory asked, but this LibTorch cannot pin: no CUDA; ordinary host memory)"
                                          : "",
                     adopted_ ? str("; the masters there alone", frozen > 0 ? str(" (and ", frozen, " frozen elements')") : "",
                                    ": the device keeps their 16-bit copies")
                              : std::string());
  }
}

OptimizerOffload::OptimizerOffload(std::vector<at::Tensor> device, const OffloadOptimizerOptions& options,
                                   const std::vector<at::Tensor>& on_host, const std::vector<at::Tensor>& masters,
                                   NvmeTensorFile* file)
    : device_(std::move(device)), file_(file) {
  pinned_ = options.pin_memory && can_pin_host_memory();
  c10::NoGradGuard no_grad;
  int64_t elements = 0, frozen = 0;
  std::set<const void*> already;
  for (const auto& t : on_host) already.insert(t.unsafeGetTensorImpl());
  REMAT_CHECK(masters.empty() || masters.size() == device_.size(), "offload_optimizer: ", masters.size(),
              " host masters for ", device_.size(), " tensors");
  // A trainable master's gradient buffer, kept across steps: made here, so
  // that what the host holds through training is held from the start (the
  // planner's whole-device budget charges it on a CPU before the first step).
  auto gradient_buffer = [&](const at::Tensor& d) {
    return d.requires_grad() ? at::empty(d.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kCPU)
                                                        .pinned_memory(pinned_))
                             : at::Tensor();
  };
  for (size_t i = 0; i < device_.size(); ++i) {
    const at::Tensor& d = device_[i];
    index_[d.unsafeGetTensorImpl()] = i;
    if (!masters.empty() && masters[i].defined()) {
      at::Tensor h = masters[i];
      REMAT_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.sizes() == d.sizes(),
                  "offload_optimizer: a stage's host master is not a float32 host tensor of its parameter's shape");
      h.requires_grad_(d.requires_grad());
      offloaded_.push_back(1);
      host_.push_back(h);
      grads_.push_back(gradient_buffer(d));
      versions_.push_back(h._version());
      (d.requires_grad() ? elements : frozen) += d.numel();
      adopted_ = true;
      continue;
    }
    const bool offload = d.requires_grad() && !already.count(d.unsafeGetTensorImpl());
    offloaded_.push_back(offload ? 1 : 0);
    if (!offload) {
      host_.push_back(d);
      grads_.emplace_back();
      versions_.push_back(0);
      continue;
    }
    REMAT_CHECK(d.scalar_type() == at::kFloat, "offload_optimizer: a master shard is not float32 (",
                c10::toString(d.scalar_type()), ")");
    at::Tensor h = file != nullptr ? file->place(d.detach()) : at::Tensor();
    if (h.defined()) {
      h = h.view(d.sizes());
    } else {
      h = at::empty(d.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(pinned_));
      h.copy_(d.detach());
    }
    h.requires_grad_(true);
    host_.push_back(h);
    grads_.push_back(gradient_buffer(d));
    versions_.push_back(h._version());
    elements += d.numel();
  }
  log_masters(options, elements, frozen, !on_host.empty(), file);
  if (options.ratio < 1) {
    log_rank0().warn("offload_optimizer.ratio {} asks for that share of the optimizer state on the host; remat "
                     "offloads the whole of it (the device keeps none of the state): leave ratio out, or at 1",
                     options.ratio);
  }
  if (options.buffer_count != OffloadOptimizerOptions{}.buffer_count || options.fast_init ||
      options.ratio != OffloadOptimizerOptions{}.ratio) {
    log_rank0().info("offload_optimizer: buffer_count {}, fast_init {}, ratio {} tune DeepSpeed's own offload "
                     "pipeline and change nothing here (the whole optimizer state is offloaded)",
                     options.buffer_count, options.fast_init, options.ratio);
  }
}

OptimizerOffload::~OptimizerOffload() {
  try {
    if (in_flight_) side_->synchronize();
    settle();
  } catch (...) {
  }
}

at::Tensor OptimizerOffload::host_of(const at::Tensor& device) const {
  auto it = index_.find(device.unsafeGetTensorImpl());
  return it == index_.end() ? device : host_[it->second];
}

void OptimizerOffload::take_gradient(const at::Tensor& device) {
  auto it = index_.find(device.unsafeGetTensorImpl());
  if (it != index_.end()) take(it->second);
}

void OptimizerOffload::take(size_t i) {
  at::Tensor& d = device_[i];
  if (!offloaded_[i] || !d.grad().defined()) return;
  c10::NoGradGuard no_grad;
  if (!grads_[i].defined()) {
    grads_[i] = at::empty(d.sizes(), at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(pinned_));
  }
  copy_to_host(d.grad(), grads_[i]);
  host_[i].mutable_grad() = grads_[i];
  d.mutable_grad() = at::Tensor();
}

void OptimizerOffload::copy_to_host(const at::Tensor& src, at::Tensor& dst) {
  if (src.device().is_cpu()) {
    dst.copy_(src);
    return;
  }
  const auto* impl = c10::impl::getDeviceGuardImpl(src.device().type());
  if (!side_) side_ = impl->getStreamFromGlobalPool(src.device());
  c10::Event computed(src.device().type());
  computed.record(impl->getStream(src.device()));
  computed.block(*side_);
  {
    c10::StreamGuard on_side(*side_);
    dst.copy_(src, /*non_blocking=*/pinned_);
  }
  impl->recordDataPtrOnStream(src.storage().data_ptr(), *side_);
  in_flight_ = true;
}

void OptimizerOffload::take_gradients() {
  for (size_t i = 0; i < device_.size(); ++i) take(i);
  if (in_flight_) side_->synchronize();
  in_flight_ = false;
  settle();  // the step writes the masters next
  taken_ = true;
}

void OptimizerOffload::push(bool force) {
  bool changed = force || taken_;
  for (size_t i = 0; i < host_.size() && !changed; ++i) changed = offloaded_[i] && host_[i]._version() != versions_[i];
  if (!changed) return;
  c10::NoGradGuard no_grad;
  bool waited = false;
  for (size_t i = 0; i < device_.size(); ++i) {
    if (!offloaded_[i]) continue;
    // A frozen master (masters_on_host) changes only when written (a load, an edit).
    if (!host_[i].requires_grad() && host_[i]._version() == versions_[i]) continue;
    if (device_[i].device().is_cpu()) {
      device_[i].detach().copy_(host_[i].detach());
    } else {
      upload(i, waited);
    }
    versions_[i] = host_[i]._version();
  }
  taken_ = false;
}

void OptimizerOffload::upload(size_t i, bool& waited) {
  const at::Device device = device_[i].device();
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  if (!up_) up_ = impl->getStreamFromGlobalPool(device);
  if (!waited) {
    c10::Event queued(device.type());
    queued.record(impl->getStream(device));
    queued.block(*up_);
    waited = true;
  }
  {
    c10::StreamGuard on_up(*up_);
    at::Tensor dst = device_[i].detach(), src = host_[i].detach();
    if (pinned_ && dst.scalar_type() != src.scalar_type()) {
      // A copy that converts goes through a float32 temporary on the device
      // as large as what it copies: in pieces, at most 64 MiB of it.
      dst = dst.view({-1});
      src = src.view({-1});
      constexpr int64_t kPiece = int64_t{16} << 20;
      for (int64_t o = 0; o < dst.numel(); o += kPiece) {
        const int64_t n = std::min(kPiece, dst.numel() - o);
        dst.narrow(0, o, n).copy_(src.narrow(0, o, n), /*non_blocking=*/true);
      }
    } else {
      dst.copy_(src, /*non_blocking=*/pinned_);
    }
  }
  // Written on up_: its memory is not reused before the copy ends, whatever frees it.
  impl->recordDataPtrOnStream(device_[i].storage().data_ptr(), *up_);
  if (uploaded_.size() != device_.size()) uploaded_.resize(device_.size());
  if (!uploaded_[i]) uploaded_[i] = std::make_unique<c10::Event>(device.type());
  uploaded_[i]->record(*up_);
  uploading_ = true;
}

void OptimizerOffload::ready(const at::Tensor& device) const {
  if (uploaded_.empty()) return;
  auto it = index_.find(device.unsafeGetTensorImpl());
  if (it == index_.end() || !uploaded_[it->second]) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.device().type());
  uploaded_[it->second]->block(impl->getStream(device.device()));
}

void OptimizerOffload::settle() {
  if (uploading_) up_->synchronize();
  uploading_ = false;
}

void OptimizerOffload::drop_gradients() {
  if (in_flight_) side_->synchronize();
  in_flight_ = false;
  settle();
  for (size_t i = 0; i < device_.size(); ++i) {
    device_[i].mutable_grad() = at::Tensor();
    host_[i].mutable_grad() = at::Tensor();
  }
}

int64_t OptimizerOffload::host_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < host_.size(); ++i) {
    if (!offloaded_[i]) continue;
    if (file_ == nullptr || !file_->on_disk(host_[i])) bytes += static_cast<int64_t>(host_[i].nbytes());
    if (grads_[i].defined()) bytes += static_cast<int64_t>(grads_[i].nbytes());
  }
  return bytes;
}

}  // namespace remat::parallel
