// Multi-rank tests of the MPI backend and the layout, run under mpirun at
// world sizes 1, 2, 3 and 4. Rank r fills r (or r + 1); every expectation is
// closed-form in the world size n.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "runtime/error.h"
#include "tests/error_of.h"
#include "runtime/layout.h"
#include "runtime/internal/nccl_communicator.h"
#include "runtime/runtime.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

std::shared_ptr<Communicator> world() { return Runtime::init().world(Backend::kMpi); }

const std::vector<at::ScalarType> kArithmeticTypes = {
    at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong, at::kByte};

// Element counts that catch off-by-one and power-of-two assumptions.
const std::vector<int64_t> kSizes = {1, 7, 4099};

TEST(Collectives, AllReduceSumEveryDtypeAndSize) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : kArithmeticTypes) {
    for (int64_t numel : kSizes) {
      at::Tensor t = at::full({numel}, r + 1, at::TensorOptions().dtype(dtype));
      comm->allReduce(t)->wait();
      EXPECT_TRUE(at::equal(t, at::full({numel}, n * (n + 1) / 2, t.options())))
          << c10::toString(dtype) << " numel " << numel;
    }
  }
}

TEST(Collectives, AllReduceMaxMinAvg) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : kArithmeticTypes) {
    auto opts = at::TensorOptions().dtype(dtype);
    at::Tensor mx = at::full({5}, r, opts), mn = at::full({5}, r, opts);
    comm->allReduce(mx, {ReduceOp::kMax})->wait();
    comm->allReduce(mn, {ReduceOp::kMin})->wait();
    EXPECT_TRUE(at::equal(mx, at::full({5}, n - 1, opts))) << c10::toString(dtype);
    EXPECT_TRUE(at::equal(mn, at::full({5}, 0, opts))) << c10::toString(dtype);
  }
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    auto opts = at::TensorOptions().dtype(dtype);
    at::Tensor avg = at::full({3}, 2 * r, opts);
    comm->allReduce(avg, {ReduceOp::kAvg})->wait();
    EXPECT_TRUE(at::equal(avg, at::full({3}, n - 1, opts))) << c10::toString(dtype);
  }
  at::Tensor ints = at::ones({2}, at::kInt);
  EXPECT_THAT(error_of<CommError>([&] { comm->allReduce(ints, {ReduceOp::kAvg})->wait(); }),
              HasSubstr("ReduceOp avg needs a floating-point tensor, got Int"));
}

TEST(Collectives, AllReduceBoolIsAnyAndAll) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  at::Tensor any = at::full({4}, r == n - 1, at::kBool);
  at::Tensor all = at::full({4}, r == n - 1, at::kBool);
  comm->allReduce(any, {ReduceOp::kSum})->wait();
  comm->allReduce(all, {ReduceOp::kMin})->wait();
  EXPECT_TRUE(any.all().item<bool>());
  EXPECT_EQ(all.any().item<bool>(), n == 1);
}

TEST(Collectives, NonContiguousTensorsAreHandled) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  at::Tensor base = at::arange(12, at::kFloat).view({3, 4}).add(r);
  at::Tensor view = base.t();  // non-contiguous, written in place
  ASSERT_FALSE(view.is_contiguous());
  comm->allReduce(view)->wait();
  at::Tensor expected = at::arange(12, at::kFloat).view({3, 4}).mul(n).add(n * (n - 1) / 2);
  EXPECT_TRUE(at::equal(base, expected));
}

TEST(Collectives, AllGatherFlat) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kBool}) {
    for (int64_t numel : kSizes) {
      auto opts = at::TensorOptions().dtype(dtype);
      at::Tensor in = at::full({numel}, dtype == at::kBool ? r % 2 : r, opts);
      at::Tensor out = at::empty({n * numel}, opts);
      comm->allGather(out, in)->wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(at::equal(out.narrow(0, q * numel, numel),
                              at::full({numel}, dtype == at::kBool ? q % 2 : q, opts)))
            << c10::toString(dtype) << " rank " << q;
      }
    }
  }
}

