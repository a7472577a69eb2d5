// The NVMe optimizer state store (parallel/internal/nvme_optimizer_store.h):
// k steps of AdamW and Adam through the file equal, bit for bit, the host Adam
// stepping the same tensors in memory, on every backend this machine runs; a
// state written is read back and stepped from; a
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
#include "optim/optimizer.h"
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

// Tensors of 7000, 0, 9000 and 1234 elements laid end to end in sub-groups of
// 5000 (one tensor spans three of them, one lies inside one), the sub-group's
// bytes (5000 x 4) not a multiple of the 4096-byte alignment: each array padded on
// disk. The third tensor has no gradient at step 2 (not stepped, its step
// count behind the others'), as LibTorch's Adam skips it.
TEST_P(Store, StepsEqualTheInMemoryHostAdamBitwise) {
  const Case c = GetParam();
  if (!starts(c.backend)) GTEST_SKIP() << io_backend_name(c.backend) << " does not start here";
  const std::vector<int64_t> sizes = {7000, 0, 9000, 1234};
  constexpr int64_t kSubGroup = 5000;
  struct Run {
    bool decoupled;
    double beta1, beta2, weight_decay;
  };
  for (const Run run : {Run{true, 0.9, 0.999, 0.01}, Run{false, 0.8, 0.95, 0.1}}) {
    torch::manual_seed(3);
    std::vector<at::Tensor> reference, masters;
    for (int64_t n : sizes) {
      reference.push_back(torch::randn({n}).requires_grad_(true));
      masters.push_back(reference.back().detach().clone().requires_grad_(true));
    }
    std::unique_ptr<torch::optim::Optimizer> host;
    if (run.decoupled) {
      host = std::make_unique<optim::HostAdamW>(
          reference, torch::optim::AdamWOptions(1e-3).betas({run.beta1, run.beta2}).weight_decay(run.weight_decay));
    } else {
      host = std::make_unique<optim::HostAdam>(
          reference, torch::optim::AdamOptions(1e-3).betas({run.beta1, run.beta2}).weight_decay(run.weight_decay));
    }
    NvmeStoreOptions options;
    options.folder = temp_folder("bitwise");
    options.sizes = sizes;
    options.sub_group_size = kSubGroup;
    options.buffer_count = c.buffer_count;
    options.io.backend = c.backend;
    options.io.block_size = 8192;
    std::string path;
    {
      NvmeOptimizerStore store(options);
      path = store.path();
      EXPECT_TRUE(fs::exists(path));
      // 17234 elements: sub-groups of 5000, 5000, 5000, 2234; each array padded
      // to the 4096-byte alignment: 20000 -> 20480, 8936 -> 12288 bytes.
      EXPECT_EQ(store.file_bytes(), 2u * (3 * 20480 + 12288));
      store.initialize();
      for (int k = 1; k <= 4; ++k) {
        const double lr = 1e-3 * k;  // a schedule: the rate changes every step
        for (size_t i = 0; i < sizes.size(); ++i) {
          const bool skipped = i == 2 && k == 2;
          const at::Tensor grad = torch::randn({sizes[i]}) * 0.1;
          reference[i].mutable_grad() = skipped ? at::Tensor() : grad.clone();
          masters[i].mutable_grad() = skipped ? at::Tensor() : grad.clone();
        }
        for (auto& group : host->param_groups()) group.options().set_lr(lr);
        host->step();
        store.step(masters, {lr, run.beta1, run.beta2, 1e-8, run.weight_decay, run.decoupled});
        for (size_t i = 0; i < sizes.size(); ++i) {
          EXPECT_TRUE(equal_bits(masters[i], reference[i])) << "step " << k << ", tensor " << i;
        }
        EXPECT_EQ(store.steps(2), k >= 2 ? k - 1 : k);
        EXPECT_EQ(store.steps(0), k);
        EXPECT_EQ(store.last_step().bytes_read, store.file_bytes());
        EXPECT_EQ(store.last_step().bytes_written, store.file_bytes());
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        at::Tensor m = torch::empty({sizes[i]}), v = torch::empty({sizes[i]});
        store.read_state(i, m, v);
        if (sizes[i] == 0) continue;  // LibTorch keeps a state for it too; nothing to compare
        const auto state = optim::optimizer_state_of(*host, reference[i]);
        EXPECT_TRUE(equal_bits(m, state.at("exp_avg"))) << "tensor " << i;
        EXPECT_TRUE(equal_bits(v, state.at("exp_avg_sq"))) << "tensor " << i;
        EXPECT_EQ(state.at("step").item<int64_t>(), store.steps(i)) << "tensor " << i;
      }
      EXPECT_EQ(store.backend(), c.backend);
    }
    EXPECT_FALSE(fs::exists(path)) << "the file is removed with the store";
  }
}

