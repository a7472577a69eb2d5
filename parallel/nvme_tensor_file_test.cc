// offload_param "nvme"'s file (parallel/nvme_tensor_file.h) alone: shards
// placed past max_in_cpu live in the file, hold their values through being
// dropped from memory and written (read back from the file), and the ones
// within it stay in memory; a disk too small is kept for check(), named; the
// file is removed with the object, and one a crashed run left is removed at
// start; a disk error on a mapped shard (SIGBUS) ends the process with exit
// 1 and a message naming the file; the handlers a program had before (SIGTERM,
// SIGBUS) are still called, with the flags they asked for; every signal that
// ends a rank from outside (SIGUSR1 forwarded by mpirun, SIGHUP...) removes it.
#include "parallel/nvme_tensor_file.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::parallel {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string temp_folder(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const fs::path dir = (base ? fs::path(base) : fs::temp_directory_path()) /
                       ("remat_nvme_params_" + std::to_string(::getpid())) / name;
  fs::create_directories(dir);
  return dir.string();
}

// The kilobytes in this process's memory of the mapping `t` begins (its Rss
// in /proc/self/smaps); -1 where no mapping begins there.
int64_t resident_kib(const at::Tensor& t) {
  std::ifstream smaps("/proc/self/smaps");
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2) {
      inside = begin == address;
      continue;
    }
    long kib = 0;
    if (inside && std::sscanf(line.c_str(), "Rss: %ld kB", &kib) == 1) return kib;
  }
  return -1;
}

TEST(NvmeTensorFile, ShardsPastMaxInCpuLiveInTheFileAndKeepTheirValues) {
  const std::string dir = temp_folder("place");
  const fs::path file = fs::path(dir) / "remat-parameters" / "rank3" / "rank3.parameters";
  at::manual_seed(1);
  const at::Tensor a = at::randn({1400}), b = at::randn({5000}), c = at::randn({3000}).to(at::kBFloat16);
  at::Tensor pb, pc;
  {
    NvmeTensorFile f({dir, 3, 1500});
    EXPECT_FALSE(f.place(a).defined()) << "within max_in_cpu: the caller keeps it in memory";
    pb = f.place(b);
    pc = f.place(c);
    ASSERT_TRUE(pb.defined() && pc.defined());
    EXPECT_TRUE(f.on_disk(pb) && f.on_disk(pc));
    EXPECT_FALSE(f.on_disk(a));
    EXPECT_EQ(pb.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(pb, b));
    EXPECT_TRUE(at::equal(pc, c.to(at::kFloat)));
    EXPECT_EQ(f.file_bytes(), 32768) << "laid end to end (64-byte aligned), the file up to its page";
    EXPECT_EQ(f.in_cpu_bytes(), 5600);
    EXPECT_EQ(fs::file_size(file), 32768u);
    EXPECT_NO_THROW(f.check());

    // Written, dropped from memory, read again from the file.
    pb.mul_(2);
    EXPECT_EQ(resident_kib(pb), 32) << "both in memory while used";
    f.release(pb);
    EXPECT_EQ(resident_kib(pb), 12) << "b's pages (and the one it shares with c) dropped, c's last 3 kept";
    EXPECT_TRUE(at::equal(pb, b * 2)) << "the write reached the file";
    f.prefetch(pc);
    f.release_all();
    EXPECT_TRUE(at::equal(pc, c.to(at::kFloat)));
  }
  EXPECT_FALSE(fs::exists(file)) << "the file goes with the object";
  EXPECT_TRUE(at::equal(pb, b * 2)) << "a shard outliving the file keeps its mapping";
}

TEST(NvmeTensorFile, ADiskTooSmallIsKeptForCheckAndNamed) {
  const std::string dir = temp_folder("small");
  NvmeTensorFile f({dir, 0, 0});
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit cap{8192, RLIM_INFINITY};
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &cap), 0);
  const at::Tensor first = f.place(at::ones({2000}));
  const at::Tensor second = f.place(at::ones({5000}));
  const at::Tensor third = f.place(at::ones({2000}));
  rlimit none{RLIM_INFINITY, RLIM_INFINITY};
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  EXPECT_TRUE(first.defined());
  EXPECT_FALSE(second.defined()) << "not reserved: the caller keeps it in memory until check() stops the run";
  EXPECT_FALSE(third.defined()) << "nothing is placed after a problem";
  const std::string e = testing::error_of<ConfigError>([&] { f.check(); });
  // The bytes all three need, not the file's size where the disk refused.
  EXPECT_THAT(e, HasSubstr("rank 0 cannot reserve 36864 bytes for its parameter shards in '" + dir +
                           "/remat-parameters/rank0/rank0.parameters' (File too large after 8192 bytes): free space "
                           "on that disk"));
}

TEST(NvmeTensorFile, ACrashedRunsFileIsRemovedAndTheUsersStay) {
  const std::string dir = temp_folder("leftover");
  const fs::path rank = fs::path(dir) / "remat-parameters" / "rank1";
  fs::create_directories(rank);
  std::ofstream(rank / "rank1.parameters") << "stale";
  std::ofstream(rank / "mine.txt") << "the user's";
  NvmeTensorFile f({dir, 1, 0});
  EXPECT_EQ(fs::file_size(rank / "rank1.parameters"), 0u) << "the stale file replaced by this run's";
  EXPECT_TRUE(fs::exists(rank / "mine.txt"));
  const std::string e = testing::error_of<ConfigError>([&] { NvmeTensorFile again({dir, 1, 0}); });
  EXPECT_THAT(e, HasSubstr("zero_optimization.offload_param.nvme_path '" + dir + "' is in use by another job"));
}

