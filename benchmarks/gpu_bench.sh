#!/usr/bin/env bash
# remat beside PyTorch on a GPU, on the same kernels (SDPA attention): the GPT
# at a launch-bound and a compute-bound shape under every checkpointing
# variant, activation offloading and PyTorch's peers, and the limits measured
# on the same run; then remat's bf16 (bf16.enabled, through the Engine:
# dp_bench --engine-only) beside torch.autocast(bfloat16), training steps with
# AdamW at the issue's two MFU shapes, without and with full checkpointing;
# writes docs/benchmarks-gpu.md (benchmarks/gpu_report.py). About 3 minutes on
# an H100 (GPU_BENCH_MFU=0 leaves the bf16 part out).
#
#   benchmarks/gpu_bench.sh              # GPU machine: build/gpu/gpt_bench and dp_bench (CMake,
#                                        #   -DREMAT_BUILD_BENCHMARKS=ON)
#   benchmarks/gpu_bench.sh --dry-run    # here: the CPU, tiny shapes, bazel-bin/benchmarks/gpt_bench and
#                                        #   dp_bench, Debian's python3-torch; report in build/gpu-bench-dry/
#
# Environment: GPT_BENCH and DP_BENCH (the binaries), PY (a python with torch),
# GPU_BENCH_DIR (the rows), GPU_BENCH_MD (the page), GPU_BENCH_MFU (0: no bf16
# part), GPU_PEAK_TFLOPS (the card's dense bf16 peak, when gpu_report.py does not
# know the card).
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: benchmarks/gpu_bench.sh [--dry-run]" >&2; exit 2 ;;
esac
if ((dry)); then
  device=cpu steps=2 warmup=1 copy_mib=16
  gpt_bench=${GPT_BENCH:-bazel-bin/benchmarks/gpt_bench} py=${PY:-/usr/bin/python3}
  dir=${GPU_BENCH_DIR:-build/gpu-bench-dry} md=${GPU_BENCH_MD:-build/gpu-bench-dry/benchmarks-gpu.md}
  # name | label | role | gpt_bench and torch_gpt_gpu_bench.py arguments
  shapes=("launch|L=2 d=64 T=32 b=2|launch-bound|--layers 2 --d-model 64 --heads 4 --d-ff 256 --seq 32 --batch 2 --vocab 128"
          "compute|L=2 d=128 T=64 b=2|compute-bound|--layers 2 --d-model 128 --heads 4 --d-ff 512 --seq 64 --batch 2 --vocab 128")
  dp_bench=${DP_BENCH:-bazel-bin/benchmarks/dp_bench}
  # name | label | arguments | remat's and PyTorch's configurations (precision_checkpointing)
  mfu_shapes=("mfu1|L=2 d=64 T=32 b=2|--layers 2 --d-model 64 --heads 4 --d-ff 256 --seq 32 --batch 2 --vocab 128|float32_none,bf16_none,bf16_full"
              "mfu2|L=2 d=128 T=64 b=2|--layers 2 --d-model 128 --heads 4 --d-ff 512 --seq 64 --batch 2 --vocab 128|bf16_none,bf16_full")
else
  device=cuda steps=5 warmup=2 copy_mib=256
  gpt_bench=${GPT_BENCH:-build/gpu/gpt_bench} py=${PY:-python3}
  dir=${GPU_BENCH_DIR:-build/gpu-bench} md=${GPU_BENCH_MD:-docs/benchmarks-gpu.md}
  shapes=("launch|L=8 d=512 T=256 b=8|launch-bound|--layers 8 --d-model 512 --heads 8 --d-ff 2048 --seq 256 --batch 8 --vocab 512"
          "compute|L=16 d=1024 T=1024 b=8|compute-bound|--layers 16 --d-model 1024 --heads 16 --d-ff 4096 --seq 1024 --batch 8 --vocab 512")
  dp_bench=${DP_BENCH:-build/gpu/dp_bench}
  # The issue's two shapes (its reference: autocast MFU 0.31 and 0.48 on an H200),
  # the second at 8 of its 24 layers: the same work per layer and token (vocab 512:
  # embeddings and head are < 1 % of it), a third of the 1.2B parameters to
  # initialise on the host, so that tools/gpu_checks.sh stays within its time.
  # float32 at the first only (about 0.3 s a step there).
  mfu_shapes=("mfu1|L=16 d=1024 T=1024 b=8|--layers 16 --d-model 1024 --heads 16 --d-ff 4096 --seq 1024 --batch 8 --vocab 512|float32_none,bf16_none,bf16_full"
              "mfu2|L=8 d=2048 T=2048 b=4|--layers 8 --d-model 2048 --heads 16 --d-ff 8192 --seq 2048 --batch 4 --vocab 512|bf16_none,bf16_full")
