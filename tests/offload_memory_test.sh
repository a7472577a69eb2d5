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
if [[ $rc -eq 2 ]] && grep -q "^verdict: .* the optimizer on the host: device .*: fits; host .*: does not fit" <<<"$out"; then
  pass "offload_param: a host one byte short of the shards and the optimizer: does not fit (exit 2)"
else
  fail "offload_param: a host one byte short (exit $rc)" "$out"
fi

# --- D. Bad input --------------------------------------------------------------
expect "--host-memory without --device cuda" "--host-memory is the host's memory beside a GPU (--device cuda)" \
  "$estimate" --host-memory 1000000

summary
