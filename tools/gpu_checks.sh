#!/usr/bin/env bash
# GPU checks: remat built with CMake against the PyTorch of a GPU machine, then
# everything a GPU user runs, in one prepared command (about 8 minutes of device
# time on an H100, the build included):
#   1. gpu_test (engine/gpu_test.cc: the tracked RNG on CUDA generators, recompute
#      bitwise at the small shape, parity with a control at a larger one, memory,
#      offloading) and nccl_test at one rank (when the machine has MPI);
#   2. remat-train on the GPU at 1 rank (NCCL) and at 2 ranks sharing the GPU
#      (MPI, staging through pinned host buffers), at ZeRO stages 0 and 3 with
#      full checkpointing and activation offloading; at 1 rank stages 1 and 3
#      with zero_optimization.offload_optimizer (pinned) beside the same runs
#      without it (losses compared, bitwise or against a control run twice),
#      stage 2 under bf16 with and without it (the masters on the host alone);
#      ZeRO-Infinity (the optimizer on the disk at stage 1, the optimizer and the
#      parameters at stage 3) beside "cpu"; a save made on the GPU resumed on the CPU and back; fp16
#      (fp16.enabled, the loss scaler) at 1 rank;
#   3. the llama and lora examples, built against the installed remat;
#   4. benchmarks/gpu_bench.sh: remat beside PyTorch on the same kernels, and
#      remat's bf16 beside torch.autocast with MFU (docs/benchmarks-gpu.md).
# The machine needs a compiler, CMake, ninja, nvcc and a CUDA PyTorch; the build
# dependencies it may lack (spdlog, fmt, nlohmann-json, CLI11, GoogleTest, zlib,
# liburing, libaio)
# travel from this Debian machine:
#
#   tools/gpu_checks.sh pack          # here: those dependencies -> .gpu-deps/ (ignored by git)
#   tools/gpu_checks.sh run [DIR]     # on the GPU machine: configure, build, run; logs under DIR
#   tools/gpu_checks.sh dry-run [DIR] # here: steps 2-4 on the CPU (--device cpu, tiny shapes)
#                                     # from ./test.sh's CMake build (build/cmake, build/install);
#                                     # gpu_test is compiled there, not run
#
# Each step prints its time and a summary line; the lines starting "gpu:",
# "train:", "example:" and "bench:" are the figures. The exit status is 0 when
# every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

deps=$PWD/.gpu-deps/usr
arch=x86_64-linux-gnu
rc=0
t0=$SECONDS

pack() {
  rm -rf .gpu-deps
  mkdir -p "$deps/include" "$deps/lib/$arch/cmake" "$deps/share/cmake"
  local h
  for h in spdlog fmt CLI nlohmann gtest gmock zlib.h zconf.h liburing liburing.h libaio.h; do
    cp -a "/usr/include/$h" "$deps/include/"
  done
  cp -a /usr/lib/$arch/libspdlog.so* /usr/lib/$arch/libfmt.so* /usr/lib/$arch/libgtest*.a /usr/lib/$arch/libgmock*.a \
    /usr/lib/$arch/liburing.so* /usr/lib/$arch/libaio.so* \
    "$deps/lib/$arch/"
  cp "$(readlink -f /usr/lib/$arch/libz.so)" "$deps/lib/$arch/libz.so"
  cp -a /usr/lib/$arch/cmake/{spdlog,fmt,GTest} "$deps/lib/$arch/cmake/"
  cp -a /usr/share/cmake/{nlohmann_json,CLI11} "$deps/share/cmake/"
  grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >>.git/info/exclude
  du -sh .gpu-deps
}

step() { echo "== $* ($((SECONDS - t0)) s)"; }
fail() { echo "FAILED: $*"; rc=1; }

machine() {
  step "machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI)
EOF
  g++ --version | head -1
  cmake --version | head -1
  echo "ninja $(ninja --version)"
  echo "mpi: $(command -v mpirun || echo none) $(command -v mpicc || true)"
}

