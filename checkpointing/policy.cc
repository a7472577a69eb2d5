#include "checkpointing/policy.h"

#include <torch/nn/modules/container/modulelist.h>


#include "checkpointing/selective_op.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace remat {
namespace {

// A marked module's call: inside a checkpoint region with the module's plan.
class CheckpointHook final : public ModuleHook {
 public:
  CheckpointHook(std::optional<CheckpointOptions> fixed, std::string name,
                 std::shared_ptr<const SaveOps> save_ops)
      : fixed_(std::move(fixed)), name_(std::move(name)), save_ops_(std::move(save_ops)) {}

  // Without fixed options the region starts from the defaults in effect when
  // it runs, so configure_checkpointing may come before or after the policy.
  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override {
    CheckpointOptions options = fixed_ ? *fixed_ : default_checkpoint_options();
    options.name = name_;
    if (save_ops_) options.save_ops = save_ops_;
    return checkpoint_ivalues(next, args, options);
  }

 private:
  std::optional<CheckpointOptions> fixed_;
  std::string name_;
  std::shared_ptr<const SaveOps> save_ops_;
};

}  // namespace

std::shared_ptr<torch::nn::ModuleListImpl> find_block_list(torch::nn::Module& model,
                                                           const std::string& path) {
  std::shared_ptr<torch::nn::Module> node;
  torch::nn::Module* current = &model;
  std::string walked;
  size_t start = 0;
  while (start <= path.size()) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    auto children = current->named_children();
    if (!children.contains(part)) {
      throw Error(str("activation checkpointing: the model has no submodule '",
                      walked.empty() ? part : walked + "." + part, "'; the children of ",
                      walked.empty() ? "the model" : "'" + walked + "'", " are: ",
                      describe_children(*current), ". Name the ModuleList of blocks in "
                      "PolicyOptions::blocks"));
    }
    node = children[part];
    current = node.get();
    walked = walked.empty() ? part : walked + "." + part;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(node);
  if (!list) {
    throw Error(str("activation checkpointing: '", path, "' is a ", module_type(*node),
                    ", not a torch::nn::ModuleList; the children of the model are: ",
                    describe_children(model)));
  }
  return list;
}

void remove_activation_checkpointing(torch::nn::Module& model) {
  set_module_hook(model, HookSlot::kCheckpoint, nullptr);
  for (const auto& m : model.modules(/*include_self=*/false)) {
    set_module_hook(*m, HookSlot::kCheckpoint, nullptr);
  }
}

int apply_activation_checkpointing(torch::nn::Module& model, const PolicyOptions& options) {
  remove_activation_checkpointing(model);
  std::vector<std::pair<std::string, const torch::nn::Module*>> chosen;
  std::shared_ptr<const SaveOps> save_ops;

  if (options.ac_condition) {
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      if (options.ac_condition(item.key(), *item.value())) {
        chosen.emplace_back(item.key(), item.value().get());
      }
    }
  } else {
    const CheckpointVariant v = options.variant;
    if (v == CheckpointVariant::kAuto) {
      throw ConfigError(
          "activation checkpointing: variant \"auto\" is planned from a profiling step on the real "
          "batch: call plan_activation_checkpointing (checkpointing/planner.h) with the budget "
          "instead of apply_activation_checkpointing (remat-train does this by itself)");
    }
    const std::string invalid = check_policy_settings(options);
    if (!invalid.empty()) throw ConfigError("activation checkpointing: " + invalid);
    if (v == CheckpointVariant::kNone) return 0;
    auto blocks = find_block_list(model, options.blocks);
    const int64_t k = v == CheckpointVariant::kSelectiveLayer ? options.every_k : 1;
    const int64_t n = static_cast<int64_t>(blocks->size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t from = options.every_k_from == EveryKFrom::kLast ? n - 1 - i : i;
      if (from % k == 0) {
        chosen.emplace_back(str(options.blocks, ".", i), blocks->ptr(i).get());
      }
    }
    if (v == CheckpointVariant::kSelectiveOp) {
      save_ops = std::make_shared<const SaveOps>(
          resolve_save_ops(options.save_ops.value_or(default_save_ops())));
    }
  }
  for (const auto& [fqn, module] : chosen) {
    set_module_hook(*module, HookSlot::kCheckpoint,
                    std::make_shared<CheckpointHook>(options.checkpoint, fqn, save_ops));
  }
  log_rank0().info("applied activation checkpointing ({}) to {} modules",
                   options.ac_condition ? std::string("ac_condition") : checkpoint_variant_name(options.variant),
                   chosen.size());
  return static_cast<int>(chosen.size());
}

}  // namespace remat
