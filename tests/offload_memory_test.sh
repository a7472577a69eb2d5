#!/usr/bin/env bash
# The memory tools see zero_optimization.offload_optimizer (docs/memory.md,
# "Offloading the optimizer"):
#   - remat-estimate's host_optimizer_bytes beside remat-train's measured
#     ones at 2 ranks, stages 1, 2 and 3: the same bytes;
#   - remat-estimate --device cuda --host-memory: the verdict line (device and
#     host), a device between the offloaded and the plain peak: the plain
#     config does not fit and the cheapest change names the offload, the
#     offloaded one fits, and does not where the host is too small (exit 2);
#   - zero_optimization.offload_param at stage 3, alone and with the
#     optimizer offloaded: the estimate's device parameters and host shards
#     (host_parameter_bytes) beside remat-train's, and the verdict's host part
#     counts the shards (one byte short of them: exit 2);
#   - on this CPU, where the host copies share the memory, the fit search
#     turns offloading off (remat-estimate and remat-train at 12 MiB a rank);
#     beside a GPU with too little host memory it names the offload to turn
#     off, and the verdict says where offload_param keeps what;
#   - the whole-device budget with offloading on this CPU: a budget the host
#     copies leave no room in is refused naming the smallest feasible one,
#     and at that one the measured peak stays within it;
#   - stage 3's grad_peak_bytes with the optimizer or the parameters
#     offloaded is the estimate's gradients (accumulating too), and
#     host_parameter_bytes is in the metrics where offload_param shards nothing;
#   - bad input: --host-memory without --device cuda.
#
#   tests/offload_memory_test.sh REMAT_TRAIN REMAT_ESTIMATE REMAT_RUN
set -uo pipefail
train=$1 estimate=$2 run=$3
source "$(dirname "$0")/testlib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
quiet=(--set train.sample_chars=0 --set train.eval_interval=0)
offload=(--set zero_optimization.offload_optimizer.device=cpu)

# --- A. The estimate's host bytes against a run's ------------------------------
for stage in 1 2 3; do
  if ! "$estimate" -np 2 "${offload[@]}" --set zero_optimization.stage=$stage --json "$tmp/e$stage.json" \
      >"$tmp/e.out" 2>&1; then
    fail "stage $stage: remat-estimate" "$(cat "$tmp/e.out")"
    continue
  fi
  if ! "$run" -np 2 -- "$train" --steps 2 "${quiet[@]}" "${offload[@]}" --set zero_optimization.stage=$stage \
      --metrics "$tmp/m$stage.jsonl" >"$tmp/train.out" 2>&1; then
    fail "stage $stage: remat-train with the optimizer offloaded" "$(cat "$tmp/train.out")"
    continue
  fi
  verdict=$(python3 - "$tmp/e$stage.json" "$tmp/m$stage.jsonl" <<'PY'
import json, sys
row = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["configured"])
measured = [json.loads(l)["host_optimizer_bytes"] for l in open(sys.argv[2])][-1]
ok = row["offload_optimizer"] and row["optimizer_bytes"] == 0 and row["host_optimizer_bytes"] == measured
print("ok" if ok else "off", f"estimated {row['host_optimizer_bytes']} bytes, measured {measured}")
PY
)
  if [[ $verdict == ok* ]]; then
    pass "stage $stage: host_optimizer_bytes ${verdict#ok }"
  else
    fail "stage $stage: the estimate's host bytes are not the run's" "$verdict"
  fi
done

# --- B. Does it fit on this device with this host? ---------------------------
gpu=(--device cuda --set zero_optimization.stage=2 --set activation_checkpointing.variant=full)
REMAT_MEMORY_PER_RANK_BYTES=$((1 << 40)) "$estimate" "${gpu[@]}" --json "$tmp/gpu.json" >"$tmp/gpu.out" 2>&1 ||
  fail "remat-estimate --device cuda" "$(cat "$tmp/gpu.out")"
