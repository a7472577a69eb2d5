#include "nn/saved_tensors_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

namespace remat {
namespace {

struct HookPair {
  PackHook pack;
  UnpackHook unpack;
};

// The scopes open on this thread, innermost last; null: hooks disabled.
thread_local std::vector<std::shared_ptr<const HookPair>> t_scopes;

// One saved variable's hooks: what pack returned, handed to unpack.
class SavedTensorHooksImpl final : public torch::autograd::SavedVariableHooks {
 public:
  explicit SavedTensorHooksImpl(std::shared_ptr<const HookPair> hooks) : hooks_(std::move(hooks)) {}
  void call_pack_hook(const at::Tensor& tensor) override { packed_ = hooks_->pack(tensor); }
  at::Tensor call_unpack_hook() override { return hooks_->unpack(packed_); }

 private:
  std::shared_ptr<const HookPair> hooks_;
  std::any packed_;
};

// The default engine plus one answer: the hooks of this thread's innermost scope.
struct HookingEngine final : public torch::autograd::Engine {
  HookingEngine() = default;
  ~HookingEngine() override { stop(); }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (t_scopes.empty() || !t_scopes.back()) return nullptr;
    return std::make_unique<SavedTensorHooksImpl>(t_scopes.back());
  }

  static torch::autograd::Engine& get() {
    static HookingEngine engine;
    return engine;
  }
};

std::once_flag g_install_once;
std::atomic<bool> g_installed{false};

}  // namespace

void install_saved_tensors_hooks_engine() {
  std::call_once(g_install_once, [] {
    torch::autograd::set_default_engine_stub(&HookingEngine::get);
    g_installed = true;
  });
}

bool saved_tensors_hooks_engine_installed() { return g_installed.load(); }

namespace {
// Installed as the program starts, by the static initialisation of this file
// (linked into every program that makes a scope): LibTorch 2.x starts the
// autograd engine's per-GPU worker threads once per process, for whichever
// engine runs the first backward, so an engine installed after a backward has
// no device threads and its first CUDA backward stops on an internal assert
// (seen with LibTorch 2.11 on an H100: tools/gpu_checks.sh, engine/gpu_test.cc).
// LibTorch 1.13 starts them per engine.
[[maybe_unused]] const bool g_installed_at_start = [] {
  install_saved_tensors_hooks_engine();
  return true;
}();
}  // namespace

saved_tensors_hooks::saved_tensors_hooks(PackHook pack, UnpackHook unpack) {
  install_saved_tensors_hooks_engine();
  t_scopes.push_back(std::make_shared<const HookPair>(HookPair{std::move(pack), std::move(unpack)}));
}

saved_tensors_hooks::~saved_tensors_hooks() { t_scopes.pop_back(); }

disable_saved_tensors_hooks::disable_saved_tensors_hooks() { t_scopes.push_back(nullptr); }

disable_saved_tensors_hooks::~disable_saved_tensors_hooks() { t_scopes.pop_back(); }

bool saved_tensors_hooks_active() { return !t_scopes.empty() && t_scopes.back() != nullptr; }

bool same_storage(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.has_storage() && b.has_storage() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

}  // namespace remat
