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
#   - device_memory_budget_bytes "auto": the share of the host's physical
#     memory less the reserve, or REMAT_MEMORY_PER_RANK_BYTES less a tenth,
#     and the fit check's words agree with the figure it judged by;
#   - remat-estimate follows train.device (and --device auto), and says when
#     it assumes what a GPU it cannot ask computes;
#   - bad input: a budget below the model state alone, two budget keys, --live
#     with tensor parallelism, ranks that tensor parallelism does not divide,
#     fp16 where this LibTorch cannot compute it (remat-train's refusal from
#     remat-estimate, cold and live, no stack trace).
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
# bf16 (ZeRO-3, no checkpointing): the rows count bf16 activations and
# float32 masters (they counted float32 activations: 1.8-1.9 x the measured
# peak). The peak within the bounds above; the activation phase (the row's
# peak less the parameters, optimizer state and other bytes the step starts
# from) against mem_act_peak_bytes: cold within 25 %, live within 15 %.
bf16=(--set bf16.enabled=true --set zero_optimization.stage=3 --set activation_checkpointing.variant=none)
if "$estimate" -np 2 "${bf16[@]}" --json "$tmp/bf16_cold.json" >"$tmp/bf16.out" 2>&1 &&
    "$estimate" -np 2 --live "${bf16[@]}" --json "$tmp/bf16_live.json" >>"$tmp/bf16.out" 2>&1 &&
    "$run" -np 2 -- "$train" --steps 3 "${quiet[@]}" "${bf16[@]}" --metrics "$tmp/bf16.jsonl" >>"$tmp/bf16.out" 2>&1; then
  verdict=$(python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
steps = [json.loads(l) for l in open(f"{tmp}/bf16.jsonl")][1:]
peak, act = max(s["mem_peak_bytes"] for s in steps), max(s["mem_act_peak_bytes"] for s in steps)
out, ok = [], True
for mode, bound, act_bound in (("cold", 0.25, 0.25), ("live", 0.10, 0.15)):
    row = next(r for r in json.load(open(f"{tmp}/bf16_{mode}.json"))["rows"] if r["configured"])
    est_act = row["peak_bytes"] - row["parameter_bytes"] - row["optimizer_bytes"] - row["other_bytes"]
    r, ra = row["peak_bytes"] / peak, est_act / act
    ok &= abs(r - 1) <= bound and abs(ra - 1) <= act_bound
    out.append(f"{mode} peak {r:.3f} x, activation phase {ra:.3f} x")
print("ok" if ok else "off", f"measured peak {peak / 2**20:.2f} MiB, activation phase {act / 2**20:.2f} MiB;",
      ", ".join(out))
PY
)
  if [[ $verdict == ok* ]]; then
    pass "bf16 at stage 3: ${verdict#ok }"
  else
    fail "bf16 at stage 3: the estimate is off (peak: cold 25 %, live 10 %; activation phase: cold 25 %, live 15 %)" "$verdict"
  fi
else
  fail "bf16 at stage 3: estimate and run" "$(cat "$tmp/bf16.out")"
fi

# Activation offloading: the host column is what the offloaded rows move to
# the host and hold there at the step's peak, cold and live alike, against
# the run's act_host_bytes (the offloading counter of the same thing), and it
# is apart from the peak (cold added it: 5.9 x the measured peak; live read
# 0). The offloaded auto rows of both modes are printed, not compared: on a
# CPU an offloaded block costs about what a kept one does, so the live plan's
# choice between them follows timing noise (a loaded machine gave cold
# 'offload_activationsx3 keepx1', live 'offload_activationsx4');
# engine/memory_estimate_test.cc's HostBytesAreOneThingColdAndLive compares
# the two modes' whole plans on costs that do not move.
offload=(--set activation_offloading.enabled=true --set activation_checkpointing.variant=none)
if "$estimate" -np 2 "${offload[@]}" --json "$tmp/off_cold.json" >"$tmp/off.out" 2>&1 &&
    "$estimate" -np 2 --live "${offload[@]}" --json "$tmp/off_live.json" >>"$tmp/off.out" 2>&1 &&
    "$run" -np 2 -- "$train" --steps 3 "${quiet[@]}" "${offload[@]}" --metrics "$tmp/off.jsonl" >>"$tmp/off.out" 2>&1; then
  verdict=$(python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
steps = [json.loads(l) for l in open(f"{tmp}/off.jsonl")][1:]
peak, host = max(s["mem_peak_bytes"] for s in steps), max(s["act_host_bytes"] for s in steps)
out, ok, plans = [], host > 0, []
for mode, bound in (("cold", 0.25), ("live", 0.10)):
    rows = json.load(open(f"{tmp}/off_{mode}.json"))["rows"]
    row = next(r for r in rows if r["configured"])
    plans.append(next(r for r in rows if r["configured"] is False and r["stage"] == row["stage"] and
                      r["policy"] == "auto" and r["offload"] and not r["hybrid"])["plan"])
    r, rh = row["peak_bytes"] / peak, row["host_bytes"] / host
    ok &= abs(r - 1) <= bound and abs(rh - 1) <= 0.10
    out.append(f"{mode} peak {r:.3f} x, host {rh:.3f} x")
print("ok" if ok else "off", f"measured peak {peak / 2**20:.2f} MiB, host {host / 2**20:.2f} MiB;", ", ".join(out),
      f"; auto plans cold '{plans[0]}', live '{plans[1]}'")
PY
)
  if [[ $verdict == ok* ]]; then
    pass "activation offloading: ${verdict#ok }"
  else
    fail "activation offloading: the estimate is off (peak: cold 25 %, live 10 %; host within 10 %)" "$verdict"
  fi
