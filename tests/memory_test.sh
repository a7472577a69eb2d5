#!/usr/bin/env bash
# The memory estimator and the whole-device budget against measured steps, at
# 2 ranks (docs/memory.md):
#   - remat-estimate's rows (cold and live) for every ZeRO stage x {none, full,
#     selective_op} beside remat-train's measured peak per rank (the larger
#     of steps 2-3, when the optimizer state exists): live within 10 %, cold
#     within 25 %;
#   - activation_checkpointing.device_memory_budget_bytes at ZeRO-3 with 8
#     blocks: the measured peak at most 1.05 x the budget, the plan's predicted
#     total within 10 % of it, the losses bitwise those of no checkpointing;
#   - bad input: a budget below the model state alone, two budget keys, --live
#     with tensor parallelism, ranks that tensor parallelism does not divide.
#
#   tests/memory_test.sh REMAT_TRAIN REMAT_ESTIMATE REMAT_RUN
set -uo pipefail
train=$1 estimate=$2 run=$3
source "$(dirname "$0")/testlib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
quiet=(--set train.sample_chars=0 --set train.eval_interval=0)

# --- A. The estimate beside the measured step --------------------------------
"$estimate" -np 2 --json "$tmp/cold.json" >"$tmp/cold.out" 2>&1 || fail "remat-estimate (cold)" "$(cat "$tmp/cold.out")"
"$estimate" -np 2 --live --json "$tmp/live.json" >"$tmp/live.out" 2>&1 || fail "remat-estimate --live" "$(cat "$tmp/live.out")"
for stage in 0 1 2 3; do
  for variant in none full selective_op; do
    if ! "$run" -np 2 -- "$train" --steps 3 "${quiet[@]}" --set zero_optimization.stage=$stage \
        --set activation_checkpointing.variant=$variant --metrics "$tmp/m.jsonl" >"$tmp/train.out" 2>&1; then
      fail "stage $stage $variant: remat-train" "$(cat "$tmp/train.out")"
      continue
    fi
    verdict=$(python3 - "$tmp" "$stage" "$variant" <<'PY'
import json, sys
tmp, stage, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
steps = [json.loads(l) for l in open(f"{tmp}/m.jsonl")]
measured = max(s["mem_peak_bytes"] for s in steps[1:])
out, ok = [], True
for mode, bound in (("cold", 0.25), ("live", 0.10)):
    rows = json.load(open(f"{tmp}/{mode}.json"))["rows"]
    row = next(r for r in rows if r["stage"] == stage and r["policy"] == policy and not r["offload"] and not r["hybrid"])
    ratio = row["peak_bytes"] / measured
    ok &= abs(ratio - 1) <= bound
    out.append(f"{mode} {row['peak_bytes'] / 2**20:.2f} MiB ({ratio:.3f} x)")
print(("ok" if ok else "off"), f"measured {measured / 2**20:.2f} MiB,", ", ".join(out))
PY
)
    if [[ $verdict == ok* ]]; then
      pass "stage $stage $variant: ${verdict#ok }"
    else
      fail "stage $stage $variant: the estimate is off (live within 10 %, cold within 25 %)" "$verdict"
    fi
  done
done
# remat-train prints the estimate of its own configuration at start.
if REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" >"$tmp/line.out" 2>&1 &&
    grep -q "memory estimate (cold): peak .* MiB per rank = parameters" "$tmp/line.out"; then
  pass "remat-train logs its configuration's estimate at start"
else
  fail "remat-train logs its configuration's estimate at start" "$(cat "$tmp/line.out")"
fi

# --- B. A whole-device budget: ZeRO-3, 8 blocks, 2 ranks ---------------------
eight=(--set model.n_layer=8 --set zero_optimization.stage=3 --set train.steps=4 "${quiet[@]}")
"$run" -np 2 -- "$train" "${eight[@]}" --set activation_checkpointing.variant=none --metrics "$tmp/none.jsonl" \
  >"$tmp/none.out" 2>&1 || fail "8 blocks without checkpointing" "$(cat "$tmp/none.out")"
"$run" -np 2 -- "$train" "${eight[@]}" --set activation_checkpointing.variant=full --metrics "$tmp/full.jsonl" \
  >"$tmp/full.out" 2>&1 || fail "8 blocks with full checkpointing" "$(cat "$tmp/full.out")"
# Halfway between the peaks of full checkpointing and none.
budget=$(python3 -c "
import json, sys
peak = lambda f: max(json.loads(l)['mem_peak_bytes'] for l in open(f))
print((peak('$tmp/none.jsonl') + peak('$tmp/full.jsonl')) // 2)")
if "$run" -np 2 -- "$train" "${eight[@]}" --set activation_checkpointing.variant=auto \
    --set activation_checkpointing.device_memory_budget_bytes="$budget" --metrics "$tmp/auto.jsonl" \
    >"$tmp/auto.out" 2>&1; then
  verdict=$(python3 - "$tmp" "$budget" <<'PY'
import json, sys
tmp, budget = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l) for l in open(f"{tmp}/auto.jsonl")]
none = [json.loads(l) for l in open(f"{tmp}/none.jsonl")]
measured = max(s["mem_peak_bytes"] for s in steps)
predicted = steps[0]["act_plan_predicted_total_peak_bytes"]
plan = steps[0]["act_plan"]
same = [s["loss"] for s in steps] == [s["loss"] for s in none]
checkpointed = any(c != "keep" for c in plan.split(","))
ok = measured <= 1.05 * budget and abs(predicted / measured - 1) <= 0.10 and same and checkpointed
print("ok" if ok else "off", f"budget {budget / 2**20:.2f} MiB, measured {measured / budget:.3f} x budget, "
      f"predicted {predicted / measured:.3f} x measured, plan {plan}, losses bitwise equal to none: {same}")
PY
)
  if [[ $verdict == ok* ]]; then
    pass "device_memory_budget_bytes at ZeRO-3, 8 blocks: ${verdict#ok }"
  else
    fail "device_memory_budget_bytes at ZeRO-3, 8 blocks (measured <= 1.05 x budget, prediction within 10 %, bitwise losses, some block checkpointed)" "$verdict"
  fi
