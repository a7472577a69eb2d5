#!/usr/bin/env bash
# ZeRO stages 0-3 (and hybrid sharding) for the GPT of configs/default.json at
# world sizes 1-4 (data parallel): per-rank model-state bytes (parameters, the
# most gradient bytes held at once, AdamW state) beside the ZeRO paper's
# formula for fp32 AdamW, the peak of gathered parameters, collective bytes per
# step beside stage 0's, and step time. The first steps of each run are warm-up
# and dropped. On a 2-core machine 3 and 4 ranks share 2 cores, so step times
# there are mostly contention. Prints a markdown table (docs/parallel.md).
#
#   bazel build //launch:remat-train //launch:remat-run
#   benchmarks/zero_bench.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-12}"
warmup=3
train=bazel-bin/launch/remat-train
run=bazel-bin/launch/remat-run
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export REMAT_LOG_LEVEL=warn
# world size, stage, hybrid_shard_size
cases=("1 0 0" "2 0 0" "2 1 0" "2 2 0" "2 3 0" "3 0 0" "3 1 0" "3 2 0" "3 3 0"
       "4 0 0" "4 1 0" "4 2 0" "4 3 0" "4 1 2" "4 2 2" "4 3 2")
for c in "${cases[@]}"; do
  set -- $c
  "$run" -np "$1" -- "$train" --config configs/default.json --steps "$steps" \
    --set train.eval_interval=0 --set train.sample_chars=0 \
    --set zero_optimization.stage="$2" --set zero_optimization.hybrid_shard_size="$3" \
    --set zero_optimization.stage3_param_persistence_threshold=0 \
    --set zero_optimization.reduce_bucket_size=20000 --set zero_optimization.overlap_comm=true \
    --metrics "$tmp/w$1.s$2.h$3.jsonl" >/dev/null 2>&1
done
/usr/bin/python3 - "$tmp" "$warmup" "${cases[@]}" <<'PY'
import json, statistics, sys
tmp, warmup, cases = sys.argv[1], int(sys.argv[2]), [tuple(map(int, c.split())) for c in sys.argv[3:]]
def load(np, stage, hybrid):
    return [json.loads(l) for l in open(f"{tmp}/w{np}.s{stage}.h{hybrid}.jsonl")]
psi = load(1, 0, 0)[-1]["param_bytes"] // 4
paper = {0: lambda n: 16, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n}
formula = {0: "16Ψ", 1: "8Ψ + 8Ψ/N", 2: "4Ψ + 12Ψ/N", 3: "16Ψ/N"}
print(f"Ψ = {psi} parameters (fp32 AdamW; N = ranks a parameter is sharded over)\n")
print("| ranks | stage | N | params B | peak grads B | AdamW B | model state B | formula | formula B "
      "| measured / formula | comm B/step | / stage 0 | step ms (median [min, max]) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for np, stage, hybrid in cases:
    m = load(np, stage, hybrid)
    last = m[-1]
    n = hybrid if hybrid else np
    state = last["param_bytes"] + last["grad_peak_bytes"] + last["optimizer_state_bytes"]
    want = paper[stage](n) * psi
    comm0 = load(np, 0, 0)[-1]["zero_comm_bytes"]
    ratio = f"{last['zero_comm_bytes'] / comm0:.4f}" if comm0 else "-"
    t = [x["step_ms"] for x in m[warmup:]]
    label = f"{np} ({hybrid} x {np // hybrid})" if hybrid else f"{np}"
    print(f"| {label} | {stage} | {n} | {last['param_bytes']} | {last['grad_peak_bytes']} | {last['optimizer_state_bytes']}"
          f" | {state} | {formula[stage]} | {want:.0f} | {state / want:.4f} | {last['zero_comm_bytes']} | {ratio}"
          f" | {statistics.median(t):.1f} [{min(t):.1f}, {max(t):.1f}] |")
PY