else
  fail "activation offloading: estimate and run" "$(cat "$tmp/off.out")"
fi

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

# Prints the budget, the measured peak of a --metrics file's steps and the
# plan; fails where the peak is over the budget.
peak_within_budget() {
  python3 - "$1" "$2" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
budget, peak = int(sys.argv[2]), max(s["mem_peak_bytes"] for s in steps)
print(f"budget {budget} B, measured peak {peak} B ({peak - budget:+d} B), plan {steps[0]['act_plan']}")
sys.exit(0 if peak <= budget else 1)
PY
}

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
# remat-estimate runs remat-train's configuration rules: a configuration the
# trainer refuses is refused in the same words, with the same exit status
# (it said "fits" and exited 0).
refused=(--set communication_data_type=bf16)
"$estimate" -np 2 "${refused[@]}" >"$tmp/refused_estimate.out" 2>&1
estimate_rc=$?
# One rank: two ranks' identical errors can interleave on one line (Open MPI 5).
"$run" -np 1 -- "$train" --steps 1 "${quiet[@]}" "${refused[@]}" >"$tmp/refused_train.out" 2>&1
train_rc=$?
estimate_says=$(grep -o "configuration error: .*" "$tmp/refused_estimate.out" | head -1)
train_says=$(grep -o "configuration error: .*" "$tmp/refused_train.out" | head -1)
if [[ $estimate_rc -ne 0 && $estimate_rc -eq $train_rc && $estimate_says == "$train_says" &&
      $estimate_says == *"reduces gradients in bf16, but bf16.enabled is false"* ]]; then
  pass "remat-estimate refuses bf16 reductions without bf16 as remat-train does (exit $estimate_rc): $estimate_says"
else
  fail "remat-estimate refuses bf16 reductions without bf16 as remat-train does (exits $estimate_rc and $train_rc)" \
    "$(cat "$tmp/refused_estimate.out")" "$(cat "$tmp/refused_train.out")"
fi
# fp16 where this LibTorch's CPU kernels cannot compute it: remat-estimate,
# cold and live, refuses it in remat-train's words and exit status, without a
# stack trace (cold said "fits", --live died in a half-precision dropout with
# 30 frames).
fp16=(--set fp16.enabled=true)
"$run" -np 1 -- "$train" --steps 1 "${quiet[@]}" "${fp16[@]}" >"$tmp/fp16_train.out" 2>&1
train_rc=$?
train_says=$(grep -o "configuration error: .*" "$tmp/fp16_train.out" | head -1)
if [[ $train_rc -eq 0 ]]; then
  skip "remat-estimate refuses fp16 as remat-train does" "this LibTorch computes fp16 on the CPU"
else
  for mode in cold live; do
    flags=()
    [[ $mode == live ]] && flags=(--live)
    "$estimate" -np 2 "${flags[@]}" "${fp16[@]}" >"$tmp/fp16_estimate.out" 2>&1
    estimate_rc=$?
    estimate_says=$(grep -o "configuration error: .*" "$tmp/fp16_estimate.out" | head -1)
    if [[ $estimate_rc -eq $train_rc && $estimate_says == "$train_says" &&
          $estimate_says == *"fp16.enabled is true, but the cpu device cannot compute in fp16"* ]] &&
        ! grep -q "frame #" "$tmp/fp16_estimate.out"; then
      pass "remat-estimate ($mode) refuses fp16 as remat-train does (exit $estimate_rc): $estimate_says"
    else
      fail "remat-estimate ($mode) refuses fp16 as remat-train does (exits $estimate_rc and $train_rc)" \
        "$(cat "$tmp/fp16_estimate.out")" "$train_says"
    fi
  done