read -r plain host_peak host_bytes < <(python3 -c '
import json, sys
r = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["configured"])
print(r["peak_bytes"], r["offload_optimizer_peak_bytes"], r["host_optimizer_bytes"])' "$tmp/gpu.json")
between=$(((plain + host_peak) / 2))
out=$(REMAT_MEMORY_PER_RANK_BYTES=$between "$estimate" "${gpu[@]}" --host-memory $((1 << 30)) 2>&1)
rc=$?
if [[ $rc -eq 2 ]] && grep -qF "the cheapest change that fits: zero_optimization.offload_optimizer.device=cpu" <<<"$out" &&
    grep -q "^verdict: .* the optimizer on the device: device .*: does not fit; host 0 B of 1 GiB: fits" <<<"$out" &&
    grep -q "with zero_optimization.offload_optimizer.device=cpu: device .*: fits; host .*: fits" <<<"$out"; then
  pass "a device between the two peaks: the plain config does not fit, the offload is named (exit 2)"
else
  fail "a device between the two peaks (exit $rc)" "$out"
fi
out=$(REMAT_MEMORY_PER_RANK_BYTES=$between "$estimate" "${gpu[@]}" "${offload[@]}" --host-memory $((1 << 30)) 2>&1)
rc=$?
if [[ $rc -eq 0 ]] && grep -q "^verdict: .* the optimizer on the host: device .*: fits; host .*: fits (--host-memory)" <<<"$out"; then
  pass "the offloaded config fits that device and host (exit 0)"
else
  fail "the offloaded config on that device and host (exit $rc)" "$out"
fi
out=$(REMAT_MEMORY_PER_RANK_BYTES=$between "$estimate" "${gpu[@]}" "${offload[@]}" --host-memory $((host_bytes - 1)) 2>&1)
rc=$?
if [[ $rc -eq 2 ]] && grep -q "^verdict: .*: fits; host .*: does not fit" <<<"$out" &&
    grep -q "the configuration does not fit: its device part fits, but what it keeps on the host" <<<"$out" &&
    ! grep -q "the configuration fits" <<<"$out"; then
  pass "a host one byte short of the optimizer's state: does not fit, said once (exit 2)"
else
  fail "a host one byte short (exit $rc)" "$out"
fi

# --- C. offload_param: the shards on the host --------------------------------
param=(--set zero_optimization.stage=3 --set zero_optimization.offload_param.device=cpu)
for opt in none cpu; do
  with=(--set zero_optimization.offload_optimizer.device=$opt)
  if ! "$estimate" -np 2 "${param[@]}" "${with[@]}" --json "$tmp/p$opt.json" >"$tmp/e.out" 2>&1; then
    fail "offload_param, offload_optimizer $opt: remat-estimate" "$(cat "$tmp/e.out")"
    continue
  fi
  if ! "$run" -np 2 -- "$train" --steps 2 "${quiet[@]}" "${param[@]}" "${with[@]}" \
      --metrics "$tmp/p$opt.jsonl" >"$tmp/train.out" 2>&1; then
    fail "offload_param, offload_optimizer $opt: remat-train" "$(cat "$tmp/train.out")"
    continue
  fi
  # Without offload_optimizer the estimate's host shards carry their AdamW
  # state, which the run counts in optimizer_state_bytes beside the device's.
  # The run pads each unit's shards, the estimate each parameter's: a few
  # elements of 16 bytes apart.
  verdict=$(python3 - "$tmp/p$opt.json" "$tmp/p$opt.jsonl" <<'PY'
import json, sys
row = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["configured"])
m = [json.loads(l) for l in open(sys.argv[2])][-1]
state = 0 if row["offload_optimizer"] else m["optimizer_state_bytes"] - row["optimizer_bytes"]
host = m["host_parameter_bytes"] + state
ok = row["parameter_bytes"] == m["param_bytes"] and abs(row["host_parameter_bytes"] - host) <= 16 * 64
if row["offload_optimizer"]:
    ok = ok and abs(row["host_optimizer_bytes"] - m["host_optimizer_bytes"]) <= 16 * 64
print("ok" if ok else "off", f"device parameters {row['parameter_bytes']} (run {m['param_bytes']}), host shards "
      f"{row['host_parameter_bytes']} (run {host})")
