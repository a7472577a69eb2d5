#include "runtime/blas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <system_error>

#include "runtime/error.h"

namespace remat {
namespace {

// `name` as the library sgemm_ came from sees it (itself, then what it
// loads): Debian's libblas.so.3 of OpenBLAS loads libopenblas.so.0, while
// the reference libblas.so.3 put first may share the process with an
// OpenBLAS another library (liblapack.so.3) loaded.
template <typename Fn>
Fn symbol(void* library, const char* name) {
  return reinterpret_cast<Fn>(::dlsym(library == nullptr ? RTLD_DEFAULT : library, name));
}

// The loaded library at `path`, held open until the process ends (nullptr
// when `path` is empty or not loaded).
void* loaded(const std::string& path) {
  return path.empty() ? nullptr : ::dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
}

// OpenBLAS's build string ("OpenBLAS 0.3.21 NO_AFFINITY USE_OPENMP Haswell
// MAX_THREADS=64") as a name ("OpenBLAS 0.3.21") and a build ("OpenMP build,
// Haswell kernels").
void read_openblas_config(const std::string& config, int parallel, BlasLibrary& blas) {
  std::istringstream words(config);
  std::string word, version, kernels;
  words >> word >> version;
  while (words >> word) {
    if (word.find('=') == std::string::npos && word != "DYNAMIC_ARCH" && word != "NO_AFFINITY" &&
        word != "USE_OPENMP" && word != "USE64BITINT" && word != "SMP") {
      kernels = word;
    }
  }
  blas.name = version.empty() ? std::string("OpenBLAS") : "OpenBLAS " + version;
  const char* threading = parallel == 2 ? "OpenMP build" : parallel == 1 ? "pthread build" : "single-threaded build";
  blas.build = kernels.empty() ? std::string(threading) : str(threading, ", ", kernels, " kernels");
}

}  // namespace

std::string BlasLibrary::text() const {
  std::string detail = build;
  if (openblas) detail += str(detail.empty() ? "" : "; ", threads, threads == 1 ? " thread" : " threads");
  return str(name, detail.empty() ? "" : str(" (", detail, ")"), path.empty() ? "" : " from " + path);
}

BlasLibrary float32_blas() {
  BlasLibrary blas;
  void* sgemm = ::dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  void* library = nullptr;
  if (sgemm != nullptr && ::dladdr(sgemm, &info) != 0 && info.dli_fname != nullptr) {
    library = loaded(info.dli_fname);
    std::error_code ec;
    const auto real = std::filesystem::canonical(info.dli_fname, ec);
    blas.path = ec ? std::string(info.dli_fname) : real.string();
  }
  using ConfigFn = char* (*)();
  using IntFn = int (*)();
  if (sgemm == nullptr) {
    blas.name = "no BLAS (LibTorch's own matrix products)";
  } else if (auto config = symbol<ConfigFn>(library, "openblas_get_config")) {
    blas.openblas = true;
    auto parallel = symbol<IntFn>(library, "openblas_get_parallel");
    auto threads = symbol<IntFn>(library, "openblas_get_num_threads");
    read_openblas_config(config(), parallel ? parallel() : -1, blas);
    blas.threads = threads ? threads() : 0;
  } else if (symbol<void*>(library, "bli_info_get_version_str") != nullptr) {
    blas.name = "BLIS";
  } else if (symbol<void*>(library, "MKL_Get_Version_String") != nullptr) {
    blas.name = "Intel MKL";
  } else {
    // Debian installs netlib's reference BLAS as .../blas/libblas.so.3.
    blas.reference = blas.path.find("/blas/libblas.so") != std::string::npos;
    blas.name = blas.reference ? "the reference BLAS" : "a BLAS";
  }
  return blas;
}

void set_blas_threads(int threads) {
  using SetFn = void (*)(int);
  if (threads < 1) return;
  // Every OpenBLAS loaded: the one products reach, and one a LAPACK loaded.
  if (auto set = symbol<SetFn>(nullptr, "openblas_set_num_threads")) set(threads);
}

}  // namespace remat
