#!/usr/bin/env bash
# Installs remat's build and test dependencies from Debian's archive when any
# is missing. Idempotent and silent when everything is present.
set -euo pipefail

packages=(
  g++
  cmake
  ninja-build
  bazel-bootstrap    # Bazel 4.2.3
  bazel-platforms
  libtorch-dev       # LibTorch 1.13 (CPU)
  libopenblas0-openmp  # the BLAS of LibTorch's float32 products (docs/benchmarks.md, "BLAS")
  libblas3           # the reference BLAS beside it, for side-by-side runs (benchmarks/blas_bench.sh)
  libopenmpi-dev
  openmpi-bin
  libspdlog-dev
  nlohmann-json3-dev
  libgtest-dev
  libgmock-dev
  libcli11-dev
  zlib1g-dev         # CRC-32 of saved training state
  liburing-dev       # io_uring backend of runtime/async_io.h (NVMe offload)
  libaio-dev         # Linux AIO backend of runtime/async_io.h
  fio                # the disk's bandwidth beside remat's (benchmarks/disk_bandwidth.sh)
  procps             # pgrep in the whole-job tests
  python3            # edits saved files in the whole-job tests
  python3-torch      # reads remat-train --export files with torch.load in the whole-job tests
  universal-ctags    # function lengths in tools/check_sizes.sh
  ccache             # test.sh's CMake builds reuse what an earlier run of this machine compiled
)
# Python's safetensors package, which tests/safetensors_test.sh checks remat's
# files against: in Debian 13 (0.5.2), not in Debian 12.
if (. /etc/os-release && [[ ${ID:-} == debian && ${VERSION_ID%%.*} -ge 13 ]]) 2>/dev/null; then
  packages+=(python3-safetensors)
fi

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "remat: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "remat: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
