#!/usr/bin/env bash
# Benchmarks remat's checkpointing against PyTorch's own (torch.utils.checkpoint,
# Debian's python3-torch) on the same GPT, and writes docs/benchmarks.md and
# docs/img/*.png. About 20 minutes on 2 cores.
# Step 7 (sequence parallelism) alone: benchmarks/sequence_parallel_bench.sh; step 8
# (data parallelism beside PyTorch DDP and ZeroRedundancyOptimizer, this platform's
# rows; the Debian 13 ones come from benchmarks/dp_bench.sh --debian13 when run
# before) alone: benchmarks/dp_bench.sh.
#
#   ./bench.sh            # full run
#   BENCH_QUICK=1 ./bench.sh   # a smoke run (small depths, few steps) into build/bench
set -euo pipefail
cd "$(dirname "$0")"
py=/usr/bin/python3  # Debian's, whatever else is first on PATH
need=()
$py -c "import torch" 2>/dev/null || need+=(python3-torch)
$py -c "import matplotlib" 2>/dev/null || need+=(python3-matplotlib)
if ((${#need[@]})); then
  echo "bench.sh: installing ${need[*]}"
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get install -y "${need[@]}" >/dev/null 2>&1 ||
    { $sudo apt-get update >/dev/null && $sudo apt-get install -y "${need[@]}" >/dev/null; }
fi
tools/install_deps.sh
bazel build //benchmarks:gpt_bench //launch:remat-run >/dev/null 2>&1 || bazel build //benchmarks:gpt_bench //launch:remat-run

quick="${BENCH_QUICK:-0}"
if [[ "$quick" == 1 ]]; then
  layers=2,4; time_layers=2; steps=3; warmup=1; md=build/bench/benchmarks.md; img=build/bench/img
  budget_layers=4; budget_steps=2
  export DP_ROUNDS=1 DP_STEPS=2 DP_WARMUP=1
else
  layers=2,4,8,16,32; time_layers=8; steps=20; warmup=3; md=docs/benchmarks.md; img=docs/img
  budget_layers=8,32; budget_steps=8
fi
mkdir -p "$img" build/bench
results=build/bench/results.jsonl
: >"$results"
model=(--batch 4 --seq 64 --d-model 128 --heads 4 --d-ff 512 --vocab 128 --seed 1234)
export REMAT_LOG_LEVEL=warn
gpt_bench=bazel-bin/benchmarks/gpt_bench
remat_variants=none,full,full_reentrant,every_k2,every_k2_reentrant,selective_op,selective_op_matmuls,offload,act_offload
budget_variants=none,full,every_k2,every_k3,every_k4,every_k8,selective_op,selective_op_matmuls,auto20,auto35,auto50,auto70
torch_variants=none,full_reentrant,full_nonreentrant,every_k2_reentrant,every_k2_nonreentrant,save_on_cpu

echo "[1/8] same function: first-step loss without dropout"
$gpt_bench "${model[@]}" --layers 4 --variants none --memory-only --dropout 0 |
  $py -c 'import json,sys; r=json.loads(sys.stdin.readline()); print(json.dumps({"framework":"remat","kind":"check","loss":r["loss"]}))' >>"$results"
$py benchmarks/torch_gpt.py "${model[@]}" --layers 4 --variants none --memory-only --dropout 0 |
  $py -c 'import json,sys; r=json.loads(sys.stdin.readline()); print(json.dumps({"framework":"pytorch","kind":"check","loss":r["loss"]}))' >>"$results"
echo "[2/8] peak activation memory, L = $layers"
$gpt_bench "${model[@]}" --layers "$layers" --variants "$remat_variants" --memory-only --out "$results"
$py benchmarks/torch_gpt.py "${model[@]}" --layers "$layers" --variants "$torch_variants" --memory-only --out "$results"
echo "[3/8] step time at L = $time_layers (remat)"
$gpt_bench "${model[@]}" --layers "$time_layers" --variants "$remat_variants" --steps "$steps" \
  --warmup "$warmup" --out "$results.time"
grep '"kind":"time"' "$results.time" >>"$results"
echo "[4/8] step time at L = $time_layers (PyTorch)"
$py benchmarks/torch_gpt.py "${model[@]}" --layers "$time_layers" --variants "$torch_variants" \
  --steps "$steps" --warmup "$warmup" --out "$results.ptime"
grep '"kind": "time"' "$results.ptime" >>"$results"
echo "[5/8] partitioned checkpoints at tensor-parallel size 2"
bazel-bin/launch/remat-run -np 2 -- $gpt_bench "${model[@]}" --layers "$time_layers" --tp 2 \
  --variants full,partitioned --memory-only --out "$results" >/dev/null
rm -f "$results.time" "$results.ptime"
echo "[6/8] memory budget planner beside the fixed policies, L = $budget_layers"
budget=build/bench/budget.jsonl
: >"$budget"
$gpt_bench "${model[@]}" --layers "$budget_layers" --variants "$budget_variants" --steps "$budget_steps" \
  --warmup 1 --out "$budget"

echo "[7/8] sequence parallelism at tensor-parallel sizes 2 and 4"
benchmarks/sequence_parallel_bench.sh build/bench/sequence_parallel.jsonl >build/bench/sequence_parallel.md

echo "[8/8] data parallelism beside PyTorch DDP and ZeroRedundancyOptimizer at 2 and 4 ranks"
benchmarks/dp_bench.sh build/bench/dp.jsonl >/dev/null  # writes build/bench/dp.md

cat >build/bench/config.json <<JSON
{"batch": 4, "seq": 64, "d_model": 128, "heads": 4, "d_ff": 512, "vocab": 128, "dropout": 0.1,
 "seed": 1234, "steps": $steps, "warmup": $warmup, "time_layers": $time_layers,
 "torch_version": "$($py -c 'import torch; print(torch.__version__)')",
 "machine": "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"}
JSON
$py benchmarks/report.py "$results" build/bench/config.json "$md" "$img" "$budget" build/bench/sequence_parallel.md \
  build/bench/dp.md
echo "wrote $md and $img/*.png"
