// Activation offloading: every tensor autograd saves for backward inside the
// scope moves to host memory in the forward and comes back in the backward.
//
//   remat::OffloadActivationsOptions options;           // torchtune's defaults
//   remat::exclude_output_head(*model, options);         // the head runs on the device
//   {
//     remat::OffloadActivations offload(options);
//     loss = model->loss(x, y);                          // saved tensors go to the host
//   }
//   loss.backward();                                     // ... and come back when needed
//
// Contract (checkpointing/offload_activations_test.cc, docs/offloading.md):
// - Saved tensors of at least min_offload_size bytes are copied to host memory;
//   smaller ones, and parameters (the model's parameters and buffers, frozen or
//   not, when the scope is given the model; leaf tensors that require grad and
//   views of them: a C++ Linear saves weight.t()), stay where they are.
// - Each tensor comes back when backward first needs it; with retain_graph it
//   comes back again in the next backward. The host copy is freed with the
//   graph (after a backward that does not retain it).
// - A saved tensor changed in place after it was saved is an error naming it,
//   as autograd's own check would be: never a gradient from another value.
// - The output head is needed first in backward: exclude_output_head marks it
//   so that its calls through remat::forward run without offloading, and what
//   runs after it in the same scope (the loss) stays on the device too. A scope
//   given the model checks that its marked head did run through remat::forward:
//   if not, the first backward that needs one of the scope's saved tensors
//   (that is, once the forward is over) throws an Error naming the head.
// - On a GPU: host copies are pinned (use_pin_memory) and made on a side stream
//   (use_streams) with at most max_fwd_stash_size copies in flight; in backward
//   the tensors saved before the one being restored are fetched ahead on the
//   side stream. On a CPU-only build the host copies go to an arena that c10's
//   allocator does not see, so what the device keeps is measurable here
//   (activation_offload_stats().host_bytes is what the arena holds).
// - Inside a non-reentrant checkpoint region the region's own saved tensors are
//   recomputed, not offloaded; the region's inputs are offloaded (they are
//   saved through the enclosing scope).
// - Without grad mode nothing is saved, so nothing is offloaded.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>

#include "checkpointing/options.h"
#include "runtime/field_table.h"

namespace remat {

class saved_tensors_hooks;

// OffloadActivationsOptions (checkpointing/options.h, where each is
// documented with its default) are the activation_offloading section's.

// Counters of activation offloading in the current context (runtime/context.h;
// metrics, tests, benchmarks): a scope's tensors count in the context current
// when the scope began, also when backward brings them back elsewhere.
struct ActivationOffloadStats {
  int64_t offloaded_tensors = 0;  // total: tensors copied to the host
  int64_t offloaded_bytes = 0;    // total
  int64_t restored_tensors = 0;   // total: tensors brought back (again for each backward)
  int64_t restored_bytes = 0;     // total
  int64_t kept_tensors = 0;       // total: saved tensors left on the device (small; not parameters)
  int64_t kept_bytes = 0;         // now: bytes of such tensors that live graphs hold
  int64_t host_bytes = 0;         // now: host copies that live graphs hold
  static const FieldTable<ActivationOffloadStats>& fields();
};
ActivationOffloadStats activation_offload_stats();

// Each field once (runtime/field_table.h): its kind, and its key in a step's
// metrics if it has one (kept_bytes and host_bytes are the engine's meter's,
// read at the forward's end). A new counter is its field, its row and its increment.
inline const FieldTable<ActivationOffloadStats>& ActivationOffloadStats::fields() {
  using S = ActivationOffloadStats;
  static const FieldTable<S> table = {
      {"offloaded_tensors", FieldKind::kTotal, &S::offloaded_tensors},
      {"offloaded_bytes", FieldKind::kTotal, &S::offloaded_bytes, "act_offloaded_bytes"},
      {"restored_tensors", FieldKind::kTotal, &S::restored_tensors},
      {"restored_bytes", FieldKind::kTotal, &S::restored_bytes, "act_restored_bytes"},
      {"kept_tensors", FieldKind::kTotal, &S::kept_tensors},
      {"kept_bytes", FieldKind::kNow, &S::kept_bytes},
      {"host_bytes", FieldKind::kNow, &S::host_bytes},
  };
  return table;
}

class OffloadActivations {
 public:
  // `model`: tensors on the storage of its parameters and buffers are never
  // offloaded (frozen weights too); without it, leaves that require grad and
  // views of them are recognised.
  explicit OffloadActivations(const OffloadActivationsOptions& options = {},
                              const torch::nn::Module* model = nullptr);
  ~OffloadActivations();
  OffloadActivations(const OffloadActivations&) = delete;
  OffloadActivations& operator=(const OffloadActivations&) = delete;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::unique_ptr<saved_tensors_hooks> scope_;
};

// The output head: the module at options.head (a dotted path) or, when that
// is empty, the model's top-level child named "head", "output" or "lm_head",
// else its last top-level child whose type is a Linear. Null when none.
std::shared_ptr<torch::nn::Module> find_output_head(torch::nn::Module& model,
                                                    const std::string& path = "");

// Marks the head so that its calls through remat::forward run without
// offloading; logs a warning (options.warn_if_no_head) when there is none.
// A path that names no module is an Error listing the children. Returns the head.
std::shared_ptr<torch::nn::Module> exclude_output_head(torch::nn::Module& model,
                                                       const OffloadActivationsOptions& options);

// The activation_offloading section's head, as remat-train applies it: with
// options.enabled, exclude_output_head; without, options.head (when given) is
// still checked to name a module of `model` (a ConfigError otherwise), so that
// a misspelt head shows before offloading is turned on, and nothing is marked.
// Returns the head, or null when none is marked or named.
std::shared_ptr<torch::nn::Module> prepare_output_head(torch::nn::Module& model,
                                                       const OffloadActivationsOptions& options);

}  // namespace remat
