#include "checkpointing/op_recorder.h"

#include <ATen/record_function.h>

#include <algorithm>

namespace remat {
namespace {

thread_local OpRecorder* current = nullptr;

}  // namespace

struct OpRecorderAccess {
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    // Every live recorder on this thread sees the op: nesting hides nothing.
    for (OpRecorder* r = current; r != nullptr; r = r->previous_) r->ops_.emplace_back(fn.name());
    return nullptr;
  }
};

// Only the outermost recorder registers the callback; inner ones join its chain.
OpRecorder::OpRecorder() : previous_(current), handle_(0) {
  current = this;
  if (previous_ == nullptr) {
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&OpRecorderAccess::on_start)
            .needsInputs(false)
            .scopes({at::RecordScope::FUNCTION}));
  }
}

OpRecorder::~OpRecorder() {
  if (previous_ == nullptr) at::removeCallback(handle_);
  current = previous_;
}

int64_t OpRecorder::count(const std::string& op) const {
  return std::count(ops_.begin(), ops_.end(), op);
}

}  // namespace remat
