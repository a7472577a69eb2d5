#!/usr/bin/env bash
# bf16 beside float32 on this machine's CPU: the GPT of the data-parallel
# benchmark trained through remat's Engine (benchmarks/dp_bench.cc
# --engine-only) with bf16.enabled (float32 masters, bf16 compute copies) and
# without, at ZeRO stages 0 and 3, without and with full checkpointing, at 2
# ranks (remat-run). Every configuration is its own run; rounds run every
# configuration once each, so the machine's noise spreads over all. Writes the
# rows to OUT.jsonl and the markdown section of docs/benchmarks.md to OUT.md
# (benchmarks/bf16_report.py). About 2-3 minutes on 2 cores.
#
#   benchmarks/bf16_bench.sh [OUT.jsonl]           # default build/bench/bf16.jsonl
#   BF16_ROUNDS=5 BF16_STEPS=4 BF16_WARMUP=1 BF16_WORLD=2 BF16_STAGES="0 3" benchmarks/bf16_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=/usr/bin/python3

rows=${1:-build/bench/bf16.jsonl}
md=${rows%.jsonl}.md
mkdir -p "$(dirname "$rows")"
: >"$rows"
rounds=${BF16_ROUNDS:-5}
steps=${BF16_STEPS:-4}
warmup=${BF16_WARMUP:-1}
world=${BF16_WORLD:-2}
stages=${BF16_STAGES:-0 3}
bazel build //benchmarks:dp_bench //launch:remat-run >/dev/null 2>&1 || bazel build //benchmarks:dp_bench //launch:remat-run
model=(--layers 8 --batch 4 --seq 64 --d-model 128 --heads 4 --d-ff 512 --vocab 128 --dropout 0.1 --seed 1234)
export REMAT_LOG_LEVEL=warn OMP_NUM_THREADS=1
log=${rows%.jsonl}.log
: >"$log"

# stage, precision flag (empty: float32), checkpointing
configs=()
for stage in $stages; do
  for ckpt in none full; do
    configs+=("$stage - $ckpt" "$stage --bf16 $ckpt")
  done
done
for ((r = 1; r <= rounds; r++)); do
  echo "bf16_bench: round $r of $rounds (${#configs[@]} runs)" >&2
  for c in "${configs[@]}"; do
    read -r stage prec ckpt <<<"$c"
    flags=()
    [[ $prec == - ]] || flags+=("$prec")
    timeout 600 bazel-bin/launch/remat-run -np "$world" -- bazel-bin/benchmarks/dp_bench "${model[@]}" \
      --stage "$stage" --overlap-comm true --engine-only "${flags[@]}" --checkpointing "$ckpt" \
      --steps "$steps" --warmup "$warmup" --out "$rows" >>"$log" 2>&1 || echo "bf16_bench: failed: $c" >&2
  done
done

# What one matmul of the GPT's size costs in each dtype here (the BLAS float32
# goes to, oneDNN for bf16): the key to reading the step times.
matmul=$($py - <<'PY'
import json, time, torch
torch.set_num_threads(1)
m, k, n = 256, 512, 512
out = {"m": m, "k": k, "n": n}
for dt in (torch.float32, torch.bfloat16):
    a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    out[str(dt).split(".")[1]] = 2 * m * k * n * 20 / (time.perf_counter() - t) / 1e9
print(json.dumps(out))
PY
)
cat >"${rows%.jsonl}.platform.json" <<JSON
{"platform": "$(. /etc/os-release; echo "$PRETTY_NAME")",
 "libtorch": "$(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo unknown)",
 "blas": "$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || echo unknown)",
 "machine": "$(getconf _NPROCESSORS_ONLN) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)",
 "cpu_bf16": "$(grep -o -m1 -w 'avx512_bf16\|amx_bf16' /proc/cpuinfo | head -1)",
 "date": "$(date -u '+%Y-%m-%d %H:%M UTC')",
 "matmul_gflops": $matmul,
 "rounds": $rounds, "steps": $steps, "warmup": $warmup, "world": $world}
JSON
$py benchmarks/bf16_report.py "$rows" >"$md"
cat "$md"
