#include "runtime/runtime.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <algorithm>
#include <memory>
#include <thread>

#include "runtime/blas.h"
#include "runtime/error.h"
#include "runtime/env_knobs.h"
#include "runtime/internal/backend_choice.h"
#include "runtime/internal/local_communicator.h"
#include "runtime/logging.h"

#if defined(REMAT_WITH_MPI)
#include "runtime/internal/mpi_communicator.h"
#include "runtime/internal/nccl_communicator.h"
#endif

#if defined(REMAT_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <unistd.h>
#endif

namespace remat {

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "mpi") return Backend::kMpi;
  if (name == "nccl") return Backend::kNccl;
  throw ConfigError(str("unknown communication backend '", name, "': use auto, mpi or nccl"));
}

Runtime& Runtime::init() {
  static Runtime runtime;
  return runtime;
}

Runtime::Runtime() {
  env_ = detect_process_env();
  set_log_rank(env_.rank, env_.world_size);  // the launcher's word, for errors while MPI starts
  int mpi_rank = 0, mpi_size = 1;
#if defined(REMAT_WITH_MPI)
  static internal::MpiSession session;  // lives until exit; finalizes MPI then
  MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
#else
  if (env_.world_size > 1) {
    throw ConfigError(str("this remat was built without MPI, so it runs one process; the "
                          "launcher asked for ", env_.world_size,
                          " (from ", env_.source, " variables): rebuild with MPI"));
  }
#endif
  if (env_.world_size != mpi_size || env_.rank != mpi_rank) {
    throw ConfigError(str("the launcher says rank ", env_.rank, " of ", env_.world_size,
                          " (from ", env_.source, " variables) but MPI says rank ", mpi_rank,
                          " of ", mpi_size, ": launch several processes with mpirun -np N"));
  }
  set_log_rank(env_.rank, env_.world_size);
  share_cores();
  report_blas();
  pick_cuda_device();
}

// Local rank i uses device i % devices. With more ranks on the node than
// GPUs, several share one (device 0 holds local ranks 0 and 2 of 4 on 2
// GPUs): the mpi backend carries their tensors; nccl refuses (world()).
void Runtime::pick_cuda_device() {
#if defined(REMAT_WITH_NCCL)
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices <= 0) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return;
  }
  cuda_devices_ = devices;
  cuda_device_ = env_.local_rank % devices;
  cudaSetDevice(cuda_device_);
  log().debug("using CUDA device {} of {}", cuda_device_, devices);
  if (env_.local_world_size > devices) {
    log_rank0().info("{} ranks on this node share its {} GPU(s): local rank i uses device i % {}",
                     env_.local_world_size, devices, devices);
  }
#endif
}

// LibTorch gives every process one intra-op thread per core, so N ranks on
// one machine run N x cores threads that spin against each other in each
// parallel kernel (on 2 cores with 4 ranks and LibTorch 2.6, a ZeRO test ran
// 20x slower). Unless the user set OMP_NUM_THREADS (launch/remat-run.sh sets
// it), the cores are shared out: cores / local ranks, at least 1.
void Runtime::share_cores() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (auto asked = knobs::omp_num_threads()) {
    bound_threads(*asked, cores, env_.local_world_size);
    return;
  }
  if (env_.local_world_size <= 1 || cores <= 0) return;
  const int threads = std::max(1, cores / env_.local_world_size);
  if (at::get_num_threads() <= threads) return;
  log().info("{} ranks share this machine's {} cores: {} intra-op thread(s) per rank "
             "(set OMP_NUM_THREADS to choose)",
             env_.local_world_size, cores, threads);
  at::set_num_threads(threads);
}

// The CPU's float32 matrix products: OpenBLAS's threads for one product
// bounded to LibTorch's intra-op threads (the cores shared out above), and
// the library they reach said once, with a warning on the reference BLAS.
void Runtime::report_blas() {
  set_blas_threads(at::get_num_threads());
  const BlasLibrary blas = float32_blas();
  if (blas.reference) {
    log_rank0().warn("CPU float32 matrix products run on {}: an order of magnitude slower than an optimised "
                     "BLAS. Install one (tools/install_deps.sh installs libopenblas0-openmp), or put its "
                     "libblas.so.3 first with LD_LIBRARY_PATH",
                     blas.text());
  } else {
    log_rank0().info("CPU float32 matrix products run on {}", blas.text());
  }
}

// The user's OMP_NUM_THREADS, lowered where it asks for more than the cores:
// more threads than cores never run at once, and LibTorch starting
// OMP_NUM_THREADS=100000 of them ended the process in a segmentation fault at
// its first parallel kernel. The ranks on this machine share the cores, so a
// value beyond them becomes the cores over the local ranks, as if unset.
// Set here, before any kernel, the bound holds for every thread LibTorch
// starts; the variable itself is lowered too, for anything the rank starts.
void Runtime::bound_threads(int64_t asked, int cores, int local_ranks) {
  if (cores <= 0 || asked <= cores) return;
  const int threads = std::max(1, cores / std::max(1, local_ranks));
  log().warn("{}={} asks for more intra-op threads than this machine's {} cores: using {}{} (set it to at most "
             "{} to silence this)",
             knobs::kOmpNumThreads, asked, cores, threads,
             local_ranks > 1 ? str(", the cores shared by its ", local_ranks, " ranks") : std::string(), cores);
  at::set_num_threads(threads);
  ::setenv(knobs::kOmpNumThreads, std::to_string(threads).c_str(), 1);
}