fi
# remat-estimate estimates for train.device (a GPU for cuda, here or not) and
# takes --device auto (a GPU where this process sees one, here the CPU); it
# said what a GPU it could not ask computes as a fact.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
if "$estimate" --set train.device=cuda >"$tmp/d.out" 2>&1 && grep -q "the model on a GPU" "$tmp/d.out" &&
    "$estimate" --device auto >"$tmp/a.out" 2>&1 &&
    [[ $(grep -c "the model on a GPU" "$tmp/a.out") -eq $((gpus > 0 ? 1 : 0)) ]]; then
  pass "remat-estimate follows train.device=cuda, and --device auto is this process's device"
else
  fail "remat-estimate follows train.device=cuda, and --device auto is this process's device" \
    "$(cat "$tmp/d.out" "$tmp/a.out")"
fi
if [[ $gpus -eq 0 ]]; then
  out=$("$estimate" --device cuda --set bf16.enabled=auto --set fp16.enabled=auto 2>&1)
  if grep -qF 'bf16.enabled "auto" -> true: the training device, cuda, is assumed to compute bf16 (compute capability 8.0 or higher; no GPU here to ask)' <<<"$out" &&
      ! grep -q "cuda, computes bf16" <<<"$out"; then
    pass "remat-estimate --device cuda without a GPU says the compute capability is assumed"
  else
    fail "remat-estimate --device cuda without a GPU says the compute capability is assumed" "$out"
  fi
fi
expect "remat-estimate refuses hybrid shards that do not divide its ranks" \
  "zero_optimization.hybrid_shard_size 3 must divide the data-parallel size 4" \
  "$estimate" -np 4 --set zero_optimization.stage=3 --set zero_optimization.hybrid_shard_size=3
expect "a bad REMAT_MEMORY_PER_RANK_BYTES" "REMAT_MEMORY_PER_RANK_BYTES='lots' is not a whole number of bytes > 0" \
  env REMAT_MEMORY_PER_RANK_BYTES=lots "$estimate"
expect "a whole-device budget below the model state alone" "is below the model state alone: parameters and buffers" \
  "$run" -np 2 -- "$train" --steps 1 --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=100000
expect "a whole-device budget no plan meets names the smallest feasible one" "The smallest feasible budget is" \
  "$run" -np 2 -- "$train" --steps 1 --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=3000000
# The smallest feasible budget remat names is a bound the run meets: at
# exactly that budget the measured peak stays within it (it was 8,004 B over:
# the state counted the parameters and optimizer state but not the rest of
# what is live at the step's start, the batch among it).
smallest=$(REMAT_LOG_LEVEL=warn "$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=3000000 2>&1 | grep -ao "The smallest feasible budget is [0-9]*" |
  head -1 | grep -o "[0-9]*$")
if [[ -n $smallest ]] && "$run" -np 2 -- "$train" --steps 3 "${quiet[@]}" --set activation_checkpointing.variant=auto \
    --set activation_checkpointing.device_memory_budget_bytes="$smallest" --metrics "$tmp/smallest.jsonl" \
    >"$tmp/smallest.out" 2>&1 &&
    verdict=$(peak_within_budget "$tmp/smallest.jsonl" "$smallest"); then
  pass "the smallest feasible budget remat names is met: $verdict"
else
  fail "the smallest feasible budget remat names is met (measured peak <= budget)" "${verdict:-$(cat "$tmp/smallest.out" 2>/dev/null)}"
fi
# A plan's predicted total is a bound too: at a budget of exactly the total
# a plan between full checkpointing and none predicts, the run holds at most
# that (it was over: the profile's backward did not scale the loss as the
# step's does, 4 B, and the state missed the batch).
"$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=20000000 --metrics "$tmp/mid.jsonl" >"$tmp/mid.out" 2>&1
predicted=$(python3 -c "import json, sys; print(json.loads(open(sys.argv[1]).readline())['act_plan_predicted_total_peak_bytes'])" \
  "$tmp/mid.jsonl" 2>/dev/null)
if [[ -n $predicted ]] && "$run" -np 2 -- "$train" --steps 3 "${quiet[@]}" --set activation_checkpointing.variant=auto \
    --set activation_checkpointing.device_memory_budget_bytes="$predicted" --metrics "$tmp/at.jsonl" >"$tmp/at.out" 2>&1 &&
    verdict=$(peak_within_budget "$tmp/at.jsonl" "$predicted"); then
  pass "a budget of exactly a plan's predicted total is met: $verdict"
