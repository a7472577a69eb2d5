#!/usr/bin/env bash
# Builds and installs remat for use from another project (find_package(remat)),
# without building or running its tests:
#
#   tools/install.sh                      # into build/install of this tree
#   tools/install.sh --prefix /opt/remat  # anywhere (write access needed there)
#   tools/install.sh --prefix P --build-dir B [-- -DCMAKE_PREFIX_PATH=<LibTorch> ...]
#
# Installs what is missing from Debian's archive first (tools/install_deps.sh),
# then configures CMake with the tests and benchmarks off, builds the libraries,
# remat-train, remat-estimate and remat-run, and installs them. Arguments after
# `--` go to CMake's configure step. The last line names the prefix to give
# CMake (CMAKE_PREFIX_PATH) in the project that uses remat.
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=$PWD/build/install
build_dir=$PWD/build/install-build
cmake_args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --prefix) [[ $# -ge 2 && -n $2 ]] || { echo "remat install: --prefix needs a folder" >&2; exit 2; }
              prefix=$2; shift 2 ;;
    --build-dir) [[ $# -ge 2 && -n $2 ]] || { echo "remat install: --build-dir needs a folder" >&2; exit 2; }
                 build_dir=$2; shift 2 ;;
    --) shift; cmake_args=("$@"); break ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "remat install: unknown argument '$1': give --prefix DIR, --build-dir DIR, or CMake options after --" >&2
       exit 2 ;;
  esac
done
case $prefix in /*) ;; *) prefix=$PWD/$prefix ;; esac

tools/install_deps.sh
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
echo "remat install: configuring in $build_dir" >&2
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_INSTALL_PREFIX="$prefix" \
  -DREMAT_BUILD_TESTS=OFF -DREMAT_BUILD_BENCHMARKS=OFF "${cmake_args[@]}" >/dev/null
echo "remat install: building (a few minutes on 2 cores)" >&2
cmake --build "$build_dir" -j"$(nproc)"
cmake --install "$build_dir" >/dev/null
[[ -f $prefix/lib/cmake/remat/rematConfig.cmake || -n $(find "$prefix" -name rematConfig.cmake -print -quit) ]] || {
  echo "remat install: the install into $prefix has no rematConfig.cmake" >&2
  exit 1
}
echo "remat installed in $prefix: use it with -DCMAKE_PREFIX_PATH=$prefix (find_package(remat)); launch with $prefix/bin/remat-run"
