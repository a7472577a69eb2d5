#include "nn/module_call.h"

#include <array>
#include <mutex>
#include <unordered_map>

#include "runtime/error.h"

namespace remat {
namespace detail {

std::atomic<int64_t> g_hooked_modules{0};

}  // namespace detail

namespace {

struct Entry {
  // Who the key points at; expired (or another module at the same address)
  // means the entry is stale.
  std::weak_ptr<const torch::nn::Module> owner;
  std::array<std::shared_ptr<ModuleHook>, kHookSlots> hooks;
};

std::mutex g_mutex;
std::unordered_map<const torch::nn::Module*, Entry> g_entries;

// Erases the entry of `module` when it no longer belongs to that module.
// Returns the live entry, or null. Call with g_mutex held.
Entry* live_entry(const torch::nn::Module* module) {
  auto it = g_entries.find(module);
  if (it == g_entries.end()) return nullptr;
  auto owner = it->second.owner.lock();
  if (owner == nullptr || owner.get() != module) {
    g_entries.erase(it);
    detail::g_hooked_modules--;
    return nullptr;
  }
  return &it->second;
}

}  // namespace

void set_module_hook(const torch::nn::Module& module, HookSlot slot, std::shared_ptr<ModuleHook> hook) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Entry* entry = live_entry(&module);
  if (hook == nullptr) {
    if (entry == nullptr) return;
    entry->hooks[static_cast<int>(slot)] = nullptr;
    for (const auto& h : entry->hooks) {
      if (h != nullptr) return;
    }
    g_entries.erase(&module);
    detail::g_hooked_modules--;
    return;
  }
  if (entry == nullptr) {
    std::weak_ptr<const torch::nn::Module> owner = module.weak_from_this();
    if (owner.expired()) {
      throw Error(str("remat::forward hooks attach to modules owned by a std::shared_ptr (a "
                      "ModuleHolder, std::make_shared, or a registered submodule); this ",
                      module.name(), " is not: create it with std::make_shared"));
    }
    entry = &g_entries[&module];
    entry->owner = owner;
    detail::g_hooked_modules++;
  }
  entry->hooks[static_cast<int>(slot)] = std::move(hook);
}

std::string module_type(const torch::nn::Module& module) {
  std::string name = module.name();
  const std::string suffix = "Impl";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    name.resize(name.size() - suffix.size());
  }
  return name;
}

std::string describe_children(const torch::nn::Module& module) {
  std::string out;
  for (const auto& item : module.named_children()) {
    out += (out.empty() ? "" : ", ") + item.key() + " (" + module_type(*item.value()) + ")";
  }
  return out.empty() ? "none" : out;
}

std::shared_ptr<ModuleHook> module_hook(const torch::nn::Module& module, HookSlot slot) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Entry* entry = live_entry(&module);
  return entry == nullptr ? nullptr : entry->hooks[static_cast<int>(slot)];
}

namespace detail {

std::vector<std::shared_ptr<ModuleHook>> hooks_of(const torch::nn::Module* module) {
  std::vector<std::shared_ptr<ModuleHook>> out;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (Entry* entry = live_entry(module)) {
    for (const auto& h : entry->hooks) {
      if (h != nullptr) out.push_back(h);
    }
  }
  return out;
}

namespace {

// Hooks from `i` inward around `body`; every closure holds what it uses, so
// an inner hook may keep `next` past this call.
c10::IValue run_from(std::shared_ptr<const std::vector<std::shared_ptr<ModuleHook>>> hooks,
                     size_t i, const std::vector<c10::IValue>& args, const IValueFn& body) {
  if (i == hooks->size()) return body(args);
  IValueFn next = [hooks, i, body](const std::vector<c10::IValue>& in) {
    return run_from(hooks, i + 1, in, body);
  };
  return (*hooks)[i]->run(args, next);
}

}  // namespace

c10::IValue run_hooks(std::vector<std::shared_ptr<ModuleHook>> hooks,
                      const std::vector<c10::IValue>& args, IValueFn body) {
  auto shared = std::make_shared<const std::vector<std::shared_ptr<ModuleHook>>>(std::move(hooks));
  return run_from(shared, 0, args, body);
}

}  // namespace detail
}  // namespace remat
