// The mpi backend's host staging (how it carries CUDA tensors), tested on CPU
// tensors with staging forced: every collective and point-to-point call gives
// the same bits staged as unstaged, through offset and strided views, at zero
// size, for float and integer dtypes, and for async work waited out of order.
// Run under mpirun at world sizes 2 and 3.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/internal/mpi_communicator.h"
#include "runtime/internal/nccl_communicator.h"
#include "runtime/runtime.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

internal::MpiCommunicator& comm() {
  static auto mpi = std::dynamic_pointer_cast<internal::MpiCommunicator>(Runtime::init().world(Backend::kMpi));
  return *mpi;
}

// Rank-dependent values that no sum of small integers reproduces by chance.
at::Tensor values(at::IntArrayRef shape, at::ScalarType dtype, int salt) {
  at::Tensor t = at::arange(c10::multiply_integers(shape), at::kDouble).add(7 * comm().rank() + salt);
  if (at::isFloatingType(dtype)) return t.mul(0.37).sin().to(dtype).view(shape);
  if (dtype == at::kBool) return t.remainder(3).eq(comm().rank() % 3).view(shape);
  return t.remainder(dtype == at::kByte ? 50 : 1000).to(dtype).view(shape);
}

// The tensors a case leaves behind (outputs, and the bases of the views it wrote).
using Case = std::function<std::vector<at::Tensor>()>;

// Runs `c` unstaged and staged; every result must be bitwise the same, and the
// staged run must have gone through host buffers.
void expect_same_staged(const std::string& name, const Case& c) {
  const int64_t before = comm().stagedBytes();
  std::vector<at::Tensor> plain = c();
  EXPECT_EQ(comm().stagedBytes(), before) << name << ": staged though not forced";
  comm().stageCpuTensorsForTesting(true);
  std::vector<at::Tensor> staged;
  try {
    staged = c();
  } catch (...) {
    comm().stageCpuTensorsForTesting(false);
    throw;
  }
  comm().stageCpuTensorsForTesting(false);
  int64_t numel = 0;
  for (const auto& t : plain) numel += t.numel();
  if (numel > 0) {
    EXPECT_GT(comm().stagedBytes(), before) << name << ": not staged";
  }
  ASSERT_EQ(plain.size(), staged.size()) << name;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(plain[i].scalar_type(), staged[i].scalar_type()) << name << " result " << i;
    EXPECT_TRUE(at::equal(plain[i], staged[i])) << name << " result " << i << "\nunstaged " << plain[i]
                                                << "\nstaged " << staged[i];
  }
}

const std::vector<at::ScalarType> kTypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong, at::kByte};

TEST(Staging, AllReduceThroughViewsEveryDtype) {
  for (auto dtype : kTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
      const std::string name = str("allReduce ", c10::toString(dtype), " ", to_string(op));
      expect_same_staged(name + " contiguous", [&] {
        at::Tensor t = values({4099}, dtype, 0);
        comm().allReduce(t, {op})->wait();
        return std::vector<at::Tensor>{t};
      });
      expect_same_staged(name + " strided and offset", [&] {
        at::Tensor base = values({6, 8}, dtype, 1);
        at::Tensor view = base.narrow(0, 1, 4).slice(1, 1, 8, 3);  // offset, every third column
        comm().allReduce(view, {op})->wait();
        at::Tensor transposed = values({5, 3}, dtype, 2);
        at::Tensor t = transposed.t();
        comm().allReduce(t, {op})->wait();
        return std::vector<at::Tensor>{base, transposed};
      });
    }
  }
  expect_same_staged("allReduce bool any and zero size", [] {
    at::Tensor any = values({9}, at::kBool, 0), empty = at::empty({0, 4});
    comm().allReduce(any)->wait();
    comm().allReduce(empty)->wait();
    return std::vector<at::Tensor>{any, empty};
  });
}

TEST(Staging, StagedAllReduceHasTheClosedFormResult) {
  const int n = comm().size(), r = comm().rank();
  comm().stageCpuTensorsForTesting(true);
  at::Tensor t = at::full({7}, r + 1, at::kLong).slice(0, 0, 7, 2);
  comm().allReduce(t)->wait();
  comm().stageCpuTensorsForTesting(false);
  EXPECT_TRUE(at::equal(t, at::full({4}, n * (n + 1) / 2, at::kLong)));
}

