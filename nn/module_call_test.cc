// remat::forward and its hooks: slot order, typed arguments and results
// through the untyped chain, no entry outliving its module, the direct path,
// hooks that apply in every context and know which context set them.
#include "nn/module_call.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <tuple>
#include <vector>

#include "runtime/context.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using remat::testing::error_of;

struct ScaleImpl : torch::nn::Module {
  int calls = 0;
  std::tuple<at::Tensor, int64_t> forward(const at::Tensor& x, int64_t k) {
    ++calls;
    return {x * static_cast<double>(k), k + 1};
  }
};
TORCH_MODULE(Scale);

// Records entering and leaving, and lets the call through.
class Recorder final : public ModuleHook {
 public:
  Recorder(std::string name, std::vector<std::string>* log) : name_(std::move(name)), log_(log) {}
  c10::IValue run(const std::vector<c10::IValue>& args, const IValueFn& next) override {
    log_->push_back(name_ + " in");
    c10::IValue out = next(args);
    log_->push_back(name_ + " out");
    return out;
  }

 private:
  std::string name_;
  std::vector<std::string>* log_;
};

TEST(ModuleCall, HooksRunInSlotOrderAroundTheForwardWithTypedValues) {
  Scale m;
  std::vector<std::string> log;
  // Registered inner first: the slot decides the order, not the registration.
  set_module_hook(*m, HookSlot::kCheckpoint, std::make_shared<Recorder>("checkpoint", &log));
  set_module_hook(*m, HookSlot::kSharding, std::make_shared<Recorder>("sharding", &log));
  at::Tensor x = torch::arange(3, torch::kFloat);
  auto [y, k] = remat::forward(m, x, int64_t{4});
  EXPECT_TRUE(torch::equal(y, x * 4));
  EXPECT_EQ(k, 5);
  EXPECT_EQ(m->calls, 1);
  EXPECT_THAT(log, ElementsAre("sharding in", "checkpoint in", "checkpoint out", "sharding out"));

  set_module_hook(*m, HookSlot::kSharding, nullptr);
  set_module_hook(*m, HookSlot::kCheckpoint, nullptr);
  EXPECT_EQ(internal::g_hooked_modules.load(), 0) << "no hook left: the direct path again";
  log.clear();
  remat::forward(m, x, int64_t{2});
  EXPECT_TRUE(log.empty());
  EXPECT_EQ(m->calls, 2);
}

TEST(ModuleCall, AHookDoesNotOutliveItsModuleEvenAtTheSameAddress) {
  std::vector<std::string> log;
  const torch::nn::Module* old_address = nullptr;
  {
    Scale m;
    old_address = m.get();
    set_module_hook(*m, HookSlot::kCheckpoint, std::make_shared<Recorder>("stale", &log));
    EXPECT_EQ(internal::hooks_of(old_address).size(), 1u);
  }
  // The module is gone: its entry is not applied and is dropped when met.
  EXPECT_TRUE(internal::hooks_of(old_address).empty());
  EXPECT_EQ(internal::g_hooked_modules.load(), 0);
  // New modules of the same type, one of which usually lands at the freed
  // address: none of them runs the old hook.
  std::vector<Scale> fresh;
  bool reused = false;
  for (int i = 0; i < 64 && !reused; ++i) {
    fresh.emplace_back();
    reused = fresh.back().get() == old_address;
    remat::forward(fresh.back(), torch::ones({1}), int64_t{1});
  }
  EXPECT_TRUE(log.empty()) << "a hook of a destroyed module ran"
                           << (reused ? " on a new module at its address" : "");
}

TEST(ModuleCall, OnlyModulesOwnedByASharedPtrTakeHooks) {
  ScaleImpl on_stack;
  auto message = error_of<Error>([&] {
    set_module_hook(on_stack, HookSlot::kCheckpoint, std::make_shared<Recorder>("x", nullptr));
  });
  EXPECT_THAT(message, HasSubstr("owned by a std::shared_ptr"));
  EXPECT_EQ(internal::g_hooked_modules.load(), 0);
}

struct PairImpl : torch::nn::Module {
  PairImpl() {
    first = register_module("first", Scale());
    second = register_module("second", Scale());
  }
  Scale first{nullptr}, second{nullptr};
};
TORCH_MODULE(Pair);

// A hook belongs to its module: it runs for any caller, in the context that
// set it, in another, or with no scope at all. Its slot remembers the
// context that set it, so an engine can see a model another engine drives
// and take off only its own hooks.
TEST(ModuleCall, HooksApplyInEveryContextAndKnowWhichContextSetThem) {
  Pair pair;
  std::vector<std::string> log;
  auto engine_a = Context::create();
  auto engine_b = Context::create();
  {
    ContextScope scope(engine_a);
    set_module_hook(*pair->first, HookSlot::kSharding, std::make_shared<Recorder>("a", &log));
  }
  set_module_hook(*pair->second, HookSlot::kCheckpoint, std::make_shared<Recorder>("default", &log));
  at::Tensor x = torch::ones({2});
  for (const auto& context : {engine_a, engine_b, std::shared_ptr<Context>()}) {
    ContextScope scope(context);
    log.clear();
    remat::forward(pair->first, x, int64_t{2});
    remat::forward(pair->second, x, int64_t{2});
    EXPECT_THAT(log, ElementsAre("a in", "a out", "default in", "default out"));
  }

  EXPECT_EQ(module_hook_owner(*pair->first, HookSlot::kSharding), engine_a);
  EXPECT_EQ(module_hook_owner(*pair->first, HookSlot::kCheckpoint), nullptr) << "an empty slot";
  EXPECT_EQ(module_hook_owner(*pair->second, HookSlot::kCheckpoint), Context::process_default());
  // What b would be refused for, and what a sees of others.
  EXPECT_EQ(hooks_set_elsewhere(*pair, *engine_b), "first (sharding), second (checkpoint)");
  EXPECT_EQ(hooks_set_elsewhere(*pair, *engine_a), "second (checkpoint)");
  EXPECT_EQ(hooks_set_elsewhere(*pair->first, *engine_a), "");

  // a takes off its own hooks only.
  EXPECT_EQ(drop_module_hooks(*engine_a), 1);
  EXPECT_EQ(module_hook(*pair->first, HookSlot::kSharding), nullptr);
  EXPECT_NE(module_hook(*pair->second, HookSlot::kCheckpoint), nullptr);
  EXPECT_EQ(internal::g_hooked_modules.load(), 1) << "first's emptied entry is gone";

  // A hook outlives the context that set it, which then blocks no one.
  {
    auto gone = Context::create();
    ContextScope scope(gone);
    set_module_hook(*pair->first, HookSlot::kSharding, std::make_shared<Recorder>("gone", &log));
  }
  EXPECT_EQ(module_hook_owner(*pair->first, HookSlot::kSharding), nullptr);
  EXPECT_EQ(hooks_set_elsewhere(*pair, *Context::process_default()), "");
  log.clear();
  remat::forward(pair->first, x, int64_t{2});
  EXPECT_THAT(log, ElementsAre("gone in", "gone out"));
  set_module_hook(*pair->first, HookSlot::kSharding, nullptr);
  set_module_hook(*pair->second, HookSlot::kCheckpoint, nullptr);
  EXPECT_EQ(internal::g_hooked_modules.load(), 0);
}

}  // namespace
}  // namespace remat
