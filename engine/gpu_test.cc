// GPU checks (CMake, label gpu: built where find_package(Torch) finds a CUDA
// LibTorch, run on a machine with a GPU): the tracked RNG on CUDA generators,
// checkpoint recompute on the device bitwise equal to the plain run (both
// region kinds, every policy), stored inputs offloaded to pinned host memory,
// activation offloading with pinned copies on side streams, the device memory
// each variant holds, and the engine training a model on the device.
// The bitwise cases run on deterministic kernels (KernelDeterminism, set for
// the whole binary); GpuParity holds the variants to the plain step's own
// run-to-run difference where the fused kernels run (docs/checkpointing.md,
// "Bitwise parity on a GPU").
// Figures go to stdout as lines starting "gpu:" (docs/benchmarks.md quotes them).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>

#include <ATen/Context.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#if defined(REMAT_WITH_C10_CUDA)  // CMake's gpu_test target, with a CUDA LibTorch
#include <c10/cuda/CUDACachingAllocator.h>
#define REMAT_GPU_TEST_ALLOCATOR_STATS 1
#endif

#include "checkpointing/checkpoint.h"
#include "checkpointing/offload_activations.h"
#include "checkpointing/policy.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "models/gpt.h"
#include "models/stack.h"
#include "rng/rng_tracker.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "tests/checkpoint_modes.h"

namespace remat {
namespace {

const at::Device kGpu(at::kCUDA, 0);

bool have_gpu() { return torch::cuda::is_available() && torch::cuda::device_count() > 0; }

#define REQUIRE_GPU() ASSERT_TRUE(have_gpu()) << "no CUDA device: the gpu-labelled tests run on a GPU machine"

// ---------------------------------------------------------------------------
// Kernel determinism. On: deterministic algorithms (warn only: an op without a
// deterministic CUDA kernel warns instead of throwing) and attention through
// SDPA's math backend, whose backward is plain kernels; the fused backends'
// backward accumulates in an order that varies from run to run, and under
// warn-only deterministic algorithms they just warn. Off: as a user's run
// has it. The guard restores what it found.
class KernelDeterminism {
 public:
  explicit KernelDeterminism(bool on)
      : algorithms_(ctx().deterministicAlgorithms()), warn_only_(ctx().deterministicAlgorithmsWarnOnly()),
        fused_(fused_attention()) {
    ctx().setDeterministicAlgorithms(on, /*warn_only=*/true);
    set_fused_attention(on ? Fused{false, false, false} : Fused{});
  }
  ~KernelDeterminism() {
    ctx().setDeterministicAlgorithms(algorithms_, warn_only_);
    set_fused_attention(fused_);
  }
  KernelDeterminism(const KernelDeterminism&) = delete;
  KernelDeterminism& operator=(const KernelDeterminism&) = delete;

 private:
  struct Fused {
    bool flash = true, mem_efficient = true, cudnn = true;
  };
  static at::Context& ctx() { return at::globalContext(); }
  static Fused fused_attention() {
    Fused f;
    f.flash = ctx().userEnabledFlashSDP();
#if REMAT_TORCH_AT_LEAST(2, 0)
    f.mem_efficient = ctx().userEnabledMemEfficientSDP();
#endif
#if REMAT_TORCH_AT_LEAST(2, 5)
    f.cudnn = ctx().userEnabledCuDNNSDP();
#endif
    return f;
  }
  static void set_fused_attention(const Fused& f) {
    ctx().setSDPUseFlash(f.flash);
#if REMAT_TORCH_AT_LEAST(2, 0)
    ctx().setSDPUseMemEfficient(f.mem_efficient);
#endif
#if REMAT_TORCH_AT_LEAST(2, 5)  // cuDNN attention (float16 and bfloat16 only: these float32 cases never take it)
    ctx().setSDPUseCuDNN(f.cudnn);
#endif
  }
  bool algorithms_, warn_only_;
  Fused fused_;
};

// cuBLAS reads its workspace configuration when its first handle is created:
// this one (PyTorch's documented choice) makes its reductions repeatable, and
// deterministic algorithms warn without it. Set before main, unless already set.
[[maybe_unused]] const bool kCublasWorkspaceConfigured =
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0) == 0;

// Every case runs on deterministic kernels unless it says otherwise.
class DeterministicKernels : public ::testing::Environment {
 public:
  void SetUp() override { on_.emplace(true); }
  void TearDown() override { on_.reset(); }

