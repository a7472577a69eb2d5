// main() for gtest binaries run under mpirun.
//
// Rank 0 prints gtest's usual output; other ranks print only their failures,
// tagged with the rank. After each case the ranks agree on pass/fail, so the
// summary counts a case failed if any rank failed it.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "runtime/runtime.h"
#include "tests/summary.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  // Bazel's premature-exit file is one path for all ranks: only rank 0 keeps
  // it, or the ranks race to delete it and print errors into rank 0's summary.
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (rank != nullptr && std::string(rank) != "0") unsetenv("TEST_PREMATURE_EXIT_FILE");
  ::testing::InitGoogleTest(&argc, argv);
  return remat::run_main([&] {
    auto& runtime = remat::Runtime::init();
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (runtime.rank() != 0) {
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(runtime.rank()));
    }
    auto* summary = new remat::testing::SummaryListener(
        [](bool failed) {
          int mine = failed ? 1 : 0, any = 0;
          MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
          return any != 0;
        },
        /*print=*/runtime.rank() == 0);
    listeners.Append(summary);
    int rc = RUN_ALL_TESTS();
    return rc != 0 || summary->failed() > 0 ? 1 : 0;
  });
}
