// The NVMe optimizer state store (parallel/internal/nvme_optimizer_store.h):
// k steps of AdamW and Adam through the file equal, bit for bit, the host Adam
// stepping the same range in memory, on every backend this machine runs; a
// disk too small and a file cut short behind its back are Errors naming the
// file (and the step); the file is gone after the store.
#include "parallel/internal/nvme_optimizer_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "optim/host_adam.h"
#include "runtime/error.h"
#include "tests/error_of.h"

namespace remat::parallel::internal {
namespace {

using ::testing::HasSubstr;
using testing::error_of;
namespace fs = std::filesystem;

std::string temp_folder(const std::string& name) {
  static int count = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  const fs::path dir = (base ? fs::path(base) : fs::temp_directory_path()) /
                       ("remat_nvme_store_" + std::to_string(::getpid())) / (name + std::to_string(++count));
  fs::create_directories(dir);
  return dir.string();
}

bool starts(IoBackend backend) {
  AsyncIoOptions options;
  options.backend = backend;
  try {
    AsyncFile probe(temp_folder("probe") + "/probe", 4096, options);
    return true;
  } catch (const Error&) {
    return false;
  }
}

bool equal_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * sizeof(float)) == 0;
}

struct Case {
  IoBackend backend;
  int buffer_count;
};

class Store : public ::testing::TestWithParam<Case> {};

