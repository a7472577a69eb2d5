// AsyncFile through every backend this machine runs, direct and buffered; the
// faults of a disk (full, refused O_DIRECT, a file cut short) and of a caller
// (unaligned, past the end, a pool run dry), each with its message.
#include "runtime/async_io.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

namespace fs = std::filesystem;

// This process's folder: under the test's own TEST_TMPDIR (Bazel), else the
// system's temporary folder (ctest); removed when the tests end.
const fs::path& test_root() {
  static const fs::path root = [] {
    const char* base = std::getenv("TEST_TMPDIR");
    fs::path dir = (base ? fs::path(base) : fs::temp_directory_path()) /
                   ("remat_async_io_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    return dir;
  }();
  return root;
}

class RemoveTestRoot : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(test_root(), ignored);
  }
};
const auto* const kRemoveTestRoot = ::testing::AddGlobalTestEnvironment(new RemoveTestRoot);

// A fresh folder of this test's.
std::string temp_folder(const std::string& name) {
  static int count = 0;
  const fs::path dir = test_root() / (name + "." + std::to_string(++count));
  fs::create_directories(dir);
  return dir.string();
}

void fill_random(void* data, size_t bytes, unsigned seed) {
  std::mt19937 gen(seed);
  auto* p = static_cast<unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(gen());
}

// Whether `backend` starts here; its error names it and why where it does not.
bool starts(IoBackend backend) {
  AsyncIoOptions options;
  options.backend = backend;
  try {
    AsyncFile probe(temp_folder("probe") + "/probe", 4096, options);
    return true;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(io_backend_name(backend)));
    EXPECT_THAT(e.what(), HasSubstr("cannot start"));
    return false;
  }
}

struct Mode {
  IoBackend backend;
  DirectIo direct;
};

class RoundTrip : public ::testing::TestWithParam<Mode> {};

