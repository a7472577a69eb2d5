// The engine's backward and optimizer step: the accumulation window, the
// non-finite check every rank agrees on, the update and the step's metrics.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/internal/engine_impl.h"
#include "engine/internal/loss_scaling.h"
#include "engine/internal/step_meter.h"
#include "engine/internal/unused_parameters.h"
#include "engine/step_counters.h"
#include "parallel/zero.h"
#include "runtime/communicator.h"
#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/memory_trace.h"

namespace remat {

namespace {

using internal::Phase;

bool gradients_finite(const std::vector<at::Tensor>& parameters) {
  // Host tensors apart (offload_param's shards beside the persistent parameters on a device).
  std::vector<at::Tensor> checks, host;
  for (const auto& p : parameters) {
    if (p.grad().defined() && p.grad().numel() > 0) {
      at::Tensor finite = at::isfinite(p.grad()).all();
      (finite.is_cpu() ? host : checks).push_back(finite);
    }
  }
  for (const auto* group : {&checks, &host}) {
    if (!group->empty() && !at::stack(*group).all().item<bool>()) return false;
  }
  return true;
}

}  // namespace

void Engine::backward(const at::Tensor& loss) {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  if (s.phase != Phase::kForwarded) {
    throw Error(s.phase == Phase::kBackwarded
                    ? "remat::Engine::backward: called twice for one forward: call step() after backward(), "
                      "then forward() for the next micro-batch"
                    : "remat::Engine::backward: no forward() since the last step(): compute the loss with "
                      "engine.forward(fn) first");
  }
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    throw Error(str("remat::Engine::backward: the loss must be a one-element tensor that requires grad (got ",
                    loss.defined() ? str(loss.sizes(), loss.requires_grad() ? "" : ", not requiring grad")
                                   : std::string("an undefined tensor"),
                    "): pass the loss forward() returned"));
  }
  const bool boundary = is_gradient_accumulation_boundary();
  at::Tensor scaled = loss / static_cast<double>(s.batch.gradient_accumulation_steps);
  s.meter.begin_backward();
  try {
    TraceSpan span("phase", "backward");
    s.zero->begin_backward(/*synchronize=*/boundary);
    (s.loss_scaling ? s.loss_scaling->scale_loss(scaled) : scaled).backward();
    s.zero->finish_backward(/*synchronize=*/boundary);
    s.meter.end_backward();
  } catch (...) {
    // The accumulation window is dropped (its gradients and partial
    // reductions with it): the next forward starts a new one.
    s.zero->abandon_backward();
    micro_steps_ = 0;
    s.phase = Phase::kIdle;
    throw;
  }
  s.loss_sum += scaled.item<double>();
  s.phase = Phase::kBackwarded;
}

bool Engine::step() {
  Impl& s = *impl_;
  ContextScope scope(s.context);
  if (s.phase != Phase::kBackwarded) {
    throw Error("remat::Engine::step: no backward() since the last step(): call backward(loss) on the loss "
                "forward() returned before each step()");
  }
  s.phase = Phase::kIdle;
  if (++micro_steps_ < s.batch.gradient_accumulation_steps) return false;
  micro_steps_ = 0;
  const int64_t step = global_steps_ + 1;
  std::optional<TraceSpan> span(std::in_place, "phase", "optimizer step");
  double grad_norm = -1;
  const Impl::Verdict verdict = s.check_gradients();
  const bool skipped = s.skip_step(step, verdict, config_);
  if (!skipped) grad_norm = s.update(*model_, config_, verdict.arrived);
  const double loss = s.mean_loss();
  const Counters& counters = s.meter.read_counters();
  if (global_steps_ == 0 && s.regions > 0 && counters.recomputes == 0) {
    // Every rank runs the same model: every rank stops here alike.
    s.throw_agreed(std::make_exception_ptr(Error(
        str("remat::Engine: the checkpointing policy marks ", s.regions, " blocks but none ran as a "
            "checkpoint region in this step's backward: the model calls its blocks directly. Call each "
            "block through remat::forward(block, ...) (docs/engine.md, the model contract)"))));
  }
  const auto& plan = s.planner->plan();
  last_metrics_ = s.meter.finish_step({step, loss, s.lr, grad_norm, skipped}, plan ? &*plan : nullptr);
  if (s.loss_scaling) {
    last_metrics_.loss_scale = s.loss_scaling->last().used_scale;
    last_metrics_.overflows = s.loss_scaling->overflows();
  }
  const StepMetrics& m = last_metrics_;
  if (config_.wall_clock_breakdown && (step % config_.steps_per_print == 0 || step == 1)) {
    log_rank0().info("step {} wall clock: forward {:.1f} ms, backward {:.1f} ms (recompute {:.1f}), "
                     "optimizer {:.1f} ms, whole step {:.1f} ms",
                     step, m.fwd_ms, m.bwd_ms, m.counter<double>("recompute_ms"), m.opt_ms, m.step_ms);
  }
  // Gradients cleared: the next step starts without them.
  s.zero->zero_grad();
  global_steps_ = step;
  if (skipped) ++skipped_steps_;
  s.lr = next_learning_rate();
  span.reset();
  s.meter.finish_trace(last_metrics_);
  // A save written in the background completes once every rank's file is
  // (one all-reduce while one is pending); a failed write stops every rank here.
  // The other errors step() throws: those every rank raises alike complete
  // the pending save first (Impl::throw_agreed); one a rank raises alone (a
  // communication failure, an exception out of the backend) leaves it
  // pending, as a collective the other ranks do not reach would hang.
  s.complete_saves(/*wait=*/false);
  return !skipped;
}

