// The one place where LibTorch 1.13 and 2.x differ for remat.
#pragma once

#include <torch/version.h>

#define REMAT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||        \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace remat::compat {

// "1.13.1", "2.4.0", ...
inline const char* torch_version() { return TORCH_VERSION; }

}  // namespace remat::compat