 private:
  std::optional<KernelDeterminism> on_;
};
[[maybe_unused]] ::testing::Environment* const kDeterministicKernels =
    ::testing::AddGlobalTestEnvironment(new DeterministicKernels);  // gtest owns it

// ---------------------------------------------------------------------------
// The tracked RNG on CUDA generators.

TEST(GpuRng, ForkDrawsFromItsOwnCudaStateAndLeavesTheDefaultOneAlone) {
  REQUIRE_GPU();
  model_parallel_manual_seed(1234, 0);
  const GeneratorStates start = capture_default_generators();
  ASSERT_TRUE(start.cuda.defined()) << "the CUDA generator's state is captured";
  const at::Tensor x = at::ones({1 << 16}, kGpu);

  at::Tensor in_fork;
  {
    auto guard = get_rng_tracker().fork();
    in_fork = at::dropout(x, 0.5, /*train=*/true);
  }
  const at::Tensor outside = at::dropout(x, 0.5, true);
  // The fork did not move the default CUDA generator: drawing again from the
  // start state gives the same mask as drawing after the fork.
  set_default_generators(start);
  EXPECT_TRUE(at::equal(at::dropout(x, 0.5, true), outside));
  EXPECT_FALSE(at::equal(in_fork, outside));

  // Seeding again replays the fork's mask; another tensor-parallel rank draws another.
  model_parallel_manual_seed(1234, 0);
  {
    auto guard = get_rng_tracker().fork();
    EXPECT_TRUE(at::equal(at::dropout(x, 0.5, true), in_fork));
  }
  model_parallel_manual_seed(1234, 1);
  {
    auto guard = get_rng_tracker().fork();
    EXPECT_FALSE(at::equal(at::dropout(x, 0.5, true), in_fork));
  }
}

TEST(GpuRng, SnapshotRestoresCudaDefaultAndTrackedStates) {
  REQUIRE_GPU();
  model_parallel_manual_seed(7, 0);
  const RngSnapshot snapshot = capture_rng();
  ASSERT_TRUE(snapshot.defaults.cuda.defined());
  ASSERT_TRUE(snapshot.tracker.at(kModelParallelRng).cuda.defined());
  const at::Tensor a = at::rand({1000}, kGpu);
  at::Tensor b;
  {
    auto guard = get_rng_tracker().fork();
    b = at::rand({1000}, kGpu);
  }
  restore_rng(snapshot);
  EXPECT_TRUE(at::equal(at::rand({1000}, kGpu), a));
  {
    auto guard = get_rng_tracker().fork();
    EXPECT_TRUE(at::equal(at::rand({1000}, kGpu), b));
  }
}

// ---------------------------------------------------------------------------
// Checkpoint regions on the device.

models::StackOptions stack_options(double dropout) {
  models::StackOptions o;
  o.shape.n_layer = 6;
  o.shape.d_model = 128;
  o.shape.n_head = 4;
  o.shape.d_ff = 512;
  o.shape.dropout = dropout;
  return o;
}

std::vector<at::Tensor> stack_step(models::Stack& model, const at::Tensor& x0) {
  model_parallel_manual_seed(123, 0);
  model->zero_grad(/*set_to_none=*/true);
  at::Tensor x = x0.clone().requires_grad_(true);
  at::Tensor y = model->forward(x);
  y.pow(2).mean().backward();
  std::vector<at::Tensor> out{y.detach(), x.grad()};
  for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

// Both region kinds, with the 6-block stack (dropout 0.1) on the device and its input.
class GpuCheckpoint : public CheckpointModes {
 protected:
  void SetUp() override {
    CheckpointModes::SetUp();
    REQUIRE_GPU();
    torch::manual_seed(0);
    model = models::Stack(stack_options(0.1));
    model->to(kGpu);
    torch::manual_seed(1);
    x = at::randn({4, 64, 128}, kGpu);
  }
  models::Stack model{nullptr};
  at::Tensor x;
};
INSTANTIATE_CHECKPOINT_MODES(GpuCheckpoint);

// One step of a function with CUDA dropout, inside a region and plainly.
TEST_P(GpuCheckpoint, RegionWithDropoutRecomputesTheForwardsMaskBitwise) {
  auto fn = [](const at::Tensor& x, const at::Tensor& w) {
    at::Tensor h = at::dropout(at::gelu(at::matmul(x, w)), 0.3, true);
    return at::dropout(at::tanh(h), 0.1, true) * 2;
  };
  at::manual_seed(3);
  const at::Tensor x0 = at::randn({64, 256}, kGpu);
  const at::Tensor w0 = at::randn({256, 256}, kGpu) / 16;
  auto run = [&](bool checkpointed) {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::manual_seed(11);
    at::Tensor y = checkpointed ? checkpoint(fn, x, w) : fn(x, w);
    at::rand({3}, kGpu);  // the generator moves on before the backward
    y.sum().backward();
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad()};
  };
  const auto plain = run(false);
  const int64_t recomputes = checkpoint_recompute_count();
  const auto ckpt = run(true);
  EXPECT_EQ(checkpoint_recompute_count(), recomputes + 1);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(ckpt[i].is_cuda());
    EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << "tensor " << i;
  }
}