PY
)
  if [[ $verdict == ok* ]]; then
    pass "offload_param, offload_optimizer $opt: ${verdict#ok }"
  else
    fail "offload_param, offload_optimizer $opt: the estimate is not the run's" "$verdict"
  fi
done
read -r shards < <(python3 -c '
import json, sys
r = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["configured"])
print(r["host_parameter_bytes"] + r["host_optimizer_bytes"])' "$tmp/pcpu.json")
out=$(REMAT_MEMORY_PER_RANK_BYTES=$((1 << 40)) "$estimate" -np 2 --device cuda "${param[@]}" "${offload[@]}" \
  --host-memory $((shards - 1)) 2>&1)
rc=$?
if [[ $rc -eq 2 ]] && grep -q "^verdict: .* ZeRO stage 3, the parameter shards (the optimizer's masters), .*: device .*: fits; host .*: does not fit" <<<"$out"; then
  pass "offload_param: a host one byte short of the shards and the optimizer: does not fit (exit 2)"
else
  fail "offload_param: a host one byte short (exit $rc)" "$out"
fi

# --- E. On this CPU the host copies share the memory ----------------------------
# At 12 MiB a rank the default config with the optimizer offloaded (12.09 MiB)
# does not fit, without offload (11.57 MiB) it does: the fit search says so.
twelve=$((12 << 20))
expect_all "remat-estimate at 12 MiB a rank names turning the offload off" \
  "the configuration does not fit; the cheapest change that fits: zero_optimization.offload_optimizer.device=none (estimated peak 11.57 MiB" -- \
  env REMAT_MEMORY_PER_RANK_BYTES=$twelve "$estimate" -np 2 "${offload[@]}"
expect_all "remat-train at 12 MiB a rank names turning the offload off" \
  "is available to each rank on this host: the cheapest change that fits: zero_optimization.offload_optimizer.device=none (estimated peak 11.57 MiB" -- \
  env REMAT_MEMORY_PER_RANK_BYTES=$twelve "$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" "${offload[@]}"
# Beside a GPU with too little host memory: the offload to turn off is named
# where the device holds it all; the verdict says what offload_param keeps where.
for case in "offload_param" "offload_param offload_optimizer"; do
  with=("${param[@]}")
  keys="zero_optimization.offload_param.device=none"
  if [[ $case == *offload_optimizer ]]; then
    with+=("${offload[@]}")
    keys="zero_optimization.offload_optimizer.device=none zero_optimization.offload_param.device=none"
  fi
  out=$(REMAT_MEMORY_PER_RANK_BYTES=$((1 << 30)) "$estimate" -np 2 --device cuda "${with[@]}" --host-memory 100000 2>&1)
  rc=$?
  where="the parameter shards, their gradients and their optimizer state on the host (offload_param)"
  [[ $case == *offload_optimizer ]] && where="the parameter shards (the optimizer's masters), their gradients and the optimizer's state on the host"
  if [[ $rc -eq 2 ]] && grep -qF "is more than the 97.7 KiB each rank has there (--host-memory); the cheapest change that fits: $keys (estimated device peak" <<<"$out" &&
      grep -qF "ZeRO stage 3, $where" <<<"$out" && ! grep "^each rank\|^verdict" <<<"$out" | grep -q "more host memory\|the optimizer on the device"; then
    pass "$case beside a GPU, too little host memory: $keys is named, the verdict says where what is (exit 2)"
  else
    fail "$case beside a GPU, too little host memory (exit $rc)" "$out"
  fi
done