else
  fail "device_memory_budget_bytes at ZeRO-3, 8 blocks" "$(cat "$tmp/auto.out")"
fi

# With gradient accumulation the gradients held between micro-batches are state too.
acc=(--set gradient_accumulation_steps=2 --set zero_optimization.stage=0 --set train.steps=3 "${quiet[@]}")
for v in none full; do
  "$run" -np 2 -- "$train" "${acc[@]}" --set activation_checkpointing.variant=$v --metrics "$tmp/acc_$v.jsonl" \
    >"$tmp/acc_$v.out" 2>&1 || fail "accumulation, $v" "$(cat "$tmp/acc_$v.out")"
done
budget=$(python3 -c "
import json
peak = lambda f: max(json.loads(l)['mem_peak_bytes'] for l in open(f))
print((peak('$tmp/acc_none.jsonl') + peak('$tmp/acc_full.jsonl')) // 2)")
if "$run" -np 2 -- "$train" "${acc[@]}" --set activation_checkpointing.variant=auto \
    --set activation_checkpointing.device_memory_budget_bytes="$budget" --metrics "$tmp/acc_auto.jsonl" \
    >"$tmp/acc_auto.out" 2>&1 &&
    verdict=$(python3 - "$tmp" "$budget" <<'PY'
import json, sys
tmp, budget = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l) for l in open(f"{tmp}/acc_auto.jsonl")]
measured = max(s["mem_peak_bytes"] for s in steps)
predicted = steps[0]["act_plan_predicted_total_peak_bytes"]
print(f"measured {measured / budget:.3f} x budget, predicted {predicted / measured:.3f} x measured, plan {steps[0]['act_plan']}")
sys.exit(0 if measured <= 1.05 * budget and abs(predicted / measured - 1) <= 0.10 else 1)
PY
); then
  pass "device_memory_budget_bytes with gradient accumulation (stage 0): $verdict"
else
  fail "device_memory_budget_bytes with gradient accumulation (stage 0)" "${verdict:-$(cat "$tmp/acc_auto.out")}"
fi

# --- C. Bad input ------------------------------------------------------------
# A configuration that does not fit what a rank has is refused before anything
# is built, naming the cheapest change that fits (here: 15 MiB per rank, ZeRO-3
# without checkpointing needs about 33 MiB, with full checkpointing 12).
expect_all "a configuration beyond the rank's memory names the cheapest change that fits" \
  "is available to each rank on this host: the cheapest change that fits: activation_checkpointing.variant=full" \
  "device_memory_budget_bytes=15728640" -- \
  env REMAT_MEMORY_PER_RANK_BYTES=15728640 "$run" -np 2 -- "$train" --steps 1 \
  --set activation_checkpointing.variant=none
expect "remat-estimate says the same" "the configuration does not fit; the cheapest change that fits: activation_checkpointing.variant=full" \
  env REMAT_MEMORY_PER_RANK_BYTES=15728640 "$estimate" -np 2 --set activation_checkpointing.variant=none
expect "a bad REMAT_MEMORY_PER_RANK_BYTES" "REMAT_MEMORY_PER_RANK_BYTES='lots' is not a whole number of bytes > 0" \
  env REMAT_MEMORY_PER_RANK_BYTES=lots "$estimate"
expect "a whole-device budget below the model state alone" "is below the model state alone: parameters and buffers" \
  "$run" -np 2 -- "$train" --steps 1 --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=100000
expect "a whole-device budget no plan meets names the smallest feasible one" "The smallest feasible budget is" \
  "$run" -np 2 -- "$train" --steps 1 --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=3000000
expect "two budget keys" "the budget is given once, keep exactly one of them" \
  "$train" --steps 1 --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=100000000 --set activation_checkpointing.memory_budget_fraction=0.5
expect "remat-estimate --live with tensor parallelism" "--live builds the model on this one process" \
  "$estimate" -np 2 --live --set tensor_parallel.size=2
expect "remat-estimate with ranks tensor parallelism does not divide" "-np 3 is not a multiple of tensor_parallel.size 2" \
  "$estimate" -np 3 --set tensor_parallel.size=2
expect "remat-estimate --json to a folder that does not exist" "--json '$tmp/no/such/dir/e.json': its folder '$tmp/no/such/dir' does not exist" \
  "$estimate" --json "$tmp/no/such/dir/e.json"

summary
