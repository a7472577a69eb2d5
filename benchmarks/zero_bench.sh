#!/usr/bin/env bash
# ZeRO stage 0 against stage 3 for the GPT of configs/default.json at world
# sizes 1, 2 and 4 (data parallel; every parameter sharded at stage 3): per-rank
# model-state bytes (parameters + gradients + AdamW state), the peak of gathered
# parameters, collective bytes and step time. Runs alternate stage 0 and 3 per
# world size; the first steps of each run are warm-up and dropped. On a 2-core
# machine 4 ranks share 2 cores, so step times there are mostly contention.
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
for np in 1 2 4; do
  for stage in 0 3; do
    "$run" -np "$np" -- "$train" --config configs/default.json --steps "$steps" \
      --set train.eval_interval=0 --set train.sample_chars=0 \
      --set zero_optimization.stage="$stage" --set zero_optimization.stage3_param_persistence_threshold=0 \
      --metrics "$tmp/w$np.s$stage.jsonl" >/dev/null 2>&1
  done
done
/usr/bin/python3 - "$tmp" "$warmup" <<'PY'
import json, statistics, sys
tmp, warmup = sys.argv[1], int(sys.argv[2])
print(f"{'world':>5} {'stage':>5} {'params B':>10} {'grads B':>10} {'AdamW B':>10} {'model state':>12}"
      f" {'peak gathered':>14} {'comm B/step':>12} {'step ms (median [min, max])':>30}")
for np in (1, 2, 4):
    for stage in (0, 3):
        m = [json.loads(l) for l in open(f"{tmp}/w{np}.s{stage}.jsonl")]
        last = m[-1]
        t = [x["step_ms"] for x in m[warmup:]]
        state = last["param_bytes"] + last["grad_bytes"] + last["optimizer_state_bytes"]
        print(f"{np:>5} {stage:>5} {last['param_bytes']:>10} {last['grad_bytes']:>10}"
              f" {last['optimizer_state_bytes']:>10} {state:>12} {last['peak_gathered_param_bytes']:>14}"
              f" {last['zero_comm_bytes']:>12} {statistics.median(t):>12.1f} [{min(t):.1f}, {max(t):.1f}]")
PY
