#!/usr/bin/env bash
# remat-train end to end under remat-run: every config runs, the loss sequence is
# bitwise the same under every checkpointing variant (data parallel on 2 ranks,
# and dp 2 x tp 2 on 4 with partitioned, contiguous and offloaded regions), the
# default config learns, resumed runs continue bitwise (and a tp=2 save resumes
# at tp=1), ZeRO stage 3 matches stage 0 and survives a killed save, and bad
# inputs fail clearly.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$1"
run="$2"
configs_dir="$(dirname "$3")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

# A small model so that 20-step runs take seconds.
small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0)

# 1. Every config runs 3 steps.
for cfg in "$configs_dir"/*.json; do
  name=$(basename "$cfg")
  if out=$("$run" -np 2 -- "$train" --config "$cfg" --steps 3 --set train.sample_chars=10 \
      --set train.eval_interval=3 2>&1) && grep -q "held-out loss" <<<"$out"; then
    pass "config $name runs 3 steps"
  else
    fail "config $name runs 3 steps" "$out"
  fi
done

# Runs remat-train for 20 steps once per variant and checks that every
# variant's losses equal the first one's bitwise.
#   parity PREFIX LABEL NP ORDER VARIANTS [COMMON ARGS...]
# ORDER: name of an array of variants; VARIANTS: name of an associative array
# variant -> its extra arguments. Metrics go to $tmp/PREFIX_<variant>.jsonl.
parity() {
  local prefix=$1 label=$2 np=$3
  local -n order=$4 extra=$5
  shift 5
  local reference="" v m out
  for v in "${order[@]}"; do
    m="$tmp/${prefix}_$v.jsonl"
    # shellcheck disable=SC2086
    out=$("$run" -np "$np" -- "$train" --config "$configs_dir/default.json" --steps 20 \
        "${small[@]}" "$@" ${extra[$v]} --metrics "$m" 2>&1)
    if [[ $? -ne 0 || $(wc -l <"$m") -ne 20 ]]; then
      fail "$label run $v" "$out"
    elif [[ -z "$reference" ]]; then
      reference=$(losses "$m")
      pass "$label run $v (reference)"
    elif [[ "$(losses "$m")" == "$reference" ]]; then
      pass "$label: losses under $v equal ${order[0]}'s bitwise over 20 steps"
    else
      fail "$label: losses under $v equal ${order[0]}'s bitwise over 20 steps" \
        "$(paste <(echo "$reference") <(losses "$m") | head -5)"
    fi
  done
}

# 2. Dropout 0.1, 2 ranks, 20 steps: the same losses bitwise under every variant.
ac=activation_checkpointing
# Regions are non-reentrant unless a variant says reentrant=true. The
# default config shards with ZeRO stage 3: units are gathered around the
# regions' recomputes.
dp_order=(none full full_reentrant selective_layer selective_layer_last selective_op selective_op_reentrant
          act_offload full_act_offload auto auto_reentrant)
declare -A dp_variants=(
  [none]="--set $ac.variant=none"
  [full]="--set $ac.variant=full"
  [full_reentrant]="--set $ac.variant=full --set $ac.reentrant=true"
  [selective_op_reentrant]="--set $ac.variant=selective_op --set $ac.reentrant=true"
  [act_offload]="--set $ac.variant=none --set activation_offloading.enabled=true"
  [full_act_offload]="--set $ac.variant=full --set activation_offloading.enabled=true"
  [selective_layer]="--set $ac.variant=selective_layer --set $ac.every_k=2"
  [selective_layer_last]="--set $ac.variant=selective_layer --set $ac.every_k=2 --set $ac.every_k_from=last"
  [selective_op]="--set $ac.variant=selective_op"
  [auto]="--set $ac.variant=auto --set $ac.memory_budget_fraction=0.75"
  [auto_reentrant]="--set $ac.variant=auto --set $ac.memory_budget_fraction=0.75 --set $ac.reentrant=true"
)
parity parity "2 ranks" 2 dp_order dp_variants --set model.dropout=0.1
field() { sed -E "s/.*\"$2\":([0-9]+).*/\1/" "$1" | head -1; }
held_none=$(field "$tmp/parity_none.jsonl" mem_fwd_held_bytes)
held_off=$(field "$tmp/parity_act_offload.jsonl" mem_fwd_held_bytes)
moved=$(field "$tmp/parity_act_offload.jsonl" act_offloaded_bytes)
if [[ -n "$held_off" && -n "$held_none" && "$moved" -gt 0 && $((held_off * 4)) -le "$held_none" ]]; then
  pass "activation offloading: the forward leaves <= 1/4 on the device ($held_off of $held_none bytes; $moved moved)"
else
  fail "activation offloading: the forward leaves <= 1/4 on the device ($held_off of $held_none bytes; $moved moved)"