# Configures and builds build/gpu against the machine's PyTorch; installs to
# build/gpu-install; builds the examples against that. Sets torch_prefix, first.
build_gpu() {
  local out=$1 nccl_dir std=17
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
  first=$PWD/.gpu-deps/first
  rm -rf "$first" && mkdir -p "$first" && cp -r "$deps/include/spdlog" "$deps/include/fmt" "$first/"
  export LD_LIBRARY_PATH=$deps/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cmake_common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD="$std" -DCMAKE_CXX_FLAGS="-I$first")

  step "configure (C++$std)"
  if ! cmake -S . -B build/gpu "${cmake_common[@]}" -DCMAKE_PREFIX_PATH="$torch_prefix;$deps" -DZLIB_ROOT="$deps" \
      -DREMAT_BUILD_BENCHMARKS=ON -DCMAKE_INSTALL_PREFIX="$PWD/build/gpu-install" \
      -DCMAKE_CUDA_ARCHITECTURES=90 "${nccl_args[@]}" >"$out/configure.log" 2>&1; then
    tail -40 "$out/configure.log"
    echo "configure failed"
    return 1
  fi
  grep -E '^-- remat:' "$out/configure.log"
  targets=(gpu_test device_test mpi_staging_test remat-train remat-estimate remat-smoke gpt_bench dp_bench)
  grep -q "NCCL ON" "$out/configure.log" && targets+=(nccl_test)
  step "build ${targets[*]}"
  if ! cmake --build build/gpu -j"$(nproc)" --target "${targets[@]}" >"$out/build.log" 2>&1 ||
     ! cmake --install build/gpu >>"$out/build.log" 2>&1; then
    grep -E 'error|Error' "$out/build.log" | head -40
    echo "build failed"
    return 1
  fi
  build_examples "$out" build/gpu-install build/gpu-examples "$torch_prefix;$deps" "${cmake_common[@]}"
}

# build_examples OUT PREFIX ROOT PREFIX_PATH [CMAKE ARGS...]
build_examples() {
  local out=$1 prefix=$2 root=$3 path=$4 name
  shift 4
  step "build the examples against $prefix"
  for name in llama lora; do
    if ! { cmake -S examples/$name -B "$root/$name" "$@" -DCMAKE_PREFIX_PATH="$PWD/$prefix;$path" &&
           cmake --build "$root/$name" -j"$(nproc)"; } >>"$out/examples-build.log" 2>&1; then
      grep -E 'error|Error' "$out/examples-build.log" | head -20
      fail "building examples/$name"
    fi
  done
}

# The metrics of a remat-train run in one line: device, losses, step time, memory.
summary() {
  python3 - "$@" <<'EOF'
import json, math, statistics, sys
label, path = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(path) if l.strip()]
losses = [r["loss"] for r in rows]
ok = len(rows) > 1 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
ms = statistics.median(r["step_ms"] for r in rows[1:]) if len(rows) > 1 else float("nan")
mib = lambda k: max((r.get(k, 0) for r in rows), default=0) / 2**20
extra = ""
if any("cuda_peak_reserved_bytes" in r for r in rows):
    extra = (f", CUDA allocator: allocated peak {mib('cuda_peak_allocated_bytes'):.1f} MiB, "
             f"reserved peak {mib('cuda_peak_reserved_bytes'):.1f} MiB")
if any("host_optimizer_bytes" in r for r in rows):
    extra += f", optimizer on the host {mib('host_optimizer_bytes'):.1f} MiB"
if any("nvme_state_bytes" in r for r in rows):
    disk_ms = statistics.median(r["nvme_step_ms"] for r in rows)
    extra += (f", on disk: moments {mib('nvme_state_bytes'):.1f} MiB, masters {mib('nvme_master_bytes'):.1f} MiB"
              f" (NVMe step median {disk_ms:.1f} ms)")
if any("nvme_parameter_bytes" in r for r in rows):
    extra += f", parameter shards on disk {mib('nvme_parameter_bytes'):.1f} MiB"
print(f"train: {label:28s} {len(rows)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, median step {ms:.1f} ms, "
      f"peak {mib('mem_peak_bytes'):.1f} MiB{extra}")
sys.exit(0 if ok else 1)
EOF
}

# train LABEL NP BACKEND DEVICE ARGS...: remat-train; its metrics summarised.
train() {
  local label=$1 np=$2 backend=$3 device=$4
  shift 4
  step "remat-train $label"
  if ! timeout 300 "$bin/remat-run" -np "$np" -- "$bin/remat-train" --backend "$backend" --device "$device" \
      --metrics "$out/$label.jsonl" "$@" >"$out/$label.log" 2>&1; then
    tail -15 "$out/$label.log"
    fail "remat-train $label"
    return
  fi
  summary "$label" "$out/$label.jsonl" || fail "remat-train $label: losses not finite or not falling"
}

