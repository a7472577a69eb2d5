#include "optim/host_adam.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/core/ScalarType.h>
#include <c10/util/TypeCast.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "optim/internal/adam_kernel.h"
#include "runtime/compat.h"
#include "runtime/error.h"

namespace remat::optim {
namespace {

using internal::AdamArrays;
using internal::AdamKernelFn;
using internal::AdamScalars;
using internal::DecayMode;

// Elements per at::parallel_for chunk: small parameters run on the calling
// thread, large ones split into pieces of at least this many elements.
constexpr int64_t kGrainSize = 32768;

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Whether ATen's elementwise kernels in this process round `x + a * b` once:
// its AVX2 and AVX-512 builds do, its generic build does not. ATen reports the
// build it chose (after ATEN_CPU_CAPABILITY) only in show_config().
bool aten_fuses_multiply_add() {
  static const bool fused = [] {
    const std::string config = at::show_config();
    const std::string key = "CPU capability usage: ";
    const auto at = config.find(key);
    if (at == std::string::npos) return cpu_has_avx2_fma();
    return config.compare(at + key.size(), 7, "DEFAULT") != 0 && cpu_has_avx2_fma();
  }();
  return fused;
}

HostAdamKernel resolve(HostAdamKernel kernel) {
  if (kernel != HostAdamKernel::kAuto) return kernel;
  return aten_fuses_multiply_add() ? HostAdamKernel::kAvx2Fma : HostAdamKernel::kGeneric;
}

AdamKernelFn kernel_fn(HostAdamKernel kernel) {
  return resolve(kernel) == HostAdamKernel::kAvx2Fma ? internal::adam_update_avx2_fma
                                                     : internal::adam_update_generic;
}

void check_kernel_available(HostAdamKernel kernel, const char* optimizer) {
  REMAT_CHECK(kernel != HostAdamKernel::kAvx2Fma || cpu_has_avx2_fma(), optimizer,
              ": the avx2+fma kernel needs a CPU with AVX2 and FMA, which this one lacks; "
              "use HostAdamKernel::kAuto or kGeneric");
}

std::string where(const char* optimizer, size_t group, size_t index) {
  return str(optimizer, ": parameter ", index, " of group ", group);
}

// The fused loop writes raw float32 host memory: refuse anything else.
void check_fusable(const at::Tensor& p, const at::Tensor& grad, const std::string& name) {
  const char* fix = "; the fused host Adam updates dense, contiguous float32 CPU tensors only";
  REMAT_CHECK(!grad.is_sparse(), name, " has a sparse gradient", fix,
              " (LibTorch's Adam refuses sparse gradients too)");
  REMAT_CHECK(p.device().is_cpu() && grad.device().is_cpu(), name, " is on ", p.device(),
              " with its gradient on ", grad.device(), fix,
              ": keep the optimizer's copy on the host or use torch::optim::AdamW on the device");
  REMAT_CHECK(p.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat, name, " is ",
              p.scalar_type(), " with a ", grad.scalar_type(), " gradient", fix,
              ": keep float32 master weights and gradients");
  REMAT_CHECK(p.is_contiguous() && grad.is_contiguous(), name,
              " or its gradient is not contiguous", fix, ": pass p.contiguous() copies");
  REMAT_CHECK_EQ(grad.numel(), p.numel(), name, ": its gradient has another size (",
                 grad.sizes(), " vs ", p.sizes(), ")");
}

void check_state(const at::Tensor& p, const at::Tensor& moment, const char* what,
                 const std::string& name) {
  REMAT_CHECK(moment.defined() && moment.device().is_cpu() && moment.scalar_type() == at::kFloat &&
                  moment.is_contiguous() && moment.numel() == p.numel(),
              name, ": its state's ", what,
              " is not a contiguous float32 CPU tensor of the parameter's size (",
              moment.defined() ? str(moment.scalar_type(), " ", moment.sizes(), " on ", moment.device())
                               : std::string("undefined"),
              " vs float32 ", p.sizes(), "); load a state saved for these parameters");
}

template <typename Map>
typename Map::key_type state_key(const at::Tensor& p) {
  return compat::optimizer_state_key<typename Map::key_type>(p.unsafeGetTensorImpl());
}

// `p`'s state, or null before its first step.
template <typename State>
const State* find_state(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& states = optimizer.state();
  const auto found = states.find(state_key<std::decay_t<decltype(states)>>(p));
  return found == states.end() ? nullptr : static_cast<const State*>(found->second.get());
}

// The state LibTorch's step would use for `p`, created as LibTorch creates it.
template <typename State>
State& state_of(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& states = optimizer.state();
  auto& slot = states[state_key<std::decay_t<decltype(states)>>(p)];
  if (!slot) {
    auto state = std::make_unique<State>();
    state->step(0);
    state->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    state->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(state);
  }
  return static_cast<State&>(*slot);
}

// A double Scalar for a float tensor, converted as ATen converts it: a value
// beyond float's range (a learning rate of 1e39) is the same error, naming no
// setting, that LibTorch's AdamW throws; the engine names the key.
float as_float(double value) { return c10::checked_convert<float, double>(value, "float"); }

// LibTorch's scalars for step number `step`, in double, cast to float as ATen
// casts a double Scalar for a float tensor.
AdamScalars scalars(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    DecayMode decay) {
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s;
  s.decay = weight_decay != 0 ? decay : DecayMode::kNone;
  s.weight_decay = as_float(weight_decay);
  s.decay_factor = as_float(1 - lr * weight_decay);
  s.beta1 = as_float(beta1);
  s.one_minus_beta1 = as_float(1 - beta1);
  s.beta2 = as_float(beta2);
  s.one_minus_beta2 = as_float(1 - beta2);
  s.sqrt_bias_correction2 = as_float(std::sqrt(bias_correction2));
  s.eps = as_float(eps);
  s.neg_step_size = as_float(-(lr / bias_correction1));
  return s;
}

template <typename Options>
AdamScalars step_scalars(const Options& options, int64_t step, DecayMode decay) {
  return scalars(options.lr(), std::get<0>(options.betas()), std::get<1>(options.betas()), options.eps(),
                 options.weight_decay(), step, decay);
}

// Every parameter that steps is checked before any is updated: a refused one
// leaves the whole step undone.
template <typename Options, typename State>
void check_step(torch::optim::Optimizer& optimizer, const char* name) {
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    REMAT_CHECK(!static_cast<const Options&>(groups[g].options()).amsgrad(), name, ": group ", g,
                " sets amsgrad, which the fused host Adam does not implement; "
                "set amsgrad(false) or use LibTorch's optimizer for that group");
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.grad().defined()) continue;
      const std::string label = where(name, g, i);
      check_fusable(p, p.grad(), label);
      if (const State* state = find_state<State>(optimizer, p)) {
        check_state(p, state->exp_avg(), "exp_avg", label);
        check_state(p, state->exp_avg_sq(), "exp_avg_sq", label);
      }
    }
  }
}