fi
# The memory metrics read the same from step 2 on as at step 1 (the previous
# step's gradients are not counted in this step's base), with offloading too.
held_steady() {
  python3 - "$1" <<'PY'
import json, sys
held = [json.loads(line)["mem_fwd_held_bytes"] for line in open(sys.argv[1])]
ok = min(held) > 0 and max(held) <= 1.02 * min(held)
print(("ok " if ok else "bad ") + " ".join(map(str, held[:4])))
PY
}
for v in none act_offload; do
  report=$(held_steady "$tmp/parity_$v.jsonl")
  if [[ "$report" == ok* ]]; then
    pass "$v: mem_fwd_held_bytes the same at every step (${report#ok })"
  else
    fail "$v: mem_fwd_held_bytes the same at every step (${report#bad })"
  fi
done
# The memory planner: every step's activation peak (mem_act_peak_bytes: each
# micro-step's forward and backward above what it began with) within 5% of
# the budget and 10% of the prediction, from the first step on, something
# checkpointed, the plan in the metrics.
#   within_budget LABEL METRICS
within_budget() {
  local report
  report=$(python3 - "$2" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
worst = max(r["mem_act_peak_bytes"] / r["act_plan_budget_bytes"] for r in rows)
pred = max(abs(r["mem_act_peak_bytes"] / r["act_plan_predicted_peak_bytes"] - 1) for r in rows)
plan = rows[0]["act_plan"]
ok = worst <= 1.05 and pred <= 0.10 and plan.replace("keep", "").strip(",") != ""
print(f"{'ok' if ok else 'bad'} plan {plan}: peak <= {worst:.3f} x budget, within {pred:.3f} of the prediction")
PY
)
  if [[ "$report" == ok* ]]; then
    pass "$1: ${report#ok }"
  else
    fail "$1: ${report#bad }"
  fi
}
within_budget "2 ranks, variant auto at 0.75" "$tmp/parity_auto.jsonl"
within_budget "2 ranks, variant auto at 0.75 (reentrant)" "$tmp/parity_auto_reentrant.jsonl"
# Gradient accumulation (ZeRO-3, and ZeRO-1, whose full gradients outlive
# each micro-step): the budget holds at every micro-step.
for stage in 3 1; do
  m="$tmp/auto_accumulation_zero$stage.jsonl"
  out=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 4 "${small[@]}" \
      --set gradient_accumulation_steps=2 --set zero_optimization.stage=$stage \
      --set $ac.variant=auto --set $ac.memory_budget_fraction=0.75 --metrics "$m" 2>&1) ||
    fail "variant auto with gradient accumulation at ZeRO stage $stage runs" "$out"
  within_budget "2 ranks, variant auto at 0.75, gradient accumulation 2, ZeRO stage $stage" "$m"
done
out=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 2 "${small[@]}" \
    --set $ac.variant=auto --set $ac.memory_budget_fraction=0.1 2>&1)
if [[ $? -ne 0 ]] && grep -q "cannot be met: the smallest peak any plan reaches is" <<<"$out" &&
   grep -q "memory_budget_fraction to at least" <<<"$out"; then
  pass "variant auto: an impossible budget stops with the smallest feasible one"
else
  fail "variant auto: an impossible budget stops with the smallest feasible one" "$out"
fi
comm() { sed -E 's/.*"comm_bytes":([0-9]+).*/\1/' "$1" | paste -sd' '; }
if [[ -n "$(comm "$tmp/parity_full.jsonl")" &&
      "$(comm "$tmp/parity_full.jsonl")" == "$(comm "$tmp/parity_full_reentrant.jsonl")" ]]; then
  pass "ZeRO-3 gathers as much around non-reentrant recomputes as around reentrant ones (comm_bytes per step equal)"
else
  fail "ZeRO-3 gathers as much around non-reentrant recomputes as around reentrant ones (comm_bytes per step equal)" \
    "$(paste <(comm "$tmp/parity_full.jsonl" | tr ' ' '\n') <(comm "$tmp/parity_full_reentrant.jsonl" | tr ' ' '\n') | head -5)"
fi

# 3. The default config learns: over its first 40 steps (of 120) the loss falls
#    by at least 30% (measured: about 40% by step 30).
m="$tmp/learn.jsonl"
out=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 40 \
    --set train.eval_interval=0 --set train.sample_chars=0 --metrics "$m" 2>&1)
first=$(losses "$m" | head -1)
last=$(losses "$m" | tail -1)
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b <= 0.7 * a) }'; then
  pass "default config: loss falls by >= 30% in 40 steps ($first -> $last)"
else
  fail "default config: loss falls by >= 30% in 40 steps ($first -> $last)" "$out"
fi

