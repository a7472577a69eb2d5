#!/usr/bin/env bash
# "auto" in a ds_config through the tools (docs/config.md, "auto": remat
# decides): remat-estimate prints what each key became and why (and --json
# holds it), its micro-batch the largest the estimate fits (the bound of
# remat-train's candidates), never smaller with more memory and the same at
# every call (a capacity, not the memory free now); remat-train measures the
# candidates at 2 ranks and takes the throughput knee, logs the search once
# and one line per key, trains with it; the run equals the run given the
# decided micro-batch bit for bit; a save keeps the decisions and a resume
# takes them (nothing measured again), and a resume given another batch says
# how the global batch changes; ranks with different memory decide alike;
# every "auto" with a planner budget ("knee", or a fraction) trains where the
# memory is not short (issue 50, item 3); a key remat cannot decide still
# refuses "auto".
# Prints "[remat-test] N passed, M failed".
#   tests/auto_values_test.sh REMAT_TRAIN REMAT_RUN REMAT_ESTIMATE
set -uo pipefail
train="$(realpath "$1")"
run="$(realpath "$2")"
estimate="$(realpath "$3")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_PROGRESS=lines
source "$(dirname "$0")/testlib.sh"

# The keys Hugging Face's Trainer fills with "auto".
cat >"$tmp/trainer.json" <<'JSON'
{
  "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"},
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "model": {"n_layer": 2, "d_model": 64, "d_ff": 128, "seq_len": 32, "dropout": 0.1},
  "train": {"eval_interval": 0, "sample_chars": 0}
}
JSON
py=/usr/bin/python3
# A field of a JSON file: json_of FILE EXPRESSION (over `j`).
json_of() { $py -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null; }
# The measured micro-batch a save recorded.
saved_micro() { json_of "$1/manifest.json" 'j["decisions"]["batch"]["train_micro_batch_size_per_gpu"]'; }

# remat-estimate's micro-batch at a given memory per rank.
micro_at() {
  REMAT_MEMORY_PER_RANK_BYTES=$1 "$estimate" -np 2 --config "$tmp/trainer.json" --json "$tmp/est_$1.json" \
    >"$tmp/est_$1.out" 2>&1 || { echo "error"; return; }
  json_of "$tmp/est_$1.json" 'j["auto"]["train_micro_batch_size_per_gpu"]["value"]'
}

# 1. remat-estimate shows every decided key: the micro-batch the largest that
#    fits, the most remat-train may choose, with the candidates it measures.
m40=$(micro_at 40000000)
out=$(cat "$tmp/est_40000000.out")
if [[ $m40 =~ ^[0-9]+$ ]] && (( m40 >= 1 )) &&
   grep -qF "\"auto\" values, as remat-train would decide them here:" <<<"$out" &&
   grep -qF "train_micro_batch_size_per_gpu \"auto\" -> $m40: the largest micro-batch whose estimated peak" <<<"$out" &&
   grep -qF "the most remat-train may choose: at start it measures the candidates 1, 2, 4, " <<<"$out" &&
   grep -qF "train_batch_size \"auto\" -> $((m40 * 2)): " <<<"$out" &&
   grep -qF "bf16.enabled \"auto\" -> false: the training device, cpu" <<<"$out" &&
   grep -qF "scheduler.params.total_num_steps \"auto\" -> 200: train.steps" <<<"$out" &&
   [[ $(grep -c '"auto" -> ' <<<"$out") -eq 16 ]]; then
  pass "remat-estimate prints the 16 decided keys (micro-batch at most $m40 at 40 MB per rank, the candidates listed)"
else
  fail "remat-estimate prints the decided keys" "$out"
fi

# 2. Its bound fits and never shrinks with more memory.
last=0 ok=1 seen=""
for bytes in 20000000 30000000 40000000 60000000 90000000; do
  m=$(micro_at "$bytes")
  seen+=" $bytes:$m"
  if ! [[ $m =~ ^[0-9]+$ ]] || (( m < last )); then ok=0; fi
  [[ $m =~ ^[0-9]+$ ]] && last=$m
