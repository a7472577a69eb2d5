// Whole-model checkpointing policies.
//
// apply_activation_checkpointing(model, options) picks submodules of a
// torch::nn model and marks them as checkpoint regions; model code calls them
// through remat::forward(module, args...), which runs a marked module inside
// remat::checkpoint and any other module directly. Marking leaves the module
// tree untouched: parameter names (state-dict keys), train/eval mode and
// behaviour stay as they were. (C++ modules cannot be re-bound the way Python
// ones are wrapped, so the call site routes instead.)
//
//   for (size_t i = 0; i < blocks->size(); ++i) {
//     x = remat::forward(blocks->ptr<BlockImpl>(i), x);
//   }
//   ...
//   remat::apply_activation_checkpointing(*model, remat::PolicyOptions::from_config(cfg.activation_checkpointing));
//
// Variants: full (every block of the named ModuleList), selective_layer (every
// k-th block), selective_op (every block, with the listed ops' outputs kept
// from the forward and reused by the recompute), or a predicate over
// fully qualified module names.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

#include "checkpointing/checkpoint.h"

namespace remat {

struct ActivationCheckpointingConfig;

using AcCondition = std::function<bool(const std::string& fqn, const torch::nn::Module& module)>;

struct PolicyOptions {
  std::string variant = "full";  // none | full | selective_layer | selective_op
  int every_k = 1;               // selective_layer
  std::vector<std::string> save_ops;  // selective_op; empty: the default list
  std::string blocks = "blocks";      // dotted path of the ModuleList of blocks
  // When set, marks exactly the modules it accepts (variant and blocks unused).
  AcCondition ac_condition;
  CheckpointOptions checkpoint = default_checkpoint_options();

  static PolicyOptions from_config(const ActivationCheckpointingConfig& config);
};

// Marks the chosen modules (replacing marks made earlier on this model) and
// returns how many. Errors name what to change (a missing path lists the
// children that exist).
int apply_activation_checkpointing(torch::nn::Module& model, const PolicyOptions& options);

// Removes every mark on `model` and its submodules.
void remove_activation_checkpointing(torch::nn::Module& model);

// Something that runs around a module's forward wherever remat::forward calls
// it: parameter sharding gathers the module's parameters before and frees them
// after (parallel/zero.h). Modules with a wrapper take and return one tensor.
class UnitWrapper {
 public:
  virtual ~UnitWrapper() = default;
  virtual at::Tensor run(const at::Tensor& x,
                         const std::function<at::Tensor(const at::Tensor&)>& body) = 0;
};

// Sets (or with null, removes) the wrapper of `module`.
void set_unit_wrapper(const torch::nn::Module* module, std::shared_ptr<UnitWrapper> wrapper);

namespace detail {
// The options of a marked module, or null.
const CheckpointOptions* checkpoint_plan_for(const torch::nn::Module* module);
UnitWrapper* unit_wrapper_for(const torch::nn::Module* module);
[[noreturn]] void wrapped_unit_signature_error(const torch::nn::Module* module);
}  // namespace detail

// Runs module->forward(args...), inside a checkpoint region when marked, and
// inside the module's unit wrapper when it has one.
// `module` is a ModuleHolder or a std::shared_ptr to the module.
template <typename M, typename... Args>
auto forward(const M& module, Args&&... args) {
  const CheckpointOptions* plan = detail::checkpoint_plan_for(&*module);
  auto call = [&](auto&&... a) {
    if (plan == nullptr) return module->forward(std::forward<decltype(a)>(a)...);
    return checkpoint_with(
        *plan, [module](auto&&... b) { return module->forward(std::forward<decltype(b)>(b)...); },
        std::forward<decltype(a)>(a)...);
  };
  UnitWrapper* wrapper = detail::unit_wrapper_for(&*module);
  if (wrapper == nullptr) return call(std::forward<Args>(args)...);
  if constexpr (sizeof...(Args) == 1 &&
                (std::is_same_v<std::decay_t<Args>, at::Tensor> && ...)) {
    return wrapper->run(args..., [&](const at::Tensor& x) { return call(x); });
  } else {
    detail::wrapped_unit_signature_error(&*module);
  }
}

}  // namespace remat