fi
mfu=${GPU_BENCH_MFU:-1}
[[ -x $gpt_bench ]] || { echo "gpu_bench.sh: no gpt_bench at $gpt_bench (build it, or set GPT_BENCH)" >&2; exit 1; }
[[ $mfu == 0 || -x $dp_bench ]] || { echo "gpu_bench.sh: no dp_bench at $dp_bench (build it, set DP_BENCH, or GPU_BENCH_MFU=0)" >&2; exit 1; }
remat_variants=none,full,full_reentrant,every_k2,selective_op,selective_op_matmuls,act_offload
torch_variants=none,full_nonreentrant,full_reentrant,every_k2_nonreentrant,selective_ac,save_on_cpu
common=(--dropout 0.1 --seed 1234 --steps "$steps" --warmup "$warmup")
export REMAT_LOG_LEVEL=warn

mkdir -p "$dir" "$(dirname "$md")"
echo "[" >"$dir/shapes.json"
sep=""
for s in "${shapes[@]}"; do
  IFS="|" read -r name label role args <<<"$s"
  printf '%s{"name": "%s", "label": "%s", "role": "%s"}\n' "$sep" "$name" "$label" "$role" >>"$dir/shapes.json"
  sep=","
  : >"$dir/$name.jsonl"
  t0=$SECONDS
  # shellcheck disable=SC2086  # $args: the shape's options, one word each
  "$gpt_bench" --device "$device" $args "${common[@]}" --variants "$remat_variants" --out "$dir/$name.jsonl"
  t1=$SECONDS
  # shellcheck disable=SC2086
  "$py" benchmarks/torch_gpt_gpu_bench.py --device "$device" $args "${common[@]}" --variants "$torch_variants" \
    --copy-mib "$copy_mib" --out "$dir/$name.jsonl"
  echo "gpu_bench: $label ($role): remat $((t1 - t0)) s, PyTorch $((SECONDS - t1)) s"
done
echo "]" >>"$dir/shapes.json"
rm -f "$dir/mfu_shapes.json"
if [[ $mfu != 0 ]]; then
  # bf16: remat's Engine (one process per configuration: ZeRO stage 0, AdamW)
  # beside torch.autocast (one process, the configurations interleaved).
  echo "[" >"$dir/mfu_shapes.json"
  sep=""
  for s in "${mfu_shapes[@]}"; do
    IFS="|" read -r name label args configs <<<"$s"
    printf '%s{"name": "%s", "label": "%s"}\n' "$sep" "$name" "$label" >>"$dir/mfu_shapes.json"
    sep=","
    : >"$dir/$name.jsonl"
    t0=$SECONDS
    for c in ${configs//,/ }; do
      flags=(--checkpointing "${c#*_}")
      [[ ${c%%_*} == bf16 ]] && flags+=(--bf16)
      # shellcheck disable=SC2086
      "$dp_bench" --device "$device" --engine-only --stage 0 $args "${flags[@]}" "${common[@]}" --out "$dir/$name.jsonl"
    done
    t1=$SECONDS
    # shellcheck disable=SC2086
    "$py" benchmarks/torch_gpt_gpu_bench.py --device "$device" $args "${common[@]}" --train-step \
      --train-variants "$configs" --out "$dir/$name.jsonl"
    echo "gpu_bench: $label (bf16, MFU): remat $((t1 - t0)) s, PyTorch $((SECONDS - t1)) s"
  done
  echo "]" >>"$dir/mfu_shapes.json"
fi
"$py" benchmarks/gpu_report.py "$dir" >"$md"
echo "gpu_bench: $md"
