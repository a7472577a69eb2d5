// What the planner's messages share (checkpointing/plan.cc defines them): the
// solver's error for a budget no plan meets, which the driver
// (checkpointing/planner.cc) raises too, and the MiB both print.
#pragma once

#include <cstdint>
#include <string>

namespace remat {

struct BlockCosts;

namespace internal {

// `bytes` in MiB with two decimals: "1.25 MiB".
std::string mib(int64_t bytes);

// The error for a budget no plan meets: the smallest one any plan meets, and
// what to change. `offloading`: every forward runs in an activation
// offloading scope (activation_offloading.enabled), which is then the cause.
[[noreturn]] void throw_budget_unmet(const BlockCosts& costs, int64_t budget, bool offloading);

}  // namespace internal
}  // namespace remat
