// The mpi backend's host staging (how it carries CUDA tensors), tested on CPU
// tensors with staging forced: every collective and point-to-point call gives
// the same bits staged as unstaged, through offset and strided views, at zero
// size, for float and integer dtypes, and for async work waited out of order.
// Where CUDA is available, every case runs on CUDA tensors too (staged through
// pinned memory, the ranks sharing the GPUs) and must give the same bits.
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

// Rank-dependent values that no sum of small integers reproduces by chance,
// computed on the CPU (the same bits for every device), then moved to `d`.
at::Tensor values(at::IntArrayRef shape, at::ScalarType dtype, int salt, at::Device d) {
  at::Tensor t = at::arange(c10::multiply_integers(shape), at::kDouble).add(7 * comm().rank() + salt);
  if (at::isFloatingType(dtype)) {
    t = t.mul(0.37).sin().to(dtype);
  } else if (dtype == at::kBool) {
    t = t.remainder(3).eq(comm().rank() % 3);
  } else {
    t = t.remainder(dtype == at::kByte ? 50 : 1000).to(dtype);
  }
  return t.view(shape).to(d);
}

at::TensorOptions on(at::ScalarType dtype, at::Device d) { return at::TensorOptions().dtype(dtype).device(d); }

// The tensors a case leaves behind (outputs, and the bases of the views it
// wrote), its tensors made on `device`.
using Case = std::function<std::vector<at::Tensor>(at::Device device)>;

bool cuda_here() { return at::hasCUDA(); }

void expect_bitwise(const std::string& name, const std::vector<at::Tensor>& want,
                    const std::vector<at::Tensor>& got) {
  ASSERT_EQ(want.size(), got.size()) << name;
  for (size_t i = 0; i < want.size(); ++i) {
    at::Tensor g = got[i].cpu();
    EXPECT_EQ(want[i].scalar_type(), g.scalar_type()) << name << " result " << i;
    EXPECT_TRUE(at::equal(want[i], g)) << name << " result " << i << "\nunstaged " << want[i] << "\nstaged " << g;
  }
}

// Runs `c` on CPU tensors unstaged, then staged (forced), then on CUDA
// tensors where there are any; every result must be bitwise the same, and the
// staged runs must have gone through host buffers.
void expect_same_staged(const std::string& name, const Case& c) {
  const at::Device cpu(at::kCPU);
  int64_t before = comm().stagedBytes();
  std::vector<at::Tensor> plain = c(cpu);
  EXPECT_EQ(comm().stagedBytes(), before) << name << ": staged though not forced";
  int64_t numel = 0;
  for (const auto& t : plain) numel += t.numel();
  comm().stageCpuTensorsForTesting(true);
  std::vector<at::Tensor> staged;
  try {
    staged = c(cpu);
  } catch (...) {
    comm().stageCpuTensorsForTesting(false);
    throw;
  }
  comm().stageCpuTensorsForTesting(false);
  if (numel > 0) {
    EXPECT_GT(comm().stagedBytes(), before) << name << ": not staged";
  }
  expect_bitwise(name, plain, staged);
  if (!cuda_here()) return;
  before = comm().stagedBytes();
  std::vector<at::Tensor> on_gpu = c(at::Device(at::kCUDA));
  for (const auto& t : on_gpu) EXPECT_TRUE(t.is_cuda()) << name << ": a result left the GPU";
  if (numel > 0) {
    EXPECT_GT(comm().stagedBytes(), before) << name << " on CUDA: not staged";
  }
  expect_bitwise(name + " on CUDA", plain, on_gpu);
}

const std::vector<at::ScalarType> kTypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong, at::kByte};

