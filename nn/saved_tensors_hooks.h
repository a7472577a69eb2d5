// Hooks on every tensor autograd saves for backward, from C++.
//
// LibTorch's C++ frontend has no saved-tensors-hooks scope, but each saved
// variable asks the default autograd engine for hooks when it is created.
// remat installs an engine that answers from a per-thread stack of scopes:
//
//   {
//     remat::saved_tensors_hooks scope(
//         [](const at::Tensor& t) -> std::any { return t.detach().to(at::kCPU); },
//         [](const std::any& packed) { return std::any_cast<at::Tensor>(packed); });
//     loss = model->forward(x).sum();   // every saved tensor goes through pack
//   }
//   loss.backward();                    // ... and comes back through unpack
//
// Contract (each point is tested in saved_tensors_hooks_test.cc, on LibTorch
// 1.13 and 2.6):
// - pack sees every tensor autograd saves inside the scope, including what a
//   custom Function saves with save_for_backward and outputs saved by their
//   own node; tensors put in ctx->saved_data are not saved variables and are
//   not hooked. LibTorch 2.x does not hook wrapped numbers (scalars).
// - pack receives the tensor itself (an output with its grad_fn set): keeping
//   it as it is makes a reference cycle that outlives the graph when backward
//   never runs. Keep t.detach() (shares the data) or a copy.
// - With hooks, autograd does not check saved tensors for in-place changes:
//   hooks that keep a reference must compare t._version() themselves, or an
//   in-place change between forward and backward gives silently wrong
//   gradients.
// - Scopes are per thread: a forward on another thread, or the engine's
//   per-device threads, do not see the caller's hooks. Unpack runs on
//   whichever thread runs the backward.
// - Parameters of C++ modules reach pack as views (Linear saves weight.t()),
//   not as the leaf: recognise them by storage (same_storage below).
// - Scopes nest (the innermost applies); disable_saved_tensors_hooks turns
//   them off for a region (a region that must not be offloaded, the hooks'
//   own work).
// - The engine is installed when the program starts (static initialisation of
//   nn/saved_tensors_hooks.cc), before any backward: LibTorch 2.x starts the
//   autograd threads of the GPUs once per process, for the engine that runs the
//   first backward, so one engine must run every backward.
//   install_saved_tensors_hooks_engine() is a no-op after that.
//   A library that installs its own engine afterwards (Python's torch module,
//   when loaded into the process) replaces it: scopes then see no tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <any>
#include <functional>
#include <memory>

namespace remat {

using PackHook = std::function<std::any(const at::Tensor&)>;
using UnpackHook = std::function<at::Tensor(const std::any&)>;

// Installs remat's autograd engine as the process's default (idempotent).
void install_saved_tensors_hooks_engine();
// Whether it is installed.
bool saved_tensors_hooks_engine_installed();

class saved_tensors_hooks {
 public:
  saved_tensors_hooks(PackHook pack, UnpackHook unpack);
  ~saved_tensors_hooks();
  saved_tensors_hooks(const saved_tensors_hooks&) = delete;
  saved_tensors_hooks& operator=(const saved_tensors_hooks&) = delete;
};

// No hooks apply inside (until a new scope is opened inside this one).
class disable_saved_tensors_hooks {
 public:
  disable_saved_tensors_hooks();
  ~disable_saved_tensors_hooks();
  disable_saved_tensors_hooks(const disable_saved_tensors_hooks&) = delete;
  disable_saved_tensors_hooks& operator=(const disable_saved_tensors_hooks&) = delete;
};

// Whether a scope applies on this thread now.
bool saved_tensors_hooks_active();

// Whether `a` and `b` view the same storage (a saved weight.t() and the weight).
bool same_storage(const at::Tensor& a, const at::Tensor& b);

}  // namespace remat