# 4. Save at step 10, resume: steps 11-20 equal the uninterrupted run bitwise.
#    The resumed run is given a copy of the whole run's --metrics file: it
#    keeps steps 1-10 of it and writes 11-20 again (not 1-20 then 11-20).
save="$tmp/save"
whole="$tmp/whole.jsonl"
resumed="$tmp/resumed.jsonl"
out1=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 20 "${small[@]}" \
    --set train.save_interval=10 --save-dir "$save" --metrics "$whole" 2>&1)
cp "$whole" "$resumed"
out2=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 20 "${small[@]}" \
    --resume "$save/step_00000010" --metrics "$resumed" 2>&1)
steps_of() { sed -E 's/.*"step":([0-9]+).*/\1/' "$1" | paste -sd' '; }
if [[ -f "$save/step_00000010/manifest.json" && "$(steps_of "$resumed")" == "$(seq -s' ' 1 20)" &&
      "$(losses "$whole")" == "$(losses "$resumed")" ]]; then
  pass "resume from step 10 reproduces steps 11-20 bitwise; the --metrics file holds steps 1-20 once"
else
  fail "resume from step 10 reproduces steps 11-20 bitwise; the --metrics file holds steps 1-20 once" "$out1" "$out2" \
    "steps: $(steps_of "$resumed")" "$(paste <(losses "$whole") <(losses "$resumed"))"
fi

# 5. Tensor parallelism on 4 ranks (dp 2 x tp 2), dropout 0.1 inside and
#    outside the tensor-parallel regions: the same losses bitwise without
#    checkpointing and with full, partitioned, partitioned + contiguous,
#    offload, and partitioned + offload + contiguous regions.
declare -A tp_variants=(
  [none]="--set $ac.variant=none"
  [full]="--set $ac.variant=full"
  [partitioned]="--set $ac.variant=full --set $ac.partition_activations=true"
  [partitioned_contiguous]="--set $ac.variant=full --set $ac.partition_activations=true --set $ac.contiguous_memory_optimization=true --set $ac.number_checkpoints=2"
  [offload]="--set $ac.variant=full --set $ac.cpu_checkpointing=true --set $ac.offload_min_bytes=0"
  [partitioned_offload_contiguous]="--set $ac.variant=full --set $ac.partition_activations=true --set $ac.cpu_checkpointing=true --set $ac.offload_min_bytes=0 --set $ac.offload_keep_last=false --set $ac.contiguous_memory_optimization=true --set $ac.number_checkpoints=2"
)
tp_variants[full_reentrant]="--set $ac.variant=full --set $ac.reentrant=true"
tp_variants[act_offload]="--set $ac.variant=none --set activation_offloading.enabled=true"
tp_variants[partitioned_act_offload]="${tp_variants[partitioned]} --set activation_offloading.enabled=true"
tp_variants[partitioned_offload_contiguous_reentrant]="${tp_variants[partitioned_offload_contiguous]} --set $ac.reentrant=true"
tp_variants[auto_partitioned]="--set $ac.variant=auto --set $ac.memory_budget_fraction=0.8 --set $ac.partition_activations=true"
tp_order=(none full full_reentrant partitioned partitioned_contiguous offload partitioned_offload_contiguous
          partitioned_offload_contiguous_reentrant act_offload partitioned_act_offload auto_partitioned)
parity tp "tp=2 on 4 ranks" 4 tp_order tp_variants --set tensor_parallel.size=2 --set model.dropout=0.1
within_budget "tp=2 on 4 ranks, variant auto at 0.8 with partitioned regions" "$tmp/tp_auto_partitioned.jsonl"
saved() { sed -E 's/.*"ckpt_saved_bytes":([0-9]+).*/\1/' "$1" | head -1; }
whole_bytes=$(saved "$tmp/tp_full.jsonl")
part_bytes=$(saved "$tmp/tp_partitioned.jsonl")
if [[ -n "$whole_bytes" && "$whole_bytes" -gt 0 && $((part_bytes * 2)) -eq "$whole_bytes" ]]; then
  pass "partitioned regions keep half the bytes at tp=2 ($part_bytes of $whole_bytes)"
else
  fail "partitioned regions keep half the bytes at tp=2 ($part_bytes of $whole_bytes)"
fi

# tp=4: every rank one tensor-parallel group; partitioned equals full.
m4a="$tmp/tp4_full.jsonl"
m4b="$tmp/tp4_part.jsonl"
out1=$("$run" -np 4 -- "$train" --config "$configs_dir/default.json" --steps 5 "${small[@]}" \
    --set tensor_parallel.size=4 --metrics "$m4a" 2>&1)
out2=$("$run" -np 4 -- "$train" --config "$configs_dir/default.json" --steps 5 "${small[@]}" \
    --set tensor_parallel.size=4 --set $ac.partition_activations=true --metrics "$m4b" 2>&1)