TEST(Staging, AllReduceThroughViewsEveryDtype) {
  for (auto dtype : kTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
      const std::string name = str("allReduce ", c10::toString(dtype), " ", to_string(op));
      expect_same_staged(name + " contiguous", [&](at::Device d) {
        at::Tensor t = values({4099}, dtype, 0, d);
        comm().allReduce(t, {op})->wait();
        return std::vector<at::Tensor>{t};
      });
      expect_same_staged(name + " strided and offset", [&](at::Device d) {
        at::Tensor base = values({6, 8}, dtype, 1, d);
        at::Tensor view = base.narrow(0, 1, 4).slice(1, 1, 8, 3);  // offset, every third column
        comm().allReduce(view, {op})->wait();
        at::Tensor transposed = values({5, 3}, dtype, 2, d);
        at::Tensor t = transposed.t();
        comm().allReduce(t, {op})->wait();
        return std::vector<at::Tensor>{base, transposed};
      });
    }
  }
  expect_same_staged("allReduce bool any and zero size", [](at::Device d) {
    at::Tensor any = values({9}, at::kBool, 0, d), empty = at::empty({0, 4}, on(at::kFloat, d));
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
    expect_same_staged(str("allGather flat ", c10::toString(dtype)), [&](at::Device d) {
      at::Tensor in_base = values({3, 10}, dtype, 3, d);
      at::Tensor in = in_base.slice(1, 2, 10, 2);  // 3 x 4, strided
      at::Tensor out_base = values({2 * n * 12 + 5}, dtype, 4, d);
      at::Tensor out = out_base.narrow(0, 5, 2 * n * 12).slice(0, 0, 2 * n * 12, 2);
      comm().allGather(out, in)->wait();
      at::Tensor empty_out = at::empty({0}, on(dtype, d));
      comm().allGather(empty_out, at::empty({0}, on(dtype, d)))->wait();
      return std::vector<at::Tensor>{out_base, in_base, empty_out};
    });
  }
  expect_same_staged("allGather list, uneven and zero-size", [&](at::Device d) {
    at::Tensor in = values({r, 3}, at::kInt, 5, d);  // rank 0 sends nothing
    std::vector<at::Tensor> outs;
    at::Tensor base = at::zeros({n, 2 * n, 3}, on(at::kInt, d));
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
      expect_same_staged(str("reduceScatter ", c10::toString(dtype), " ", to_string(op)), [&](at::Device d) {
        at::Tensor in = values({5, 2 * n}, dtype, 6, d).t();  // 2n x 5, non-contiguous
        at::Tensor out_base = values({3, 5}, dtype, 7, d);
        at::Tensor out = out_base.narrow(0, 1, 2);  // offset view, 2 x 5
        comm().reduceScatter(out, in, {op})->wait();
        return std::vector<at::Tensor>{out_base};
      });
    }
  }
  for (int root = 0; root < n; ++root) {
    expect_same_staged(str("broadcast from ", root), [&](at::Device d) {
      at::Tensor base = values({4, 6}, at::kDouble, 8, d);
      at::Tensor view = base.slice(1, 1, 6, 2);
      comm().broadcast(view, {root})->wait();
      at::Tensor ints = values({11}, at::kByte, 9, d), empty = at::empty({0}, on(at::kLong, d));
      comm().broadcast(ints, {root})->wait();
      comm().broadcast(empty, {root})->wait();
      return std::vector<at::Tensor>{base, ints, empty};
    });
  }
}

TEST(Staging, SendRecvRing) {
  const int n = comm().size(), r = comm().rank();
  expect_same_staged("send and recv around the ring", [&](at::Device d) {
    at::Tensor out = values({4, 5}, at::kFloat, 10, d).t();
    at::Tensor base = at::zeros({8, 5}, on(at::kFloat, d));
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
  expect_same_staged("async, waited in reverse", [&](at::Device d) {
    at::Tensor a = values({33}, at::kFloat, 11, d);
    at::Tensor in = values({6}, at::kLong, 12, d), gathered = at::empty({6 * n}, on(at::kLong, d));
    at::Tensor rs_in = values({2 * n, 3}, at::kDouble, 13, d), rs_out = at::empty({2, 3}, on(at::kDouble, d));
    at::Tensor b = values({3, 4}, at::kInt, 14, d).t();
    std::vector<std::shared_ptr<Work>> works = {comm().allReduce(a), comm().allGather(gathered, in),
                                                comm().reduceScatter(rs_out, rs_in), comm().broadcast(b, {n - 1})};
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    return std::vector<at::Tensor>{a, gathered, rs_out, b.contiguous()};
  });
}

// Only where CUDA exists can a call mix devices; on CPU the plan's check is
// unit-tested on device names (runtime_unit_test).
TEST(Staging, MixedDevicesAreRefusedNamingBoth) {
  if (!cuda_here()) GTEST_SKIP() << "needs CUDA";
  const at::Device cuda(at::kCUDA);
  at::Tensor out = at::empty({2 * comm().size()}, on(at::kFloat, cuda)), in = at::ones({2});
  EXPECT_THAT(error_of<CommError>([&] { comm().allGather(out, in); }),
              HasSubstr(str("allGather: the tensors of one call must be on one device, got ", out.device().str(),
                            " (tensor 0) and cpu (tensor 1)")));
  at::Tensor t = at::ones({3}, on(at::kFloat, cuda));
  comm().allReduce(t)->wait();  // still in step: the refused call sent nothing
  EXPECT_TRUE(at::equal(t.cpu(), at::full({3}, comm().size(), at::kFloat)));
}

// What `auto` picks: mpi without GPUs, and on one node with GPUs nccl only
// where there is one per rank; explicit nccl where it does not fit is refused.
TEST(BackendAuto, PicksNcclOnlyWithAGpuPerRank) {
  const ProcessEnv& env = Runtime::init().env();
  bool gpu_each = false;
  if (internal::nccl_available()) {
    if (!cuda_here()) GTEST_SKIP() << "GPUs, but a CPU-only LibTorch: cannot count them here";
    gpu_each = env.local_world_size <= static_cast<int>(at::getNumGPUs());  // one node
  }
  EXPECT_EQ(Runtime::init().world(Backend::kAuto)->backendName(), gpu_each ? "nccl" : "mpi");
  if (!gpu_each) {
    EXPECT_THAT(error_of<Error>([] { Runtime::init().world(Backend::kNccl); }), HasSubstr("nccl backend"));
  }
}

}  // namespace
}  // namespace remat