done
if (( ok == 1 && last > m40 )); then
  pass "more memory, a bound at least as large:$seen"
else
  fail "more memory, a bound at least as large:$seen" "$(cat "$tmp/est_90000000.out")"
fi

# 3. Without REMAT_MEMORY_PER_RANK_BYTES the bound comes from the host's
#    physical memory, not what is free now: three calls, with memory taken
#    between them, decide the same (it drifted: 3140, 3148, 3187). A model
#    whose bound the memory sets, not the training split's sequences.
bounds=""
wide=(--set model.n_layer=4 --set model.d_model=128 --set model.d_ff=512 --set model.seq_len=64)
for i in 1 2 3; do
  "$estimate" -np 2 --config "$tmp/trainer.json" "${wide[@]}" --json "$tmp/stable_$i.json" >"$tmp/stable_$i.out" 2>&1
  bounds+=" $(json_of "$tmp/stable_$i.json" 'j["auto"]["train_micro_batch_size_per_gpu"]["value"]')"
  [[ $i -eq 1 ]] && $py -c 'import time; b = bytearray(256 << 20); time.sleep(0.5)' &
done
wait
read -r b1 b2 b3 <<<"$bounds"
if [[ $b1 =~ ^[0-9]+$ && "$b1" == "$b2" && "$b2" == "$b3" ]] &&
   grep -qF "each rank has (this host's physical memory over 2 ranks)" "$tmp/stable_1.out" &&
   ! grep -qF "the training split's sequences" "$tmp/stable_1.out"; then
  pass "the bound is the same at every call (physical memory over the ranks):$bounds"
else
  fail "the bound is the same at every call:$bounds" "$(cat "$tmp/stable_1.out")"
fi

# 4. remat-train measures the candidates up to that bound at 2 ranks, logs
#    the search once (rank 0) and one line per key, and trains with the knee.
REMAT_MEMORY_PER_RANK_BYTES=40000000 timeout 300 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" \
  --steps 3 --metrics "$tmp/auto.jsonl" --save-dir "$tmp/saves" >"$tmp/auto.out" 2>&1
rc=$?
out=$(tr -d '\000' <"$tmp/auto.out")
micro=$(saved_micro "$tmp/saves/step_00000003")
search=$(grep -F "micro-batch search (forward+backward tokens/s per rank, the slowest rank's): 1: " <<<"$out")
seconds=$(sed -nE 's/.*the best, in ([0-9.]+) s.*/\1/p' <<<"$search")
if [[ $rc -eq 0 && $micro =~ ^[0-9]+$ ]] && (( micro <= m40 )) && [[ $(grep -c "micro-batch search" <<<"$out") -eq 1 ]] &&
   grep -qE "\[rank 0/2[^]]*\] micro-batch search" <<<"$out" && grep -qF " $micro: " <<<"$search" &&
   grep -qF "; chose $micro, the smallest within 5 % of the best" <<<"$search" &&
   grep -qF "train_micro_batch_size_per_gpu \"auto\" -> $micro: the throughput knee: the smallest measured" <<<"$out" &&
   grep -qF "candidates up to $m40 (the largest that fits) measured in" <<<"$out" &&
   grep -qF "batch $((micro * 2)) = micro $micro x accumulation 1 x dp 2" <<<"$out" &&
   grep -qF "scheduler.params.warmup_num_steps \"auto\" -> 2: Hugging Face's Trainer fills its warmup_steps" <<<"$out" &&
   [[ $(grep -c '"auto" -> ' <<<"$out") -eq 16 ]] && grep -q "step 3/3" <<<"$out" &&
   $py -c "import sys; sys.exit(0 if float('$seconds') <= 15 else 1)"; then
  pass "remat-train measures the candidates up to $m40 and trains at the knee, $micro, decided in $seconds s"
else
  fail "remat-train measures the candidates and trains at the knee (exit $rc, micro '$micro', ${seconds:-?} s)" \
    "$out"
fi