// A non-finite loss or gradient (DeepSpeed's overflow check): every rank
// sees the same verdict, so all stop or all skip together. In the same
// reduction, which parameters got a gradient on any rank.
Engine::Impl::Verdict Engine::Impl::check_gradients() {
  const at::Tensor arrivals = zero->take_gradient_arrivals();
  // On the model's device, as the gradients it checks: the backend takes them.
  at::Tensor checks = at::zeros({2 + arrivals.numel()}, at::TensorOptions().dtype(at::kDouble).device(placed));
  checks[0] = std::isfinite(loss_sum) ? 0.0 : 1.0;
  checks[1] = gradients_finite(zero->parameters()) ? 0.0 : 1.0;
  checks.narrow(0, 2, arrivals.numel()).copy_(arrivals);
  if (world->size() > 1) {
    world->allReduce(checks, {ReduceOp::kMax})->wait();
    meter.count_comm(checks.nbytes());
  }
  const at::Tensor nonfinite = checks.narrow(0, 0, 2);
  Verdict verdict;
  verdict.arrived = checks.narrow(0, 2, arrivals.numel());
  verdict.bad_loss = nonfinite[0].item<double>() > 0;
  verdict.bad_grads = nonfinite[1].item<double>() > 0;
  return verdict;
}

bool Engine::Impl::skip_step(int64_t step, const Verdict& verdict, const Config& config) {
  const bool bad_loss = verdict.bad_loss, bad_grads = verdict.bad_grads;
  if (loss_scaling) {
    // fp16: a non-finite step is an overflow of the scale (train.on_nonfinite does not apply).
    const auto update = loss_scaling->record(step, bad_loss || bad_grads);
    if (update.skip) {
      optimizer->zero_grad();
    } else {
      internal::LossScaling::unscale(zero->parameters(), update.used_scale);
    }
    return update.skip;
  }
  if (!bad_loss && !bad_grads) return false;
  const std::string what = str(bad_loss ? "the loss" : "", bad_loss && bad_grads ? " and " : "",
                               bad_grads ? "the gradients" : "");
  if (config.train.on_nonfinite == "stop") {
    // The verdict is every rank's (check_gradients' all-reduce): a save
    // pending in the background completes first, as a blocking one would have.
    throw_agreed(std::make_exception_ptr(Error(
        str("step ", step, ": ", what, " went non-finite (nan or inf; local loss ", loss_sum,
            "). Stopped before updating or saving anything of this step. "
            "Lower optimizer.params.lr, set gradient_clipping, or set "
            "train.on_nonfinite=skip to drop such steps"))));
  }
  log_rank0().warn("step {}: {} went non-finite: this step's update is skipped "
                   "(train.on_nonfinite=skip)", step, what);
  optimizer->zero_grad();
  return true;
}

// The optimizer step over the parameters some rank gave a gradient; returns
// the gradient norm before clipping (-1: clipping is off).
double Engine::Impl::update(torch::nn::Module& model, const Config& config, const at::Tensor& arrived) {
  double grad_norm = -1;
  meter.begin_optimizer();
  const auto unused = internal::leave_unused_alone(*zero, model, arrived, *optimizer);
  if (config.gradient_clipping > 0) {
    grad_norm = zero->clip_grad_norm(config.gradient_clipping, layout->tp_group());
  }
  {
    MemoryCategoryScope state(MemoryCategory::kOptimizerState);
    try {
      optimizer->step();
    } catch (const std::runtime_error& e) {
      // A rate so large that the update's scalar (AdamW's lr / (1 - beta1^t))
      // leaves float: c10's checked conversion throws a message naming no setting.
      const std::string what = e.what();
      if (what.find("cannot be converted to type") == std::string::npos) throw;
      // Not agreed: a rank whose shard holds no parameter never computes the
      // scalar, so no save completion (a collective) runs before this error.
      throw ConfigError(str("the optimizer step at learning rate ", lr, " overflows the parameters' arithmetic (",
                            what, "): lower optimizer.params.lr (and the scheduler's warmup_max_lr)"));
    }
  }
  internal::put_back_unused(unused, *optimizer);
  // Every rank's parameters read right between steps (stages 1 and 2 gather the stepped shards).
  zero->after_step();
  meter.end_optimizer();
  return grad_norm;
}

// The step's loss: the mean over micro-steps (summed already) and data-parallel ranks.
double Engine::Impl::mean_loss() {
  at::Tensor loss_t = at::full({1}, loss_sum, at::TensorOptions().dtype(at::kDouble).device(placed));
  const auto& dp_group = layout->dp_group();
  if (dp_group->size() > 1) {
    dp_group->allReduce(loss_t, {ReduceOp::kAvg})->wait();
    meter.count_comm(loss_t.nbytes());
  }
  return loss_t.item<double>();
}

}  // namespace remat