TEST(Collectives, AllGatherListWithUnevenSizes) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  at::Tensor in = at::full({r + 1, 2}, r, at::kDouble);  // rank r sends (r+1) x 2
  std::vector<at::Tensor> outs;
  for (int q = 0; q < n; ++q) outs.push_back(at::empty({q + 1, 2}, at::kDouble));
  comm->allGather(outs, in)->wait();
  for (int q = 0; q < n; ++q) {
    EXPECT_TRUE(at::equal(outs[q], at::full({q + 1, 2}, q, at::kDouble))) << "rank " << q;
  }
}

TEST(Collectives, ReduceScatter) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  const int64_t chunk = 3;
  for (auto dtype : {at::kFloat, at::kDouble, at::kInt, at::kBFloat16}) {
    auto opts = at::TensorOptions().dtype(dtype);
    // Element j of rank r's input is r + j.
    at::Tensor in = at::arange(n * chunk, opts).add(r);
    at::Tensor out = at::empty({chunk}, opts);
    comm->reduceScatter(out, in)->wait();
    // Rank q gets sum over ranks of (rank + q*chunk + k).
    at::Tensor expected = at::arange(chunk, opts).add(r * chunk).mul(n).add(n * (n - 1) / 2);
    EXPECT_TRUE(at::equal(out, expected)) << c10::toString(dtype);
  }
  at::Tensor in = at::full({n * 2}, 2.0 * r, at::kFloat), out = at::empty({2}, at::kFloat);
  comm->reduceScatter(out, in, {ReduceOp::kAvg})->wait();
  EXPECT_TRUE(at::equal(out, at::full({2}, n - 1.0, at::kFloat)));
}

TEST(Collectives, BroadcastFromEveryRoot) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (int root = 0; root < n; ++root) {
    at::Tensor t = at::full({2, 5}, r == root ? 42 + root : -1, at::kLong);
    comm->broadcast(t, {root})->wait();
    EXPECT_TRUE(at::equal(t, at::full({2, 5}, 42 + root, at::kLong))) << "root " << root;
  }
}

TEST(Collectives, BarrierAndSendRecvRing) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  comm->barrier()->wait();
  if (n == 1) {
    at::Tensor t = at::zeros({1});
    EXPECT_THAT(error_of<CommError>([&] { comm->send(t, 0); }),
                HasSubstr("send: peer 0 must be another rank of this communicator"));
    return;
  }
  at::Tensor out = at::full({6}, r, at::kFloat), in = at::empty({6}, at::kFloat);
  auto recv = comm->recv(in, (r - 1 + n) % n, {/*tag=*/7});
  auto send = comm->send(out, (r + 1) % n, {/*tag=*/7});
  send->wait();
  recv->wait();
  EXPECT_TRUE(at::equal(in, at::full({6}, (r - 1 + n) % n, at::kFloat)));
}

TEST(Collectives, AsyncWorkOverlapsCompute) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  at::Tensor a = at::full({1 << 16}, r, at::kFloat), b = at::full({1 << 10}, 1.0, at::kDouble);
  auto wa = comm->allReduce(a);
  auto wb = comm->allReduce(b, {ReduceOp::kMax});
  // Compute while both are in flight, then wait in the reverse order.
  at::Tensor x = at::randn({128, 128});
  at::Tensor y = at::matmul(x, x);
  EXPECT_EQ(y.size(0), 128);
  wb->wait();
  wa->wait();
  EXPECT_TRUE(wa->isCompleted());
  EXPECT_TRUE(at::equal(a, at::full({1 << 16}, n * (n - 1) / 2, at::kFloat)));
  EXPECT_TRUE(at::equal(b, at::full({1 << 10}, 1.0, at::kDouble)));
  wa->wait();  // idempotent
}