// N not a multiple of the sub-group size, the sub-group's bytes (5000 x 4) not
// a multiple of the 4096-byte block: each array padded on disk.
TEST_P(Store, StepsEqualTheInMemoryHostAdamBitwise) {
  const Case c = GetParam();
  if (!starts(c.backend)) GTEST_SKIP() << io_backend_name(c.backend) << " does not start here";
  constexpr int64_t kSubGroup = 5000, kNumel = 3 * kSubGroup + 1234;
  struct Run {
    bool decoupled;
    double beta1, beta2, weight_decay;
  };
  for (const Run run : {Run{true, 0.9, 0.999, 0.01}, Run{false, 0.8, 0.95, 0.1}}) {
    torch::manual_seed(3);
    const at::Tensor init = torch::randn({kNumel});
    at::Tensor reference = init.clone();
    reference.mutable_grad() = torch::zeros({kNumel});
    std::unique_ptr<torch::optim::Optimizer> host;
    if (run.decoupled) {
      host = std::make_unique<optim::HostAdamW>(
          std::vector<at::Tensor>{reference},
          torch::optim::AdamWOptions(1e-3).betas({run.beta1, run.beta2}).weight_decay(run.weight_decay));
    } else {
      host = std::make_unique<optim::HostAdam>(
          std::vector<at::Tensor>{reference},
          torch::optim::AdamOptions(1e-3).betas({run.beta1, run.beta2}).weight_decay(run.weight_decay));
    }
    NvmeStoreOptions options;
    options.folder = temp_folder("bitwise");
    options.numel = kNumel;
    options.sub_group_size = kSubGroup;
    options.buffer_count = c.buffer_count;
    options.io.backend = c.backend;
    options.io.block_size = 8192;
    std::string path;
    {
      NvmeOptimizerStore store(options);
      path = store.path();
      EXPECT_TRUE(fs::exists(path));
      EXPECT_EQ(store.file_bytes(), 3u * (3 * 20480 + 8192));  // 20000 -> 20480, 4936 -> 8192 bytes
      store.initialize(init);
      at::Tensor device_copy = torch::zeros({kNumel});  // what the callback writes, as the params would be
      for (int k = 1; k <= 4; ++k) {
        const double lr = 1e-3 * k;  // a schedule: the rate changes every step
        const at::Tensor grad = torch::randn({kNumel}) * 0.1;
        reference.mutable_grad().copy_(grad);
        for (auto& group : host->param_groups()) {
          if (run.decoupled) {
            static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
          } else {
            static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
          }
        }
        host->step();
        optim::HostAdamStep adam{lr, run.beta1, run.beta2, 1e-8, run.weight_decay, run.decoupled};
        int64_t seen = 0;
        store.step(grad, adam, [&](int64_t begin, const float* masters, int64_t n) {
          EXPECT_EQ(begin, seen);
          std::memcpy(device_copy.data_ptr<float>() + begin, masters, n * sizeof(float));
          seen += n;
        });
        EXPECT_EQ(seen, kNumel);
        EXPECT_EQ(store.steps(), k);
        EXPECT_TRUE(equal_bits(device_copy, reference)) << "step " << k;
        EXPECT_EQ(store.last_step().bytes_read, store.file_bytes());
        EXPECT_EQ(store.last_step().bytes_written, store.file_bytes());
      }
      at::Tensor masters = torch::empty({kNumel}), m = torch::empty({kNumel}), v = torch::empty({kNumel});
      store.read(masters, m, v);
      EXPECT_TRUE(equal_bits(masters, reference));
      ASSERT_EQ(host->state().size(), 1u);
      const auto& state = *host->state().begin()->second;
      const at::Tensor ref_m = run.decoupled
                                   ? static_cast<const torch::optim::AdamWParamState&>(state).exp_avg()
                                   : static_cast<const torch::optim::AdamParamState&>(state).exp_avg();
      const at::Tensor ref_v = run.decoupled
                                   ? static_cast<const torch::optim::AdamWParamState&>(state).exp_avg_sq()
                                   : static_cast<const torch::optim::AdamParamState&>(state).exp_avg_sq();
      EXPECT_TRUE(equal_bits(m, ref_m));
      EXPECT_TRUE(equal_bits(v, ref_v));
      EXPECT_EQ(store.backend(), c.backend);
    }
    EXPECT_FALSE(fs::exists(path)) << "the file is removed with the store";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Store,
                         ::testing::Values(Case{IoBackend::kIoUring, 2}, Case{IoBackend::kIoUring, 4},
                                           Case{IoBackend::kLibaio, 2}, Case{IoBackend::kLibaio, 3},
                                           Case{IoBackend::kThreads, 2}, Case{IoBackend::kThreads, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(io_backend_name(info.param.backend)) + "_" +
                                  std::to_string(info.param.buffer_count) + "_buffers";
                         });

// A disk too small for the state: the store's file cannot be created at its
// size, and the error names the file (RLIMIT_FSIZE in a child: EFBIG).
TEST(StoreFaults, ADiskTooSmallIsRefusedAtStartNamingTheFile) {
  const std::string folder = temp_folder("small");
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit cap{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &cap);
    NvmeStoreOptions options;
    options.folder = folder;
    options.numel = 1 << 20;  // 12 MiB of state
    const std::string out = error_of<Error>([&] { NvmeOptimizerStore store(options); });
    (void)!::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char chunk[4096];
  for (ssize_t got; (got = ::read(fds[0], chunk, sizeof chunk)) > 0;) out.append(chunk, static_cast<size_t>(got));
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  EXPECT_THAT(out, HasSubstr(folder + "/rank0.optimizer"));
  EXPECT_THAT(out, HasSubstr("EFBIG"));
}

// The file cut short behind the store's back (a disk that failed): the step is
// an Error naming the step, the sub-group and the file, and later steps are
// refused saying the state is lost.
TEST(StoreFaults, AFileCutShortMidRunNamesTheStepAndTheFile) {
  NvmeStoreOptions options;
  options.folder = temp_folder("cut");
  options.numel = 4 * 2048;
  options.sub_group_size = 2048;  // four sub-groups of 24 KiB records
  options.io.backend = IoBackend::kThreads;
  NvmeOptimizerStore store(options);
  store.initialize(torch::ones({options.numel}));
  const at::Tensor grad = torch::ones({options.numel});
  store.step(grad, {});
  ASSERT_EQ(::truncate(store.path().c_str(), 2 * 3 * 8192), 0);
  const std::string e = error_of<Error>([&] { store.step(grad, {}); });
  EXPECT_THAT(e, HasSubstr("NVMe optimizer state, step 2, sub-group "));
  EXPECT_THAT(e, HasSubstr("in '" + store.path() + "'"));
  EXPECT_THAT(error_of<Error>([&] { store.step(grad, {}); }), HasSubstr("the optimizer state is lost"));
}

TEST(StoreFaults, WrongInputsAreNamed) {
  NvmeStoreOptions options;
  options.folder = temp_folder("inputs");
  options.numel = 100;
  options.buffer_count = 1;
  EXPECT_THAT(error_of<Error>([&] { NvmeOptimizerStore store(options); }), HasSubstr("buffer_count 1 must be at least 2"));
  options.buffer_count = 2;
  NvmeOptimizerStore store(options);
  EXPECT_THAT(error_of<Error>([&] { store.step(torch::ones({99}), {}); }),
              HasSubstr("the gradients must be a contiguous float32 host tensor of 100 elements"));
}

}  // namespace
}  // namespace remat::parallel::internal
