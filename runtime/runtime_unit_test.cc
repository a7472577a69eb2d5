// Errors, environment, knobs, logging, layout arithmetic, the backend choice
// and the host staging's plan (no MPI needed).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <vector>

#include <ATen/ATen.h>

#include <filesystem>

#include "runtime/blas.h"
#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "tests/error_of.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/process_env.h"
#include "runtime/runtime.h"
#include "runtime/internal/backend_choice.h"
#include "runtime/internal/host_staging.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using remat::testing::error_of;

TEST(Errors, CheckEqPrintsBothSidesAndLocation) {
  int a = 3, b = 4;
  auto msg = error_of<Error>([&] { REMAT_CHECK_EQ(a, b, "numel of ", "x"); });
  EXPECT_THAT(msg, HasSubstr("numel of x: expected a == b (3 vs 4) at "));
  EXPECT_THAT(msg, HasSubstr("runtime_unit_test.cc:"));
  msg = error_of<Error>([&] { REMAT_CHECK_LT(b, a); });
  EXPECT_THAT(msg, HasSubstr("expected b < a (4 vs 3)"));
  msg = error_of<Error>([&] { REMAT_CHECK(a > b, "a was ", a); });
  EXPECT_THAT(msg, HasSubstr("a was 3: expected a > b at"));
  REMAT_CHECK_EQ(a, 3);  // passing checks do nothing
}

TEST(Errors, Hierarchy) {
  EXPECT_THROW(throw TimeoutError("t"), CommError);
  EXPECT_THROW(throw CommError("c"), Error);
  EXPECT_THROW(throw ConfigError("c"), Error);
  EXPECT_THROW(throw Error("e"), std::runtime_error);
}

using Vars = std::map<std::string, std::string>;