if [[ $(wc -l <"$m4a") -eq 5 && "$(losses "$m4a")" == "$(losses "$m4b")" ]]; then
  pass "tp=4: partitioned losses equal full's bitwise"
else
  fail "tp=4: partitioned losses equal full's bitwise" "$out1" "$out2"
fi

# Save and resume with tensor parallelism: each rank its own shard.
tsave="$tmp/tp_save"
whole="$tmp/tp_whole.jsonl"
resumed="$tmp/tp_resumed.jsonl"
out1=$("$run" -np 2 -- "$train" --config "$configs_dir/tp2_partitioned.json" --steps 10 \
    "${small[@]}" --set train.save_interval=5 --save-dir "$tsave" --metrics "$whole" 2>&1)
out2=$("$run" -np 2 -- "$train" --config "$configs_dir/tp2_partitioned.json" --steps 10 \
    "${small[@]}" --resume "$tsave/step_00000005" --metrics "$resumed" 2>&1)
if [[ $(wc -l <"$resumed") -eq 5 && "$(losses "$whole" | tail -5)" == "$(losses "$resumed")" ]]; then
  pass "tp=2: resume from step 5 reproduces steps 6-10 bitwise"
else
  fail "tp=2: resume from step 5 reproduces steps 6-10 bitwise" "$out1" "$out2"
fi
# The same save resumed at tensor_parallel.size 1 (dp 2): re-sliced, and said so.
out3=$("$run" -np 2 -- "$train" --config "$configs_dir/tp2_partitioned.json" --steps 10 \
    "${small[@]}" --set tensor_parallel.size=1 --resume "$tsave/step_00000005" --metrics "$tmp/tp1_resumed.jsonl" 2>&1)
if [[ $(wc -l <"$tmp/tp1_resumed.jsonl") -eq 5 ]] &&
   grep -q "made at tensor-parallel size 2 x data-parallel size 1; this run has 1 x 2" <<<"$out3"; then
  pass "a tp=2 save resumes at tp=1 (steps 6-10), with the warning that it re-slices"
else
  fail "a tp=2 save resumes at tp=1 (steps 6-10), with the warning that it re-slices" "$out3"
fi

# 6. ZeRO stage 3: dp 2 x tp 2 on 4 ranks runs and matches stage 0 within
#    float tolerance (engine/zero_engine_test.cc justifies 1e-5); a sharded save
#    resumes bitwise; a save killed with SIGKILL leaves the previous one loadable.
m0="$tmp/zero_stage0.jsonl"
m3="$tmp/zero_stage3.jsonl"
out1=$("$run" -np 4 -- "$train" --config "$configs_dir/zero3_tp2.json" --steps 10 "${small[@]}" \
    --set zero_optimization.stage=0 --metrics "$m0" 2>&1)
out2=$("$run" -np 4 -- "$train" --config "$configs_dir/zero3_tp2.json" --steps 10 "${small[@]}" \
    --metrics "$m3" 2>&1)
if [[ $(wc -l <"$m3" 2>/dev/null) -eq 10 ]] &&
   paste <(losses "$m0") <(losses "$m3") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5) bad = 1 } END { exit bad }'; then
  pass "zero3_tp2 on 4 ranks: stage 3 losses match stage 0 within 1e-5 over 10 steps"
else
  fail "zero3_tp2 on 4 ranks: stage 3 losses match stage 0 within 1e-5 over 10 steps" "$out1" "$out2" \
    "$(paste <(losses "$m0") <(losses "$m3") | head -5)"
fi
zsave="$tmp/zero_save"
whole="$tmp/zero_whole.jsonl"
resumed="$tmp/zero_resumed.jsonl"
out1=$("$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" --steps 10 "${small[@]}" \
    --set zero_optimization.stage3_param_persistence_threshold=0 --set train.save_interval=5 \
    --save-dir "$zsave" --metrics "$whole" 2>&1)
out2=$("$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" --steps 10 "${small[@]}" \
    --set zero_optimization.stage3_param_persistence_threshold=0 --resume "$zsave/step_00000005" \
    --metrics "$resumed" 2>&1)
if [[ $(wc -l <"$resumed" 2>/dev/null) -eq 5 && "$(losses "$whole" | tail -5)" == "$(losses "$resumed")" ]]; then
  pass "zero3: a sharded save at step 5 resumes steps 6-10 bitwise"
else
  fail "zero3: a sharded save at step 5 resumes steps 6-10 bitwise" "$out1" "$out2"
fi
# Saves every step with a 3 s pause before each rename; SIGKILL lands inside one.
ksave="$tmp/kill_save"
REMAT_FAULT_SAVE_PAUSE_MS=3000 "$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" \
    --steps 50 "${small[@]}" --set train.save_interval=1 --save-dir "$ksave" >"$tmp/kill.log" 2>&1 &
