// Whole-model checkpointing policies.
//
// apply_activation_checkpointing(model, options) picks submodules of a
// torch::nn model and marks them as checkpoint regions; model code calls them
// through remat::forward(module, args...) (nn/module_call.h), where the mark
// is a hook that runs the module inside remat::checkpoint. Marking leaves the module
// tree untouched: parameter names (state-dict keys), train/eval mode and
// behaviour stay as they were. (C++ modules cannot be re-bound the way Python
// ones are wrapped, so the call site routes instead.)
//
//   for (size_t i = 0; i < blocks->size(); ++i) {
//     x = remat::forward(blocks->ptr<BlockImpl>(i), x);
//   }
//   ...
//   remat::apply_activation_checkpointing(*model, cfg.activation_checkpointing);
//
// Variants: full (every block of the named ModuleList), selective_layer (every
// k-th block), selective_op (every block, with the listed ops' outputs kept
// from the forward and reused by the recompute), or a predicate over
// fully qualified module names.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpointing/checkpoint.h"
#include "checkpointing/options.h"
#include "nn/module_call.h"

namespace remat {

using AcCondition = std::function<bool(const std::string& fqn, const torch::nn::Module& module)>;

// variant, every_k, every_k_from and save_ops (PolicySettings,
// checkpointing/options.h, where they are documented with their defaults) are
// the activation_checkpointing section's own; the rest is what the JSON does
// not carry.
struct PolicyOptions : PolicySettings {
  PolicyOptions() = default;
  // The policy of a config section: PolicyOptions(cfg.activation_checkpointing).
  // The section's storage, synchronize and profile settings reach the regions
  // through configure_checkpointing.
  PolicyOptions(const PolicySettings& settings) : PolicySettings(settings) {}  // NOLINT

  std::string blocks = "blocks";  // dotted path of the ModuleList of blocks
  // When set, marks exactly the modules it accepts (variant and blocks unused).
  AcCondition ac_condition;
  // Unset: each region uses the default options in effect when it runs
  // (configure_checkpointing may come before or after the policy). Set: these
  // options, whatever the defaults (name and save_ops are the policy's).
  std::optional<CheckpointOptions> checkpoint;
};

// Marks the chosen modules (replacing marks made earlier on this model) and
// returns how many. Errors name what to change (a missing path lists the
// children that exist).
int apply_activation_checkpointing(torch::nn::Module& model, const PolicyOptions& options);

// The ModuleList at a dotted path (PolicyOptions::blocks); an Error naming the
// children that exist otherwise.
std::shared_ptr<torch::nn::ModuleListImpl> find_block_list(torch::nn::Module& model,
                                                           const std::string& path);

// Removes every mark on `model` and its submodules.
void remove_activation_checkpointing(torch::nn::Module& model);

}  // namespace remat