TEST(Collectives, SplitMakesOrderedSubgroups) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  // Even and odd ranks; key -r reverses the order inside each group.
  auto sub = comm->split(r % 2, -r);
  ASSERT_TRUE(sub);
  int members = (n + (r % 2 == 0 ? 1 : 0)) / 2;
  EXPECT_EQ(sub->size(), members);
  int below_me_same_parity = 0, sum = 0;
  for (int q = 0; q < n; ++q) {
    if (q % 2 != r % 2) continue;
    sum += q;
    if (q > r) ++below_me_same_parity;
  }
  EXPECT_EQ(sub->rank(), below_me_same_parity);
  at::Tensor t = at::full({3}, r, at::kInt);
  sub->allReduce(t)->wait();
  EXPECT_TRUE(at::equal(t, at::full({3}, sum, at::kInt)));
  // color < 0: not a member.
  auto none = comm->split(r == 0 ? -1 : 0, r);
  EXPECT_EQ(none == nullptr, r == 0);
}

TEST(Collectives, ArgumentErrorsAreClear) {
  auto comm = world();
  const int n = comm->size();
  at::Tensor in = at::zeros({4}), wrong = at::zeros({4 * n + 1});
  EXPECT_THAT(error_of<Error>([&] { comm->allGather(wrong, in); }),
              HasSubstr("allGather: the output must hold size() inputs: expected "
                        "output.numel() == input.numel() * size (" +
                        std::to_string(4 * n + 1) + " vs " + std::to_string(4 * n) + ")"));
  at::Tensor doubles = at::zeros({4 * n}, at::kDouble);
  EXPECT_THAT(error_of<CommError>([&] { comm->allGather(doubles, in); }),
              HasSubstr("allGather: dtypes differ (Double vs Float)"));
  EXPECT_THAT(error_of<CommError>([&] { comm->broadcast(in, {n}); }),
              HasSubstr("broadcast: root " + std::to_string(n) + " is not a rank"));
  at::Tensor complex = at::zeros({2}, at::kComplexFloat);
  EXPECT_THAT(error_of<CommError>([&] { comm->allReduce(complex); }),
              HasSubstr("dtype ComplexFloat is not supported by reductions"));
  at::Tensor undefined;
  EXPECT_THAT(error_of<CommError>([&] { comm->allReduce(undefined); }),
              HasSubstr("allReduce: got an undefined tensor"));
  // Every rank made the same failing calls, so the communicator is still in step.
  at::Tensor t = at::ones({1});
  comm->allReduce(t)->wait();
  EXPECT_EQ(t.item<float>(), n);
}

TEST(Collectives, NcclAbsenceIsExplained) {
  if (internal::nccl_available()) return;  // exercised by the GPU-tagged tests instead
  auto mpi = std::dynamic_pointer_cast<internal::MpiCommunicator>(world());
  ASSERT_TRUE(mpi);
  auto msg = error_of<CommError>([&] { internal::make_nccl_communicator(mpi); });
  EXPECT_THAT(msg, HasSubstr("nccl backend"));
  EXPECT_THAT(msg, HasSubstr("use the mpi backend"));
  EXPECT_THAT(error_of<ConfigError>([] { parse_backend("gloo"); }),
              HasSubstr("unknown communication backend 'gloo': use auto, mpi or nccl"));
}

class DebugCollectives : public ::testing::Test {
 protected:
  void SetUp() override { setenv("REMAT_DEBUG_COLLECTIVES", "1", 1); }
  void TearDown() override { unsetenv("REMAT_DEBUG_COLLECTIVES"); }
};

TEST_F(DebugCollectives, MatchingCallsPass) {
  auto comm = world();
  const int n = comm->size();
  at::Tensor t = at::ones({4});
  comm->allReduce(t)->wait();
  at::Tensor out = at::empty({4 * n});
  comm->allGather(out, t)->wait();
  EXPECT_TRUE(at::equal(out, at::full({4 * n}, n, at::kFloat)));
}