victim=$!
for _ in $(seq 1 120); do [[ -f "$ksave/latest" ]] && break; sleep 0.5; done
sleep 4
pkill -KILL -f "remat-train --config $configs_dir/zero3.json" || true
wait "$victim" 2>/dev/null
left_tmp=$(find "$ksave" -name '*.tmp' | wc -l)
kept=$(cat "$ksave/latest" 2>/dev/null)
if out=$("$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" "${small[@]}" \
      --resume "$ksave" --steps "$(( ${kept#step_} + 1 ))" 2>&1) && [[ -n "$kept" && "$left_tmp" -ge 1 ]]; then
  pass "zero3: SIGKILL during a save ($left_tmp partial files) leaves $kept loadable"
else
  fail "zero3: SIGKILL during a save ($left_tmp partial files) leaves $kept loadable" "$out" \
    "$(tail -5 "$tmp/kill.log")"
fi

# bf16 compute from fp32 master shards: runs, learns, and stays near float32.
mb="$tmp/zero_bf16.jsonl"
mf="$tmp/zero_fp32.jsonl"
out1=$("$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" --steps 10 "${small[@]}" \
    --set bf16.enabled=true --metrics "$mb" 2>&1)
out2=$("$run" -np 2 -- "$train" --config "$configs_dir/zero3.json" --steps 10 "${small[@]}" \
    --metrics "$mf" 2>&1)
if [[ $(wc -l <"$mb" 2>/dev/null) -eq 10 ]] &&
   paste <(losses "$mf") <(losses "$mb") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 0.05) bad = 1 } END { exit bad }' &&
   awk -v a="$(losses "$mb" | head -1)" -v b="$(losses "$mb" | tail -1)" 'BEGIN { exit !(b < a) }'; then
  pass "zero3 bf16: 10 steps learn and stay within 0.05 of float32"
else
  fail "zero3 bf16: 10 steps learn and stay within 0.05 of float32" "$out1" "$out2" \
    "$(paste <(losses "$mf") <(losses "$mb") | head -5)"
fi

# The memory timeline: rank 0's step 2 as a Chrome trace whose categories add
# up to the tracked count at every sample, with each block's recompute and the
# step's peak (the metrics' mem_peak_bytes); its plot beside it where a
# python3 has matplotlib, else the command to draw it.
mtrace="$tmp/memory.json"
out=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 3 "${small[@]}" \
    --memory-trace "$mtrace" --metrics "$tmp/memory_metrics.jsonl" 2>&1)
report=$(python3 - "$mtrace" "$tmp/memory_metrics.jsonl" <<'PY' 2>&1
import json, sys
trace = json.load(open(sys.argv[1]))
step2 = [json.loads(line) for line in open(sys.argv[2])][1]
events = trace["traceEvents"]
by_cat = [e for e in events if e["ph"] == "C" and e["name"] == "cpu memory by category"]
tracked = [e for e in events if e["ph"] == "C" and e["name"] == "cpu memory tracked"]
off = sum(1 for a, b in zip(by_cat, tracked)
          if a["ts"] != b["ts"] or sum(a["args"].values()) != b["args"]["tracked"] or min(a["args"].values()) < 0)
recomputes = sorted(e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "recompute")
phases = [e["name"] for e in events if e["ph"] == "X" and e.get("cat") == "phase"]
peak = max(e["args"]["tracked"] for e in tracked)
ok = (len(by_cat) == len(tracked) > 10 and off == 0 and trace["otherData"]["step"] == 2 and
      recomputes == ["recompute blocks.0", "recompute blocks.1"] and
      sorted(phases) == ["backward", "forward", "optimizer step"] and peak == step2["mem_peak_bytes"])
print(("ok " if ok else "bad ") + f"{len(by_cat)} samples ({off} off), {recomputes}, phases {phases}, "
      f"peak {peak} vs mem_peak_bytes {step2['mem_peak_bytes']}")
PY
)
if [[ "$report" == ok* ]]; then
  pass "--memory-trace: ${report#ok }"
else
  fail "--memory-trace: ${report#bad }" "$out"
fi
if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null || python3 -c 'import matplotlib' 2>/dev/null; then
  if [[ -s "$tmp/memory.png" ]] && grep -qF "its plot: $tmp/memory.png" <<<"$out"; then
    pass "--memory-trace: its plot beside it"
  else
    fail "--memory-trace: its plot beside it" "$out"
  fi
elif grep -qF "apt-get install python3-matplotlib); then run python3 '$tmp/memory.plot.py' '$mtrace' '$tmp/memory.png'" <<<"$out"; then
  pass "--memory-trace without matplotlib: the command that draws its plot"
