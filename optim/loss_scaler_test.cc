// The loss scaler's arithmetic against DeepSpeed's documented behaviour
// (docs/_pages/config-json.md "FP16 training options" and its DynamicLossScaler):
// each table is a sequence of steps, overflowed or clean, with the scale the
// step used, whether it was skipped and the scale of the next step, worked
// out by hand from those rules.
#include "optim/loss_scaler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::optim {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

struct Row {
  bool overflow;
  double used, next;  // the step's scale and the next step's; skip == overflow
};

void expect_sequence(LossScaler& scaler, const std::vector<Row>& rows) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto u = scaler.update(rows[i].overflow);
    EXPECT_EQ(u.skip, rows[i].overflow) << "step " << i;
    EXPECT_EQ(u.used_scale, rows[i].used) << "step " << i;
    EXPECT_EQ(u.next_scale, rows[i].next) << "step " << i;
    EXPECT_EQ(scaler.scale(), rows[i].next) << "step " << i;
  }
}

LossScalerOptions dynamic(int power, int64_t window, int hysteresis, bool consecutive = false, double min = 1) {
  LossScalerOptions o;
  o.initial_scale_power = power;
  o.loss_scale_window = window;
  o.hysteresis = hysteresis;
  o.consecutive_hysteresis = consecutive;
  o.min_loss_scale = min;
  return o;
}

TEST(LossScaler, DefaultsAreDeepSpeeds) {
  const LossScalerOptions o;
  EXPECT_TRUE(o.dynamic());
  EXPECT_EQ(o.initial_scale_power, 16);
  EXPECT_EQ(o.loss_scale_window, 1000);
  EXPECT_EQ(o.hysteresis, 2);
  EXPECT_FALSE(o.consecutive_hysteresis);
  EXPECT_EQ(o.min_loss_scale, 1);
  LossScaler scaler(o);
  EXPECT_EQ(scaler.scale(), 65536);
  // The first doubling: the clean step after 1000 clean steps.
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(scaler.update(false).next_scale, 65536) << i;
  EXPECT_EQ(scaler.update(false).next_scale, 131072);
  EXPECT_EQ(scaler.state().overflows, 0);
}

// Hysteresis 2 without consecutive_hysteresis: the first overflow is
// tolerated; once used, every overflow halves until a doubling refills it,
// clean steps between them or not.
TEST(LossScaler, HysteresisIsRefilledByDoublingsOnly) {
  LossScaler scaler(dynamic(4, 2, 2));
  EXPECT_EQ(scaler.scale(), 16);
  expect_sequence(scaler, {{false, 16, 16},
                           {false, 16, 16},
                           {false, 16, 32},  // two clean steps before it: doubled
                           {true, 32, 32},   // tolerated (hysteresis 2 -> 1)
                           {true, 32, 16},   // halved
                           {true, 16, 8},    // halved again: nothing refilled it
                           {false, 8, 8},
                           {false, 8, 8},
                           {false, 8, 16},  // doubled, the tolerance refilled
                           {true, 16, 16},  // tolerated
                           {false, 16, 16},
                           {true, 16, 8}});  // halved: a clean step does not refill
  EXPECT_EQ(scaler.state().overflows, 5);
  EXPECT_EQ(scaler.state().iteration, 12);
  EXPECT_EQ(scaler.state().last_overflow, 11);
}

// consecutive_hysteresis: every clean step refills the tolerance, so only
// `hysteresis` overflows in a row halve the scale.
TEST(LossScaler, ConsecutiveHysteresisHalvesOnlyConsecutiveOverflows) {
  LossScaler scaler(dynamic(4, 2, 2, /*consecutive=*/true));
  expect_sequence(scaler, {{false, 16, 16},
                           {false, 16, 16},
                           {false, 16, 32},
                           {true, 32, 32},   // tolerated
                           {false, 32, 32},  // refilled
                           {true, 32, 32},   // tolerated again
                           {true, 32, 16},   // two in a row: halved
                           {false, 16, 16},
                           {false, 16, 16},
                           {false, 16, 32}});  // two clean steps since the overflow: doubled
  EXPECT_EQ(scaler.state().overflows, 3);
}

