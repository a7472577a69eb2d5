#include "tests/summary.h"

#include <cstdio>

namespace remat::testing {

void SummaryListener::OnTestEnd(const ::testing::TestInfo& info) {
  bool failed = combine_(info.result()->Failed());
  (failed ? failed_ : passed_) += 1;
}

void SummaryListener::OnTestProgramEnd(const ::testing::UnitTest&) {
  if (!print_) return;
  std::printf("[remat-test] %d passed, %d failed\n", passed_, failed_);
  std::fflush(stdout);
}

}  // namespace remat::testing
