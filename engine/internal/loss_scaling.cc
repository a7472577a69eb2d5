#include "engine/internal/loss_scaling.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <nlohmann/json.hpp>

#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat::internal {

at::Tensor LossScaling::scale_loss(const at::Tensor& loss) const {
  // A 16-bit loss is scaled in float32 (the scale alone may exceed fp16's
  // 65504); the backward casts the gradient back where the model went 16-bit.
  const bool half = loss.scalar_type() == at::kHalf || loss.scalar_type() == at::kBFloat16;
  return (half ? loss.to(at::kFloat) : loss) * scaler_.scale();
}

optim::LossScaler::Update LossScaling::record(int64_t step, bool overflow) {
  try {
    last_ = scaler_.update(overflow);
  } catch (const Error& e) {
    throw Error(str("step ", step, ": ", e.what()));
  }
  if (overflow) {
    log_rank0().info("step {}: fp16 gradients overflowed (inf or nan on some rank): the step is skipped; loss "
                     "scale {}", step, last_.next_scale < last_.used_scale
                                           ? str(last_.used_scale, ", halved to ", last_.next_scale)
                                           : str(last_.used_scale, ", kept (an overflow fp16.hysteresis tolerates)"));
  }
  return last_;
}

void LossScaling::unscale(const std::vector<at::Tensor>& tensors, double scale) {
  // A power of two (dynamic scaling) divides exactly: float32 compute gives
  // the gradients of an unscaled backward bit for bit.
  const double inverse = 1.0 / scale;
  for (const auto& t : tensors) {
    if (t.grad().defined()) t.mutable_grad().mul_(inverse);
  }
}

std::string LossScaling::save() const {
  const auto& s = scaler_.state();
  return nlohmann::json{{"scale", s.scale},
                        {"iteration", s.iteration},
                        {"last_overflow", s.last_overflow},
                        {"hysteresis_left", s.hysteresis_left},
                        {"overflows", s.overflows}}
      .dump();
}

void LossScaling::load(const std::string& text) {
  optim::LossScalerState s;
  try {
    const auto j = nlohmann::json::parse(text);
    s.scale = j.at("scale").get<double>();
    s.iteration = j.at("iteration").get<int64_t>();
    s.last_overflow = j.at("last_overflow").get<int64_t>();
    s.hysteresis_left = j.at("hysteresis_left").get<int>();
    s.overflows = j.at("overflows").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(str("the save's fp16 loss scaler state is not one (", e.what(), "): ", text));
  }
  scaler_.load_state(s);
}

std::string fp16_compute_failure(c10::Device device) {
  try {
    at::AutoGradMode grad(true);
    const auto opts = at::TensorOptions().dtype(at::kHalf).device(device);
    at::Tensor a = at::ones({2, 2}, opts).requires_grad_(true);
    at::mm(a, at::ones({2, 2}, opts)).sum().backward();
    if (!a.grad().defined()) return "the backward gave no gradient";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return what.substr(0, what.find('\n'));
  }
  return "";
}

std::string fp16_refusal(c10::Device device) {
  const std::string missing = fp16_compute_failure(device);
  if (missing.empty()) return "";
  // Where a half-precision matmul fails, so would the model.
  return str("config error: fp16.enabled is true, but the ", c10::DeviceTypeName(device.type(), /*lower_case=*/true),
             " device cannot compute in fp16 with this LibTorch (", compat::torch_version(), "): a half-precision "
             "matmul and its backward fail (", missing, "). Set bf16.enabled instead (bf16 needs no loss scaling), "
             "or train on a GPU");
}

std::unique_ptr<LossScaling> wire_loss_scaling(const optim::LossScalerOptions& options, c10::Device device,
                                               bool at_float32) {
  const std::string where = c10::DeviceTypeName(device.type(), /*lower_case=*/true);
  if (at_float32) {
    log_rank0().warn("fp16.enabled with EngineOptions::fp16_scaler_at_float32 (a test seam): the loss scaler runs "
                     "over float32 compute on the {} device", where);
  } else if (const std::string refusal = fp16_refusal(device); !refusal.empty()) {
    throw ConfigError(refusal);
  }
  auto scaling = std::make_unique<LossScaling>(options);
  log_rank0().info("fp16 loss scaling: {} scale {}{}", options.dynamic() ? "dynamic, first" : "static",
                   scaling->scale(), at_float32 ? "" : str("; the model computes in fp16 on the ", where, " device"));
  return scaling;
}

}  // namespace remat::internal
