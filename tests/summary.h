// Test-case accounting shared by remat's gtest mains.
//
// Each test binary ends with one line "[remat-test] N passed, M failed" that
// ./test.sh adds up across targets. Under mpirun a case passes only if it
// passed on every rank, and only rank 0 prints the line.
#pragma once

#include <gtest/gtest.h>

#include <functional>

namespace remat::testing {

// Counts finished cases. `combine` turns this rank's "failed" flag into the
// job's (identity for one process, an MPI all-reduce under mpirun).
class SummaryListener : public ::testing::EmptyTestEventListener {
 public:
  explicit SummaryListener(std::function<bool(bool)> combine, bool print = true)
      : combine_(std::move(combine)), print_(print) {}

  void OnTestEnd(const ::testing::TestInfo& info) override;
  void OnTestProgramEnd(const ::testing::UnitTest& unit) override;

  int passed() const { return passed_; }
  int failed() const { return failed_; }

 private:
  std::function<bool(bool)> combine_;
  bool print_;
  int passed_ = 0;
  int failed_ = 0;
};

}  // namespace remat::testing