TEST_P(GpuCheckpoint, EveryPolicyMatchesThePlainRunBitwise) {
  const auto plain = stack_step(model, x);
  for (auto [name, k] : {std::pair{"full", 1}, {"selective_layer", 2}, {"selective_op", 1}}) {
    PolicyOptions o;
    o.variant = checkpoint_variant_from_name(name);
    o.every_k = k;
    ASSERT_GT(apply_activation_checkpointing(*model, o), 0) << name;
    const auto ckpt = stack_step(model, x);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << name << " tensor " << i;
    }
  }
  remove_activation_checkpointing(*model);
}

// Stored inputs in pinned host memory (cpu_checkpointing), contiguous
// buffers, and the profile's device-synchronised timings.
TEST_P(GpuCheckpoint, CpuCheckpointingKeepsInputsInPinnedHostMemoryAndTheGradients) {
  const auto plain = stack_step(model, x);

  const CheckpointOptions saved = default_checkpoint_options();
  for (bool contiguous : {false, true}) {
    // offload_keep_last (the default) keeps the last region's input on the
    // device: its recompute comes first in the backward.
    const bool keep_last = contiguous;
    RegionSettings region;
    region.reentrant = GetParam();
    region.cpu_checkpointing = true;
    region.offload_keep_last = keep_last;
    region.contiguous_memory_optimization = contiguous;
    if (contiguous) region.number_checkpoints = 6;
    region.synchronize_checkpoint_boundary = true;
    region.profile = true;
    configure_checkpointing(region);
    PolicyOptions o;
    o.variant = CheckpointVariant::kFull;
    ASSERT_EQ(apply_activation_checkpointing(*model, o), 6);

    // The forward alone, to look at what the regions hold.
    model_parallel_manual_seed(123, 0);
    model->zero_grad(true);
    at::Tensor xi = x.clone().requires_grad_(true);
    at::Tensor y = model->forward(xi);
    const auto stored = checkpoint_stored_tensors();
    // Blocks 2-6 store their inputs (block 1's is the caller's leaf, kept as it is).
    ASSERT_EQ(stored.size(), 5u);
    int on_device = 0;
    for (const auto& t : stored) {
      if (t.is_cuda()) {
        ++on_device;
        continue;
      }
      EXPECT_TRUE(t.is_cpu()) << "stored input on " << t.device();
      EXPECT_TRUE(t.is_pinned()) << "stored input not in pinned memory";
    }
    EXPECT_EQ(on_device, keep_last ? 1 : 0) << "offload_keep_last " << keep_last;
    y.pow(2).mean().backward();
    std::vector<at::Tensor> ckpt{y.detach(), xi.grad()};
    for (const auto& p : model->parameters()) ckpt.push_back(p.grad().clone());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << "contiguous " << contiguous << " tensor " << i;
    }
    const auto profile = take_checkpoint_profile();
    ASSERT_FALSE(profile.empty());
    for (const auto& [name, p] : profile) {
      EXPECT_EQ(p.recomputes, 1) << name;
      EXPECT_GT(p.forward_ms, 0) << name;
      EXPECT_GT(p.recompute_ms, 0) << name;
    }
    remove_activation_checkpointing(*model);
    reset_checkpoint_buffers();
  }
  default_checkpoint_options() = saved;
}

// ---------------------------------------------------------------------------
// Device memory: what each variant holds after the forward, measured two ways
// (remat's MemoryTracker and the caching allocator's own statistics).

