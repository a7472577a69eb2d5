// The tracked RNG: named generator states that code switches into with fork(),
// so that dropout drawn inside a region can be replayed exactly.
//
// Each named state covers the CPU generator and, where CUDA is available, the
// current CUDA device's generator: CPU tensors draw from the first, CUDA
// tensors from the second.
//
//   auto& tracker = remat::get_rng_tracker();
//   tracker.add("model-parallel-rng", 1234 + 2718 + tp_rank);
//   {
//     auto guard = tracker.fork("model-parallel-rng");
//     x = torch::dropout(x, 0.1, true);   // draws from the named state
//   }                                      // default generators restored
//
// Nested forks behave like unnested ones: entering a fork saves the progress of
// the state in use, so forking the same name twice continues one stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat {

class ParallelLayout;

// The generator states of one stream: the CPU's, and the current CUDA
// device's when CUDA is available (undefined otherwise).
struct GeneratorStates {
  at::Tensor cpu;
  at::Tensor cuda;
};

// The default generators' states now; set_default_generators restores them.
GeneratorStates capture_default_generators();
void set_default_generators(const GeneratorStates& states);

class RNGStatesTracker {
 public:
  // Adds a named state seeded with `seed`. A duplicate name or seed is an
  // Error (two streams with one seed would draw the same numbers).
  void add(const std::string& name, uint64_t seed);

  bool has(const std::string& name) const { return states_.count(name) > 0; }

  // Switches the default generators to `name` until the guard ends; then the
  // state's progress is kept and the previous generators come back.
  class ForkGuard {
   public:
    ForkGuard(ForkGuard&&) noexcept;
    ForkGuard& operator=(ForkGuard&&) = delete;
    ~ForkGuard();

   private:
    friend class RNGStatesTracker;
    ForkGuard(RNGStatesTracker* tracker, std::string name);
    RNGStatesTracker* tracker_;
    std::string name_;
  };
  [[nodiscard]] ForkGuard fork(const std::string& name = "model-parallel-rng");

  std::map<std::string, GeneratorStates> get_states() const;
  // Replaces every state (a checkpoint restore). Not allowed inside a fork.
  void set_states(const std::map<std::string, GeneratorStates>& states);
  void reset();

 private:
  void enter(const std::string& name);
  void leave(const std::string& name);

  std::map<std::string, GeneratorStates> states_;
  std::map<uint64_t, std::string> seeds_;
  // Names of the forks in progress, innermost last, and the default
  // generators' states saved when the outermost one began.
  std::vector<std::string> active_;
  GeneratorStates outside_;
};

// The current context's tracker (runtime/context.h): each context has its
// own named states; without a ContextScope, the process default's. The default
// generators it forks into are LibTorch's, one set per process.
RNGStatesTracker& get_rng_tracker();

inline constexpr const char* kModelParallelRng = "model-parallel-rng";
inline constexpr uint64_t kModelParallelSeedOffset = 2718;

// Seeds the default generators with `seed` and the current tracker's model-parallel
// state with seed + 2718 + tp_rank: dropout inside tensor-parallel regions
// differs across tensor-parallel ranks and matches across data-parallel ones.
void model_parallel_manual_seed(uint64_t seed, int tp_rank);
void model_parallel_manual_seed(uint64_t seed, const ParallelLayout& layout);

// Everything random here: the default generators and the current context's
// tracker states.
struct RngSnapshot {
  GeneratorStates defaults;
  std::map<std::string, GeneratorStates> tracker;
};
RngSnapshot capture_rng();
// Puts back every state the snapshot holds (tracker states: the snapshot's
// set of names; a state drop_unchanged left out stays as it is now).
void restore_rng(const RngSnapshot& snapshot);
// Drops from `snapshot` each state that equals the current one (leaving an
// undefined tensor): a generator nothing drew from since the snapshot was taken. A checkpoint region does
// this after its forward, so it keeps only the states its recompute must
// replay (at tensor-parallel size 1 the tracker's state is never forked:
// 5056 bytes less per region).
void drop_unchanged(RngSnapshot& snapshot);

}  // namespace remat
