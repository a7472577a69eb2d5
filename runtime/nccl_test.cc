// NCCL backend tests (tagged gpu): run where a GPU and a CUDA LibTorch exist.
// One GPU allows one NCCL rank, so these run at world size 1 there; the
// closed forms hold at any size.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/error.h"
#include "runtime/internal/mpi_communicator.h"
#include "runtime/internal/nccl_communicator.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

std::shared_ptr<Communicator> nccl_world() {
  Runtime::init();
  if (!internal::nccl_available() || !at::hasCUDA()) {
    throw Error("no CUDA device (or a CPU-only LibTorch): run the gpu-tagged tests on a GPU");
  }
  return internal::make_nccl_communicator(internal::MpiCommunicator::world());
}

TEST(Nccl, CollectivesGiveClosedFormResults) {
  auto comm = nccl_world();
  const int n = comm->size(), r = comm->rank();
  auto cuda = at::TensorOptions().device(at::kCUDA);
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
    at::Tensor t = at::full({1023}, r + 1, cuda.dtype(dtype));
    comm->allReduce(t)->wait();
    EXPECT_TRUE(at::equal(t.cpu(), at::full({1023}, n * (n + 1) / 2, at::TensorOptions().dtype(dtype))))
        << c10::toString(dtype);
  }
  at::Tensor avg = at::full({8}, 2.0 * r, cuda.dtype(at::kFloat));
  comm->allReduce(avg, {ReduceOp::kAvg})->wait();
  EXPECT_TRUE(at::equal(avg.cpu(), at::full({8}, n - 1.0)));

  at::Tensor in = at::full({5}, r, cuda.dtype(at::kFloat)), out = at::empty({5 * n}, in.options());
  comm->allGather(out, in)->wait();
  EXPECT_TRUE(at::equal(out.cpu(), at::arange(n, at::kFloat).repeat_interleave(5)));

  std::vector<at::Tensor> outs;
  for (int q = 0; q < n; ++q) outs.push_back(at::empty({q + 1}, in.options()));
  at::Tensor mine = at::full({r + 1}, r, in.options());
  comm->allGather(outs, mine)->wait();
  for (int q = 0; q < n; ++q) EXPECT_TRUE(at::equal(outs[q].cpu(), at::full({q + 1}, q, at::kFloat)));

  at::Tensor big = at::full({3 * n}, r + 1, in.options()), part = at::empty({3}, in.options());
  comm->reduceScatter(part, big)->wait();
  EXPECT_TRUE(at::equal(part.cpu(), at::full({3}, n * (n + 1) / 2, at::kFloat)));

  at::Tensor b = at::full({4}, r == 0 ? 7 : 0, in.options());
  comm->broadcast(b)->wait();
  EXPECT_TRUE(at::equal(b.cpu(), at::full({4}, 7, at::kFloat)));
  comm->barrier()->wait();
}

// Host tensors (the engine's agreements, save metadata, CPU scalars) go over
// the MPI communicator NCCL was bootstrapped from; a call mixing host and
// device tensors, and a strided device tensor, are refused.
TEST(Nccl, CarriesHostTensorsOverMpiAndRejectsMixedAndNonContiguousTensors) {
  auto comm = nccl_world();
  const int n = comm->size(), r = comm->rank();
  at::Tensor cpu = at::full({4}, r + 1, at::kLong);
  comm->allReduce(cpu)->wait();
  EXPECT_TRUE(cpu.device().is_cpu());
  EXPECT_TRUE(at::equal(cpu, at::full({4}, n * (n + 1) / 2, at::kLong)));
  at::Tensor host_in = at::full({2}, r, at::kFloat), host_out = at::empty({2 * n}, at::kFloat);
  comm->allGather(host_out, host_in)->wait();
  EXPECT_TRUE(at::equal(host_out, at::arange(n, at::kFloat).repeat_interleave(2)));

  at::Tensor device_out = at::empty({2 * n}, at::TensorOptions().device(at::kCUDA));
  try {
    comm->allGather(device_out, host_in);
    ADD_FAILURE() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("takes CUDA tensors"));
  }
  at::Tensor strided = at::ones({4, 4}, at::TensorOptions().device(at::kCUDA)).t();
  try {
    comm->allReduce(strided);
    ADD_FAILURE() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("needs contiguous tensors"));
  }
}

}  // namespace
}  // namespace remat
