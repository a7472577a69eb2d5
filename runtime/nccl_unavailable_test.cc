// Without CUDA at configure time the nccl backend explains its absence.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/error.h"
#include "runtime/internal/mpi_communicator.h"
#include "runtime/internal/nccl_communicator.h"
#include "runtime/runtime.h"

TEST(Nccl, AbsentFromThisBuild) {
  remat::Runtime::init();
  EXPECT_FALSE(remat::internal::nccl_available());
  try {
    remat::internal::make_nccl_communicator(remat::internal::MpiCommunicator::world());
    ADD_FAILURE() << "expected CommError";
  } catch (const remat::CommError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("not in this build"));
  }
}
