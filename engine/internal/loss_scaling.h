// fp16's loss scaling in the engine: the scaler's arithmetic
// (optim/loss_scaler.h) wired to the step. backward() multiplies the loss by
// scale(); step() takes the overflow verdict of its one collective over every
// rank's gradients (Engine::Impl::check_gradients, the same on every rank),
// record()s it, and either skips the step or unscale()s the gradients the
// optimizer steps (shards included) before clipping. The state goes into
// saves as JSON. The engine's own: not installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "optim/loss_scaler.h"

namespace remat::internal {

class LossScaling {
 public:
  explicit LossScaling(const optim::LossScalerOptions& options) : scaler_(options) {}

  double scale() const { return scaler_.scale(); }
  // What backward() differentiates: `loss` times the scale.
  at::Tensor scale_loss(const at::Tensor& loss) const;
  // A step's verdict (overflow: a non-finite loss or gradient on some rank):
  // the scale updated, an overflow logged on rank 0 with the scale it leaves.
  // An overflow at fp16.min_loss_scale is an Error naming `step`.
  optim::LossScaler::Update record(int64_t step, bool overflow);
  // The last record()'s update.
  const optim::LossScaler::Update& last() const { return last_; }
  int64_t overflows() const { return scaler_.state().overflows; }
  // Divides each tensor's gradient by `scale` (the scale they carry).
  static void unscale(const std::vector<at::Tensor>& tensors, double scale);

  // The scaler's state as JSON text for a save, and back (a ConfigError
  // naming what is wrong with a state that is not one).
  std::string save() const;
  void load(const std::string& text);

 private:
  optim::LossScaler scaler_;
  optim::LossScaler::Update last_;
};

// Whether `device` computes in fp16 with this LibTorch: empty where a
// half-precision matmul and its backward run there, else the first line of
// the error they raise (LibTorch 1.13's CPU kernels have no half matmul;
// 2.6's do).
std::string fp16_compute_failure(c10::Device device);

// The ConfigError text of fp16.enabled on a `device` that cannot compute in
// fp16 (fp16_compute_failure names why); empty where it can.
std::string fp16_refusal(c10::Device device);

// The loss scaling of fp16.enabled on `device`: a ConfigError naming fp16 and
// the device where it cannot compute in fp16 (fp16_compute_failure).
// `at_float32` is the test seam (EngineOptions::fp16_scaler_at_float32): the
// scaler over float32 compute, on any device.
std::unique_ptr<LossScaling> wire_loss_scaling(const optim::LossScalerOptions& options, c10::Device device,
                                               bool at_float32);

}  // namespace remat::internal
