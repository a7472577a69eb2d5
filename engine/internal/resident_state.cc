// resident_state (engine_impl.h): what a micro-step starts from outside its
// activations, read off the live model through the same two answers the
// estimator prices (engine/internal/memory_state.h): where parallel/ holds
// each part of the model state (ZeroModel::holding) and the optimizer's
// state bytes per element.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "engine/internal/engine_impl.h"
#include "engine/internal/memory_state.h"
#include "optim/optimizer.h"
#include "optim/options.h"
#include "parallel/zero.h"
#include "runtime/error.h"

namespace remat::internal {
namespace {

// What `optimizer` allocates at its first step for `local_trainable` bytes of
// float32 parameters (0 once it has), with a note on what the figure is.
std::pair<int64_t, std::string> pending_state(const torch::optim::Optimizer& optimizer, int64_t local_trainable) {
  if (optim::optimizer_state_bytes(optimizer) > 0) return {0, ""};
  const auto options = optim::options_of(optimizer);
  if (!options) return {0, " (an optimizer remat does not know: its state is not counted)"};
  const int64_t per_element = optim::state_bytes_per_element(*options);
  // Per float32 element (4 bytes) of what it steps.
  return {local_trainable * per_element / 4, per_element > 0 ? " (to be allocated at the first step)" : ""};
}

std::string mib_text(int64_t b) { return str(std::round(static_cast<double>(b) / 10485.76) / 100, " MiB"); }

}  // namespace

std::pair<int64_t, std::string> resident_state(torch::nn::Module& model, parallel::ZeroModel& zero,
                                               const torch::optim::Optimizer& optimizer, int64_t accumulation,
                                               bool host_is_device, int64_t live) {
  std::set<const void*> seen;
  int64_t params = 0, local_trainable = 0, model_trainable = 0;
  auto count = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) params += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : model.parameters()) {
    count(p);
    // Gradients accumulate in float32 whatever the compute dtype (a bf16
    // copy's go into its float32 master's).
    const int64_t grad_element = std::max<int64_t>(static_cast<int64_t>(p.element_size()), 4);
    if (p.requires_grad()) model_trainable += static_cast<int64_t>(p.numel()) * grad_element;
  }
  for (const auto& b : model.buffers()) count(b);
  // A part on the host (offload_optimizer's masters and state, offload_param's
  // shards, which the optimizer steps): the tensors the optimizer steps,
  // their gradients and its state are on the host. On a GPU they are not
  // charged to the device's budget; on a CPU the host is the device: the
  // budget bounds them too (the measured peak holds them), so they are
  // charged, the state the optimizer will allocate included. The device
  // tensors the masters are copied into are charged either way: stage 3's
  // shards apart from the model's parameters (16-bit under bf16 or fp16;
  // stages 1-2's are views of the model's, counted above; offload_param
  // keeps none).
  bool host = false;
  for (const parallel::HeldTensors& part : zero.holding()) {
    if (part.place != parallel::Place::kDevice) host = true;
    if (part.part != parallel::StatePart::kStepped) continue;
    for (const auto& p : part.tensors) {
      if (p.requires_grad()) local_trainable += static_cast<int64_t>(p.numel() * p.element_size());
    }
  }
  for (const auto& t : zero.device_parameters()) count(t);
  const parallel::ZeroStats zs = zero.stats();
  const int64_t on_host = host ? zs.host_bytes + zs.host_param_bytes + optim::optimizer_state_bytes(optimizer) : 0;
  int64_t state = host ? 0 : optim::optimizer_state_bytes(optimizer);
  const int64_t other = std::max<int64_t>(0, live - params - state - on_host);
  auto [pending, note] = pending_state(optimizer, local_trainable);
  int64_t host_charged = 0;
  if (host && host_is_device) {
    host_charged = on_host + pending;
    note = str(" (the optimizer on the host, which on this CPU is the device's memory: what it steps, their "
               "gradients and its state, ", mib_text(host_charged), pending > 0 ? ", some at the first step)" : ")");
  } else if (host) {
    note = " (the optimizer on the host: what it steps, their gradients and its state not counted)";
  } else {
    state += pending;
  }
  // Held between micro-batches: the stage's rule (parallel/zero_memory.h).
  const int64_t grads =
      accumulation > 1 ? zero.gradient_hold(model_trainable, local_trainable).between_micro_batches : 0;
  return {params + state + host_charged + grads + other,
          str("parameters and buffers ", mib_text(params), " + optimizer state ", mib_text(state + host_charged), note,
              grads > 0 ? str(" + gradients held between micro-batches ", mib_text(grads)) : std::string(),
              other > 0 ? str(" + other tensors live at the step's start (the batch among them) ", mib_text(other))
                        : std::string())};
}

}  // namespace remat::internal