else
  fail "--memory-trace without matplotlib: the command that draws its plot" "$out"
fi

# 6b. Sequence parallelism, tp 2 on 2 ranks, dropout 0.1, 20 steps: the same
#     losses bitwise under every checkpointing variant, collectives kept or
#     recomputed; each region keeps half of what it keeps without it.
sp_order=(none full full_collectives selective_op_collectives full_reentrant)
declare -A sp_variants=(
  [none]="--set $ac.variant=none"
  [full]="--set $ac.variant=full"
  [full_collectives]="--set $ac.variant=full --set $ac.save_collectives=true"
  [selective_op_collectives]="--set $ac.variant=selective_op --set $ac.save_collectives=true"
  [full_reentrant]="--set $ac.variant=full --set $ac.reentrant=true"
)
parity sp "sequence parallel, tp 2" 2 sp_order sp_variants --set model.dropout=0.1 \
  --set tensor_parallel.size=2 --set tensor_parallel.sequence_parallel=true
m_sp_off="$tmp/sp_off_full.jsonl"
out=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 2 "${small[@]}" \
    --set tensor_parallel.size=2 --set $ac.variant=full --metrics "$m_sp_off" 2>&1)
if [[ -n "$(saved "$m_sp_off")" && $(( $(saved "$tmp/sp_full.jsonl") * 2 )) -eq $(saved "$m_sp_off") ]]; then
  pass "sequence parallel, tp 2: full checkpointing keeps half the region bytes ($(saved "$tmp/sp_full.jsonl") of $(saved "$m_sp_off"))"
else
  fail "sequence parallel, tp 2: full checkpointing keeps half the region bytes" "$out" \
    "with: $(saved "$tmp/sp_full.jsonl"), without: $(saved "$m_sp_off")"
fi
tp_bytes() { sed -E 's/.*"tp_comm_bytes":([0-9]+).*/\1/' "$1" | paste -sd' '; }
if [[ -n "$(tp_bytes "$tmp/sp_none.jsonl")" && "$(tp_bytes "$tmp/sp_full_collectives.jsonl")" == "$(tp_bytes "$tmp/sp_none.jsonl")" &&
      "$(tp_bytes "$tmp/sp_full.jsonl")" != "$(tp_bytes "$tmp/sp_none.jsonl")" ]]; then
  pass "sequence parallel, tp 2: with save_collectives each step moves no checkpointing's tensor-parallel bytes"
else
  fail "sequence parallel, tp 2: with save_collectives each step moves no checkpointing's tensor-parallel bytes" \
    "none: $(tp_bytes "$tmp/sp_none.jsonl" | cut -c1-80)" "full: $(tp_bytes "$tmp/sp_full.jsonl" | cut -c1-80)" \
    "kept: $(tp_bytes "$tmp/sp_full_collectives.jsonl" | cut -c1-80)"
fi
out=$("$run" -np 2 -- "$train" --config "$configs_dir/default.json" --steps 1 "${small[@]}" \
    --set tensor_parallel.sequence_parallel=true 2>&1)
if [[ $? -eq 0 ]] && grep -qF "tensor_parallel.sequence_parallel with tensor_parallel.size 1 has nothing to split" <<<"$out"; then
  pass "sequence parallel at tp 1: a warning, and the run goes on"
else
  fail "sequence parallel at tp 1: a warning, and the run goes on" "$out"
fi

# 7. Bad inputs: a nonzero exit and the message that says what to change.
expect "tensor_parallel.size that does not divide the world" \
  "tensor_parallel.size=3 does not divide the world size 4: choose one of 1, 2, 4" \
  "$run" -np 4 -- "$train" --config "$configs_dir/default.json" --set tensor_parallel.size=3
expect "heads not divisible across tensor-parallel ranks" \
  "model.n_head (2) and model.d_ff (256) must be multiples of tensor_parallel.size (4)" \
  "$run" -np 4 -- "$train" --config "$configs_dir/default.json" --set tensor_parallel.size=4 \
  --set model.n_head=2
expect "sequence parallelism with a seq_len the group does not divide" \
  "model.seq_len=33 is not a multiple of 2: set model.seq_len to 32 or 34" \
  "$run" -np 2 -- "$train" --config "$configs_dir/tp2_sequence_parallel.json" "${small[@]}" --set model.seq_len=33
expect "bf16 reductions without bf16" "communication_data_type \"bf16\" reduces gradients in bf16, but bf16.enabled is false" \
  "$train" --config "$configs_dir/default.json" --set communication_data_type=bf16
expect "a zero stage that does not exist" "'zero_optimization.stage' = 4 must be 0, 1, 2 or 3" \
  "$train" --config "$configs_dir/zero3.json" --set zero_optimization.stage=4