TEST_P(RoundTrip, RandomDataComesBackBitForBit) {
  const Mode mode = GetParam();
  if (!starts(mode.backend)) return;  // starts() asserted the refusal names the backend and why
  AsyncIoOptions options;
  options.backend = mode.backend;
  options.direct = mode.direct;
  options.block_size = 256 << 10;
  options.queue_depth = 4;
  const size_t bytes = (3 << 20) + (12 << 10);  // 12 full pieces and a partial one
  AsyncFile file(temp_folder("round") + "/state", bytes + 8192, options);
  EXPECT_EQ(file.backend(), mode.backend);
  EXPECT_EQ(file.direct(), mode.direct != DirectIo::kOff);  // ext4 and xfs allow O_DIRECT
  AlignedBuffer out(bytes), in(bytes);
  fill_random(out.data(), bytes, 7);
  file.write(4096, out.data(), bytes).wait();
  file.read(4096, in.data(), bytes).wait();
  EXPECT_EQ(std::memcmp(out.data(), in.data(), bytes), 0);
  const AsyncIoStats stats = file.stats();
  EXPECT_EQ(stats.reads, 1u);
  EXPECT_EQ(stats.writes, 1u);
  EXPECT_EQ(stats.bytes_read, bytes);
  EXPECT_EQ(stats.bytes_written, bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, RoundTrip,
    ::testing::Values(Mode{IoBackend::kIoUring, DirectIo::kRequired}, Mode{IoBackend::kIoUring, DirectIo::kOff},
                      Mode{IoBackend::kLibaio, DirectIo::kRequired}, Mode{IoBackend::kLibaio, DirectIo::kOff},
                      Mode{IoBackend::kThreads, DirectIo::kRequired}, Mode{IoBackend::kThreads, DirectIo::kOff}),
    [](const ::testing::TestParamInfo<Mode>& info) {
      return std::string(io_backend_name(info.param.backend)) +
             (info.param.direct == DirectIo::kOff ? "_buffered" : "_direct");
    });

TEST(AsyncFile, AutoNamesTheBackendItChoseAndWhy) {
  AsyncFile file(temp_folder("auto") + "/f", 4096);
  EXPECT_NE(file.backend(), IoBackend::kAuto);
  EXPECT_THAT(file.backend_reason(), HasSubstr(io_backend_name(file.backend())));
  if (starts(IoBackend::kIoUring)) {
    EXPECT_EQ(file.backend(), IoBackend::kIoUring);
  }
}

// A container that forbids io_uring (simulated: REMAT_FAULT_NO_IO_URING):
// auto takes libaio and says why; io_uring asked for by name is refused.
TEST(AsyncFile, AutoFallsBackWhereIoUringCannotStart) {
  ::setenv("REMAT_FAULT_NO_IO_URING", "1", 1);
  const std::string dir = temp_folder("fallback");
  AsyncIoOptions options;
  options.backend = IoBackend::kIoUring;
  const std::string refused = error_of<Error>([&] { AsyncFile(dir + "/f", 4096, options); });
  options.backend = IoBackend::kAuto;
  std::unique_ptr<AsyncFile> file = std::make_unique<AsyncFile>(dir + "/f", 1 << 20, options);
  AlignedBuffer out(1 << 20), in(1 << 20);
  fill_random(out.data(), out.size(), 5);
  file->write(0, out.data(), out.size()).wait();
  file->read(0, in.data(), in.size()).wait();
  ::unsetenv("REMAT_FAULT_NO_IO_URING");
  EXPECT_THAT(refused, HasSubstr("the io_uring backend was asked for but cannot start: io_uring_queue_init: "
                                 "Operation not permitted (EPERM)"));
  EXPECT_THAT(refused, HasSubstr("ask for libaio, threads or auto"));
  EXPECT_NE(file->backend(), IoBackend::kIoUring);
  EXPECT_THAT(file->backend_reason(), HasSubstr("(auto: io_uring cannot start: io_uring_queue_init: "
                                                "Operation not permitted (EPERM)"));
  EXPECT_EQ(std::memcmp(out.data(), in.data(), in.size()), 0);
}

// Many more requests than the queue holds, each its own region, waited for in
// reverse order: every one lands where it belongs. Under each submission style.
TEST(AsyncFile, ManyRequestsInFlightCompleteWithTheRightData) {
  for (IoBackend backend : {IoBackend::kIoUring, IoBackend::kLibaio, IoBackend::kThreads}) {
    if (!starts(backend)) continue;
    for (int style = 0; style < 3; ++style) {
      AsyncIoOptions options;
      options.backend = backend;
      options.block_size = 16 << 10;
      options.queue_depth = 4;
      options.thread_count = style == 2 ? 3 : 1;
      options.single_submit = style == 1;
      options.overlap_events = style != 1;
      const size_t count = 48, each = 64 << 10;
      AsyncFile file(temp_folder("many") + "/f", count * each, options);
      AlignedBuffer out(count * each), in(count * each);
      fill_random(out.data(), count * each, 11 + style);
      std::vector<IoRequest> writes, reads;
      for (size_t i = 0; i < count; ++i) {
        writes.push_back(file.write(i * each, static_cast<char*>(out.data()) + i * each, each));
      }
      for (size_t i = count; i-- > 0;) writes[i].wait();
      for (size_t i = 0; i < count; ++i) {
        reads.push_back(file.read(i * each, static_cast<char*>(in.data()) + i * each, each));
      }
      for (size_t i = count; i-- > 0;) reads[i].wait();
      EXPECT_EQ(std::memcmp(out.data(), in.data(), count * each), 0)
          << io_backend_name(backend) << " style " << style;
    }
  }
}

// A request of 25 pieces of 12 KiB and a last one of 4 KiB.
TEST(AsyncFile, ARequestSplitIntoBlocksReassembles) {
  AsyncIoOptions options;
  options.block_size = 12 << 10;
  options.queue_depth = 2;
  const size_t bytes = 25 * (12 << 10) + 4096;
  AsyncFile file(temp_folder("split") + "/f", bytes, options);
  AlignedBuffer out(bytes), in(bytes);
  fill_random(out.data(), bytes, 3);
  IoRequest write = file.write(0, out.data(), bytes);
  write.wait();
  EXPECT_TRUE(write.done());
  file.read(0, in.data(), bytes).wait();
  EXPECT_EQ(std::memcmp(out.data(), in.data(), bytes), 0);
}

TEST(AsyncFile, UnalignedRequestsAreRefusedInDirectModeOnly) {
  AsyncIoOptions options;
  options.direct = DirectIo::kRequired;
  AsyncFile file(temp_folder("align") + "/f", 1 << 20, options);
  ASSERT_TRUE(file.direct());
  AlignedBuffer buffer(64 << 10);
  char* odd = static_cast<char*>(buffer.data()) + 512;
  EXPECT_THAT(error_of<Error>([&] { file.write(0, odd, 4096); }), HasSubstr("multiples of 4096"));
  EXPECT_THAT(error_of<Error>([&] { file.read(100, buffer.data(), 4096); }), HasSubstr("at offset 100"));
  EXPECT_THAT(error_of<Error>([&] { file.read(0, buffer.data(), 1000); }), HasSubstr("1000 bytes"));
  options.direct = DirectIo::kOff;
  AsyncFile plain(temp_folder("align") + "/g", 1 << 20, options);
  std::memcpy(odd, "remat", 5);
  plain.write(100, odd, 5).wait();
  char back[5] = {};
  plain.read(100, back, 5).wait();
  EXPECT_EQ(std::string(back, 5), "remat");
}

TEST(AsyncFile, ReadsAndWritesPastTheEndAreRefusedNamingFileAndOffset) {
  const std::string path = temp_folder("end") + "/f";
  AsyncFile file(path, 64 << 10);
  AlignedBuffer buffer(8192);
  const std::string read = error_of<Error>([&] { file.read(60 << 10, buffer.data(), 8192); });
  EXPECT_THAT(read, HasSubstr("read of 8192 bytes at offset 61440 of '" + path + "' passes its end (65536 bytes)"));
  EXPECT_THAT(error_of<Error>([&] { file.write(1 << 20, buffer.data(), 4096); }), HasSubstr("passes its end"));
}

TEST(AsyncFile, AFileCutShortBehindItsBackIsAnErrorNotAHang) {
  const std::string path = temp_folder("cut") + "/f";
  for (IoBackend backend : {IoBackend::kIoUring, IoBackend::kLibaio, IoBackend::kThreads}) {
    if (!starts(backend)) continue;
    AsyncIoOptions options;
    options.backend = backend;
    AsyncFile file(path, 64 << 10, options);
    ASSERT_EQ(::truncate(path.c_str(), 16 << 10), 0);
    AlignedBuffer buffer(8192);
    EXPECT_THAT(error_of<Error>([&] { file.read(32 << 10, buffer.data(), 8192).wait(); }),
                HasSubstr("read of '" + path + "' at offset 32768 (8192 bytes): met the end of the file"))
        << io_backend_name(backend);
  }
}

TEST(AsyncFile, WaitGivesUpAfterItsTimeoutSayingWhatIsStuck) {
  AsyncIoOptions options;
  options.backend = IoBackend::kThreads;
  options.queue_depth = 1;
  const size_t bytes = 64 << 20;
  AsyncFile file(temp_folder("timeout") + "/f", bytes, options);
  AlignedBuffer buffer(bytes);
  IoRequest write = file.write(0, buffer.data(), bytes);
  EXPECT_THAT(error_of<TimeoutError>([&] { write.wait(std::chrono::milliseconds(0)); }),
              HasSubstr("of 64 pieces complete: the disk or the I/O backend is stuck"));
  write.wait();
}

TEST(AsyncFile, TwoThreadsOnDistinctRegions) {
  AsyncIoOptions options;
  options.block_size = 64 << 10;
  options.thread_count = 2;
  const size_t region = 1 << 20;
  AsyncFile file(temp_folder("threads") + "/f", 2 * region, options);
  auto worker = [&](int t, bool* ok) {
    AlignedBuffer out(region), in(region);
    *ok = true;
    for (int round = 0; round < 8; ++round) {
      fill_random(out.data(), region, 100 * t + round);
      file.write(t * region, out.data(), region).wait();
      file.read(t * region, in.data(), region).wait();
      *ok = *ok && std::memcmp(out.data(), in.data(), region) == 0;
    }
  };
  bool ok0 = false, ok1 = false;
  std::thread a(worker, 0, &ok0), b(worker, 1, &ok1);
  a.join();
  b.join();
  EXPECT_TRUE(ok0);
  EXPECT_TRUE(ok1);
  EXPECT_EQ(file.stats().writes, 16u);
}

TEST(AsyncIoOptions, EachProblemIsNamed) {
  AsyncIoOptions options;
  options.block_size = 1000;
  options.queue_depth = 0;
  options.thread_count = 0;
  const std::string problems = check_async_io_options(options);
  EXPECT_THAT(problems, HasSubstr("aio.block_size 1000 is not a multiple of the alignment 4096"));
  EXPECT_THAT(problems, HasSubstr("aio.queue_depth 0"));
  EXPECT_THAT(problems, HasSubstr("aio.thread_count 0"));
  EXPECT_THAT(error_of<ConfigError>([&] { AsyncFile(temp_folder("opts") + "/f", 4096, options); }),
              HasSubstr("aio.queue_depth 0"));
  options = AsyncIoOptions();
  options.direct = DirectIo::kOff;
  options.block_size = 1000;
  EXPECT_EQ(check_async_io_options(options), "");
}

TEST(BufferPool, LendsAlignedBuffersAndTimesOutWhenAllAreLent) {
  BufferPool pool(2, 10000);
  EXPECT_EQ(pool.buffer_size(), 10000u);
  BufferPool::Lease a = pool.acquire();
  std::optional<BufferPool::Lease> b(pool.acquire());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  EXPECT_EQ(a.size(), 12288u);  // rounded up to the alignment
  EXPECT_NE(a.data(), b->data());
  EXPECT_EQ(pool.available(), 0u);
  EXPECT_THAT(error_of<TimeoutError>([&] { pool.acquire(std::chrono::milliseconds(10)); }),
              HasSubstr("all 2 buffers of 10000 bytes still lent"));
  b.reset();
  EXPECT_EQ(pool.available(), 1u);
  BufferPool::Lease c = pool.acquire(std::chrono::milliseconds(10));
  EXPECT_NE(c.data(), a.data());
}

TEST(Folders, FreeSpaceAndTheDirectIoProbe) {
  const std::string dir = temp_folder("folder");
  EXPECT_GT(free_bytes(dir), 0u);
  EXPECT_THAT(error_of<ConfigError>([&] { require_free_bytes(dir, uint64_t(1) << 62, "the optimizer state"); }),
              HasSubstr("the optimizer state needs 4611686018427387904 bytes in '" + dir + "'"));
  EXPECT_THAT(error_of<Error>([&] { free_bytes(dir + "/missing"); }), HasSubstr("missing"));
  // The probe agrees with what a file there gets.
  const DirectIoSupport probe = probe_direct_io(dir);
  AsyncIoOptions options;
  options.direct = DirectIo::kPreferred;
  AsyncFile file(dir + "/f", 4096, options);
  EXPECT_EQ(file.direct(), probe.supported) << probe.reason;
  EXPECT_FALSE(probe_direct_io(dir + "/missing").supported);
}

// --- a filesystem of our own: a child process in a private mount namespace ---

// Runs `body` in a child process after `setup` (a mount, a limit), so that
// what setup changes dies with the child; returns what the body returned, or
// nullopt where setup failed (not root: no mount).
std::optional<std::string> in_child(const std::function<bool()>& setup, const std::function<std::string()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return std::nullopt;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    if (!setup()) ::_exit(3);
    std::string out;
    try {
      out = body();
    } catch (const std::exception& e) {
      out = std::string("exception: ") + e.what();
    }
    (void)!::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char chunk[4096];
  ssize_t got;
  while ((got = ::read(fds[0], chunk, sizeof chunk)) > 0) out.append(chunk, static_cast<size_t>(got));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) return std::nullopt;
  return out;
}