models::GptOptions gpt_options() {
  models::GptOptions o;
  o.vocab_size = 512;
  o.shape.n_layer = 8;
  o.shape.d_model = 512;
  o.shape.n_head = 8;
  o.shape.d_ff = 2048;
  o.shape.seq_len = 256;
  o.shape.dropout = 0.1;
  return o;
}

struct GpuBatch {
  at::Tensor x, y;
};
GpuBatch gpu_batch(int64_t batch, int64_t seq, int64_t vocab) {
  at::Generator gen = at::detail::createCPUGenerator(99);
  return {at::randint(vocab, {batch, seq}, gen, at::kLong).to(kGpu),
          at::randint(vocab, {batch, seq}, gen, at::kLong).to(kGpu)};
}

struct Measured {
  int64_t held = 0;         // bytes the forward leaves for backward (MemoryTracker)
  int64_t peak = 0;         // step peak above the start (MemoryTracker)
  int64_t alloc_peak = -1;  // step peak above the start (caching allocator; -1: not built in)
  double ms = 0;
  std::vector<at::Tensor> grads;
  at::Tensor loss;
};

Measured gpt_step(models::Gpt& model, const GpuBatch& b, const OffloadActivationsOptions* offload = nullptr,
                  uint64_t seed = 5) {
  model_parallel_manual_seed(seed, 0);
  model->zero_grad(true);
  torch::cuda::synchronize();
#ifdef REMAT_GPU_TEST_ALLOCATOR_STATS
  namespace alloc = c10::cuda::CUDACachingAllocator;
  alloc::resetPeakStats(0);
  const int64_t alloc_start = alloc::getDeviceStats(0).allocated_bytes[0].current;
#endif
  Measured m;
  const auto t0 = std::chrono::steady_clock::now();
  {
    MemoryTracker mem;
    at::Tensor loss;
    if (offload) {
      OffloadActivations scope(*offload, model.get());
      loss = model->loss(b.x, b.y);
    } else {
      loss = model->loss(b.x, b.y);
    }
    torch::cuda::synchronize();
    m.held = mem.current(c10::DeviceType::CUDA);
    loss.backward();
    torch::cuda::synchronize();
    m.peak = mem.peak(c10::DeviceType::CUDA);
    m.loss = loss.detach();
  }
  m.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
#ifdef REMAT_GPU_TEST_ALLOCATOR_STATS
  m.alloc_peak = alloc::getDeviceStats(0).allocated_bytes[0].peak - alloc_start;
#endif
  for (const auto& p : model->parameters()) m.grads.push_back(p.grad().clone());
  return m;
}

// The last of `n` steps, with the median step time of the `n` (after one warm-up step).
Measured measured_steps(models::Gpt& model, const GpuBatch& b, const OffloadActivationsOptions* offload = nullptr,
                        int n = 5) {
  gpt_step(model, b, offload);
  std::vector<double> ms;
  Measured m;
  for (int i = 0; i < n; ++i) {
    m = gpt_step(model, b, offload);
    ms.push_back(m.ms);
  }
  std::sort(ms.begin(), ms.end());
  m.ms = ms[ms.size() / 2];
  return m;
}

void expect_same_grads(const Measured& a, const Measured& b, const std::string& what) {
  EXPECT_TRUE(at::equal(a.loss, b.loss)) << what << " loss";
  ASSERT_EQ(a.grads.size(), b.grads.size());
  int differ = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) differ += !at::equal(a.grads[i], b.grads[i]);
  EXPECT_EQ(differ, 0) << what << ": gradients differing from the plain run";
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

