// Which BLAS LibTorch's float32 matrix products on the CPU reach, and how
// many threads it runs for one product.
//
// Debian's LibTorch calls sgemm_ from whatever libblas.so.3 the system (or
// LD_LIBRARY_PATH) puts first: netlib's reference BLAS unless an optimised
// one is installed, about 16x slower on one 512 x 512 product on a 2-core
// machine (7.5 against 123 GFLOP/s per thread with OpenBLAS 0.3.21). The
// runtime logs what it found once on rank 0 and warns on the reference.
//
//   const BlasLibrary blas = float32_blas();
//   if (blas.reference) ...;  // blas.text(): "the reference BLAS (/usr/lib/.../blas/libblas.so.3)"
#pragma once

#include <string>

namespace remat {

struct BlasLibrary {
  std::string path;          // the file sgemm_ comes from, links resolved ("" when none is loaded)
  std::string name;          // "OpenBLAS 0.3.21", "the reference BLAS", "BLIS", ...
  std::string build;         // OpenBLAS's threading and kernels: "OpenMP build, Haswell kernels"
  bool openblas = false;
  bool reference = false;    // netlib's reference implementation
  int threads = 0;           // OpenBLAS's threads for one product (0: not OpenBLAS)
  // "OpenBLAS 0.3.21 (OpenMP build, Haswell kernels; 1 thread) from /usr/lib/..."
  std::string text() const;
};

// What this process's sgemm_ is.
BlasLibrary float32_blas();

// OpenBLAS's threads for one product set to `threads` (LibTorch's intra-op
// threads): its pthread build otherwise starts one per core in every rank,
// and N ranks on one machine then spin N x cores threads (on 2 cores, 2
// ranks ran the default job at 15 305 tokens/s against 39 582 bounded).
// Nothing for another BLAS.
void set_blas_threads(int threads);

}  // namespace remat