trains() {
  local steps=$1 dev=$2 one=$3 stage
  local ckpt=(--set activation_checkpointing.variant=full --set activation_offloading.enabled=true)
  for stage in 0 3; do
    train "np1-$one-zero$stage" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=$stage "${ckpt[@]}"
    train "np2-mpi-zero$stage" 2 mpi "$dev" --steps "$steps" --set zero_optimization.stage=$stage "${ckpt[@]}"
  done
  # zero_optimization.offload_optimizer (docs/memory.md): the optimizer's state and step on
  # the host, beside the same runs without it (np1 zero3 above; zero1 here).
  local offload=(--set zero_optimization.offload_optimizer.device=cpu --set zero_optimization.offload_optimizer.pin_memory=true)
  train "np1-$one-zero1" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=1 "${ckpt[@]}"
  for stage in 1 3; do
    train "np1-$one-zero$stage-offload" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=$stage \
      "${ckpt[@]}" "${offload[@]}"
  done
  train "np1-$one-zero3-offload-param" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=3 "${ckpt[@]}" \
    "${offload[@]}" --set zero_optimization.offload_param.device=cpu --set zero_optimization.offload_param.pin_memory=true
  # bf16: the masters on the host alone, the device keeping the bf16 parameters
  # (param_bytes a third of the run without offload at stage 2).
  local bf16=(--set bf16.enabled=true --set zero_optimization.stage=2)
  train "np1-$one-zero2-bf16" 1 "$one" "$dev" --steps "$steps" "${ckpt[@]}" "${bf16[@]}"
  train "np1-$one-zero2-bf16-offload" 1 "$one" "$dev" --steps "$steps" "${ckpt[@]}" "${bf16[@]}" "${offload[@]}"
  # ZeRO-Infinity (docs/memory.md): the optimizer's moments and masters on this
  # machine's disk at stage 1, and at stage 3 the parameter shards too (every
  # one past max_in_cpu 0), beside the same runs with "cpu".
  local nvme=$out/nvme
  rm -rf "$nvme" && mkdir -p "$nvme"
  local on_disk=(--set zero_optimization.offload_optimizer.device=nvme
                 --set "zero_optimization.offload_optimizer.nvme_path=$nvme")
  train "np1-$one-zero1-nvme" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=1 "${ckpt[@]}" \
    "${on_disk[@]}"
  train "np1-$one-zero3-nvme" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=3 "${ckpt[@]}" \
    "${on_disk[@]}" --set zero_optimization.offload_param.device=nvme \
    --set "zero_optimization.offload_param.nvme_path=$nvme" --set zero_optimization.offload_param.max_in_cpu=0
  # The same run again: the control for what the GPU's kernels repeat.
  train "np1-$one-zero1-again" 1 "$one" "$dev" --steps "$steps" --set zero_optimization.stage=1 "${ckpt[@]}"
  parity "np1-$one-zero1" "np1-$one-zero1-again" "np1-$one-zero1-offload"
  parity "np1-$one-zero1" "np1-$one-zero1-again" "np1-$one-zero1-nvme"
  parity "np1-$one-zero3" "" "np1-$one-zero3-offload"
  parity "np1-$one-zero3-offload-param" "" "np1-$one-zero3-nvme"
  parity "np1-$one-zero2-bf16" "" "np1-$one-zero2-bf16-offload"
  # A save made on the device, resumed on the CPU, and that one resumed on the device.
  local saves=$out/saves
  rm -rf "$saves"
  train "save-on-$dev" 1 auto "$dev" --steps 4 --save-dir "$saves"
  train "resume-on-cpu" 1 mpi cpu --steps 6 --resume "$saves" --save-dir "$saves"
  train "resume-back-on-$dev" 1 auto "$dev" --steps 8 --resume "$saves" --save-dir "$saves"
}