TEST(Staging, AllGatherFlatAndList) {
  const int n = comm().size(), r = comm().rank();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kBool}) {
    expect_same_staged(str("allGather flat ", c10::toString(dtype)), [&] {
      at::Tensor in_base = values({3, 10}, dtype, 3);
      at::Tensor in = in_base.slice(1, 2, 10, 2);  // 3 x 4, strided
      at::Tensor out_base = values({2 * n * 12 + 5}, dtype, 4);
      at::Tensor out = out_base.narrow(0, 5, 2 * n * 12).slice(0, 0, 2 * n * 12, 2);
      comm().allGather(out, in)->wait();
      at::Tensor empty_out = at::empty({0}, at::TensorOptions().dtype(dtype));
      comm().allGather(empty_out, at::empty({0}, at::TensorOptions().dtype(dtype)))->wait();
      return std::vector<at::Tensor>{out_base, in_base, empty_out};
    });
  }
  expect_same_staged("allGather list, uneven and zero-size", [&] {
    at::Tensor in = values({r, 3}, at::kInt, 5);  // rank 0 sends nothing
    std::vector<at::Tensor> outs;
    at::Tensor base = at::zeros({n, 2 * n, 3}, at::kInt);
    for (int q = 0; q < n; ++q) outs.push_back(base[q].narrow(0, 1, q));  // offset views
    comm().allGather(outs, in)->wait();
    return std::vector<at::Tensor>{base};
  });
}

TEST(Staging, ReduceScatterAndBroadcast) {
  const int n = comm().size();
  for (auto dtype : {at::kFloat, at::kHalf, at::kInt, at::kLong}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
      expect_same_staged(str("reduceScatter ", c10::toString(dtype), " ", to_string(op)), [&] {
        at::Tensor in = values({5, 2 * n}, dtype, 6).t();  // 2n x 5, non-contiguous
        at::Tensor out_base = values({3, 5}, dtype, 7);
        at::Tensor out = out_base.narrow(0, 1, 2);  // offset view, 2 x 5
        comm().reduceScatter(out, in, {op})->wait();
        return std::vector<at::Tensor>{out_base};
      });
    }
  }
  for (int root = 0; root < n; ++root) {
    expect_same_staged(str("broadcast from ", root), [&] {
      at::Tensor base = values({4, 6}, at::kDouble, 8);
      at::Tensor view = base.slice(1, 1, 6, 2);
      comm().broadcast(view, {root})->wait();
      at::Tensor ints = values({11}, at::kByte, 9), empty = at::empty({0}, at::kLong);
      comm().broadcast(ints, {root})->wait();
      comm().broadcast(empty, {root})->wait();
      return std::vector<at::Tensor>{base, ints, empty};
    });
  }
}

TEST(Staging, SendRecvRing) {
  const int n = comm().size(), r = comm().rank();
  expect_same_staged("send and recv around the ring", [&] {
    at::Tensor out = values({4, 5}, at::kFloat, 10).t();
    at::Tensor base = at::zeros({8, 5}, at::kFloat);
    at::Tensor in = base.slice(0, 1, 8, 2).t();  // 5 x 4, strided
    auto sent = comm().send(out, (r + 1) % n, {3});
    auto got = comm().recv(in, (r + n - 1) % n, {3});
    got->wait();
    sent->wait();
    return std::vector<at::Tensor>{base};
  });
}

// Started in one order, waited in the reverse: each result is written back
// when its own work completes.
TEST(Staging, AsyncWorkWaitedOutOfOrder) {
  const int n = comm().size();
  expect_same_staged("async, waited in reverse", [&] {
    at::Tensor a = values({33}, at::kFloat, 11);
    at::Tensor in = values({6}, at::kLong, 12), gathered = at::empty({6 * n}, at::kLong);
    at::Tensor rs_in = values({2 * n, 3}, at::kDouble, 13), rs_out = at::empty({2, 3}, at::kDouble);
    at::Tensor b = values({3, 4}, at::kInt, 14).t();
    std::vector<std::shared_ptr<Work>> works = {comm().allReduce(a), comm().allGather(gathered, in),
                                                comm().reduceScatter(rs_out, rs_in), comm().broadcast(b, {n - 1})};
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    return std::vector<at::Tensor>{a, gathered, rs_out, b.contiguous()};
  });
}

// What `auto` picks on a machine without GPUs; explicit nccl there is refused.
TEST(BackendAuto, PicksMpiWithoutAGpu) {
  if (internal::nccl_available()) GTEST_SKIP() << "this machine has a GPU: the choice is tested in runtime_unit_test";
  EXPECT_EQ(Runtime::init().world(Backend::kAuto)->backendName(), "mpi");
  EXPECT_THAT(error_of<Error>([] { Runtime::init().world(Backend::kNccl); }), HasSubstr("nccl backend"));
}

}  // namespace
}  // namespace remat
