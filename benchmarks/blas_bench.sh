#!/usr/bin/env bash
# The BLAS of LibTorch's float32 products, side by side in one run: the
# default job (configs/default.json, 2 ranks, remat-run's threads) and one
# float32 matmul on one thread, with each libblas.so.3 installed here put
# first by LD_LIBRARY_PATH: the reference BLAS (netlib), OpenBLAS's OpenMP
# and pthread builds. Rounds interleave the libraries; medians [min, max].
# Prints a markdown table (docs/benchmarks.md, "BLAS").
#
#   bazel build //launch:remat-train //launch:remat-run
#   benchmarks/blas_bench.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
steps="${2:-30}"
train=bazel-bin/launch/remat-train
run=bazel-bin/launch/remat-run
lib="/usr/lib/$(uname -m)-linux-gnu"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export REMAT_LOG_LEVEL=warn
libraries=()
for name in blas openblas-openmp openblas-pthread; do
  [[ -e "$lib/$name/libblas.so.3" ]] && libraries+=("$name")
done
for ((r = 1; r <= rounds; r++)); do
  for name in "${libraries[@]}"; do
    start=$(date +%s.%N)
    LD_LIBRARY_PATH="$lib/$name" "$run" -np 2 -- "$train" --config configs/default.json --steps "$steps" \
      --set train.eval_interval=0 --set train.sample_chars=0 --metrics "$tmp/$name.$r.jsonl" >/dev/null 2>&1
    echo "$(date +%s.%N) $start" >"$tmp/$name.$r.wall"
    LD_LIBRARY_PATH="$lib/$name" OMP_NUM_THREADS=1 /usr/bin/python3 - >"$tmp/$name.$r.gflops" <<'PY'
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
for _ in range(3): a @ b
n, start = 0, time.perf_counter()
while time.perf_counter() - start < 1.0:
    a @ b
    n += 1
print(2 * 512 ** 3 * n / (time.perf_counter() - start) / 1e9)
PY
  done
done
/usr/bin/python3 - "$tmp" "$rounds" "${libraries[@]}" <<'PY'
import json, statistics, sys
tmp, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def spread(xs, digits=1):
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}, {max(xs):.{digits}f}]"
c = json.load(open("configs/default.json"))
tokens = c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * c["model"]["seq_len"] * 2
rows = {}
for name in names:
    tok, wall, gf, last = [], [], [], None
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{tmp}/{name}.{r}.jsonl")]
        steps = [l for l in lines if "step_ms" in l][2:]  # the first two warm up
        tok.append(tokens / (statistics.median(l["step_ms"] for l in steps) / 1000))
        end, start = map(float, open(f"{tmp}/{name}.{r}.wall").read().split())
        wall.append(end - start)
        gf.append(float(open(f"{tmp}/{name}.{r}.gflops").read()))
        last = lines[-1].get("loss", last)
    rows[name] = (tok, wall, gf, last)
base = statistics.median(rows[names[0]][0])
print(f"| libblas.so.3 | default job tokens/s (2 ranks) | × {names[0]} | job wall s | float32 matmul GFLOP/s (1 thread, 512²) | last loss |")
print("|---|---|---|---|---|---|")
for name, (tok, wall, gf, last) in rows.items():
    print(f"| {name} | {spread(tok, 0)} | {statistics.median(tok) / base:.2f} | {spread(wall)} | {spread(gf)} | {last} |")
PY