# parity BASE CONTROL OTHER: OTHER's losses against BASE's, bitwise or the
# largest difference, beside CONTROL's (BASE run again: what the kernels
# repeat; "" for none), and the device's parameter bytes of the two. A
# difference where the control is bitwise fails.
parity() {
  local base=$out/$1.jsonl control=${2:+$out/$2.jsonl} other=$out/$3.jsonl
  [[ -s $base && -s $other ]] || return
  python3 - "$1" "$3" "$base" "$other" "$control" <<'EOF' || fail "parity $3 against $1"
import json, sys
base_label, other_label, base, other, control = sys.argv[1:6]
load = lambda p: [json.loads(l) for l in open(p) if l.strip()]
a, b = load(base), load(other)
gap = lambda x, y: max(abs(r["loss"] - s["loss"]) for r, s in zip(x, y))
d = gap(a, b)
c = gap(a, load(control)) if control else None
params = lambda rows: rows[-1].get("param_bytes", 0) / 2**20
line = f"train: parity {other_label} against {base_label}: " + ("bitwise" if d == 0 else f"max |loss difference| {d:.3g}")
if c is not None:
    line += " (the control, the same run twice: " + ("bitwise" if c == 0 else f"{c:.3g}") + ")"
line += f"; device param_bytes {params(b):.2f} MiB against {params(a):.2f} MiB"
print(line)
sys.exit(1 if c == 0 and d > 0 else 0)
EOF
}

# fp16_run STEPS DEVICE BACKEND: remat-train with fp16.enabled at 1 rank (fp16
# compute copies of float32 masters, DeepSpeed's dynamic loss scaling from
# 2^16, whose first steps may overflow and be skipped): losses finite and
# falling, the scale in every metrics line.
fp16_run() {
  local steps=$1 dev=$2 backend=$3 label=np1-$3-fp16
  train "$label" 1 "$backend" "$dev" --steps "$steps" --set fp16.enabled=true
  [[ -s $out/$label.jsonl ]] || return
  python3 - "$out/$label.jsonl" <<'EOF' || fail "remat-train $label: no loss_scale in its metrics"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if not rows or not all("loss_scale" in r for r in rows):
    sys.exit("loss_scale missing from the metrics")
skipped = sum(1 for r in rows if r.get("skipped"))
print(f"train: fp16 loss scale {rows[0]['loss_scale']:g} -> {rows[-1]['loss_scale']:g}, "
      f"{skipped} of {len(rows)} steps skipped for overflow")
EOF
}

# example NAME NP ARGS...: an example's run and its last loss.
example() {
  local name=$1 np=$2
  shift 2
  step "example $name at $np ranks $*"
  local log=$out/example-$name-np$np.log
  if ! timeout 300 "$bin/remat-run" -np "$np" -- "$examples/$name/$name" --losses "$log.losses" "$@" >"$log" 2>&1; then
    tail -15 "$log"
    fail "example $name at $np ranks"
    return
  fi
  echo "example: $name np$np $* -> $(wc -l <"$log.losses") steps, first $(head -1 "$log.losses"), last $(tail -1 "$log.losses")"
}

# A run that cannot fit the device: it must end with a clear message and a
# nonzero exit on every rank, not a hang or a backtrace.
oom() {
  local device=$1
  step "a run too large for the $device"
  local log=$out/oom.log
  # The memory check before training would refuse it (a configuration error
  # naming the cheapest change): told the device is huge, the run reaches the
  # allocator's own out-of-memory error.
  if REMAT_MEMORY_PER_RANK_BYTES=$((1 << 50)) timeout 300 "$bin/remat-run" -np 1 -- "$bin/remat-train" \
      --device "$device" --steps 2 \
      --set train_micro_batch_size_per_gpu=8192 --set model.seq_len=1024 --set model.d_model=1024 \
      --set model.d_ff=4096 --set model.n_head=16 >"$log" 2>&1; then
    fail "a run too large for the $device trained"
  elif grep -q "unexpected error\|Segmentation\|Exception raised from" "$log"; then
    fail "a run too large for the $device ended unclearly"
  fi
  echo "oom: $(grep -m1 -E 'remat (out of memory|configuration error|error)' "$log" | cut -c1-300)"
}