expect "contiguous buffers without number_checkpoints" \
  "'activation_checkpointing.number_checkpoints' is not set" \
  "$train" --config "$configs_dir/tp2_partitioned.json" \
  --set activation_checkpointing.contiguous_memory_optimization=true
expect "a --memory-trace in a folder that does not exist, before any step" \
  "--memory-trace '$tmp/no-such-folder/m.json': its folder '$tmp/no-such-folder' does not exist: create it first" \
  "$run" -np 2 -- "$train" --config "$configs_dir/default.json" "${small[@]}" --memory-trace "$tmp/no-such-folder/m.json"
expect "a --memory-trace that is a directory" "--memory-trace '$tmp' is a directory: give a file path" \
  "$train" --config "$configs_dir/default.json" "${small[@]}" --memory-trace "$tmp"
expect "missing config file" "cannot read '$tmp/nope.json'" \
  "$run" -np 2 -- "$train" --config "$tmp/nope.json"
expect "unknown config key" "unknown key 'model.n_layr'; did you mean 'model.n_layer'?" \
  "$train" --config "$configs_dir/default.json" --set model.n_layr=3
expect "missing data file" "cannot read data.path '$tmp/no-corpus.txt'" \
  "$train" --config "$configs_dir/default.json" --set data.path="$tmp/no-corpus.txt"
expect "resume with another model shape" "holds a model with vocab=" \
  "$run" -np 2 -- "$train" --config "$configs_dir/default.json" "${small[@]}" \
  --set model.n_layer=3 --resume "$save"
: >"$tmp/empty.txt"
expect "empty data file" "data: '$tmp/empty.txt' is empty" \
  "$train" --config "$configs_dir/default.json" --set data.path="$tmp/empty.txt"
mkdir -p "$tmp/empty"
expect "resume from a folder without a save" "holds no manifest.json and no 'latest' file" \
  "$train" --config "$configs_dir/default.json" --resume "$tmp/empty"
cp -r "$save/step_00000010" "$tmp/corrupt"
head -c 100 "$save/step_00000010/rank_0.pt" >"$tmp/corrupt/rank_0.pt"
expect "resume from a truncated file" "rank_0.pt' is damaged: 100 bytes" \
  "$run" -np 2 -- "$train" --config "$configs_dir/default.json" "${small[@]}" --resume "$tmp/corrupt"