// A fresh filesystem of `type` at `dir`, seen by this (child) process only.
bool mount_private(const std::string& type, const std::string& data, const std::string& dir) {
  return ::unshare(CLONE_NEWNS) == 0 && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
         ::mount(type.c_str(), dir.c_str(), type.c_str(), 0, data.empty() ? nullptr : data.c_str()) == 0;
}

// ramfs refuses O_DIRECT (as tmpfs did before Linux 6.6): preferred falls back
// to buffered I/O, required is a ConfigError naming the path.
TEST(AsyncFile, AFilesystemWithoutDirectIoFallsBackOrIsRefused) {
  const std::string dir = temp_folder("ramfs");
  auto run = [&] {
    return in_child([&] { return mount_private("ramfs", "", dir); }, [&] {
      AsyncIoOptions options;
      options.direct = DirectIo::kRequired;
      std::string out = error_of<ConfigError>([&] { AsyncFile(dir + "/f", 4096, options); });
      options.direct = DirectIo::kPreferred;
      AsyncFile file(dir + "/f", 8192, options);
      AlignedBuffer buffer(4096);
      std::memcpy(buffer.data(), "ramfs", 5);
      file.write(4096, buffer.data(), 4096).wait();
      std::memset(buffer.data(), 0, 5);
      file.read(4096, buffer.data(), 4096).wait();
      return out + "|direct=" + std::to_string(file.direct()) + "|" + std::string(static_cast<char*>(buffer.data()), 5) +
             "|probe=" + std::to_string(probe_direct_io(dir).supported);
    });
  };
  const std::optional<std::string> out = run();
  if (!out) {
    // Not root: /dev/shm is what there is; the file gets what the probe says.
    const bool direct = probe_direct_io("/dev/shm").supported;
    AsyncFile file("/dev/shm/remat_async_io_test." + std::to_string(::getpid()), 4096);
    EXPECT_EQ(file.direct(), direct);
    ::unlink(file.path().c_str());
    return;
  }
  EXPECT_THAT(*out, HasSubstr("'" + dir + "/f' is on a filesystem that refuses direct I/O"));
  EXPECT_THAT(*out, HasSubstr("give a folder on a disk filesystem"));
  EXPECT_THAT(*out, HasSubstr("|direct=0|ramfs|probe=0"));
}