ProcessEnv detect(const Vars& vars) {
  return detect_process_env([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// A step that runs out of memory ends the process with exit code 1 and a
// message naming it and where to look, not LibTorch's backtrace as an
// "unexpected error".
TEST(Errors, OutOfMemoryEndsTheProcessSayingWhatToChange) {
  ::testing::internal::CaptureStderr();
  const int rc = run_main([]() -> int {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__},
                                "CUDA out of memory. Tried to allocate 2.00 GiB");
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(err, ::testing::HasSubstr("remat out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"));
  EXPECT_THAT(err, ::testing::HasSubstr("remat-estimate"));
  EXPECT_THAT(err, ::testing::Not(::testing::HasSubstr("unexpected error")));
  EXPECT_THAT(err, ::testing::Not(::testing::HasSubstr("Exception raised from")));
}

TEST(ProcessEnvTest, SingleProcessByDefault) {
  ProcessEnv env = detect({});
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.source, "single");
}

TEST(ProcessEnvTest, ReadsOpenMpiVariables) {
  ProcessEnv env = detect({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"RANK", "0"}});
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
}

TEST(ProcessEnvTest, ReadsRankWorldSizeConvention) {
  ProcessEnv env = detect({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(env.source, "env");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.local_rank, 0);
}

TEST(ProcessEnvTest, BadValuesAreClearErrors) {
  EXPECT_THAT(error_of<ConfigError>([] { detect({{"RANK", "4"}, {"WORLD_SIZE", "4"}}); }),
              HasSubstr("RANK=4 is out of range for WORLD_SIZE=4: ranks run from 0 to 3"));
  EXPECT_THAT(error_of<ConfigError>([] { detect({{"RANK", "x"}, {"WORLD_SIZE", "4"}}); }),
              HasSubstr("RANK='x' is not a non-negative integer"));
  EXPECT_THAT(error_of<ConfigError>([] { detect({{"RANK", "1"}}); }),
              HasSubstr("WORLD_SIZE is not set while RANK is"));
  EXPECT_THAT(error_of<ConfigError>([] {
                detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"},
                        {"LOCAL_WORLD_SIZE", "2"}});
              }),
              HasSubstr("LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"));
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

TEST(Knobs, BadValuesAreClearErrors) {
  {
    ScopedEnv env(knobs::kDebugCollectives, "maybe");
    EXPECT_THAT(error_of<ConfigError>([] { knobs::get_bool(knobs::kDebugCollectives); }),
                HasSubstr("REMAT_DEBUG_COLLECTIVES='maybe' is not a boolean"));
  }
  {
    ScopedEnv env(knobs::kCommTimeoutSeconds, "-3");
    EXPECT_THAT(error_of<ConfigError>([] { knobs::comm_timeout(); }),
                HasSubstr("REMAT_COMM_TIMEOUT_S='-3' is not a number of seconds from 0.001"));
  }
  {
    ScopedEnv env(knobs::kCommTimeoutSeconds, "1.5");
    EXPECT_EQ(knobs::comm_timeout().count(), 1500);
  }
  {
    ScopedEnv env(knobs::kLogLevel, "loud");
    EXPECT_THAT(error_of<ConfigError>([] { log_level_from_env(); }),
                HasSubstr("REMAT_LOG_LEVEL='loud' is not a log level"));
  }
  {
    ScopedEnv env(knobs::kLogLevel, "debug");
    EXPECT_EQ(log_level_from_env(), spdlog::level::debug);
  }
  EXPECT_FALSE(knobs::get_bool("REMAT_SURELY_UNSET_VARIABLE"));
}

// inf, 1e10 and 1e30 overflowed the deadline arithmetic (the first collective
// "timed out" at once, "within -9.22337e+15 s"); 1e-4 rounded to 0 ms.
TEST(Knobs, CommTimeoutIsFiniteAndBetweenOneMillisecondAndSevenDays) {
  for (const char* bad : {"inf", "-inf", "nan", "1e10", "1e30", "1e400", "604801", "1e-4", "0.0009", "0", "-0",
                          "5s", "abc"}) {
    ScopedEnv env(knobs::kCommTimeoutSeconds, bad);
    EXPECT_THAT(error_of<ConfigError>([] { knobs::comm_timeout(); }),
                HasSubstr(str("REMAT_COMM_TIMEOUT_S='", bad,
                              "' is not a number of seconds from 0.001 (1 ms) to 604800 (7 days)")))
        << bad;
  }
  const std::vector<std::pair<const char*, int64_t>> good = {
      {"0.001", 1}, {"0.0015", 2}, {"2", 2000}, {"300", 300000}, {"604800", int64_t{604800} * 1000}};
  for (const auto& [text, ms] : good) {
    ScopedEnv env(knobs::kCommTimeoutSeconds, text);
    EXPECT_EQ(knobs::comm_timeout().count(), ms) << text;
  }
  // The longest timeout still fits a steady_clock deadline.
  ScopedEnv env(knobs::kCommTimeoutSeconds, "604800");
  const auto deadline = std::chrono::steady_clock::now() + knobs::comm_timeout();
  EXPECT_GT(deadline, std::chrono::steady_clock::now());
}

// One reading for every numeric and boolean variable: the value exactly as
// set, in plain decimal digits. REMAT_COMM_TIMEOUT_S took hex ("0x10" = 16 s)
// and exponents, the whole-number variables took leading spaces and a sign,
// and the booleans took neither: the same value meant a number to one
// variable and an error to another.
TEST(Knobs, EveryNumericAndBooleanVariableTakesTheSameSpellings) {
  struct Variable {
    const char* name;
    std::function<double(const std::string&)> read;  // the value it takes from the text
  };
  auto from_env = [](const char* name, auto read) {
    return [name, read](const std::string& text) {
      ScopedEnv env(name, text.c_str());
      return static_cast<double>(read());
    };
  };
  const std::vector<Variable> numbers = {
      {knobs::kCommTimeoutSeconds, from_env(knobs::kCommTimeoutSeconds, [] { return knobs::comm_timeout().count() / 1000; })},
      {knobs::kFaultSavePauseMs, from_env(knobs::kFaultSavePauseMs, [] { return knobs::fault_save_pause()->count(); })},
      {knobs::kMemoryPerRankBytes, from_env(knobs::kMemoryPerRankBytes, [] { return *knobs::memory_per_rank_bytes(); })},
      {knobs::kOmpNumThreads, from_env(knobs::kOmpNumThreads, [] { return *knobs::omp_num_threads(); })},
      {"OMPI_COMM_WORLD_SIZE", [](const std::string& text) {
         return detect({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", text}}).world_size;
       }},
  };
  for (const auto& v : numbers) {
    EXPECT_EQ(v.read("16"), 16) << v.name;
    EXPECT_EQ(v.read("016"), 16) << v.name << ": decimal, not octal";
    for (const char* bad : {" 16", "16 ", "\t16", "16\n", "+16", "0x10", "1.6e1", "16abc", "-16", "1,6"}) {
      EXPECT_THAT(error_of<ConfigError>([&] { v.read(bad); }), HasSubstr(str(v.name, "='", bad, "' is not ")))
          << v.name << " took '" << bad << "'";
    }
  }
  for (const char* bad : {" 1", "1 ", "+1", "0x1", "\ton"}) {
    ScopedEnv env(knobs::kDebugCollectives, bad);
    EXPECT_THAT(error_of<ConfigError>([] { knobs::get_bool(knobs::kDebugCollectives); }),
                HasSubstr(str("REMAT_DEBUG_COLLECTIVES='", bad, "' is not a boolean")))
        << bad;
  }
  ScopedEnv env(knobs::kDebugCollectives, "On");
  EXPECT_TRUE(knobs::get_bool(knobs::kDebugCollectives));
  // The error says how to write the number.
  ScopedEnv spaced(knobs::kFaultSavePauseMs, " 5");
  EXPECT_THAT(error_of<ConfigError>([] { knobs::fault_save_pause(); }),
              HasSubstr("REMAT_FAULT_SAVE_PAUSE_MS=' 5' is not a whole number of milliseconds from 0 to 60000 (1 "
                        "minute) (write it in plain decimal digits: no spaces, sign, hex or exponent): it pauses"));
}

// The save pauses this long after each file it writes: 1e12 ms stalled a save
// for good. The seam is for tests; a minute is more than any test waits.
TEST(Knobs, FaultSavePauseIsBoundedAtOneMinute) {
  for (const char* bad : {"60001", "1000000000000", "99999999999999999999999"}) {
    ScopedEnv env(knobs::kFaultSavePauseMs, bad);
    EXPECT_THAT(error_of<ConfigError>([] { knobs::fault_save_pause(); }),
                HasSubstr(str("REMAT_FAULT_SAVE_PAUSE_MS='", bad,
                              "' is not a whole number of milliseconds from 0 to 60000 (1 minute): it pauses each "
                              "save for a test to interrupt")))
        << bad;
  }
  ScopedEnv env(knobs::kFaultSavePauseMs, "60000");
  EXPECT_EQ(knobs::fault_save_pause()->count(), 60000);
}

// The library float32 products reach is found and named; OpenBLAS's threads
// follow what the runtime sets (tests/reliability_test.sh checks the log
// line with OpenBLAS and with the reference BLAS put first).
TEST(Blas, NamesTheLibraryOfFloat32ProductsAndSetsOpenBlasThreads) {
  const at::Tensor a = at::ones({8, 8});
  EXPECT_EQ(at::mm(a, a)[0][0].item<float>(), 8.0F);  // LibTorch's product, through that library
  const BlasLibrary blas = float32_blas();
  ASSERT_FALSE(blas.path.empty()) << "sgemm_ was not found in this process";
  EXPECT_TRUE(std::filesystem::exists(blas.path)) << blas.path;
  EXPECT_THAT(blas.text(), HasSubstr(blas.name));
  EXPECT_THAT(blas.text(), HasSubstr(" from " + blas.path));
  if (!blas.openblas) return;
  EXPECT_THAT(blas.name, ::testing::StartsWith("OpenBLAS 0."));
  EXPECT_THAT(blas.build, ::testing::ContainsRegex("^(OpenMP|pthread|single-threaded) build"));
  const int before = blas.threads;
  set_blas_threads(1);
  EXPECT_EQ(float32_blas().threads, 1);
  EXPECT_THAT(float32_blas().text(), HasSubstr("; 1 thread)"));
  set_blas_threads(0);  // ignored
  EXPECT_EQ(float32_blas().threads, 1);
  set_blas_threads(before);
}

TEST(Logging, PrefixCarriesRankAndLayout) {
  set_log_rank(3, 4);
  EXPECT_EQ(log_prefix(), "[rank 3/4]");
  set_log_layout(1, 2, 1, 2);
  EXPECT_EQ(log_prefix(), "[rank 3/4 tp 1/2 dp 1/2]");
  set_log_rank(0, 1);
}

TEST(ParallelDimsTest, ValidLayouts) {
  ParallelDims dims = ParallelDims::from_world(8, 2);
  EXPECT_EQ(dims.dp, 4);
  EXPECT_EQ(dims.tp, 2);
  EXPECT_TRUE(dims.tp_enabled());
  EXPECT_TRUE(dims.dp_enabled());
  EXPECT_FALSE(ParallelDims::from_world(3, 3).dp_enabled());
  EXPECT_EQ(dims.to_string(), "dp=4 x tp=2 (world 8)");
}

TEST(ParallelDimsTest, ErrorsListEveryFactorAndTheWorldSize) {
  EXPECT_THAT(error_of<ConfigError>([] { ParallelDims(2, 3, 4); }),
              HasSubstr("dp=2 x tp=3 = 6 does not match the world size 4"));
  EXPECT_THAT(error_of<ConfigError>([] { ParallelDims(2, 3, 4); }),
              HasSubstr("one of 1, 2, 4 for world size 4"));
  EXPECT_THAT(error_of<ConfigError>([] { ParallelDims::from_world(6, 4); }),
              HasSubstr("tensor_parallel.size=4 does not divide the world size 6: choose one "
                        "of 1, 2, 3, 6"));
  EXPECT_THAT(error_of<ConfigError>([] { ParallelDims::from_world(4, 0); }),
              HasSubstr("tensor_parallel.size=0 does not divide"));
}

}  // namespace
}  // namespace remat

#include <ATen/ATen.h>

#include "runtime/internal/local_communicator.h"

namespace remat {
namespace {

TEST(LocalCommunicatorTest, OneRankCollectivesAreIdentities) {
  internal::LocalCommunicator comm;
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.backendName(), "local");
  at::Tensor t = at::arange(6, at::kFloat);
  comm.allReduce(t, {ReduceOp::kAvg})->wait();
  EXPECT_TRUE(at::equal(t, at::arange(6, at::kFloat)));
  at::Tensor out = at::empty({6});
  comm.allGather(out, t)->wait();
  EXPECT_TRUE(at::equal(out, t));
  std::vector<at::Tensor> outs{at::empty({2, 3})};
  comm.allGather(outs, t.view({2, 3}))->wait();
  EXPECT_TRUE(at::equal(outs[0], t.view({2, 3})));
  at::Tensor part = at::empty({6});
  comm.reduceScatter(part, t)->wait();
  EXPECT_TRUE(at::equal(part, t));
  comm.barrier()->wait();
  EXPECT_TRUE(comm.split(0, 0));
  EXPECT_FALSE(comm.split(-1, 0));
}

TEST(LocalCommunicatorTest, ErrorsMatchTheOtherBackends) {
  internal::LocalCommunicator comm;
  at::Tensor ints = at::ones({2}, at::kInt), wrong = at::empty({3});
  EXPECT_THAT(error_of<CommError>([&] { comm.allReduce(ints, {ReduceOp::kAvg}); }),
              HasSubstr("ReduceOp avg needs a floating-point tensor, got Int"));
  EXPECT_THAT(error_of<Error>([&] { comm.allGather(wrong, at::ones({2})); }),
              HasSubstr("allGather: the output must hold size() inputs"));
  EXPECT_THAT(error_of<CommError>([&] { comm.broadcast(wrong, {1}); }),
              HasSubstr("broadcast: root 1 is not a rank of this communicator (0..0)"));
  EXPECT_THAT(error_of<CommError>([&] { comm.send(wrong, 0); }),
              HasSubstr("communication backend 'local' does not implement send"));
}

// The devices of one call decide its staging; no CUDA tensor is needed to
// state them, only devices.
TEST(HostStagingTest, PlanFollowsTheDevice) {
  using internal::plan_staging;
  const c10::Device cpu("cpu"), cuda1("cuda:1");
  auto plan = plan_staging({cpu, cpu}, false, "allGather", "mpi");
  EXPECT_FALSE(plan.stage);
  plan = plan_staging({cpu, cpu}, /*force_cpu=*/true, "allGather", "mpi");
  EXPECT_TRUE(plan.stage);
  EXPECT_FALSE(plan.pinned);  // a CPU-only LibTorch cannot pin
  plan = plan_staging({cuda1, cuda1}, false, "allGather", "mpi");
  EXPECT_TRUE(plan.stage);
  EXPECT_TRUE(plan.pinned);
  EXPECT_FALSE(plan_staging({}, true, "barrier", "mpi").stage);  // nothing to stage
}

TEST(HostStagingTest, MixedDevicesAreRefusedNamingBoth) {
  using internal::plan_staging;
  const c10::Device cpu("cpu"), cuda0("cuda:0"), cuda1("cuda:1");
  auto msg = error_of<CommError>([&] { plan_staging({cuda0, cpu}, false, "allGather", "mpi"); });
  EXPECT_THAT(msg, HasSubstr("allGather: the tensors of one call must be on one device, got cuda:0 (tensor 0) "
                             "and cpu (tensor 1); move them to one device"));
  msg = error_of<CommError>([&] { plan_staging({cpu, cpu, cuda1}, true, "reduceScatter", "mpi"); });
  EXPECT_THAT(msg, HasSubstr("got cpu (tensor 0) and cuda:1 (tensor 2)"));
  msg = error_of<CommError>([&] { plan_staging({cuda0, cuda1}, false, "allReduce", "mpi"); });
  EXPECT_THAT(msg, HasSubstr("got cuda:0 (tensor 0) and cuda:1 (tensor 1)"));
  msg = error_of<CommError>([&] { plan_staging({c10::Device("meta")}, false, "send", "mpi"); });
  EXPECT_THAT(msg, HasSubstr("send: the mpi backend takes CPU or CUDA tensors, got one on meta"));
}

// Forced on CPU tensors: stand-ins are contiguous copies, and finish() writes
// back exactly the outputs, into the caller's views, and nothing else.
TEST(HostStagingTest, StandInsCopyInAndBackThroughViews) {
  internal::HostStaging staging({/*stage=*/true, /*pinned=*/false});
  at::Tensor base = at::arange(24, at::kLong).view({4, 6});
  at::Tensor strided = base.slice(1, 0, 6, 2);  // 4 x 3, every second column
  at::Tensor offset = at::arange(10, at::kFloat).narrow(0, 3, 5);
  at::Tensor read = at::full({2}, 7, at::kInt);
  auto host = staging.stage({strided, offset, read},
                            {internal::StagedRole::kInOut, internal::StagedRole::kOut, internal::StagedRole::kIn});
  ASSERT_EQ(host.size(), 3u);
  EXPECT_TRUE(host[0].is_contiguous());
  EXPECT_NE(host[0].data_ptr(), strided.data_ptr());
  EXPECT_TRUE(at::equal(host[0], strided));  // in-place: the values went in
  EXPECT_TRUE(at::equal(host[2], read));
  EXPECT_EQ(staging.bytes(), 2 * 12 * 8 + 5 * 4 + 2 * 4);  // in and out, out, in
  host[0].neg_();
  host[1].fill_(-1);
  at::Tensor expected = base.clone();
  expected.slice(1, 0, 6, 2).neg_();
  staging.finish();
  EXPECT_TRUE(at::equal(base, expected));  // the other columns untouched
  EXPECT_TRUE(at::equal(offset, at::full({5}, -1.0f)));
  EXPECT_TRUE(at::equal(read, at::full({2}, 7, at::kInt)));
  at::Tensor empty = at::empty({0, 3});
  internal::HostStaging none({/*stage=*/false, false});
  auto same = none.stage({empty}, {internal::StagedRole::kInOut});
  EXPECT_TRUE(same[0].is_same(empty));  // not staged: the tensor itself
  EXPECT_EQ(none.bytes(), 0);
}

// Per rank: node, GPUs seen, device used.
internal::RankDevices on(const std::string& node, int gpus, const std::string& device) {
  return {node, gpus, device};
}

TEST(BackendChoiceTest, NcclOnlyWhereEveryRankHasAGpuOfItsOwn) {
  using internal::choose_auto_backend;
  // One node, two GPUs, one rank each.
  auto c = choose_auto_backend(true, {on("a", 2, "0000:01:00.0"), on("a", 2, "0000:02:00.0")});
  EXPECT_TRUE(c.nccl) << c.reason;
  EXPECT_EQ(c.reason, "each of the 2 ranks has a GPU of its own");
  // Two nodes whose GPUs have the same bus id: still one each.
  c = choose_auto_backend(true, {on("a", 1, "0000:01:00.0"), on("b", 1, "0000:01:00.0")});
  EXPECT_TRUE(c.nccl) << c.reason;
  // Each rank sees one GPU through its own CUDA_VISIBLE_DEVICES: distinct devices.
  c = choose_auto_backend(true, {on("a", 1, "0000:01:00.0"), on("a", 1, "0000:41:00.0")});
  EXPECT_TRUE(c.nccl) << c.reason;
  EXPECT_TRUE(choose_auto_backend(true, {on("a", 1, "0000:01:00.0")}).nccl);
}

TEST(BackendChoiceTest, MpiWhereRanksShareAGpuOrLackOne) {
  using internal::choose_auto_backend;
  auto c = choose_auto_backend(true, {on("a", 1, "0000:01:00.0"), on("a", 1, "0000:01:00.0")});
  EXPECT_FALSE(c.nccl);
  EXPECT_EQ(c.reason, "2 ranks share 1 GPU on node a (ranks 0, 1 on device 0000:01:00.0); nccl needs one GPU per rank");
  // 4 ranks on 2 GPUs of node b, 1 rank alone on node a.
  c = choose_auto_backend(true, {on("a", 1, "x0"), on("b", 2, "y0"), on("b", 2, "y1"), on("b", 2, "y0"),
                                 on("b", 2, "y1")});
  EXPECT_FALSE(c.nccl);
  EXPECT_THAT(c.reason, HasSubstr("4 ranks share 2 GPUs on node b (ranks 1, 3 on device y0)"));
  c = choose_auto_backend(true, {on("a", 1, "x0"), on("b", 0, "")});
  EXPECT_FALSE(c.nccl);
  EXPECT_THAT(c.reason, HasSubstr("rank 1 on node b sees no GPU"));
  EXPECT_EQ(choose_auto_backend(true, {on("a", 0, ""), on("a", 0, "")}).reason, "no rank sees a GPU");
  c = choose_auto_backend(false, {on("a", 1, "x0")});
  EXPECT_FALSE(c.nccl);
  EXPECT_EQ(c.reason, "this remat was built without NCCL");
}

TEST(BackendChoiceTest, ExplicitNcclShortOfGpusIsAConfigError) {
  internal::check_nccl_fits({on("a", 2, "d0"), on("a", 2, "d1")});  // fits: no error
  auto msg = error_of<ConfigError>(
      [] { internal::check_nccl_fits({on("a", 1, "d0"), on("a", 1, "d0"), on("a", 1, "d0")}); });
  EXPECT_THAT(msg, HasSubstr("the nccl backend needs one GPU per rank, but 3 ranks share 1 GPU on node a "
                             "(ranks 0, 1, 2 on device d0): use the mpi backend"));
  EXPECT_THAT(msg, HasSubstr("or start at most as many ranks on each node as it has GPUs"));
  EXPECT_THAT(error_of<ConfigError>([] { internal::check_nccl_fits({on("a", 1, "d0"), on("b", 0, "")}); }),
              HasSubstr("the nccl backend needs one GPU per rank, but rank 1 on node b sees no GPU: use the mpi "
                        "backend"));
}

TEST(BackendChoiceTest, ReportsTravelAsText) {
  auto r = internal::decode_rank_devices(internal::encode(on("node-7.example", 4, "0000:3b:00.0")));
  EXPECT_EQ(r.node, "node-7.example");
  EXPECT_EQ(r.gpus, 4);
  EXPECT_EQ(r.device, "0000:3b:00.0");
  r = internal::decode_rank_devices(internal::encode(on("cpu-box", 0, "")));
  EXPECT_EQ(r.gpus, 0);
  EXPECT_TRUE(r.device.empty());
  EXPECT_THAT(error_of<Error>([] { internal::decode_rank_devices("garbage"); }), HasSubstr("GPUS|DEVICE|NODE"));
}

}  // namespace
}  // namespace remat
