// main() for single-process gtest binaries.
#include <gtest/gtest.h>

#include "tests/summary.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto* summary = new remat::testing::SummaryListener([](bool failed) { return failed; });
  ::testing::UnitTest::GetInstance()->listeners().Append(summary);
  int rc = RUN_ALL_TESTS();
  return rc != 0 || summary->failed() > 0 ? 1 : 0;
}