TEST(GpuMemory, CheckpointingVariantsHoldLessDeviceMemoryWithThePlainGradients) {
  REQUIRE_GPU();
  const auto o = gpt_options();
  torch::manual_seed(0);
  models::Gpt model(o);
  model->to(kGpu);
  const GpuBatch b = gpu_batch(8, o.shape.seq_len, o.vocab_size);
  gpt_step(model, b);  // warm-up: cuBLAS handles, caching allocator blocks
  const Measured plain = measured_steps(model, b);
  std::printf("gpu: GPT L=%d d=%d seq=%d batch=8, dropout %.1f\n", o.shape.n_layer, o.shape.d_model,
              o.shape.seq_len, o.shape.dropout);
  std::printf("gpu: %-18s held %8.1f MiB  peak %8.1f MiB  allocator peak %8.1f MiB  step %7.2f ms (median of 5)\n", "none",
              mib(plain.held), mib(plain.peak), mib(plain.alloc_peak), plain.ms);
  EXPECT_GT(plain.held, 0) << "MemoryTracker saw no CUDA allocation";
  if (plain.alloc_peak >= 0) {
    // The tracker counts what c10's CUDA allocator reports: the two peaks agree.
    EXPECT_NEAR(static_cast<double>(plain.peak), static_cast<double>(plain.alloc_peak), 0.05 * plain.alloc_peak);
  }
  std::map<std::string, int64_t> held;
  for (auto [name, k] : {std::pair{"full", 1}, {"selective_layer", 2}, {"selective_op", 1}}) {
    PolicyOptions p;
    p.variant = checkpoint_variant_from_name(name);
    p.every_k = k;
    apply_activation_checkpointing(*model, p);
    const Measured m = measured_steps(model, b);
    expect_same_grads(plain, m, name);
    std::printf("gpu: %-18s held %8.1f MiB  peak %8.1f MiB  allocator peak %8.1f MiB  step %7.2f ms\n",
                (std::string(name) + (k > 1 ? " k=2" : "")).c_str(), mib(m.held), mib(m.peak), mib(m.alloc_peak),
                m.ms);
    held[name] = m.held;
    remove_activation_checkpointing(*model);
  }
  // Full checkpointing keeps one [batch, seq, d_model] input per block plus
  // the head's activations: far under the plain run's per-block activations.
  EXPECT_LT(held["full"] * 4, plain.held);
  EXPECT_LT(held["full"], held["selective_layer"]);
  EXPECT_LT(held["selective_layer"], plain.held);
  EXPECT_LT(held["selective_op"], plain.held);
}

TEST(GpuMemory, ActivationOffloadingWithPinnedCopiesOnSideStreamsKeepsTheGradients) {
  REQUIRE_GPU();
  const auto o = gpt_options();
  torch::manual_seed(0);
  models::Gpt model(o);
  model->to(kGpu);
  const GpuBatch b = gpu_batch(8, o.shape.seq_len, o.vocab_size);
  const Measured plain = measured_steps(model, b);
  for (bool streams : {true, false}) {
    OffloadActivationsOptions off;
    off.enabled = true;
    off.use_pin_memory = true;
    off.use_streams = streams;
    exclude_output_head(*model, off);
    const Measured timed = measured_steps(model, b, &off);
    const ActivationOffloadStats before = activation_offload_stats();
    const Measured m = gpt_step(model, b, &off);
    const ActivationOffloadStats after = activation_offload_stats();
    expect_same_grads(plain, m, streams ? "offload, streams" : "offload, no streams");
    EXPECT_GT(after.offloaded_bytes - before.offloaded_bytes, 0);
    EXPECT_EQ(after.restored_bytes - before.restored_bytes, after.offloaded_bytes - before.offloaded_bytes);
    EXPECT_EQ(after.host_bytes, 0) << "host copies freed with the graph";
    EXPECT_LT(m.held * 2, plain.held) << "the device keeps less than half of the plain run's activations";
    std::printf("gpu: offload %-12s held %8.1f MiB  peak %8.1f MiB  allocator peak %8.1f MiB  step %7.2f ms  "
                "(plain %.2f ms) offloaded %.1f MiB\n",
                streams ? "streams" : "no streams", mib(m.held), mib(m.peak), mib(m.alloc_peak), timed.ms, plain.ms,
                mib(after.offloaded_bytes - before.offloaded_bytes));
  }
}

// ---------------------------------------------------------------------------
// Parity with a control. At a shape where the fused kernels run as in a
// user's run (deterministic algorithms off, attention through SDPA's fused
// backends), the plain step itself is not bitwise repeatable: their backward
// accumulates in a varying order. The plain step twice gives each gradient's
// run-to-run difference; every variant (the same forward kernels on the same
// RNG draws, recomputed or brought back) must then give the plain loss bitwise
// and each gradient within kControlFactor x that difference of the plain one.

models::GptOptions control_options() {
  models::GptOptions o;
  o.vocab_size = 512;
  o.shape.n_layer = 4;
  o.shape.d_model = 1024;
  o.shape.n_head = 16;
  o.shape.d_ff = 4096;
  o.shape.seq_len = 1024;
  o.shape.dropout = 0.1;
  return o;
}

// A variant's difference to the plain step is a second draw of the same
// kind as the plain-vs-plain difference; the largest element of a tensor's
// difference varies from draw to draw, 4x leaves room for that and stays
// orders of magnitude under a real fault (another dropout mask, a stale
// recompute: differences of the gradients' own size).
constexpr double kControlFactor = 4.0;