# 5. The save records every decision and the search's measurements.
if [[ $(json_of "$tmp/saves/step_00000003/manifest.json" 'len(j["decisions"]["auto"])') == 16 ]] &&
   [[ $(json_of "$tmp/saves/step_00000003/manifest.json" 'j["decisions"]["micro_batch_search"]["chosen"]') == "$micro" ]] &&
   [[ $(json_of "$tmp/saves/step_00000003/manifest.json" \
        'all(t["tokens_per_s"] > 0 for t in j["decisions"]["micro_batch_search"]["measured"])') == True ]]; then
  pass "the save records the 16 decided values and the search's measurements"
else
  fail "the save records the decided values and the search" "$(cat "$tmp/saves/step_00000003/manifest.json")"
fi

# 6. An "auto" run is the run given the decided micro-batch, bit for bit (the
#    search's passes leave the parameters, the gradients and dropout's RNG
#    streams as they found them).
REMAT_MEMORY_PER_RANK_BYTES=40000000 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" --steps 3 \
  --set train_micro_batch_size_per_gpu="$micro" --metrics "$tmp/given.jsonl" >"$tmp/given.out" 2>&1
if [[ -s "$tmp/given.jsonl" ]] && cmp -s <(losses "$tmp/auto.jsonl") <(losses "$tmp/given.jsonl") &&
   ! grep -q "micro-batch search" "$tmp/given.out"; then
  pass "the \"auto\" run equals the run given micro-batch $micro, bit for bit (losses $(losses "$tmp/auto.jsonl" | tr '\n' ' '))"
else
  fail "the \"auto\" run equals the run given micro-batch $micro" \
    "$(paste <(losses "$tmp/auto.jsonl") <(losses "$tmp/given.jsonl"))" "$(cat "$tmp/given.out")"
fi

# 7. A resume takes the save's decisions, says so, and measures nothing.
REMAT_MEMORY_PER_RANK_BYTES=40000000 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" --steps 2 \
  --save-dir "$tmp/resume" --metrics "$tmp/first.jsonl" >"$tmp/first.out" 2>&1
