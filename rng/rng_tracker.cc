#include "rng/rng_tracker.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <mutex>

#include "runtime/context.h"
#include "runtime/error.h"
#include "runtime/layout.h"
#include "runtime/memory_trace.h"

namespace remat {
namespace {

bool cuda_available() { return at::globalContext().hasCUDA() && at::detail::getCUDAHooks().getNumGPUs() > 0; }

at::Generator cuda_generator() {
  return at::globalContext().defaultGenerator(
      at::Device(at::kCUDA, at::detail::getCUDAHooks().current_device()));
}

// A fresh state for `seed`, produced without disturbing the default generators.
GeneratorStates seeded(uint64_t seed) {
  GeneratorStates saved = capture_default_generators();
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  if (cuda_available()) {
    auto gen = cuda_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  GeneratorStates fresh = capture_default_generators();
  set_default_generators(saved);
  return fresh;
}

}  // namespace

GeneratorStates capture_default_generators() {
  // Generator states are not activations, even when a forward captures them.
  MemoryCategoryScope category(MemoryCategory::kOther);
  GeneratorStates states;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.cpu = gen.get_state();
  }
  if (cuda_available()) {
    auto gen = cuda_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.cuda = gen.get_state();
  }
  return states;
}

void set_default_generators(const GeneratorStates& states) {
  if (states.cpu.defined()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(states.cpu);
  }
  if (states.cuda.defined() && cuda_available()) {
    auto gen = cuda_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(states.cuda);
  }
}

void RNGStatesTracker::add(const std::string& name, uint64_t seed) {
  if (states_.count(name)) {
    throw Error(str("RNG tracker: a state named '", name,
                    "' exists already; use another name or reset() the tracker first"));
  }
  auto it = seeds_.find(seed);
  if (it != seeds_.end()) {
    throw Error(str("RNG tracker: seed ", seed, " is used by state '", it->second,
                    "' already; two states with one seed draw identical numbers, so give '",
                    name, "' another seed"));
  }
  states_[name] = seeded(seed);
  seeds_[seed] = name;
}

RNGStatesTracker::ForkGuard::ForkGuard(RNGStatesTracker* tracker, std::string name)
    : tracker_(tracker), name_(std::move(name)) {
  tracker_->enter(name_);
}

RNGStatesTracker::ForkGuard::ForkGuard(ForkGuard&& other) noexcept
    : tracker_(other.tracker_), name_(std::move(other.name_)) {
  other.tracker_ = nullptr;
}

RNGStatesTracker::ForkGuard::~ForkGuard() {
  if (tracker_ != nullptr) tracker_->leave(name_);
}

RNGStatesTracker::ForkGuard RNGStatesTracker::fork(const std::string& name) {
  if (!states_.count(name)) {
    std::string known;
    for (const auto& [n, s] : states_) known += (known.empty() ? "" : ", ") + n;
    throw Error(str("RNG tracker: no state named '", name, "' (known: ",
                    known.empty() ? "none" : known,
                    "); add() it first, e.g. through model_parallel_manual_seed"));
  }
  return ForkGuard(this, name);
}

void RNGStatesTracker::enter(const std::string& name) {
  GeneratorStates now = capture_default_generators();
  if (active_.empty()) {
    outside_ = now;
  } else {
    states_[active_.back()] = now;  // keep the progress of the enclosing fork
  }
  set_default_generators(states_.at(name));
  active_.push_back(name);
}

void RNGStatesTracker::leave(const std::string& name) {
  REMAT_CHECK(!active_.empty() && active_.back() == name,
              "RNG tracker: forks must end in the reverse order they began");
  states_[name] = capture_default_generators();
  active_.pop_back();
  set_default_generators(active_.empty() ? outside_ : states_.at(active_.back()));
}

std::map<std::string, GeneratorStates> RNGStatesTracker::get_states() const {
  MemoryCategoryScope category(MemoryCategory::kOther);  // as capture_default_generators
  auto copy = states_;
  // The state of a fork in progress lives in the default generators.
  if (!active_.empty()) copy[active_.back()] = capture_default_generators();
  for (auto& [name, s] : copy) {
    s.cpu = s.cpu.defined() ? s.cpu.clone() : s.cpu;
    s.cuda = s.cuda.defined() ? s.cuda.clone() : s.cuda;
  }
  return copy;
}

void RNGStatesTracker::set_states(const std::map<std::string, GeneratorStates>& states) {
  REMAT_CHECK(active_.empty(), "RNG tracker: set_states() inside a fork (of '",
              active_.empty() ? "" : active_.back(), "'); call it outside every fork");
  states_ = states;
  // Seeds are not part of a saved state; forget them so add() checks names only.
  seeds_.clear();
}

void RNGStatesTracker::reset() {
  REMAT_CHECK(active_.empty(), "RNG tracker: reset() inside a fork; call it outside every fork");
  states_.clear();
  seeds_.clear();
}

RNGStatesTracker& get_rng_tracker() { return Context::current().get<RNGStatesTracker>(); }

void model_parallel_manual_seed(uint64_t seed, int tp_rank) {
  REMAT_CHECK_GE(tp_rank, 0, "model_parallel_manual_seed: tensor-parallel rank");
  at::manual_seed(seed);
  auto& tracker = get_rng_tracker();
  tracker.reset();
  tracker.add(kModelParallelRng, seed + kModelParallelSeedOffset + static_cast<uint64_t>(tp_rank));
}

void model_parallel_manual_seed(uint64_t seed, const ParallelLayout& layout) {
  model_parallel_manual_seed(seed, layout.tp_rank());
}

RngSnapshot capture_rng() { return {capture_default_generators(), get_rng_tracker().get_states()}; }

void restore_rng(const RngSnapshot& snapshot) {
  set_default_generators(snapshot.defaults);
  auto& tracker = get_rng_tracker();
  auto states = snapshot.tracker;
  // States drop_unchanged left out stay as they are now.
  bool partial = false;
  const bool cuda = cuda_available();
  for (const auto& [name, s] : states) partial = partial || !s.cpu.defined() || (cuda && !s.cuda.defined());
  if (partial) {
    const auto now = tracker.get_states();
    for (auto& [name, s] : states) {
      auto current = now.find(name);
      if (current == now.end()) continue;
      if (!s.cpu.defined()) s.cpu = current->second.cpu;
      if (!s.cuda.defined()) s.cuda = current->second.cuda;
    }
  }
  tracker.set_states(states);
}

void drop_unchanged(RngSnapshot& snapshot) {
  const RngSnapshot now = capture_rng();
  auto same = [](const at::Tensor& a, const at::Tensor& b) {
    return a.defined() && b.defined() && a.sizes() == b.sizes() && at::equal(a, b);
  };
  if (same(snapshot.defaults.cpu, now.defaults.cpu)) snapshot.defaults.cpu = at::Tensor();
  if (same(snapshot.defaults.cuda, now.defaults.cuda)) snapshot.defaults.cuda = at::Tensor();
  // Tracker states keep their names (a fork needs the name to exist).
  for (auto& [name, s] : snapshot.tracker) {
    auto current = now.tracker.find(name);
    if (current == now.tracker.end()) continue;
    if (same(s.cpu, current->second.cpu)) s.cpu = at::Tensor();
    if (same(s.cuda, current->second.cuda)) s.cuda = at::Tensor();
  }
}

}  // namespace remat