// A state written (a load) is what the next read returns and what the next
// step continues from; a cleared one starts again from zero moments.
TEST(StoreState, WrittenStateIsReadBackAndSteppedFrom) {
  NvmeStoreOptions options;
  options.folder = temp_folder("state");
  options.sizes = {3000, 5000};
  options.sub_group_size = 2048;
  options.io.backend = IoBackend::kThreads;
  NvmeOptimizerStore store(options);
  store.initialize();
  torch::manual_seed(5);
  const at::Tensor m = torch::randn({5000}), v = torch::rand({5000});
  store.write_state(1, m, v, 7);
  EXPECT_EQ(store.steps(1), 7);
  EXPECT_EQ(store.steps(0), 0);
  at::Tensor m2 = torch::empty({5000}), v2 = torch::empty({5000}), z = torch::empty({3000}), z2 = torch::empty({3000});
  store.read_state(1, m2, v2);
  EXPECT_TRUE(equal_bits(m, m2));
  EXPECT_TRUE(equal_bits(v, v2));
  store.read_state(0, z, z2);
  EXPECT_EQ(z.abs().sum().item<float>(), 0.0f) << "writing tensor 1 left tensor 0's moments (sharing a sub-group)";
  // The next step continues from step 8 with those moments, as LibTorch's Adam would.
  at::Tensor p = torch::randn({5000}).requires_grad_(true), q = p.detach().clone().requires_grad_(true);
  at::Tensor p0 = torch::randn({3000}).requires_grad_(true);
  const at::Tensor g = torch::randn({5000});
  q.mutable_grad() = g.clone();
  at::Tensor mm = m.clone(), vv = v.clone();
  optim::HostAdamStep adam;
  adam.step = 8;
  optim::host_adam_update(p.data_ptr<float>(), g.data_ptr<float>(), mm.data_ptr<float>(), vv.data_ptr<float>(), 5000,
                          adam);
  store.step({p0, q}, adam);
  EXPECT_TRUE(equal_bits(p, q));
  EXPECT_EQ(store.steps(1), 8);
  store.write_state(1, at::Tensor(), at::Tensor(), 0);
  store.read_state(1, m2, v2);
  EXPECT_EQ(m2.abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(store.steps(1), 0);
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
    options.sizes = {1 << 20};  // 8 MiB of state
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
  options.sizes = {4 * 2048};
  options.sub_group_size = 2048;  // four sub-groups of 16 KiB records
  options.io.backend = IoBackend::kThreads;
  NvmeOptimizerStore store(options);
  store.initialize();
  at::Tensor master = torch::ones({4 * 2048}).requires_grad_(true);
  master.mutable_grad() = torch::ones({4 * 2048});
  store.step({master}, {});
  ASSERT_EQ(::truncate(store.path().c_str(), 2 * 2 * 8192), 0);
  const std::string e = error_of<Error>([&] { store.step({master}, {}); });
  EXPECT_THAT(e, HasSubstr("NVMe optimizer state, step 2, sub-group "));
  EXPECT_THAT(e, HasSubstr("in '" + store.path() + "'"));
  EXPECT_THAT(error_of<Error>([&] { store.step({master}, {}); }), HasSubstr("the optimizer state is lost"));
}

TEST(StoreFaults, WrongInputsAreNamed) {
  NvmeStoreOptions options;
  options.folder = temp_folder("inputs");
  options.sizes = {100};
  options.buffer_count = 1;
  EXPECT_THAT(error_of<Error>([&] { NvmeOptimizerStore store(options); }), HasSubstr("buffer_count 1 must be at least 2"));
  options.buffer_count = 2;
  NvmeOptimizerStore store(options);
  at::Tensor master = torch::ones({100}).requires_grad_(true);
  master.mutable_grad() = torch::ones({99});
  EXPECT_THAT(error_of<Error>([&] { store.step({master}, {}); }),
              HasSubstr("the gradient of tensor 0 must be a contiguous float32 host tensor of 100 elements"));
  EXPECT_THAT(error_of<Error>([&] { store.step({master, master}, {}); }), HasSubstr("2 tensors to step, made for 1"));
}

}  // namespace
}  // namespace remat::parallel::internal
