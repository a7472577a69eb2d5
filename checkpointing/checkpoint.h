// Activation checkpointing regions: remat::checkpoint(fn, args...).
//
// Forward runs `fn` without recording a graph and keeps only its inputs;
// backward restores the RNG state the forward saw (default generators and the
// tracker's states) and runs `fn` again. Two modes (CheckpointOptions::reentrant,
// docs/checkpointing.md says when to pick which):
// - non-reentrant (the default): `fn` runs with grad, so the graph is the
//   plain one, but every tensor autograd saves inside the region is replaced
//   by a slot; the first slot a backward needs recomputes `fn` and fills every
//   slot, stopping as soon as the last one is filled. torch::autograd::grad
//   (also inside `fn`, and gradients of gradients), backward with `inputs`,
//   partial backward and gradient hooks behave as without checkpointing.
//   Needs remat's autograd engine (nn/saved_tensors_hooks.h), installed by
//   the first region.
// - reentrant: `fn` runs without a graph inside one custom autograd Function
//   whose backward recomputes `fn` with grad and backpropagates through it;
//   torch::autograd::grad through it, or inside `fn`, is refused.
// Parameters used inside `fn` receive their gradients, even when no input
// requires grad. Without grad mode (eval) `fn` simply runs and nothing is kept.
//
//   at::Tensor y = remat::checkpoint([&](const at::Tensor& x) { return block->forward(x); }, x);
//   auto [h, aux] = remat::checkpoint(
//       [&](const at::Tensor& x, int64_t k, c10::optional<at::Tensor> mask) {
//         return std::make_tuple(f(x, k, mask), k + 1);
//       }, x, 3, c10::nullopt);
//
// Arguments and results may be tensors (requiring grad or not, undefined),
// optional tensors, int, int64, double, bool, strings, and vectors/tuples of
// these. Results may be tensors fn did not create (an input, a view, a
// parameter, a captured tensor): the caller gets a fresh alias of each, and
// the tensor itself keeps its history. An input changed in place before
// backward is an error naming it; fn throwing leaves counters, buffers and the
// RNG as before the call; non-reentrant regions also refuse tensors they saved
// that were changed in place after being saved (as autograd does without hooks).
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "checkpointing/region_options.h"
#include "checkpointing/stored_inputs.h"
#include "nn/ivalue_codec.h"

namespace remat {

class ParallelLayout;

// The options checkpoint() uses when given none (and that policies start from).
CheckpointOptions& default_checkpoint_options();

// Sets the default options from the region settings (the activation_checkpointing
// section's; checkpointing/options.h):
// partition_activations (over the layout's tensor-parallel group),
// cpu_checkpointing (with offload_min_bytes, offload_max_in_flight,
// offload_keep_last), contiguous_memory_optimization with number_checkpoints,
// synchronize_checkpoint_boundary, profile, reentrant and save_collectives. Regions and policies read the
// defaults when they run, so it may come before or after
// apply_activation_checkpointing. `layout` may be null when
// partition_activations is off. Errors name the key to change.
//
//   remat::ParallelLayout layout(world, remat::ParallelDims::from_world(world->size(), 2));
//   remat::configure_checkpointing(cfg.activation_checkpointing, &layout);
//   y = remat::checkpoint(block_fn, x);   // x kept as 1/2 per rank
void configure_checkpointing(const RegionSettings& config, const ParallelLayout* layout = nullptr);

// Frees the contiguous checkpoint buffers of the default options (regions
// alive now keep their own slots). Call it between phases that checkpoint
// inputs of other shapes.
void reset_checkpoint_buffers();

// The untyped core: `fn` takes and returns IValues.
c10::IValue checkpoint_ivalues(const CheckpointFn& fn, std::vector<c10::IValue> args,
                               const CheckpointOptions& options = default_checkpoint_options());

std::map<std::string, RegionProfile> checkpoint_profile();

// Bytes of tensors that live checkpoint regions hold for backward: their saved
// inputs (partitioned: this rank's shares; offloaded: counted on the host;
// views: see covered_bytes in stored_inputs.h) plus, for selective_op, the kept op
// outputs. A region stops counting once a backward that does not retain the
// graph has run through it.
int64_t checkpoint_saved_bytes();

// Tensors that live regions hold for their stored inputs (tests).
std::vector<at::Tensor> checkpoint_stored_tensors();
// The aggregate so far, which then starts again from zero.
std::map<std::string, RegionProfile> take_checkpoint_profile();
// Logs the aggregate (one line per region) and starts a new one: call once a step.
void log_checkpoint_profile_step(int64_t step);

// How many times checkpoint regions recomputed in this process (for tests and
// metrics).
int64_t checkpoint_recompute_count();


// The typed front: fn is called with the same argument types it was given.
template <typename F, typename... Args>
auto checkpoint_with(const CheckpointOptions& options, F&& fn, Args&&... args) {
  using Result = Plain<std::invoke_result_t<F&, Plain<Args>...>>;
  std::vector<c10::IValue> packed{IValueCodec<Plain<Args>>::encode(args)...};
  // The body outlives this call (backward recomputes with it): it keeps a copy of fn.
  CheckpointFn body = erase_types<Args...>(std::forward<F>(fn));
  return IValueCodec<Result>::decode(checkpoint_ivalues(body, std::move(packed), options));
}

template <typename F, typename... Args>
auto checkpoint(F&& fn, Args&&... args) {
  return checkpoint_with(default_checkpoint_options(), std::forward<F>(fn),
                         std::forward<Args>(args)...);
}

}  // namespace remat