// Each gradient's largest absolute difference between two steps.
std::vector<double> max_abs_diffs(const Measured& a, const Measured& b) {
  std::vector<double> out;
  for (size_t i = 0; i < a.grads.size(); ++i) out.push_back((a.grads[i] - b.grads[i]).abs().max().item<double>());
  return out;
}

// Each gradient's allowed difference: kControlFactor x the control's, where the
// control showed none, x the largest control difference relative to its
// gradient's size, scaled to this gradient's size. Whether a reordered sum
// happens to give the same bits in one pair of runs is chance; the size of a
// reordering's difference relative to the values summed is the kernels'.
std::vector<double> tolerances(const Measured& plain, const std::vector<double>& control) {
  std::vector<double> scale;
  double relative = 0;
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    scale.push_back(plain.grads[i].abs().max().item<double>());
    if (scale[i] > 0) relative = std::max(relative, control[i] / scale[i]);
  }
  std::vector<double> out;
  for (size_t i = 0; i < control.size(); ++i) out.push_back(kControlFactor * std::max(control[i], relative * scale[i]));
  return out;
}

TEST(GpuParity, WithFusedKernelsEveryVariantStaysWithinThePlainStepsRunToRunDifference) {
  REQUIRE_GPU();
  KernelDeterminism fused(false);
  const auto o = control_options();
  torch::manual_seed(0);
  models::Gpt model(o);
  model->to(kGpu);
  const auto names = model->named_parameters().keys();
  const GpuBatch b = gpu_batch(4, o.shape.seq_len, o.vocab_size);
  gpt_step(model, b);  // warm-up
  const Measured plain = gpt_step(model, b);
  const Measured again = gpt_step(model, b);
  ASSERT_TRUE(at::equal(plain.loss, again.loss)) << "the plain step's loss differs run to run: the forward's "
                                                    "kernels are expected to be repeatable";
  const std::vector<double> control = max_abs_diffs(plain, again);
  const std::vector<double> tol = tolerances(plain, control);
  const auto n = static_cast<int>(control.size());
  const auto control_differ = std::count_if(control.begin(), control.end(), [](double d) { return d > 0; });
  std::printf("gpu: parity GPT L=%d d=%d seq=%d batch=4, fused attention, deterministic algorithms off\n",
              o.shape.n_layer, o.shape.d_model, o.shape.seq_len);
  std::printf("gpu: parity control (plain vs plain)  loss bitwise, %d of %d gradients differ, largest max|d| %.3g\n",
              static_cast<int>(control_differ), n, *std::max_element(control.begin(), control.end()));

  auto check = [&](const std::string& name, const Measured& m) {
    EXPECT_TRUE(at::equal(plain.loss, m.loss)) << name << ": loss differs from the plain step's";
    const std::vector<double> d = max_abs_diffs(plain, m);
    int differ = 0, over = 0;
    double worst = 0;  // the largest difference over its tolerance
    for (int i = 0; i < n; ++i) {
      differ += d[i] > 0;
      if (d[i] > tol[i]) {
        ++over;
        ADD_FAILURE() << name << ": gradient " << names[i] << " max|d| " << d[i] << " over " << tol[i]
                      << " (control " << control[i] << ")";
      }
      if (tol[i] > 0) worst = std::max(worst, d[i] / tol[i]);
    }
    std::printf("gpu: parity %-24s loss bitwise %s, %d of %d gradients differ, largest max|d| %.3g, "
                "worst / tolerance %.2f, %d over\n",
                name.c_str(), at::equal(plain.loss, m.loss) ? "yes" : "NO", differ, n,
                *std::max_element(d.begin(), d.end()), worst, over);
  };
  const bool reentrant = default_checkpoint_options().reentrant;
  for (auto [name, k, region_reentrant] :
       {std::tuple{"full", 1, false}, {"full", 1, true}, {"selective_layer", 2, false}, {"selective_op", 1, false}}) {
    default_checkpoint_options().reentrant = region_reentrant;
    PolicyOptions p;
    p.variant = checkpoint_variant_from_name(name);
    p.every_k = k;
    ASSERT_GT(apply_activation_checkpointing(*model, p), 0) << name;
    check(str(name, k > 1 ? " k=2" : "", region_reentrant ? ", reentrant" : ""), gpt_step(model, b));
    remove_activation_checkpointing(*model);
  }
  default_checkpoint_options().reentrant = reentrant;
  OffloadActivationsOptions off;
  off.enabled = true;
  exclude_output_head(*model, off);
  check("offload, streams", gpt_step(model, b, &off));

  // The check can fail: other dropout masks move the loss and most gradients
  // far outside their tolerance.
  const Measured other = gpt_step(model, b, nullptr, /*seed=*/6);
  EXPECT_FALSE(at::equal(plain.loss, other.loss));
  const std::vector<double> d = max_abs_diffs(plain, other);
  int over = 0;
  for (int i = 0; i < n; ++i) over += d[i] > tol[i];
  EXPECT_GT(over * 2, n) << "a step with other dropout masks stays within the tolerances: they prove nothing";
  std::printf("gpu: parity other dropout masks        %d of %d gradients over their tolerance (expected: most)\n",
              over, n);
}