run() {
  out=${1:-${OUT:-build/gpu-logs}}
  mkdir -p "$out"
  machine
  build_gpu "$out" || { echo "== done in $((SECONDS - t0)) s, rc 1"; return 1; }
  bin=build/gpu examples=build/gpu-examples
  step "gpu_test"
  build/gpu/gpu_test --gtest_color=no >"$out/gpu_test.log" 2>&1 || fail gpu_test
  grep -E '^gpu:|^\[  FAILED|^\[  PASSED|Failure|Expected|Which is|actual|error' "$out/gpu_test.log" | head -80
  step "device_test, 1 rank (the engine places, trains, saves to the CPU and back)"
  build/gpu/remat-run -np 1 -- build/gpu/device_test --gtest_color=no >"$out/device_test.log" 2>&1 || fail device_test
  grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|Failure|error' "$out/device_test.log" | head -20
  step "mpi_staging_test, 2 ranks sharing the GPU (the mpi backend's CUDA staging)"
  build/gpu/remat-run -np 2 -- build/gpu/mpi_staging_test --gtest_color=no >"$out/mpi_staging_test.log" 2>&1 ||
    fail mpi_staging_test
  grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|Failure|error' "$out/mpi_staging_test.log" | head -20
  step "remat-smoke: 1 rank (auto: nccl), 2 ranks sharing the GPU (auto: mpi)"
  build/gpu/remat-run -np 1 -- build/gpu/remat-smoke 2>&1 | tail -2 || fail "remat-smoke at 1 rank"
  build/gpu/remat-run -np 2 -- build/gpu/remat-smoke 2>&1 | tail -3 || fail "remat-smoke at 2 ranks"
  if [[ " ${targets[*]} " == *" nccl_test "* ]]; then
    step "nccl_test, 1 rank"
    build/gpu/remat-run -np 1 -- build/gpu/nccl_test --gtest_color=no >"$out/nccl_test.log" 2>&1 || fail nccl_test
    grep -E '^\[  FAILED|^\[  PASSED|Failure|error' "$out/nccl_test.log" | head -40
  else
    echo "== nccl_test not built: no MPI on this machine (the NCCL backend is bootstrapped over MPI)"
  fi
  trains 30 cuda nccl
  fp16_run 20 cuda nccl
  oom cuda
  example llama 1
  example llama 2 --set zero_optimization.stage=3 --set activation_checkpointing.variant=full
  example lora 2 --set zero_optimization.stage=3
  bench "$out" || fail "benchmarks/gpu_bench.sh"
  echo "== done in $((SECONDS - t0)) s, rc $rc"
  return $rc
}

dry_run() {
  out=${1:-build/gpu-dry}
  mkdir -p "$out"
  bin=build/cmake examples=build/gpu-dry-examples
  step "build (CMake, this machine's LibTorch): gpu_test compiled, remat-train, gpt_bench"
  if ! { cmake --build build/cmake -j"$(nproc)" --target gpu_test device_test remat-train remat-estimate remat-smoke gpt_bench dp_bench &&
         cmake --install build/cmake --prefix build/install; } >"$out/build.log" 2>&1; then
    grep -E 'error|Error' "$out/build.log" | head -40
    echo "build failed (run ./test.sh first: it configures build/cmake)"
    return 1
  fi
  build_examples "$out" build/install "$examples" "" -G Ninja
  trains 3 cpu mpi
  example llama 1 --steps 2
  example lora 2 --steps 2 --set zero_optimization.stage=3
  bench "$out" --dry-run || fail "benchmarks/gpu_bench.sh --dry-run"
  echo "== done in $((SECONDS - t0)) s, rc $rc"
  return $rc
}

# bench DIR [--dry-run]: benchmarks/gpu_bench.sh with this build's gpt_bench;
# on the GPU its page is DIR/benchmarks-gpu.md (copied over docs/benchmarks-gpu.md here).
bench() {
  local dir=$1
  shift
  step "benchmarks/gpu_bench.sh $*"
  GPT_BENCH=$bin/gpt_bench DP_BENCH=$bin/dp_bench GPU_BENCH_DIR="$dir/gpu-bench" GPU_BENCH_MD="$dir/benchmarks-gpu.md" \
    benchmarks/gpu_bench.sh "$@" >"$dir/gpu_bench.log" 2>&1
  local status=$?
  grep -E '^gpu_bench:|Error|error' "$dir/gpu_bench.log" | head -40
  [[ -f $dir/benchmarks-gpu.md ]] && grep -E '^\| |^- ' "$dir/benchmarks-gpu.md" | head -100
  return $status
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  dry-run) shift; dry_run "$@" ;;
  *) echo "usage: tools/gpu_checks.sh pack | run [DIR] | dry-run [DIR]" >&2; exit 2 ;;
esac