first=$(saved_micro "$tmp/resume/step_00000002")
out=$(REMAT_MEMORY_PER_RANK_BYTES=40000000 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" --steps 3 \
      --resume "$tmp/resume" --save-dir "$tmp/resume" 2>&1 | tr -d '\000')
if [[ $first =~ ^[0-9]+$ ]] &&
   grep -qF "resume: took the values decided by the run of the save in '$tmp/resume/step_00000002' (step 2), nothing measured again: " <<<"$out" &&
   grep -qF "train_micro_batch_size_per_gpu \"auto\" -> $first: kept from the save in '$tmp/resume/step_00000002' (step 2), whose run decided it: the throughput knee" <<<"$out" &&
   grep -qF "batch $((first * 2)) = micro $first x accumulation 1 x dp 2" <<<"$out" &&
   ! grep -q "micro-batch search" <<<"$out" && ! grep -q "global batch changes" <<<"$out" &&
   grep -q "step 3/3" <<<"$out" && [[ $(saved_micro "$tmp/resume/step_00000003") == "$first" ]]; then
  pass "a resume keeps the save's micro-batch ($first), says so, and measures nothing"
else
  fail "a resume keeps the save's micro-batch ($first)" "$out"
fi

# 8. A resume given another batch is told how the global batch changes.
other=$((first + 1))
out=$(REMAT_MEMORY_PER_RANK_BYTES=40000000 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" --steps 3 \
      --resume "$tmp/resume/step_00000002" --set train_micro_batch_size_per_gpu=$other 2>&1 | tr -d '\000')
if grep -qF "resume: the global batch changes from $((first * 2)) (micro $first x accumulation 1 x dp 2), what the save's run trained with, to $((other * 2)) (micro $other x accumulation 1 x dp 2)" <<<"$out" &&
   grep -qF "give train_batch_size $((first * 2)) to keep the save's" <<<"$out" && grep -q "step 3/3" <<<"$out"; then
  pass "a resume at micro-batch $other says the global batch changes from $((first * 2)) to $((other * 2))"
else
  fail "a resume given another batch says the global batch changes" "$out"
fi

# 9. Ranks with different memory measure the same candidates (the smallest
#    fit of any rank) and decide alike.
out=$("$run" -np 2 -- bash -c 'REMAT_MEMORY_PER_RANK_BYTES=$(((OMPI_COMM_WORLD_RANK + 1) * 20000000)) exec "$0" "$@"' \
      "$train" --config "$tmp/trainer.json" --steps 1 2>&1 | tr -d '\000')
m20=$(micro_at 20000000)
if grep -q "step 1/1" <<<"$out" && grep -qF "candidates up to $m20 (the largest that fits)" <<<"$out"; then
  pass "ranks with 20 MB and 40 MB measure the candidates up to $m20, the smaller fit, and train alike"
else
  fail "ranks with different memory decide alike (up to $m20)" "$out"
fi

# 10. --print-config prints the measured micro-batch, as JSON --config reads.
REMAT_MEMORY_PER_RANK_BYTES=40000000 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" --print-config \
  >"$tmp/print.out" 2>"$tmp/print.err"
printed=$($py -c 'import json, sys
text = open(sys.argv[1]).read()
print(json.loads(text[text.index("{"):])["train_micro_batch_size_per_gpu"])' "$tmp/print.out" 2>/dev/null)
if [[ $printed =~ ^[0-9]+$ ]] && (( printed >= 1 && printed <= m40 )); then
  pass "--print-config prints the measured micro-batch, $printed"
else
  fail "--print-config prints the measured micro-batch" "$(cat "$tmp/print.out" "$tmp/print.err")"
fi

# 11. Every "auto" with a planner budget at 1 GiB per rank and 2 blocks
#     (issue 50, item 3: "not even a micro-batch of 1 fits ... 921.6 MiB"):
#     the knee and a reachable fraction train; a fraction no plan of 2 blocks
#     reaches at any micro-batch (0.5) gets the planner's refusal, which names
#     the budget, as at a given micro-batch, not a memory refusal. The
#     reachable fractions are reachable at whatever micro-batch the knee
#     measures (at micro-batch 1 the smallest are 0.795 with 2 blocks and 0.683
#     with 4; a loaded machine measures the knee at 1): 0.85 and 0.75.
budget=(--set activation_checkpointing.variant=auto --set zero_optimization.stage=1)
for case in "knee 2" "0.85 2" "0.75 4"; do
  read -r fraction layers <<<"$case"
  out=$(REMAT_MEMORY_PER_RANK_BYTES=$((1 << 30)) timeout 300 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" \
        --steps 3 "${budget[@]}" --set activation_checkpointing.memory_budget_fraction=$fraction \
        --set model.n_layer=$layers 2>&1 | tr -d '\000')
  if grep -q "step 3/3" <<<"$out" && grep -q "micro-batch search" <<<"$out" && ! grep -q "not even a micro-batch" <<<"$out"; then
    pass "every \"auto\" with memory_budget_fraction $fraction, $layers blocks, 1 GiB per rank trains ($(grep -o 'batch [0-9]* = micro [0-9]*' <<<"$out"))"
  else
    fail "every \"auto\" with memory_budget_fraction $fraction, $layers blocks, 1 GiB per rank trains" "$out"
  fi
done
out=$(REMAT_MEMORY_PER_RANK_BYTES=$((1 << 30)) timeout 300 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" \
      --steps 3 "${budget[@]}" --set activation_checkpointing.memory_budget_fraction=0.5 2>&1 | tr -d '\000')
if grep -q "micro-batch search" <<<"$out" && ! grep -q "not even a micro-batch" <<<"$out" &&
   grep -qF "activation checkpointing: the memory budget of" <<<"$out" &&
   grep -qF "cannot be met: the smallest peak any plan reaches is" <<<"$out"; then
  pass "memory_budget_fraction 0.5 with 2 blocks: the planner's refusal names the budget, not the memory"
else
  fail "memory_budget_fraction 0.5 with 2 blocks: the planner's refusal" "$out"
fi

# 12. A key remat cannot decide still refuses "auto", naming it.
expect "train.steps \"auto\" is refused" \
  "'train.steps' must be integer, got string \"auto\" (\"auto\" is filled in by a launcher" \
  "$train" --config "$tmp/trainer.json" --set train.steps=auto

summary
