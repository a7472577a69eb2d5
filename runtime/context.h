// Where remat's libraries keep their mutable state: one Context holds one
// state object per library type (the checkpoint defaults and counters, the
// activation-offloading counters, the tensor-parallel byte count, the RNG
// tracker), so that two engines in one process, or two tests, each with its
// own Context, never see each other's settings.
//
// Code reaches the state through Context::current(): the context that the
// innermost ContextScope installed on this thread, else the process default,
// so that code using remat without an engine behaves as one process-wide
// state. An engine creates a context and installs it around everything it
// runs (setup, forward, backward, the step):
//
//   auto context = remat::Context::create();
//   {
//     remat::ContextScope scope(context);
//     remat::configure_checkpointing(cfg, &layout);  // into this context only
//     loss = model->loss(x, y);
//     loss.backward();
//   }
//
// Objects created in a forward and used later (checkpoint regions, offloading
// scopes, tensor-parallel autograd functions) keep the context current at
// their creation and use it when they run, so a backward on another thread
// (autograd's device threads) or outside any scope still counts into, and
// reads from, the context of its forward.
//
// A library defines its state as a default-constructible type in its own
// files and asks `Context::current().get<State>()`; runtime/ knows nothing of
// the types. Module hooks are not context state: they belong to the module
// (nn/module_call.h says why).
#pragma once

#include <memory>
#include <mutex>
#include <typeindex>
#include <unordered_map>

namespace remat {

class Context : public std::enable_shared_from_this<Context> {
 public:
  // A new context with no state yet (each state is created at first use).
  static std::shared_ptr<Context> create();

  // The context installed on this thread by the innermost ContextScope, else
  // the process default.
  static Context& current();
  // The same, as a shared_ptr, for objects that keep it past this call.
  static std::shared_ptr<Context> current_shared();
  // The context used where no scope is installed.
  static const std::shared_ptr<Context>& process_default();

  // This context's state of type T, default-constructed at first use; it
  // lives as long as the context. Safe to call from several threads.
  template <class T>
  T& get() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = states_[std::type_index(typeid(T))];
    if (!slot) slot = std::make_shared<T>();
    return *static_cast<T*>(slot.get());
  }

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

 private:
  Context() = default;

  std::mutex mutex_;
  std::unordered_map<std::type_index, std::shared_ptr<void>> states_;
};

// Installs `context` as this thread's current context until the scope ends;
// scopes nest (the innermost wins) and must end in reverse order. A null
// context installs nothing (the enclosing one stays current).
class ContextScope {
 public:
  explicit ContextScope(std::shared_ptr<Context> context);
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  std::shared_ptr<Context> context_;
  Context* previous_ = nullptr;
};

}  // namespace remat