# Ranks started with different settings stop at start naming the key and the
# ranks, instead of hanging in a collective or training diverging replicas.
# Each rank adds FLAG <its rank + 1> (Open MPI 5.0.7's mpirun crashes on a
# multi-program "A : B" line).
per_rank=(bash -c 'flag=$1; shift; exec "$@" "$flag" $(( ${OMPI_COMM_WORLD_RANK:-$PMIX_RANK} + 1 ))' _)
for flag in --seed --steps; do
  key=train.${flag#--}
  expect "ranks with different $flag" "$key: 1 on rank 0; 2 on rank 1" \
    "$run" -np 2 -- "${per_rank[@]}" "$flag" "$train" --config "$configs_dir/default.json" "${small[@]}" \
    --set train.steps=2
done
# The launcher shares the cores out among the ranks' intra-op thread pools
# unless the user chose a number (each rank prints what it was given).
threads_of() { env -u OMP_NUM_THREADS "$@" "$run" -np 4 -- sh -c 'echo "threads=${OMP_NUM_THREADS:-unset}"' 2>/dev/null | sort | uniq -c | tr -s ' '; }
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
want=$(( cores / 4 )); want=$(( want < 1 ? 1 : want ))
got=$(threads_of)
if [[ "$got" == " 4 threads=$want" ]]; then pass "launcher gives each of 4 ranks $want intra-op thread(s) on $cores cores"
else fail "launcher gives each of 4 ranks $want intra-op thread(s) on $cores cores" "$got"; fi
# 2 ranks on 2 or more cores are not oversubscribed, whatever OMP_NUM_THREADS says.
if (( cores >= 2 )); then
  line=$(OMP_NUM_THREADS=1 "$run" -np 2 -- true 2>&1 | grep '^remat-run:')
  if [[ "$line" != *--oversubscribe* ]]; then pass "launcher binds 2 ranks on $cores cores with OMP_NUM_THREADS=1"
  else fail "launcher binds 2 ranks on $cores cores with OMP_NUM_THREADS=1" "$line"; fi
fi
got=$(threads_of OMP_NUM_THREADS=3)
if [[ "$got" == " 4 threads=3" ]]; then pass "launcher keeps the user's OMP_NUM_THREADS"
else fail "launcher keeps the user's OMP_NUM_THREADS" "$got"; fi
expect "launcher without a program" "no program to run" "$run" -np 2
expect "launcher without -np" "say how many ranks" "$run" -- "$train"
expect "launcher without mpirun" "install Open MPI (Debian/Ubuntu: apt-get install openmpi-bin)" \
  env PATH=/nonexistent /bin/bash "$run" -np 2 -- "$train"
# Output into a pipe arrives whole, and a reader that goes away early
# (`| head`) ends the job: nonzero, in seconds, and without the segmentation
# fault Open MPI 4's mpirun had in its abort (exit 139, and its stack on
# stderr), whether stderr is a file or the same pipe.
lines=$("$run" -np 2 -- seq 1 50000 2>/dev/null | wc -l)
if [[ "$lines" -eq 100000 ]]; then pass "launcher output through a pipe arrives whole (100000 lines)"
else fail "launcher output through a pipe arrives whole" "$lines of 100000 lines"; fi
for into in file pipe; do
  start=$SECONDS
  if [[ $into == file ]]; then
    timeout 120 "$run" -np 2 -- "$train" "${small[@]}" --steps 1000000 2>"$tmp/head.err" | head -2 >/dev/null
    rc=${PIPESTATUS[0]}
  else
    timeout 120 "$run" -np 2 -- "$train" "${small[@]}" --steps 1000000 2>&1 | head -2 >/dev/null
    rc=${PIPESTATUS[0]}; : >"$tmp/head.err"
  fi
  took=$((SECONDS - start))
  if [[ $rc -ne 0 && $rc -ne 124 && $rc -ne 139 ]] && ! grep -q 'Segmentation fault' "$tmp/head.err"; then
    pass "launcher piped into head (stderr to a $into): the job ends in ${took} s, exit $rc"
  else
    fail "launcher piped into head (stderr to a $into) ends the job without a crash (exit $rc after ${took} s)" \
      "$(grep -A3 'Segmentation' "$tmp/head.err")"
  fi
done

# Output into a socket (a service's journal) is relayed alike: when its
# reader goes away, mpirun never meets the SIGPIPE it aborted on (Open MPI 4:
# "SIGPIPE detected on fd 13 - aborting", the abort that crashed).
# (A training job: Open MPI 5's mpirun, ending a job that floods its output
# such as seq's, at times takes 30 s and a SIGKILL.)
socket_head() {
  python3 - "$run" "$train" "${small[@]}" <<'PY'
import socket, subprocess, sys, time
ours, theirs = socket.socketpair()
job = subprocess.Popen([sys.argv[1], "-np", "2", "--", *sys.argv[2:], "--steps", "1000000"],
                       stdout=theirs, stderr=subprocess.PIPE, text=True)
theirs.close()
ours.recv(10)
ours.close()
start = time.time()
try:
    _, err = job.communicate(timeout=60)
except subprocess.TimeoutExpired:
    job.kill()
    _, err = job.communicate()
news = [l for l in err.splitlines() if not l.startswith("remat-run: mpirun")]
# Nonzero: mpirun exits 1 on the relay's SIGTERM (Open MPI 5's at times dies
# of a SIGKILL, -9); a segmentation fault (-11) is what the relay prevents.
print(f"exit {job.returncode} after {time.time() - start:.0f} s", *news[:4], sep="\n")
PY
}
got=$(socket_head 2>&1)
if [[ $got =~ ^exit\ (-9|[1-9][0-9]*)\ after\ [0-9]\ s$ ]]; then pass "launcher into a socket whose reader goes away: $got"
else fail "launcher into a socket whose reader goes away ends the job quietly in seconds" "$got"; fi

# A non-blocking pipe (its writer's flags, set by whoever started remat-run)
# that fills up: mpirun alone dropped the rest of the output and exited 0; the
# relay ends the job and says why (Open MPI 5's mpirun, done by then, still
# exits 0).
nonblocking_pipe() {
  python3 - "$run" <<'PY'
import fcntl, os, subprocess, sys, time
read_end, write_end = os.pipe()
fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
job = subprocess.Popen([sys.argv[1], "-np", "2", "--", "seq", "1", "200000"], stdout=write_end,
                       stderr=subprocess.PIPE, text=True)
os.close(write_end)
time.sleep(1)  # a slow reader: the pipe fills
lines = sum(1 for _ in os.fdopen(read_end, "rb"))
err = job.stderr.read()
print(f"exit {job.wait()}, {lines} of 400000 lines", *err.splitlines()[1:3], sep="\n")
PY
}
got=$(nonblocking_pipe 2>&1)
if [[ $got == *"the rest of its output discarded: the output is a non-blocking pipe"* ]]; then
  pass "launcher into a full non-blocking pipe says the output was cut short (${got%%$'\n'*})"
else
  fail "launcher into a full non-blocking pipe says the output was cut short" "$got"
fi

summary