// Hysteresis 1 halves at every overflow, never below min_loss_scale; an
// overflow at the floor is an error naming the key to change.
TEST(LossScaler, MinLossScaleIsTheFloorAndAnOverflowThereStops) {
  LossScaler scaler(dynamic(2, 1000, 1));
  expect_sequence(scaler, {{true, 4, 2}, {true, 2, 1}});
  const LossScalerState before = scaler.state();
  EXPECT_THAT(error_of<Error>([&] { scaler.update(true); }),
              HasSubstr("overflowed at the loss scale's floor (fp16.min_loss_scale = 1)"));
  EXPECT_EQ(scaler.state(), before);  // nothing recorded

  // A floor that is not a power of two: the halving stops at it.
  LossScaler odd(dynamic(2, 1000, 1, false, 3));
  expect_sequence(odd, {{true, 4, 3}, {false, 3, 3}});
  EXPECT_THAT(error_of<Error>([&] { odd.update(true); }), HasSubstr("fp16.min_loss_scale = 3"));
  // With hysteresis, the floor stops only once the tolerance is used up.
  LossScaler tolerant(dynamic(0, 1000, 2));
  expect_sequence(tolerant, {{true, 1, 1}});
  EXPECT_THROW(tolerant.update(true), Error);
}

// A static scale never changes; an overflow still skips its step.
TEST(LossScaler, StaticScaleSkipsOverflowsAndNeverChanges) {
  LossScalerOptions o = dynamic(16, 1, 1);
  o.loss_scale = 128;
  LossScaler scaler(o);
  EXPECT_FALSE(o.dynamic());
  expect_sequence(scaler, {{false, 128, 128}, {false, 128, 128}, {false, 128, 128}, {true, 128, 128},
                           {true, 128, 128}, {true, 128, 128}, {false, 128, 128}});
  EXPECT_EQ(scaler.state().overflows, 3);
}

// A state loaded into a fresh scaler continues bitwise as the uninterrupted one.
TEST(LossScaler, LoadedStateContinuesTheSequence) {
  const std::vector<bool> overflows = {false, false, false, true, true, false, false, false, true, false, false};
  LossScaler whole(dynamic(4, 2, 2));
  LossScaler first(dynamic(4, 2, 2)), second(dynamic(4, 2, 2));
  for (size_t i = 0; i < overflows.size(); ++i) {
    const auto a = whole.update(overflows[i]);
    if (i == 5) second.load_state(first.state());
    const auto b = (i < 5 ? first : second).update(overflows[i]);
    EXPECT_EQ(a.used_scale, b.used_scale) << i;
    EXPECT_EQ(a.next_scale, b.next_scale) << i;
  }
  EXPECT_EQ(second.state(), whole.state());

  LossScalerState bad = whole.state();
  bad.scale = 0;
  EXPECT_THAT(error_of<ConfigError>([&] { second.load_state(bad); }), HasSubstr("its scale is 0"));
  bad = whole.state();
  bad.last_overflow = bad.iteration;
  EXPECT_THAT(error_of<ConfigError>([&] { second.load_state(bad); }), HasSubstr("inconsistent"));
}

TEST(LossScaler, OptionsNameEveryBrokenKey) {
  LossScalerOptions o;
  o.loss_scale = -1;
  o.initial_scale_power = 200;
  o.loss_scale_window = 0;
  o.hysteresis = 0;
  o.min_loss_scale = 0;
  const std::string problems = check_loss_scaler_options(o);
  for (const char* key : {"'fp16.loss_scale' = -1", "'fp16.initial_scale_power' = 200",
                          "'fp16.loss_scale_window' = 0", "'fp16.hysteresis' = 0", "'fp16.min_loss_scale' = 0"}) {
    EXPECT_THAT(problems, HasSubstr(key));
  }
  EXPECT_THAT(error_of<ConfigError>([&] { LossScaler s(o); }), HasSubstr("'fp16.hysteresis' = 0"));
  EXPECT_EQ(check_loss_scaler_options(LossScalerOptions{}), "");
}

}  // namespace
}  // namespace remat::optim