TEST_F(DebugCollectives, MismatchNamesBothRanksAndBothCalls) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  if (n == 1) {
    // One rank cannot disagree with itself: the check passes.
    at::Tensor t = at::ones({4});
    comm->allReduce(t)->wait();
    EXPECT_EQ(t.sum().item<float>(), 4);
    return;
  }
  // Rank 0 sums 4 floats, the others 5: without the check this corrupts memory.
  at::Tensor t = at::ones({r == 0 ? 4 : 5});
  auto msg = error_of<CommError>([&] { comm->allReduce(t)->wait(); });
  EXPECT_THAT(msg, HasSubstr("collective mismatch on a communicator of " + std::to_string(n)));
  std::string mine = r == 0 ? "shape=[4]" : "shape=[5]";
  std::string theirs = r == 0 ? "shape=[5]" : "shape=[4]";
  int other = r == 0 ? 1 : 0;
  EXPECT_THAT(msg, HasSubstr("rank " + std::to_string(r) + " called allReduce(seq=0, dtype=Float, " +
                             mine));
  EXPECT_THAT(msg, HasSubstr("but rank " + std::to_string(other) +
                             " called allReduce(seq=0, dtype=Float, " + theirs));
  // Different ops are caught the same way.
  at::Tensor b = at::ones({2});
  msg = error_of<CommError>([&] {
    if (r == 0) {
      comm->broadcast(b)->wait();
    } else {
      comm->allReduce(b)->wait();
    }
  });
  EXPECT_THAT(msg, HasSubstr(r == 0 ? "called broadcast(seq=1" : "called allReduce(seq=1"));
}

// REMAT_DEBUG_COLLECTIVES changes what every collective exchanges: set on
// rank 1 alone it hung start-up for good (rank 1 waited to create the debug
// mode's communicator, which the others never made). The ranks now agree on
// it as the communicator is made, and every rank raises the same error.
TEST(DebugCollectivesAgreement, OnSomeRanksOnlyEveryRankRefusesIt) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  if (n == 1) {  // one rank agrees with itself
    setenv("REMAT_DEBUG_COLLECTIVES", "1", 1);
    EXPECT_TRUE(std::dynamic_pointer_cast<internal::MpiCommunicator>(world())->debugCollectives());
    unsetenv("REMAT_DEBUG_COLLECTIVES");
    return;
  }
  const std::vector<std::pair<int, const char*>> cases = {{1, "1"}, {n - 1, "maybe"}};
  for (const auto& [odd_rank, value] : cases) {
    if (r == odd_rank) setenv("REMAT_DEBUG_COLLECTIVES", value, 1);
    std::string msg;
    try {
      world();
    } catch (const ConfigError& e) {
      msg = e.what();
    }
    unsetenv("REMAT_DEBUG_COLLECTIVES");
    std::string others;
    for (int q = 0; q < n; ++q) {
      if (q != odd_rank) others += str(others.empty() ? "" : ", ", q);
    }
    const std::string held = str("<not set> on rank", n > 2 ? "s " : " ", others, "; '", value, "' on rank ", odd_rank);
    if (std::string(value) == "1") {
      EXPECT_THAT(msg, HasSubstr(str("the ranks of this job were started with different REMAT_DEBUG_COLLECTIVES: ",
                                     held, ". It changes what every collective exchanges")));
    } else {
      EXPECT_THAT(msg, HasSubstr(str("REMAT_DEBUG_COLLECTIVES='maybe' is not a boolean: use 1 or 0 (or true/false), "
                                     "without spaces (rank ", odd_rank, "'s value; the ranks have ", held, ")")));
    }
  }
  // The refusal left the ranks in step.
  at::Tensor t = at::ones({2});
  comm->allReduce(t)->wait();
  EXPECT_TRUE(at::equal(t, at::full({2}, n, at::kFloat)));
}

