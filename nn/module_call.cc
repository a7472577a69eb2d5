#include "nn/module_call.h"

#include <array>
#include <mutex>
#include <unordered_map>

#include "runtime/context.h"
#include "runtime/error.h"

namespace remat {
namespace internal {

std::atomic<int64_t> g_hooked_modules{0};

}  // namespace internal

namespace {

struct Entry {
  // Who the key points at; expired (or another module at the same address)
  // means the entry is stale.
  std::weak_ptr<const torch::nn::Module> module;
  std::array<std::shared_ptr<ModuleHook>, kHookSlots> hooks;
  // The context that set each slot (Context::current() then).
  std::array<std::weak_ptr<Context>, kHookSlots> owners;

  bool empty() const {
    for (const auto& h : hooks) {
      if (h != nullptr) return false;
    }
    return true;
  }
};

// The hooks of every module in the process, keyed by module: one table,
// because a module is one object whatever context calls it.
class HookTable {
 public:
  static HookTable& instance() {
    static HookTable table;
    return table;
  }

  std::mutex mutex;

  // Erases the entry of `module` when it no longer belongs to that module.
  // Returns the live entry, or null. Call with `mutex` held.
  Entry* live_entry(const torch::nn::Module* module) {
    auto it = entries_.find(module);
    if (it == entries_.end()) return nullptr;
    auto alive = it->second.module.lock();
    if (alive == nullptr || alive.get() != module) {
      erase(it);
      return nullptr;
    }
    return &it->second;
  }

  Entry& add(const torch::nn::Module& module, std::weak_ptr<const torch::nn::Module> alive) {
    Entry& entry = entries_[&module];
    entry.module = std::move(alive);
    internal::g_hooked_modules++;
    return entry;
  }

  void erase(const torch::nn::Module* module) {
    auto it = entries_.find(module);
    if (it != entries_.end()) erase(it);
  }

  // Calls f(module, entry) for each live entry; stale ones are dropped, and
  // so are those f leaves empty.
  template <typename F>
  void for_each(F f) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto alive = it->second.module.lock();
      if (alive == nullptr || alive.get() != it->first) {
        it = erase(it);
        continue;
      }
      f(*alive, it->second);
      it = it->second.empty() ? erase(it) : std::next(it);
    }
  }

 private:
  using Map = std::unordered_map<const torch::nn::Module*, Entry>;
  Map::iterator erase(Map::iterator it) {
    internal::g_hooked_modules--;
    return entries_.erase(it);
  }

  Map entries_;
};

}  // namespace

const char* hook_slot_name(HookSlot slot) {
  switch (slot) {
    case HookSlot::kSharding: return "sharding";
    case HookSlot::kCheckpoint: return "checkpoint";
    case HookSlot::kNoOffload: return "no-offload";
  }
  return "unknown";
}

void set_module_hook(const torch::nn::Module& module, HookSlot slot, std::shared_ptr<ModuleHook> hook) {
  auto& table = HookTable::instance();
  std::lock_guard<std::mutex> lock(table.mutex);
  Entry* entry = table.live_entry(&module);
  const int i = static_cast<int>(slot);
  if (hook == nullptr) {
    if (entry == nullptr) return;
    entry->hooks[i] = nullptr;
    entry->owners[i].reset();
    if (entry->empty()) table.erase(&module);
    return;
  }
  if (entry == nullptr) {
    std::weak_ptr<const torch::nn::Module> alive = module.weak_from_this();
    if (alive.expired()) {
      throw Error(str("remat::forward hooks attach to modules owned by a std::shared_ptr (a "
                      "ModuleHolder, std::make_shared, or a registered submodule); this ",
                      module.name(), " is not: create it with std::make_shared"));
    }
    entry = &table.add(module, std::move(alive));
  }
  entry->hooks[i] = std::move(hook);
  entry->owners[i] = Context::current_shared();
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
  auto& table = HookTable::instance();
  std::lock_guard<std::mutex> lock(table.mutex);
  Entry* entry = table.live_entry(&module);
  return entry == nullptr ? nullptr : entry->hooks[static_cast<int>(slot)];
}

std::shared_ptr<Context> module_hook_owner(const torch::nn::Module& module, HookSlot slot) {
  auto& table = HookTable::instance();
  std::lock_guard<std::mutex> lock(table.mutex);
  Entry* entry = table.live_entry(&module);
  const int i = static_cast<int>(slot);
  return entry == nullptr || entry->hooks[i] == nullptr ? nullptr : entry->owners[i].lock();
}

std::string hooks_set_elsewhere(const torch::nn::Module& model, const Context& context) {
  std::string out;
  auto& table = HookTable::instance();
  std::lock_guard<std::mutex> lock(table.mutex);
  auto check = [&](const torch::nn::Module* module, const std::string& path) {
    Entry* entry = table.live_entry(module);
    if (entry == nullptr) return;
    for (int i = 0; i < kHookSlots; ++i) {
      auto owner = entry->owners[i].lock();
      if (entry->hooks[i] == nullptr || owner == nullptr || owner.get() == &context) continue;
      out += str(out.empty() ? "" : ", ", path, " (", hook_slot_name(static_cast<HookSlot>(i)), ")");
    }
  };
  check(&model, "<root>");
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    check(item.value().get(), item.key());
  }
  return out;
}

int64_t drop_module_hooks(const Context& owner) {
  int64_t dropped = 0;
  auto& table = HookTable::instance();
  std::lock_guard<std::mutex> lock(table.mutex);
  table.for_each([&](const torch::nn::Module&, Entry& entry) {
    for (int i = 0; i < kHookSlots; ++i) {
      if (entry.hooks[i] != nullptr && entry.owners[i].lock().get() == &owner) {
        entry.hooks[i] = nullptr;
        entry.owners[i].reset();
        ++dropped;
      }
    }
  });
  return dropped;
}

namespace internal {

std::vector<std::shared_ptr<ModuleHook>> hooks_of(const torch::nn::Module* module) {
  std::vector<std::shared_ptr<ModuleHook>> out;
  auto& table = HookTable::instance();
  std::lock_guard<std::mutex> lock(table.mutex);
  if (Entry* entry = table.live_entry(module)) {
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

}  // namespace internal
}  // namespace remat