#if defined(REMAT_WITH_MPI) && defined(REMAT_WITH_NCCL)
namespace {

// What this rank reports for choosing the backend: its node, how many GPUs
// it sees, which one it uses.
internal::RankDevices local_devices(int devices, int device) {
  internal::RankDevices mine;
  mine.gpus = devices;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  mine.node = host;
  char bus[64] = {};
  if (device >= 0 && cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess) {
    mine.device = bus;
  } else if (device >= 0) {
    cudaGetLastError();
    mine.device = str("device ", device);
  }
  return mine;
}

}  // namespace
#endif

std::shared_ptr<Communicator> Runtime::world(Backend backend) {
#if defined(REMAT_WITH_MPI)
  auto mpi = internal::MpiCommunicator::world();
  if (backend == Backend::kMpi) return mpi;
#if defined(REMAT_WITH_NCCL)
  // Every rank's report, so that every rank decides the same.
  std::vector<internal::RankDevices> ranks;
  for (const auto& report : mpi->gatherStrings(internal::encode(local_devices(cuda_devices_, cuda_device_)),
                                               "reporting each rank's GPUs to choose the backend")) {
    ranks.push_back(internal::decode_rank_devices(report));
  }
  if (backend == Backend::kNccl) internal::check_nccl_fits(ranks);
  const internal::BackendChoice choice = internal::choose_auto_backend(/*nccl_built=*/true, ranks);
#else
  const internal::BackendChoice choice = internal::choose_auto_backend(/*nccl_built=*/false, {});
#endif
  if (backend == Backend::kNccl) return internal::make_nccl_communicator(mpi);
  // Said where a GPU is involved; a CPU job's log stays as it was.
  auto& log0 = log_rank0();
  log0.log(choice.nccl || cuda_devices_ > 0 ? spdlog::level::info : spdlog::level::debug,
           "backend auto: {} ({})", choice.nccl ? "nccl" : "mpi", choice.reason);
  return choice.nccl ? internal::make_nccl_communicator(mpi) : mpi;
#else
  if (backend != Backend::kAuto) {
    throw ConfigError("this remat was built without MPI: only the local (one-process) "
                      "backend exists; pass --backend auto or rebuild with MPI");
  }
  return std::make_shared<internal::LocalCommunicator>();
#endif
}

namespace {

// After this rank's error: the peers of a multi-rank job end too (MPI_Abort),
// so none waits in a collective this rank will never make.
void end_peers() {
#if defined(REMAT_WITH_MPI)
  int size = 1;
  if (internal::MpiSession::initialized()) MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) internal::MpiSession::abort(1);
#endif
}

// An error as printed: each word (a run without white space: a path, a
// value the user gave) over 240 characters cut in the middle, its ends kept
// and how much was left out said, so that a value of megabytes never floods
// the terminal and the error stays readable.
std::string capped(const std::string& text) {
  constexpr size_t kHead = 80, kTail = 120, kLongest = 240;
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    size_t end = i;
    while (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end]))) ++end;
    if (end - i > kLongest) {
      out += text.substr(i, kHead) + "...(" + std::to_string(end - i - kHead - kTail) + " characters)..." +
             text.substr(end - kTail, kTail);
    } else {
      out.append(text, i, end - i);
    }
    while (end < text.size() && std::isspace(static_cast<unsigned char>(text[end]))) out += text[end++];
    i = end;
  }
  return out;
}

}  // namespace

int run_main(const std::function<int()>& body) {
  try {
    return body();
  } catch (const c10::OutOfMemoryError& e) {
    // LibTorch's allocators (CUDA's caching allocator, the CPU's) ran out: what
    // lowers the peak is the run's to change, so say where to look.
    std::fprintf(stderr,
                 "%s remat out of memory: %s\n  the step needs more memory than the device has free: "
                 "remat-estimate shows each variant's peak for a config, and docs/memory.md what lowers "
                 "it (a smaller micro-batch, activation checkpointing or offloading, a higher ZeRO stage)\n",
                 log_prefix().c_str(), capped(e.what_without_backtrace()).c_str());
    std::fflush(stderr);
    end_peers();
    return 1;
  } catch (const std::exception& e) {
    const char* kind = dynamic_cast<const TimeoutError*>(&e)  ? "timeout"
                       : dynamic_cast<const CommError*>(&e)   ? "communication error"
                       : dynamic_cast<const ConfigError*>(&e) ? "configuration error"
                       : dynamic_cast<const Error*>(&e)       ? "error"
                                                              : "unexpected error";
    std::fprintf(stderr, "%s remat %s: %s\n", log_prefix().c_str(), kind, capped(e.what()).c_str());
    std::fflush(stderr);
    end_peers();
    return 1;
  }
}

}  // namespace remat
