// Errors, environment, knobs, logging and layout arithmetic (no MPI needed).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <vector>

#include "runtime/env_knobs.h"
#include "runtime/error.h"
#include "tests/error_of.h"
#include "runtime/layout.h"
#include "runtime/logging.h"
#include "runtime/process_env.h"

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

}  // namespace
}  // namespace remat
