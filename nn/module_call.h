// The per-module call route: model code calls a submodule through
// remat::forward(module, args...), and features attach to that call from
// outside through hooks, without the model or each other knowing.
//
//   for (size_t i = 0; i < blocks->size(); ++i) x = remat::forward(blocks->ptr<BlockImpl>(i), x);
//
// A hook sits in one of a fixed set of slots, outermost first: parameter
// sharding (parallel/zero.h gathers a unit's parameters around it), then the
// checkpoint region (checkpointing/policy.h runs the module inside one), so a
// checkpointed unit recomputes inside its gather, then the exclusion from
// activation offloading (checkpointing/offload_activations.h). A module with no hook is
// called directly; with none registered at all, the route costs one atomic load.
//
// Hooks are keyed by module and hold no ownership of it: an entry whose module
// has been destroyed is never applied (even to a new module at the same
// address) and is dropped when met. Modules must be owned by a shared_ptr (a
// ModuleHolder, std::make_shared, or a registered child), as torch::nn's are.
//
// Hooks belong to the module, not to a remat::Context (runtime/context.h):
// every caller of remat::forward on a module runs its hooks, in any context or
// none, so a model evaluated outside its engine's scope still gathers its
// ZeRO-3 parameters. Each slot records the context that set it (the current
// one at set_module_hook), so that an engine can refuse a model that another
// engine drives (hooks_set_elsewhere) and take its own hooks off when it ends
// (drop_module_hooks). A hook outlives the context that set it unless removed.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <atomic>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "nn/ivalue_codec.h"

namespace remat {

class Context;

// Where a hook sits around a module's forward; lower runs outside higher.
enum class HookSlot : int {
  kSharding = 0,
  kCheckpoint = 1,
  kNoOffload = 2,  // the output head runs without activation offloading
};
inline constexpr int kHookSlots = 3;

class ModuleHook {
 public:
  virtual ~ModuleHook() = default;
  // Runs `next` (the next hook inward, or the module's forward) on `args`, with
  // whatever this hook does around it. `next` may be kept and called later (a
  // checkpoint region recomputes in backward): it holds what it needs.
  virtual c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) = 0;
};

// "torch::nn::Linear" rather than the class name "torch::nn::LinearImpl".
std::string module_type(const torch::nn::Module& module);
// The children for error messages: "name (Type), ..." or "none".
std::string describe_children(const torch::nn::Module& module);

// "sharding", "checkpoint" or "no-offload".
const char* hook_slot_name(HookSlot slot);

// Sets the hook of `module` in `slot` (null removes it); the current context
// (Context::current()) becomes the slot's owner.
void set_module_hook(const torch::nn::Module& module, HookSlot slot, std::shared_ptr<ModuleHook> hook);
// The hook of `module` in `slot`, or null.
std::shared_ptr<ModuleHook> module_hook(const torch::nn::Module& module, HookSlot slot);
// The context that set the hook of `module` in `slot`; null when the slot is
// empty or that context no longer exists.
std::shared_ptr<Context> module_hook_owner(const torch::nn::Module& module, HookSlot slot);

// The hooks on `model` and its submodules that a context other than `context`
// set and that context still exists, as "path (slot), ..." (the model itself
// is "<root>"); empty when there are none. An engine taking a model checks
// this with its own context and refuses a model another engine drives.
std::string hooks_set_elsewhere(const torch::nn::Module& model, const Context& context);

// Removes every hook `owner` set, on any module; returns how many.
int64_t drop_module_hooks(const Context& owner);

namespace internal {

// Modules with a hook now (stale entries included until they are met).
extern std::atomic<int64_t> g_hooked_modules;

// The hooks of `module`, outermost first; empty when it has none.
std::vector<std::shared_ptr<ModuleHook>> hooks_of(const torch::nn::Module* module);

// Runs `hooks` around `body`.
c10::IValue run_hooks(std::vector<std::shared_ptr<ModuleHook>> hooks,
                      const std::vector<c10::IValue>& args, IValueFn body);

}  // namespace internal

namespace internal {

// The module as a std::shared_ptr (ModuleHolders hand theirs out).
template <typename M>
auto shared_module(const M& module) {
  if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, M>) {
    return module.ptr();
  } else {
    return module;
  }
}

}  // namespace internal

// Runs module->forward(args...) through the hooks `module` has. `module` is a
// ModuleHolder or a std::shared_ptr to the module.
template <typename M, typename... Args>
auto forward(const M& holder, Args&&... args) {
  auto module = internal::shared_module(holder);
  if (internal::g_hooked_modules.load(std::memory_order_relaxed) == 0) {
    return module->forward(std::forward<Args>(args)...);
  }
  auto hooks = internal::hooks_of(module.get());
  if (hooks.empty()) return module->forward(std::forward<Args>(args)...);
  using Result = Plain<decltype(module->forward(std::forward<Args>(args)...))>;
  std::vector<c10::IValue> packed{IValueCodec<Plain<Args>>::encode(args)...};
  // The body keeps its own handle on the module: a checkpoint region calls it
  // again in backward.
  IValueFn body = erase_types<Args...>(
      [module](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); });
  return IValueCodec<Result>::decode(
      internal::run_hooks(std::move(hooks), packed, std::move(body)));
}

}  // namespace remat