# --- F. The whole-device budget with offloading on this CPU ---------------------
# 3,000,000 bytes was taken with the optimizer offloaded and measured 3.3-4.6
# MB: the host copies were left out of what the planner charges.
for case in offload_optimizer offload_param; do
  with=("${offload[@]}")
  [[ $case == offload_param ]] && with=("${param[@]}")
  budget=(--set activation_checkpointing.variant=auto "${with[@]}")
  out=$(REMAT_LOG_LEVEL=warn "$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" "${budget[@]}" \
    --set activation_checkpointing.device_memory_budget_bytes=3000000 2>&1)
  smallest=$(grep -ao "The smallest feasible budget is [0-9]*" <<<"$out" | head -1 | grep -o "[0-9]*$")
  if [[ -z $smallest ]] || ! grep -q "which on this CPU is the device's memory" <<<"$out"; then
    fail "$case: a budget of 3000000 bytes is refused, naming the smallest feasible one" "$out"
    continue
  fi
  if "$run" -np 2 -- "$train" --steps 3 "${quiet[@]}" "${budget[@]}" \
      --set activation_checkpointing.device_memory_budget_bytes="$smallest" --metrics "$tmp/b$case.jsonl" \
      >"$tmp/b.out" 2>&1 &&
      verdict=$(python3 - "$tmp/b$case.jsonl" "$smallest" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
budget, peak = int(sys.argv[2]), max(s["mem_peak_bytes"] for s in steps)
print(f"budget {budget} B, measured peak {peak} B ({peak - budget:+d} B)")
sys.exit(0 if peak <= budget else 1)
PY
); then
    pass "$case: 3000000 bytes refused; at the smallest feasible budget named: $verdict"
  else
    fail "$case: at the smallest feasible budget named, the measured peak stays within it" "${verdict:-$(cat "$tmp/b.out")}"
  fi
done

# --- G. Stage 3's gradient peak with offloading; host_parameter_bytes ----------
for case in "offload_optimizer 1" "offload_optimizer 3" "offload_param 1" "both 1"; do
  read -r what acc <<<"$case"
  with=("${offload[@]}")
  [[ $what == offload_param ]] && with=("${param[@]}")
  [[ $what == both ]] && with=("${param[@]}" "${offload[@]}")
  with+=(--set zero_optimization.stage=3 --set gradient_accumulation_steps=$acc --set train_micro_batch_size_per_gpu=4)
  if ! "$estimate" -np 2 "${with[@]}" --json "$tmp/g.json" >"$tmp/e.out" 2>&1 ||
      ! "$run" -np 2 -- "$train" --steps 2 "${quiet[@]}" "${with[@]}" --metrics "$tmp/g.jsonl" >"$tmp/train.out" 2>&1; then
    fail "$case: remat-estimate and remat-train" "$(cat "$tmp/e.out" "$tmp/train.out")"
    continue
  fi
  verdict=$(python3 - "$tmp/g.json" "$tmp/g.jsonl" <<'PY'
import json, sys
row = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["configured"])
measured = [json.loads(l)["grad_peak_bytes"] for l in open(sys.argv[2])][-1]
ok = measured > 0 and abs(row["gradient_bytes"] - measured) <= 4 * 64
print("ok" if ok else "off", f"grad_peak_bytes {measured}, estimated {row['gradient_bytes']}")
PY
)
  if [[ $verdict == ok* ]]; then
    pass "stage 3, $what, accumulation $acc: ${verdict#ok }"
  else
    fail "stage 3, $what, accumulation $acc: grad_peak_bytes is the estimate's gradients" "$verdict"
  fi
done
if "$run" -np 2 -- "$train" --steps 1 "${quiet[@]}" "${param[@]}" \
    --set zero_optimization.stage3_param_persistence_threshold=100000000 --metrics "$tmp/none.jsonl" >"$tmp/train.out" 2>&1 &&
    [[ $(python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline()).get("host_parameter_bytes"))' \
         "$tmp/none.jsonl") == 0 ]]; then
  pass "offload_param with every parameter persistent: host_parameter_bytes 0 in the metrics"
else
  fail "offload_param with every parameter persistent: host_parameter_bytes 0 in the metrics" \
    "$(cat "$tmp/none.jsonl" "$tmp/train.out" 2>/dev/null)"
fi

# --- D. Bad input --------------------------------------------------------------
expect "--host-memory without --device cuda" "--host-memory is the host's memory beside a GPU (--device cuda)" \
  "$estimate" --host-memory 1000000

summary
