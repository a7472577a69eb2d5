#!/usr/bin/env bash
# The GPT of configs/default.json at tensor_parallel.size 2 on 2 ranks, under
# each way of keeping checkpoint inputs: per-rank ckpt_saved_bytes and step
# time relative to no checkpointing. Variants run in interleaved rounds (A B C
# ... A B C ...) so machine noise spreads evenly; the first steps of each run
# are warm-up and dropped; medians over the rest with [min, max].
#
#   bazel build //launch:remat-train //launch:remat-run
#   benchmarks/tp_checkpoint_bench.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
steps="${2:-15}"
warmup=3
train=bazel-bin/launch/remat-train
run=bazel-bin/launch/remat-run
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ac=activation_checkpointing
declare -A args=(
  [none]="--set $ac.variant=none"
  [full]="--set $ac.variant=full"
  [partitioned]="--set $ac.variant=full --set $ac.partition_activations=true"
  [partitioned_contiguous]="--set $ac.variant=full --set $ac.partition_activations=true --set $ac.contiguous_memory_optimization=true --set $ac.number_checkpoints=4"
  [offload]="--set $ac.variant=full --set $ac.cpu_checkpointing=true"
  [partitioned_offload]="--set $ac.variant=full --set $ac.partition_activations=true --set $ac.cpu_checkpointing=true"
)
order=(none full partitioned partitioned_contiguous offload partitioned_offload)
export REMAT_LOG_LEVEL=warn
for ((r = 1; r <= rounds; r++)); do
  for v in "${order[@]}"; do
    # shellcheck disable=SC2086
    "$run" -np 2 -- "$train" --config configs/default.json --set tensor_parallel.size=2 \
      --steps "$steps" --set train.eval_interval=0 --set train.sample_chars=0 ${args[$v]} \
      --metrics "$tmp/$v.$r.jsonl" >/dev/null 2>&1
  done
done
/usr/bin/python3 - "$tmp" "$rounds" "$warmup" "$steps" "${order[@]}" <<'PY'
import json, statistics, sys
tmp, rounds, warmup, steps, order = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                     int(sys.argv[4]), sys.argv[5:])
rows = {}
for v in order:
    times, peaks, saved, offloaded, gathered = [], [], 0, 0, 0
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{tmp}/{v}.{r}.jsonl")]
        times += [m["step_ms"] for m in lines[warmup:]]
        peaks += [m["mem_peak_bytes"] - m["mem_base_bytes"] for m in lines[warmup:]]
        saved, offloaded, gathered = (lines[-1]["ckpt_saved_bytes"], lines[-1]["ckpt_offloaded_bytes"],
                                      lines[-1]["ckpt_gathered_bytes"])
    rows[v] = (statistics.median(times), min(times), max(times), saved, offloaded, gathered,
               max(peaks) / 2**20)
base = rows["none"][0]
print("GPT (configs/default.json) at tensor_parallel.size 2, 2 ranks; per-rank bytes")
print(f"{'variant':<24}{'ckpt_saved_bytes':>17}{'offloaded':>11}{'gathered':>10}"
      f"{'peak MiB':>10}{'step ms (median [min, max])':>32}{'vs none':>9}")
for v in order:
    med, lo, hi, saved, off, gat, peak = rows[v]
    print(f"{v:<24}{saved:>17}{off:>11}{gat:>10}{peak:>10.2f}{med:>14.1f} [{lo:.1f}, {hi:.1f}]"
          f"{med / base:>9.3f}")
print(f"{rounds * (steps - warmup)} measured steps per variant: {rounds} rounds x {steps} steps, "
      f"the first {warmup} of each dropped. Peak: live CPU tensor bytes above the step's start "
      "(offloaded copies are CPU memory too on this machine).")
PY