// The file cut short behind the mapping's back: reading the shard is a SIGBUS,
// which ends the process with exit 1 and a message naming the file.
TEST(NvmeTensorFileDeathTest, ADiskErrorOnAMappedShardEndsTheRunNamingTheFile) {
  const std::string dir = temp_folder("sigbus");
  EXPECT_EXIT(
      {
        NvmeTensorFile f({dir, 0, 0});
        at::Tensor shard = f.place(at::ones({4096}));
        f.release(shard);
        ::truncate(f.path().c_str(), 0);
        std::printf("%f\n", shard.sum().item<double>());
      },
      ::testing::ExitedWithCode(1),
      "remat error: offload_param nvme: a parameter shard mapped from '.*rank0.parameters' could not be read or "
      "written \\(SIGBUS: a disk error under nvme_path, or the file was cut short");
}

// What the program's handlers below see: the file, to say whether it was
// removed before they ran.
char g_file[4096];
void exit_7_if_file_removed(int, siginfo_t*, void*) { ::_exit(::access(g_file, F_OK) != 0 ? 7 : 8); }
void exit_11(int, siginfo_t*, void*) { ::_exit(11); }

void install(int sig, void (*handler)(int, siginfo_t*, void*), int flags) {
  struct sigaction action {};
  action.sa_sigaction = handler;
  action.sa_flags = SA_SIGINFO | flags;
  sigemptyset(&action.sa_mask);
  ::sigaction(sig, &action, nullptr);
}

// Files made and destroyed in turn (an engine per run of a sweep, in one
// process): a disk error on the 300th is still named. The handler knew the
// first 256 files' ranges only, and the SIGBUS ended the process bare.
TEST(NvmeTensorFileDeathTest, ADiskErrorIsNamedAfterManyFilesCameAndWent) {
  const std::string dir = temp_folder("sigbus_many");
  EXPECT_EXIT(
      {
        for (int i = 0; i < 299; ++i) NvmeTensorFile({dir, 0, 0});
        NvmeTensorFile f({dir, 0, 0});
        at::Tensor shard = f.place(at::ones({4096}));
        f.release(shard);
        ::truncate(f.path().c_str(), 0);
        std::printf("%f\n", shard.sum().item<double>());
      },
      ::testing::ExitedWithCode(1), "a parameter shard mapped from '.*rank0.parameters' could not be read");
}

// A program with its own SIGTERM handler (SA_SIGINFO, SA_RESTART): remat's
// removes the file, then calls it; the program's system calls still restart
// (remat's handler keeps SA_RESTART). It was not called (the process was
// killed by the SIGTERM), and SA_RESTART was dropped.
TEST(NvmeTensorFileDeathTest, AProgramsSigtermHandlerRunsAfterTheFileIsRemoved) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";  // the handlers installed afresh, in a process of the test's own
  const std::string dir = temp_folder("sigterm");
  EXPECT_EXIT(
      {
        install(SIGTERM, exit_7_if_file_removed, SA_RESTART);
        NvmeTensorFile f({dir, 0, 0, "offload_optimizer"});
        std::strncpy(g_file, f.path().c_str(), sizeof g_file - 1);
        struct sigaction now {};
        ::sigaction(SIGTERM, nullptr, &now);
        if ((now.sa_flags & SA_RESTART) == 0) ::_exit(9);
        ::raise(SIGTERM);
        ::_exit(10);
      },
      ::testing::ExitedWithCode(7), "");
}

// A SIGBUS that is not on remat's files (a mapping of the program's, cut
// short) goes to the handler the process had (a program's, Open MPI's
// backtrace); it was dropped for the default, which ends the process.
TEST(NvmeTensorFileDeathTest, ASigbusElsewhereGoesToTheProcesssHandler) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  const std::string dir = temp_folder("sigbus_elsewhere");
  EXPECT_EXIT(
      {
        install(SIGBUS, exit_11, 0);
        NvmeTensorFile f({dir, 0, 0});
        const int fd = ::open((dir + "/the_programs").c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || ::ftruncate(fd, 4096) != 0) ::_exit(12);
        auto* mapped = static_cast<volatile char*>(::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0));
        if (::ftruncate(fd, 0) != 0) ::_exit(13);
        std::printf("%d\n", mapped[0]);
        ::_exit(14);
      },
      ::testing::ExitedWithCode(11), "");
}

// The signals that end a rank from outside besides SIGTERM and SIGINT:
// SIGUSR1 and SIGUSR2 (mpirun forwards them to the ranks, a scheduler sends
// them before the end of a job), SIGHUP, SIGPIPE (mpirun gone). The process ends
// by the signal as before, and its file is gone (it stayed).
TEST(NvmeTensorFileDeathTest, EveryEndingSignalRemovesTheFile) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  for (const int sig : {SIGUSR1, SIGHUP, SIGPIPE}) {
    // One folder for this process and the death test's (which runs the test
    // again, under a process id of its own).
    const char* base = std::getenv("TEST_TMPDIR");
    const std::string dir =
        ((base ? fs::path(base) : fs::temp_directory_path()) / ("remat_nvme_signal_" + std::to_string(sig))).string();
    fs::create_directories(dir);
    EXPECT_EXIT(
        {
          ::signal(sig, SIG_DFL);
          NvmeTensorFile f({dir, 0, 0, "offload_optimizer"});
          f.place(at::ones({4096}));
          ::raise(sig);
          ::_exit(10);
        },
        ::testing::KilledBySignal(sig), "")
        << strsignal(sig);
    EXPECT_FALSE(fs::exists(fs::path(dir) / "remat-masters" / "rank0" / "rank0.masters")) << strsignal(sig);
  }
}

}  // namespace
}  // namespace remat::parallel