// A write that fills the disk: a 1 MiB tmpfs of our own where this process may
// mount one (ENOSPC), else a file-size limit of 1 MiB (RLIMIT_FSIZE: EFBIG).
TEST(AsyncFile, AWriteThatFillsTheDiskNamesFileOffsetAndBytes) {
  const std::string dir = temp_folder("full");
  const std::string path = dir + "/f";
  auto fill = [&](bool limit) {
    std::string out;
    for (IoBackend backend : {IoBackend::kIoUring, IoBackend::kLibaio, IoBackend::kThreads}) {
      AsyncIoOptions options;
      options.backend = backend;
      options.block_size = 256 << 10;
      std::unique_ptr<AsyncFile> file;
      try {
        file = std::make_unique<AsyncFile>(path, 4 << 20, options);
      } catch (const Error&) {
        continue;  // not on this kernel (the round trip tests assert why)
      }
      if (limit) {
        ::signal(SIGXFSZ, SIG_IGN);
        rlimit cap{1 << 20, RLIM_INFINITY};  // the soft limit: raised again below
        ::setrlimit(RLIMIT_FSIZE, &cap);
      }
      AlignedBuffer buffer(4 << 20);
      out += std::string(io_backend_name(backend)) + ": " +
             error_of<Error>([&] { file->write(0, buffer.data(), buffer.size()).wait(); }) + "\n";
      file.reset();
      ::unlink(path.c_str());
      if (limit) {
        rlimit none{RLIM_INFINITY, RLIM_INFINITY};
        ::setrlimit(RLIMIT_FSIZE, &none);
      }
    }
    return out;
  };
  std::optional<std::string> out =
      in_child([&] { return mount_private("tmpfs", "size=1M", dir); }, [&] { return fill(false); });
  const bool mounted = out.has_value();
  if (!mounted) out = in_child([] { return true; }, [&] { return fill(true); });
  ASSERT_TRUE(out.has_value());
  const std::string expected = mounted ? "No space left on device (ENOSPC): the disk is full"
                                       : "File too large (EFBIG)";
  EXPECT_THAT(*out, HasSubstr("threads: write of '" + path + "' at offset "));
  EXPECT_THAT(*out, HasSubstr(expected));
  for (const char* backend : {"io_uring", "libaio", "threads"}) {
    const size_t at = out->find(std::string(backend) + ": ");
    if (at == std::string::npos) continue;
    const std::string line = out->substr(at, out->find('\n', at) - at);
    EXPECT_THAT(line, HasSubstr(expected)) << line;
    EXPECT_THAT(line, HasSubstr("bytes)")) << line;
  }
  std::cout << (mounted ? "full disk: a 1 MiB tmpfs (ENOSPC)\n" : "full disk: RLIMIT_FSIZE (EFBIG)\n") << *out;
}

}  // namespace
}  // namespace remat
