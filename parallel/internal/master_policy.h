// Where each shard's float32 master lives and how the model's 16-bit compute
// copy is made from it (internal to parallel/): the one policy the three
// strategies ask, made by ZeroModel from its options before the strategy.
//
//   mixed()            the model computes in 16 bits (bf16 or fp16:
//                      compute_dtype()) from copies of float32 masters; every
//                      strategy asks this, none keeps its own flag;
//   masters_on_host()  offload_optimizer under mixed precision (stages 1-3,
//                      zero_options.h): the masters live in host memory alone
//                      (pinned where asked and this LibTorch can pin), the
//                      device keeps the 16-bit copies, which the optimizer
//                      steps through host mode;
//   params_on_host()   offload_param (stage 3): the shards themselves are
//                      float32 host tensors; with its "nvme", those past
//                      max_in_cpu mapped from a file (nvme_tensor_file.h),
//                      which the strategy asks the policy to read ahead of a
//                      gather (prefetch) and to drop once used (release).
//
// Host mode (offload_optimizer, zero_offload.h): ZeroModel starts it once the
// strategy exists (start_host_mode). The strategies then tell the policy as
// each reduced gradient shard is complete (gradient_reduced: in the window's
// last micro-step it goes to the host at once) and before they read one of
// their parameters on the current stream (before_read: waits for its copy
// back from the host master), and ZeroModel pushes the stepped masters back
// (push) and takes the window's gradients (take_gradients).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/zero_options.h"

namespace remat::parallel {

class OptimizerOffload;
class NvmeTensorFile;
struct NvmeFiles;

class MasterPolicy {
 public:
  // `nvme`: the NVMe offloads' files (zero.h; none given: none on NVMe).
  MasterPolicy(const ZeroOptions& options, const MixedPrecision& mixed, const NvmeFiles& nvme);
  ~MasterPolicy();
  MasterPolicy(const MasterPolicy&) = delete;
  MasterPolicy& operator=(const MasterPolicy&) = delete;

  // The model computes with 16-bit copies of float32 masters.
  bool mixed() const { return mixed_.enabled(); }
  const MixedPrecision& precision() const { return mixed_; }
  at::ScalarType compute_dtype() const { return mixed_.compute_dtype; }
  at::ScalarType reduce_dtype() const { return mixed_.reduce_dtype; }
  bool masters_on_host() const { return masters_on_host_; }
  bool params_on_host() const { return params_on_host_; }

  // `values` (float32, on the device) copied into a new float32 master in
  // host memory, pinned where asked and possible (masters_on_host); with
  // offload_optimizer "nvme", mapped from its file.
  at::Tensor host_master(const at::Tensor& values) const;
  // Stage 3's shard from this rank's float32 piece `mine` of a unit's flat
  // buffer: a float32 host tensor (params_on_host), the 16-bit copy of a
  // host master (masters_on_host), else a float32 device tensor of its own.
  at::Tensor stage3_shard(const at::Tensor& mine) const;
  // offload_param "nvme": a shard in the file read ahead, or dropped from
  // memory (nothing for the others); every shard dropped (after a step).
  void prefetch(const at::Tensor& shard) const;
  void release(const at::Tensor& shard) const;
  void release_all() const;
  bool on_disk(const at::Tensor& shard) const;
  // A compute copy's 16-bit gradient added into its master's, in float32,
  // and dropped (nothing unless mixed(), or where it has none).
  void fold_gradient(at::Tensor& copy, at::Tensor& master) const;

  // Host mode (offload_optimizer): `stepped` is what the strategy's optimizer
  // would step, `host_shards` offload_param's shards among them, `masters`
  // the strategy's host masters (masters_on_host; zero_offload.h).
  void start_host_mode(std::vector<at::Tensor> stepped, const OffloadOptimizerOptions& options,
                       const std::vector<at::Tensor>& host_shards, const std::vector<at::Tensor>& masters);
  bool host_mode() const { return host_ != nullptr; }
  // What the optimizer steps: `stepped` (the strategy's parameters()), or in
  // host mode their host masters (`settle`: free to write once this returns).
  std::vector<at::Tensor> optimizer_tensors(std::vector<at::Tensor> stepped, bool settle) const;
  // The host tensor standing for `device` (itself outside host mode).
  at::Tensor host_of(const at::Tensor& device) const;
  // Host mode's steps (nothing outside it; zero_offload.h).
  void push(bool force);
  void settle();
  void take_gradients();
  void drop_gradients();
  int64_t host_bytes() const;

  // A backward begins (`synchronize`: the accumulation window's last
  // micro-step) or ended.
  void begin_backward(bool synchronize) { last_micro_step_ = synchronize; }
  void end_backward() { last_micro_step_ = false; }
  // Called by the strategies with one of their parameters each time its
  // reduced gradient was updated (stages 1-3): in host mode, in the window's
  // last micro-step, it goes to the host at once.
  void gradient_reduced(const at::Tensor& shard) const;
  // Called by the strategies with one of their parameters just before they
  // read it on the current stream: in host mode, its copy from the host
  // master still in flight is waited for.
  void before_read(const at::Tensor& t) const;

 private:
  MixedPrecision mixed_;
  bool masters_on_host_ = false, masters_pinned_ = false;
  bool params_on_host_ = false, params_pinned_ = false;
  bool last_micro_step_ = false;
  std::unique_ptr<OptimizerOffload> host_;  // host mode only
  std::shared_ptr<NvmeTensorFile> nvme_params_, nvme_masters_;
};

// Whole parameters under the policy (stage 0's; stages 1-2's frozen ones):
// without mixed precision the model's own tensors, stepped as they are; with
// it each becomes a 16-bit compute copy of a float32 master, on the device
// (what the optimizer steps; refresh() makes the copies again) or under
// masters_on_host in host memory (the optimizer steps the copy through host
// mode, whose copies back write it).
class WholeCopies {
 public:
  // Before any hook is added to `params` (the model's): a parameter's dtype
  // is fixed from here on. Each master's name is the copy's, in `names`.
  void install(const MasterPolicy& policy, std::vector<at::Tensor> params,
               std::map<const void*, std::string>& names);
  // What the optimizer steps: the device masters, else the model's tensors.
  const std::vector<at::Tensor>& stepped() const { return masters_; }
  // The model's tensors (the compute copies under mixed precision).
  const std::vector<at::Tensor>& model() const { return params_; }
  // masters_on_host: the host masters, one for each of stepped().
  const std::vector<at::Tensor>& host_masters() const { return host_; }
  // Mixed precision: one of stepped() written since the last refresh (a
  // step, a load, a copy back from the host).
  bool changed() const;
  // The compute copies made again from the device masters (none to make
  // under masters_on_host); changed() false again.
  void refresh();
  // The float32 masters put back into the model (mixed precision only).
  void leave_whole();

 private:
  const MasterPolicy* policy_ = nullptr;  // set under mixed precision only
  std::vector<at::Tensor> params_, masters_, host_;
  std::vector<int64_t> versions_;  // mixed precision: stepped()'s versions at the last refresh
};

}  // namespace remat::parallel