TEST(GpuParity, DeterministicKernelsMakeThePlainStepAndFullCheckpointingBitwiseAtTheLargerShape) {
  REQUIRE_GPU();  // deterministic algorithms and math attention: the environment's
  const auto o = control_options();
  torch::manual_seed(0);
  models::Gpt model(o);
  model->to(kGpu);
  const GpuBatch b = gpu_batch(4, o.shape.seq_len, o.vocab_size);
  gpt_step(model, b);  // warm-up
  const Measured plain = gpt_step(model, b);
  expect_same_grads(plain, gpt_step(model, b), "plain again");
  PolicyOptions p;
  p.variant = CheckpointVariant::kFull;
  apply_activation_checkpointing(*model, p);
  const Measured full = measured_steps(model, b, nullptr, 1);
  expect_same_grads(plain, full, "full");
  remove_activation_checkpointing(*model);
  std::printf("gpu: parity deterministic kernels, math attention: plain vs plain and full bitwise, step %.1f ms "
              "(full)\n", full.ms);
}

// ---------------------------------------------------------------------------
// The engine training a model on the device: every checkpointing variant and
// activation offloading give the plain run's losses bitwise.

std::vector<double> engine_losses(const std::string& variant, bool offload, int steps) {
  models::GptOptions o = gpt_options();
  o.shape.n_layer = 4;
  o.shape.d_model = 256;
  o.shape.d_ff = 1024;
  o.shape.seq_len = 128;
  const std::string json = str(R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "gradient_clipping": 1.0,
      "activation_checkpointing": {"variant": ")", variant, R"("},
      "activation_offloading": {"enabled": )", offload ? "true" : "false", R"(},
      "train": {"seed": 5}})");
  Config config = parse_config(json, "<gpu test>");
  auto layout = init_distributed(config);
  models::Gpt model(o);
  model->to(kGpu);
  auto engine = initialize(model.ptr(), config, EngineOptions{{}, layout});
  std::vector<double> losses;
  while (engine->global_steps() < steps) {
    // One batch over and over: the loss must fall.
    at::Generator gen = at::detail::createCPUGenerator(17 + engine->micro_steps());
    at::Tensor x = at::randint(o.vocab_size, {4, o.shape.seq_len}, gen, at::kLong).to(kGpu);
    at::Tensor y = at::randint(o.vocab_size, {4, o.shape.seq_len}, gen, at::kLong).to(kGpu);
    engine->backward(engine->forward([&] { return model->loss(x, y); }));
    if (engine->step()) losses.push_back(engine->last_metrics().loss);
  }
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_cuda());
  return losses;
}

TEST(GpuEngine, EveryVariantAndOffloadingTrainLikeThePlainRunBitwise) {
  REQUIRE_GPU();
  const auto plain = engine_losses("none", false, 5);
  ASSERT_EQ(plain.size(), 5u);
  EXPECT_LT(plain.back(), plain.front()) << "training lowers the loss";
  for (auto [variant, offload] : {std::pair{"full", false}, {"selective_op", false}, {"none", true},
                                  {"full", true}}) {
    const auto losses = engine_losses(variant, offload, 5);
    ASSERT_EQ(losses.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(losses[i], plain[i]) << variant << (offload ? " + offload" : "") << " step " << i + 1;
    }
  }
  std::printf("gpu: engine losses %.6f -> %.6f over 5 steps, equal bitwise across variants\n", plain.front(),
              plain.back());
}

}  // namespace
}  // namespace remat
