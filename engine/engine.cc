// The engine's accessors and the forward: the learning rate of a step's
// first micro-step, the plan of variant auto, and the user's forward under
// the sharding and activation offloading. The backward and the optimizer
// step are in engine_step.cc; saves, export, evaluation and gathered
// parameters in engine_state.cc.
#include "engine/engine.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpointing/offload_activations.h"
#include "checkpointing/planner.h"
#include "engine/internal/engine_impl.h"
#include "engine/internal/step_meter.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "parallel/zero.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"

namespace remat {

using internal::Phase;

const ParallelLayout& Engine::layout() const { return *impl_->layout; }
torch::optim::Optimizer& Engine::optimizer() const { return *impl_->optimizer; }
parallel::ZeroModel& Engine::sharding() const { return *impl_->zero; }
const std::shared_ptr<Context>& Engine::context() const { return impl_->context; }
at::Device Engine::device() const { return impl_->placed; }

at::Tensor Engine::to_device(const at::Tensor& t) const {
  if (!t.defined() || t.device() == impl_->placed) return t;
  return t.to(impl_->placed, /*non_blocking=*/t.is_pinned());
}

std::vector<at::Tensor> Engine::to_device(const std::vector<at::Tensor>& tensors) const {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(to_device(t));
  return out;
}

bool Engine::is_gradient_accumulation_boundary() const {
  return micro_steps_ + 1 >= impl_->batch.gradient_accumulation_steps;
}

double Engine::get_lr() const { return impl_->lr; }

double Engine::next_learning_rate() const {
  return optim::learning_rate(config_.optimizer, config_.scheduler, global_steps_ - skipped_steps_ + 1);
}

const MicroBatchSearch* Engine::micro_batch_search() const { return impl_->search ? &*impl_->search : nullptr; }

at::Tensor Engine::forward(const std::function<at::Tensor()>& fn, const std::vector<int64_t>& plan_key) {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  s.check_forward_order();
  if (micro_steps_ == 0) {
    // The first micro-step of an optimizer step.
    s.lr = next_learning_rate();
    optim::set_learning_rate(*s.optimizer, s.lr);
    if (s.auto_plan) s.plan_blocks(*model_, config_, fn, plan_key);
    // Gradients set to none, as LibTorch 2.x's zero_grad does. Before the
    // base is read: the last step's gradients are not this step's memory.
    s.zero->zero_grad();
    s.zero->take_gradient_arrivals();  // a profiling step's are not this step's
    s.meter.begin_step();
    s.loss_sum = 0;
  }
  s.meter.begin_forward();
  at::Tensor loss = s.run_forward(*model_, config_, fn);
  s.meter.end_forward();
  s.phase = Phase::kForwarded;
  return loss;
}

void Engine::Impl::check_forward_order() const {
  if (phase == Phase::kForwarded) {
    throw Error("remat::Engine::forward: the previous forward's loss has not been through backward(): call "
                "backward(loss) after each forward (for a forward without backward, use evaluate())");
  }
  if (phase == Phase::kBackwarded) {
    throw Error("remat::Engine::forward: step() was not called after the last backward(): call step() after "
                "every backward (it steps the optimizer only at the accumulation boundary)");
  }
  REMAT_CHECK(gathered_scopes == 0, "remat::Engine::forward inside a GatheredParameters scope: end the scope "
              "first (a training forward gathers and frees the parameters itself)");
  // Stages 0-2 would find the loss not requiring grad; stage 3's gathered
  // units make it require grad, and its steps would train nothing.
  if (!trains) {
    throw Error("remat::Engine::forward: no parameter of the model requires grad (every one was frozen when "
                "remat::initialize wired it), so a training step would change nothing: leave the parameters "
                "to train with requires_grad before remat::initialize (for a forward without backward, use "
                "evaluate())");
  }
}

// variant auto: the blocks planned for this plan key (a profiling run of
// `fn` when the key is new).
void Engine::Impl::plan_blocks(torch::nn::Module& model, const Config& config, const std::function<at::Tensor()>& fn,
                               const std::vector<int64_t>& plan_key) {
  // One forward and backward of this micro-batch per profiling run, scaled
  // as backward() scales it (the same tensors as the step's); the planner
  // puts the RNG back, the gradients are dropped by forward().
  auto profile_step = [&] {
    forward_backward(model, config, fn, static_cast<double>(batch.gradient_accumulation_steps));
  };
  meter.begin_planning();
  if (device_budget_bytes) {
    auto [state, what] = internal::resident_state(model, *zero, *optimizer, batch.gradient_accumulation_steps,
                                                  device == c10::DeviceType::CPU, memory->current(device));
    planner->set_state_bytes(state, std::move(what));
  }
  const bool planned = planner->ensure(plan_key, profile_step);
  meter.end_planning(planned);
  if (planned) {
    const auto& choices = planner->plan()->choices;
    regions = static_cast<int>(std::count_if(choices.begin(), choices.end(), [](BlockChoice c) {
      return c != BlockChoice::kKeep && c != BlockChoice::kOffloadActivations;
    }));
  }
}

void Engine::Impl::forward_backward(torch::nn::Module& model, const Config& config,
                                    const std::function<at::Tensor()>& fn, double divide_by) {
  zero->begin_forward();
  std::unique_ptr<OffloadActivations> offload;
  if (config.activation_offloading.enabled) {
    offload = std::make_unique<OffloadActivations>(config.activation_offloading, &model);
  }
  at::Tensor loss = zero->finish_forward(fn());
  offload.reset();
  zero->begin_backward(/*synchronize=*/true);
  (loss / divide_by).backward();
  zero->finish_backward(/*synchronize=*/true);
}

// The model's forward under the sharding and activation offloading.
// The user's forward. A forward that mixes devices (a batch left on the CPU
// with the model on a GPU) fails in LibTorch's first kernel that sees both:
// that error is the user's to fix in the loop, so it says where the model is
// and how a batch gets there.
at::Tensor Engine::Impl::call_forward(const std::function<at::Tensor()>& fn) const {
  try {
    return fn();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (what.find("Expected all tensors to be on the same device") == std::string::npos &&
        what.find("is not on the expected device") == std::string::npos) {
      throw;
    }
    throw Error(str("remat::Engine::forward: the forward mixed devices (", what.substr(0, what.find('\n')),
                    "); the model is on ", placed.str(),
                    ": move each batch, and every tensor the forward takes from outside, with "
                    "engine->to_device(t) (docs/engine.md, \"The device\")"));
  }
}

at::Tensor Engine::Impl::run_forward(torch::nn::Module& model, const Config& config,
                                     const std::function<at::Tensor()>& fn) {
  // On a memory trace: what the forward allocates (and no scope below
  // claims) is the activations autograd keeps.
  TraceSpan span("phase", "forward");
  MemoryCategoryScope activations(MemoryCategory::kSavedActivations);
  zero->begin_forward();
  std::unique_ptr<OffloadActivations> offload;
  try {
    if (config.activation_offloading.enabled) {
      offload = std::make_unique<OffloadActivations>(config.activation_offloading, &model);
    }
    at::Tensor loss = call_forward(fn);
    if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
      throw Error(str("remat::Engine::forward: the function must return the loss, a one-element tensor that "
                      "requires grad (got ",
                      loss.defined() ? str(loss.sizes(), loss.requires_grad() ? "" : ", not requiring grad")
                                     : std::string("an undefined tensor"),
                      "); for a forward without backward, use evaluate()"));
    }
    return zero->finish_forward(loss);
  } catch (...) {
    // Whatever the forward left gathered is freed; the next forward starts
    // clean (its regions and graph die with the exception's stack).
    offload.reset();
    zero->end_evaluation();
    throw;
  }
}

}  // namespace remat
