#include "checkpointing/op_recorder.h"

#include <ATen/record_function.h>

#include <algorithm>

namespace remat {
namespace {

thread_local OpRecorder* current = nullptr;

}  // namespace

struct OpRecorderAccess {
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (current != nullptr) current->ops_.emplace_back(fn.name());
    return nullptr;
  }
};

OpRecorder::OpRecorder() : previous_(current) {
  current = this;
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&OpRecorderAccess::on_start)
          .needsInputs(false)
          .scopes({at::RecordScope::FUNCTION}));
}

OpRecorder::~OpRecorder() {
  at::removeCallback(handle_);
  current = previous_;
}

int64_t OpRecorder::count(const std::string& op) const {
  return std::count(ops_.begin(), ops_.end(), op);
}

}  // namespace remat