template <typename State>
void update(const at::Tensor& p, State& state, const AdamScalars& s, AdamKernelFn fn) {
  const AdamArrays arrays{p.data_ptr<float>(), p.grad().data_ptr<float>(),
                          state.exp_avg().template data_ptr<float>(),
                          state.exp_avg_sq().template data_ptr<float>()};
  at::parallel_for(0, p.numel(), kGrainSize,
                   [&](int64_t begin, int64_t end) { fn(arrays, s, begin, end); });
  // As LibTorch's in-place ops do: autograd sees that these tensors changed.
  p.unsafeGetTensorImpl()->bump_version();
  state.exp_avg().unsafeGetTensorImpl()->bump_version();
  state.exp_avg_sq().unsafeGetTensorImpl()->bump_version();
}

template <typename Options, typename State>
void fused_step(torch::optim::Optimizer& optimizer, DecayMode decay, HostAdamKernel kernel,
                const char* name) {
  check_step<Options, State>(optimizer, name);
  const AdamKernelFn fn = kernel_fn(kernel);
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      State& state = state_of<State>(optimizer, p);
      state.step(state.step() + 1);
      update(p, state, step_scalars(options, state.step(), decay), fn);
    }
  }
}

template <typename Closure>
at::Tensor run_closure(Closure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace

const char* kernel_name(HostAdamKernel kernel) {
  switch (kernel) {
    case HostAdamKernel::kAuto: return "auto";
    case HostAdamKernel::kGeneric: return "generic";
    case HostAdamKernel::kAvx2Fma: return "avx2+fma";
  }
  return "?";
}

HostAdamKernel auto_kernel() { return resolve(HostAdamKernel::kAuto); }

void host_adam_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                      const HostAdamStep& step, HostAdamKernel kernel) {
  check_kernel_available(kernel, "host_adam_update");
  REMAT_CHECK_GE(step.step, 1, "host_adam_update: step number");
  const AdamScalars s = scalars(step.lr, step.beta1, step.beta2, step.eps, step.weight_decay, step.step,
                                step.decoupled ? DecayMode::kDecoupled : DecayMode::kL2);
  const AdamArrays arrays{param, grad, exp_avg, exp_avg_sq};
  const AdamKernelFn fn = kernel_fn(kernel);
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) { fn(arrays, s, begin, end); });
}

HostAdamW::HostAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                     torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(std::move(param_groups), defaults) {
  REMAT_CHECK(!defaults.amsgrad(), "HostAdamW: amsgrad is not implemented by the fused host "
              "Adam; set amsgrad(false) or use torch::optim::AdamW");
}

HostAdamW::HostAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults)
    : HostAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor HostAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  fused_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      *this, DecayMode::kDecoupled, kernel_, "HostAdamW");
  return loss;
}

void HostAdamW::set_kernel(HostAdamKernel kernel) {
  check_kernel_available(kernel, "HostAdamW");
  kernel_ = kernel;
}

HostAdamKernel HostAdamW::kernel() const { return resolve(kernel_); }

HostAdam::HostAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                   torch::optim::AdamOptions defaults)
    : torch::optim::Adam(std::move(param_groups), defaults) {
  REMAT_CHECK(!defaults.amsgrad(), "HostAdam: amsgrad is not implemented by the fused host "
              "Adam; set amsgrad(false) or use torch::optim::Adam");
}

HostAdam::HostAdam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults)
    : HostAdam({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor HostAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  fused_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(*this, DecayMode::kL2,
                                                                      kernel_, "HostAdam");
  return loss;
}

void HostAdam::set_kernel(HostAdamKernel kernel) {
  check_kernel_available(kernel, "HostAdam");
  kernel_ = kernel;
}

HostAdamKernel HostAdam::kernel() const { return resolve(kernel_); }

}  // namespace remat::optim