TEST(Timeouts, UnansweredReceiveTimesOutWithAClearError) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  if (n == 1) {
    EXPECT_THAT(error_of<CommError>([&] {
                  at::Tensor t = at::zeros({1});
                  comm->recv(t, 0);
                }),
                HasSubstr("recv: peer 0 must be another rank"));
    return;
  }
  if (r == 1) {
    at::Tensor t = at::zeros({3});
    SendRecvOptions opts;
    opts.timeout = std::chrono::milliseconds(300);
    auto work = comm->recv(t, 0, opts);
    auto msg = error_of<TimeoutError>([&] { work->wait(); });
    EXPECT_THAT(msg, HasSubstr("recv(dtype=Float, shape=[3], src=0, tag=0) on rank 1 of " +
                               std::to_string(n) + " did not complete within 0.3 s"));
    EXPECT_THAT(msg, HasSubstr("REMAT_COMM_TIMEOUT_S"));
    EXPECT_THAT(msg, HasSubstr("sent (or received) no matching message with this tag"));
  }
  comm->barrier()->wait();
}

// With REMAT_DEBUG_COLLECTIVES already set, a timeout does not advise running
// with it: it says what the debug mode does and does not cover. (A collective
// that times out ends the process's communication, so only a receive, which
// is withdrawn, is timed out here; the collective's texts sit beside it in
// mpi_communicator.cc's timeout_advice.)
TEST_F(DebugCollectives, ATimeoutDoesNotAdviseTheDebugModeItRunsIn) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  if (n == 1) return;  // no peer to wait for
  if (r == 1) {
    at::Tensor t = at::zeros({3});
    SendRecvOptions opts;
    opts.timeout = std::chrono::milliseconds(300);
    auto work = comm->recv(t, 0, opts);
    auto msg = error_of<TimeoutError>([&] { work->wait(); });
    EXPECT_THAT(msg, HasSubstr("did not complete within 0.3 s"));
    EXPECT_THAT(msg, ::testing::Not(HasSubstr("Run with REMAT_DEBUG_COLLECTIVES=1"))) << msg;
    EXPECT_THAT(msg, HasSubstr("(REMAT_DEBUG_COLLECTIVES checks collectives, not send and recv)")) << msg;
  }
  // Collectives still pair up afterwards: the receive was withdrawn.
  at::Tensor t = at::ones({2});
  comm->allReduce(t)->wait();
  EXPECT_TRUE(at::equal(t, at::full({2}, n, at::kFloat)));
}

TEST(Layout, GroupsAreAdjacentTensorParallelRanks) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (int tp = 1; tp <= n; ++tp) {
    if (n % tp != 0) continue;
    ParallelLayout layout(comm, ParallelDims::from_world(n, tp));
    EXPECT_EQ(layout.get_model_parallel_rank(), r % tp);
    EXPECT_EQ(layout.get_data_parallel_rank(), r / tp);
    EXPECT_EQ(layout.get_model_parallel_world_size(), tp);
    EXPECT_EQ(layout.get_data_parallel_world_size(), n / tp);
    ASSERT_EQ(layout.tp_group()->size(), tp);
    ASSERT_EQ(layout.dp_group()->size(), n / tp);
    EXPECT_EQ(layout.tp_group()->rank(), r % tp);
    EXPECT_EQ(layout.dp_group()->rank(), r / tp);
    // Sum of world ranks inside each group, in closed form.
    at::Tensor t = at::full({1}, r, at::kLong), d = at::full({1}, r, at::kLong);
    layout.get_model_parallel_group()->allReduce(t)->wait();
    layout.get_data_parallel_group()->allReduce(d)->wait();
    int64_t first = (r / tp) * tp;
    EXPECT_EQ(t.item<int64_t>(), tp * first + tp * (tp - 1) / 2) << "tp=" << tp;
    int64_t dp = n / tp, offset = r % tp;
    EXPECT_EQ(d.item<int64_t>(), dp * offset + tp * dp * (dp - 1) / 2) << "tp=" << tp;
  }
}

}  // namespace
}  // namespace remat
