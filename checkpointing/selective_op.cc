#include "checkpointing/selective_op.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <mutex>

#include "runtime/compat.h"
#include "runtime/error.h"

namespace remat {

struct SelectiveOpScope::State {
  const SaveOps* ops;
  SelectiveCache* cache;
  Mode mode;
  State* previous;
  c10::impl::IncludeDispatchKeyGuard include{c10::DispatchKey::Fake};
  State(const SaveOps* o, SelectiveCache* c, Mode m, State* p) : ops(o), cache(c), mode(m), previous(p) {}
};

namespace {

thread_local SelectiveOpScope::State* g_state = nullptr;
thread_local int g_kernel_depth = 0;

int64_t tensor_bytes(const std::vector<c10::IValue>& values) {
  int64_t bytes = 0;
  for (const auto& v : values) {
    if (v.isTensor() && v.toTensor().defined()) bytes += v.toTensor().nbytes();
  }
  return bytes;
}

// Names the call: op, overload and the arguments' tensor shapes and dtypes, so
// that a replay can only hand an output back to the very call that made it.
std::string signature(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  std::string out = schema.overload_name().empty() ? schema.name()
                                                   : schema.name() + "." + schema.overload_name();
  const size_t n = schema.arguments().size();
  out += "(";
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const auto& v = stack[i];
    if (i + n != stack.size()) out += ", ";
    if (v.isTensor() && v.toTensor().defined()) {
      const auto& t = v.toTensor();
      out += str(c10::toString(t.scalar_type()), t.sizes());
    } else if (v.isTensor()) {
      out += "None";
    } else {
      out += v.tagKind();
    }
  }
  return out + ")";
}

// Runs the op's real kernel below the selective key.
void run_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard exclude(c10::DispatchKey::Fake);
  ++g_kernel_depth;
  try {
    op.callBoxed(stack);
  } catch (...) {
    --g_kernel_depth;
    throw;
  }
  --g_kernel_depth;
}

void selective_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto* state = g_state;
  const auto& schema = op.schema();
  if (state == nullptr || schema.is_mutable() || !state->ops->count(schema.name())) {
    run_kernel(op, stack);
    return;
  }
  SelectiveCache& cache = *state->cache;
  const size_t n_returns = schema.returns().size();
  std::string name = signature(schema, *stack);
  // The cache keeps private copies: model code may change an output in place
  // through an alias that shares no version counter with it (the C++ Linear
  // adds its bias in place to an _unsafe_view of the matmul), and the
  // recompute may do the same to what it is handed.
  auto copies = [](const std::vector<c10::IValue>& values) {
    std::vector<c10::IValue> out;
    for (const auto& v : values) {
      out.push_back(v.isTensor() && v.toTensor().defined() ? c10::IValue(v.toTensor().clone()) : v);
    }
    return out;
  };
  if (state->mode == SelectiveOpScope::Mode::kRecord) {
    run_kernel(op, stack);
    std::vector<c10::IValue> returns =
        copies(std::vector<c10::IValue>(stack->end() - n_returns, stack->end()));
    cache.bytes += tensor_bytes(returns);
    cache.entries.push_back({std::move(name), std::move(returns)});
    return;
  }
  if (cache.next >= cache.entries.size() || cache.entries[cache.next].op != name) {
    throw Error(str("selective_op: the recompute called ", name, " as saved op #", cache.next,
                    " but the forward ",
                    cache.next < cache.entries.size()
                        ? "called " + cache.entries[cache.next].op
                        : std::string("saved only ") + std::to_string(cache.entries.size()) +
                              " op outputs",
                    "; the region must run the same ops in the same order both times"));
  }
  torch::jit::drop(*stack, schema.arguments().size());
  for (auto& v : copies(cache.entries[cache.next].returns)) stack->push_back(std::move(v));
  ++cache.next;
}

void ensure_fallback() {
  static std::once_flag once;
  static torch::Library* library = nullptr;  // lives for the process
  std::call_once(once, [] {
    if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(c10::DispatchKey::Fake)) {
      throw Error(
          "selective_op checkpointing needs the dispatcher's Fake key, but another library "
          "already registered a fallback there; use the full or selective_layer variant");
    }
    library = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::Fake, __FILE__,
                                 __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&selective_fallback>());
  });
  if (library == nullptr) throw Error("selective_op checkpointing could not be set up");
}

}  // namespace

std::vector<std::string> default_save_ops() { return {"aten::mm", "aten::addmm"}; }

std::vector<std::string> matmul_save_ops() {
  return {"aten::mm",
          "aten::addmm",
          "aten::bmm",
          "aten::_scaled_dot_product_attention",
          "aten::_scaled_dot_product_flash_attention",
          "aten::_scaled_dot_product_efficient_attention",
          "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::max"};
}

std::vector<std::string> collective_save_ops() {
  return {"remat::tp_all_reduce", "remat::tp_all_gather", "remat::tp_reduce_scatter"};
}

SaveOps resolve_save_ops(const std::vector<std::string>& names) {
  std::set<std::string> known;
  for (const auto& op : c10::Dispatcher::singleton().getAllOpNames()) known.insert(op.name);
  auto version_specific = matmul_save_ops();
  for (const auto& name : collective_save_ops()) version_specific.push_back(name);
  SaveOps out;
  for (const auto& name : names) {
    if (known.count(name)) {
      out.insert(name);
      continue;
    }
    if (std::find(version_specific.begin(), version_specific.end(), name) != version_specific.end()) {
      continue;
    }
    // The closest registered name, by shared prefix then length.
    std::string best;
    size_t best_score = 0;
    for (const auto& k : known) {
      size_t p = 0;
      while (p < k.size() && p < name.size() && k[p] == name[p]) ++p;
      if (p > best_score || (p == best_score && !best.empty() && k.size() < best.size())) {
        best_score = p;
        best = k;
      }
    }
    throw Error(str("activation_checkpointing.save_ops: unknown operator '", name,
                    "' (LibTorch ", compat::torch_version(), "); did you mean '", best, "'?"));
  }
  return out;
}

SelectiveOpScope::SelectiveOpScope(const SaveOps& ops, SelectiveCache& cache, Mode mode) {
  ensure_fallback();
  if (mode == Mode::kReplay) cache.next = 0;
  state_ = std::make_unique<State>(&ops, &cache, mode, g_state);
  g_state = state_.get();
}

SelectiveOpScope::~SelectiveOpScope() { g_state = state_->previous; }

bool selective_op_kernel_running() { return g_kernel_depth > 0; }

}  // namespace remat