else
  fail "a budget of exactly a plan's predicted total is met (measured peak <= budget)" \
    "${verdict:-$(cat "$tmp/mid.out" "$tmp/at.out" 2>/dev/null)}"
fi
# device_memory_budget_bytes "auto" on the CPU: the host's physical memory
# (within a cgroup v2 limit) over its 2 ranks, less a tenth of that (at least
# 1 GiB), is the plan's budget, to the byte: a capacity, the same at every
# launch. It was the host's MemAvailable (issue 49), which moved between
# launches, and the "auto" micro-batch with it (issue 50).
physical=$(( $(getconf _PHYS_PAGES) * $(getconf PAGE_SIZE) ))
limit=$(cat /sys/fs/cgroup/memory.max 2>/dev/null)
[[ "$limit" =~ ^[0-9]+$ ]] && (( limit < physical )) && physical=$limit
"$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=auto --metrics "$tmp/device_auto.jsonl" \
  >"$tmp/device_auto.out" 2>&1
resolved=$(python3 -c "import json, sys; print(json.loads(open(sys.argv[1]).readline())['act_plan_device_budget_bytes'])" \
  "$tmp/device_auto.jsonl" 2>/dev/null)
want=$(python3 -c "share = $physical // 2; print(share - max(share // 10, 1 << 30))")
if [[ "${resolved:-0}" == "$want" ]]; then
  pass "device_memory_budget_bytes \"auto\" is the share of the physical memory less the reserve: $resolved bytes"
else
  fail "device_memory_budget_bytes \"auto\" is the share of the physical memory less the reserve ($want)" \
    "${resolved:-$(cat "$tmp/device_auto.out")}"
fi
# With REMAT_MEMORY_PER_RANK_BYTES, what a rank may use: a tenth kept (16 MiB:
# 15099494 bytes); the planner keeps what fits and the run stays within it.
# It ignored the variable and planned against the host's physical memory.
sixteen=$((16 << 20))
REMAT_MEMORY_PER_RANK_BYTES=$sixteen "$run" -np 2 -- "$train" --steps 2 "${quiet[@]}" --set model.n_layer=8 \
  --set activation_checkpointing.variant=auto --set activation_checkpointing.device_memory_budget_bytes=auto \
  --metrics "$tmp/given_auto.jsonl" >"$tmp/given_auto.out" 2>&1
verdict=$(python3 - "$tmp/given_auto.jsonl" $((sixteen - sixteen / 10)) <<'PY' 2>&1
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
want, budget = int(sys.argv[2]), steps[0]["act_plan_device_budget_bytes"]
peak = max(s["mem_peak_bytes"] for s in steps)
print(f"budget {budget} B (want {want}), measured peak {peak} B")
sys.exit(0 if budget == want and peak <= budget else 1)
PY
)
if [[ $? -eq 0 ]]; then
  pass "device_memory_budget_bytes \"auto\" with REMAT_MEMORY_PER_RANK_BYTES=16 MiB: $verdict"
else
  fail "device_memory_budget_bytes \"auto\" with REMAT_MEMORY_PER_RANK_BYTES=16 MiB" "$verdict" "$(cat "$tmp/given_auto.out")"
fi
# Where nothing fits, the refusal judges the figure it names ("does not fit",
# 8 MiB), not the host's memory ("fits") beside "about 8 MiB is available".
out=$(REMAT_MEMORY_PER_RANK_BYTES=$((8 << 20)) "$run" -np 1 -- "$train" --steps 1 "${quiet[@]}" \
  --set activation_checkpointing.variant=auto --set activation_checkpointing.device_memory_budget_bytes=auto 2>&1)
if grep -q "memory 8.00 MiB per rank: the configured peak does not fit) but about 8 MiB is available" <<<"$out" &&
    ! grep -q "the configured peak fits" <<<"$out"; then
  pass "the refusal under REMAT_MEMORY_PER_RANK_BYTES with \"auto\" says one thing"
else
  fail "the refusal under REMAT_MEMORY_PER_RANK_BYTES with \"auto\" says one thing" "$out"
fi
expect "device_memory_budget_bytes \"auto\" beside another budget" \
  "sets 'memory_budget_bytes' and 'device_memory_budget_bytes': the budget is given once" \
  "$train" --steps 1 --set activation_checkpointing.variant=auto \
  --set activation_checkpointing.device_memory_budget_bytes=auto --set activation_checkpointing.memory_budget_bytes=5
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
