#include "runtime/context.h"

namespace remat {
namespace {

// Null: no scope on this thread, the process default is current. Each scope
// keeps its context alive, so the pointer is valid while it is installed.
thread_local Context* t_current = nullptr;

}  // namespace

std::shared_ptr<Context> Context::create() { return std::shared_ptr<Context>(new Context()); }

const std::shared_ptr<Context>& Context::process_default() {
  // Never destroyed: regions and hooks alive at exit may still reach it.
  static const auto* context = new std::shared_ptr<Context>(create());
  return *context;
}

Context& Context::current() {
  return t_current != nullptr ? *t_current : *process_default();
}

std::shared_ptr<Context> Context::current_shared() {
  return t_current != nullptr ? t_current->shared_from_this() : process_default();
}

ContextScope::ContextScope(std::shared_ptr<Context> context) : context_(std::move(context)) {
  if (context_ == nullptr) return;
  previous_ = t_current;
  t_current = context_.get();
}

ContextScope::~ContextScope() {
  if (context_ != nullptr) t_current = previous_;
}

}  // namespace remat
