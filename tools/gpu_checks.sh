#!/usr/bin/env bash
# GPU checks: remat built with CMake against the PyTorch of a GPU machine, and
# the gpu-labelled tests run there (engine/gpu_test.cc always; runtime/nccl_test.cc
# when the machine has MPI). The machine needs a compiler, CMake, ninja, nvcc and
# a CUDA PyTorch; the build dependencies it may lack (spdlog, fmt, nlohmann-json,
# CLI11, GoogleTest, zlib) travel from this Debian machine:
#
#   tools/gpu_checks.sh pack          # here: those dependencies -> .gpu-deps/ (ignored by git)
#   tools/gpu_checks.sh run [DIR]     # on the GPU machine: configure, build, run; logs under DIR
#
# The run prints the machine, the versions, each step's time and the tests'
# summary; the gpu_test lines starting "gpu:" are the measured figures.
set -uo pipefail
cd "$(dirname "$0")/.."

deps=$PWD/.gpu-deps/usr
arch=x86_64-linux-gnu

pack() {
  rm -rf .gpu-deps
  mkdir -p "$deps/include" "$deps/lib/$arch/cmake" "$deps/share/cmake"
  local h
  for h in spdlog fmt CLI nlohmann gtest gmock zlib.h zconf.h; do cp -a "/usr/include/$h" "$deps/include/"; done
  cp -a /usr/lib/$arch/libspdlog.so* /usr/lib/$arch/libfmt.so* /usr/lib/$arch/libgtest*.a /usr/lib/$arch/libgmock*.a \
    "$deps/lib/$arch/"
  cp "$(readlink -f /usr/lib/$arch/libz.so)" "$deps/lib/$arch/libz.so"
  cp -a /usr/lib/$arch/cmake/{spdlog,fmt,GTest} "$deps/lib/$arch/cmake/"
  cp -a /usr/share/cmake/{nlohmann_json,CLI11} "$deps/share/cmake/"
  grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >>.git/info/exclude
  du -sh .gpu-deps
}

run() {
  local out=${1:-${OUT:-build/gpu-logs}}
  mkdir -p "$out"
  local t0=$SECONDS
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI)
EOF
  g++ --version | head -1
  cmake --version | head -1
  echo "ninja $(ninja --version)"
  echo "mpi: $(command -v mpirun || echo none) $(command -v mpicc || true)"

  local torch_prefix nccl_dir std=17
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  # PyTorch from 2.12 on needs C++20 to include ATen.
  if python3 -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 12))'; then
    std=20
  fi
  nccl_dir=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  local nccl_args=()
  if [[ -n $nccl_dir && -f $nccl_dir/include/nccl.h ]]; then
    nccl_args=(-DNCCL_INCLUDE_DIR="$nccl_dir/include" -DNCCL_LIBRARY="$(ls "$nccl_dir"/lib/libnccl.so* | head -1)")
  fi
  # The carried spdlog and fmt come before PyTorch's include folder, which holds
  # a newer fmt than that spdlog was built with: -I is searched before -isystem,
  # from a folder of its own (GCC drops an -I folder that is also -isystem).
  local first=$PWD/.gpu-deps/first
  rm -rf "$first" && mkdir -p "$first" && cp -r "$deps/include/spdlog" "$deps/include/fmt" "$first/"
  export LD_LIBRARY_PATH=$deps/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

  echo "== configure (C++$std)"
  if ! cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=$std \
      -DCMAKE_PREFIX_PATH="$torch_prefix;$deps" -DZLIB_ROOT="$deps" -DREMAT_BUILD_BENCHMARKS=OFF \
      -DCMAKE_CXX_FLAGS="-I$first" \
      -DCMAKE_CUDA_ARCHITECTURES=90 "${nccl_args[@]}" >"$out/configure.log" 2>&1; then
    tail -40 "$out/configure.log"
    echo "configure failed"
    return 1
  fi
  grep -E '^-- remat:' "$out/configure.log"
  local targets=(gpu_test)
  grep -q "NCCL ON" "$out/configure.log" && targets+=(nccl_test)
  echo "== build ${targets[*]} ($((SECONDS - t0)) s)"
  if ! cmake --build build/gpu -j"$(nproc)" --target "${targets[@]}" >"$out/build.log" 2>&1; then
    grep -E 'error|Error' "$out/build.log" | head -40
    echo "build failed"
    return 1
  fi
  echo "== gpu_test ($((SECONDS - t0)) s)"
  local rc=0
  build/gpu/gpu_test --gtest_color=no >"$out/gpu_test.log" 2>&1 || rc=1
  grep -E '^gpu:|^\[  FAILED|^\[  PASSED|Failure|Expected|Which is|actual|error' "$out/gpu_test.log" | head -80
  echo "== PyTorch's GPT on the device ($((SECONDS - t0)) s)"
  python3 benchmarks/torch_gpt_gpu.py >"$out/torch_gpt_gpu.log" 2>&1 || rc=1
  grep -E '^torch-gpu:|Error' "$out/torch_gpt_gpu.log"
  if [[ " ${targets[*]} " == *" nccl_test "* ]]; then
    echo "== nccl_test, 1 rank ($((SECONDS - t0)) s)"
    build/gpu/remat-run -np 1 -- build/gpu/nccl_test --gtest_color=no >"$out/nccl_test.log" 2>&1 || rc=1
    grep -E '^\[  FAILED|^\[  PASSED|Failure|error' "$out/nccl_test.log" | head -40
  else
    echo "== nccl_test not built: no MPI on this machine (the NCCL backend is bootstrapped over MPI)"
  fi
  echo "== done in $((SECONDS - t0)) s, rc $rc"
  return $rc
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: tools/gpu_checks.sh pack | run [DIR]" >&2; exit 2 ;;
esac
