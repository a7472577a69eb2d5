#!/usr/bin/env bash
# "auto" in a ds_config through the tools (docs/config.md, "auto": remat
# decides): remat-estimate prints what each key became and why (and --json
# holds it), its micro-batch the largest the estimate fits and never smaller
# with more memory; remat-train decides the same at 2 ranks, logs one line per
# key, trains with it; a key remat cannot decide still refuses "auto".
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
  "model": {"n_layer": 2, "d_model": 64, "d_ff": 128, "seq_len": 32},
  "train": {"eval_interval": 0, "sample_chars": 0}
}
JSON

# remat-estimate's micro-batch at a given memory per rank.
micro_at() {
  REMAT_MEMORY_PER_RANK_BYTES=$1 "$estimate" -np 2 --config "$tmp/trainer.json" --json "$tmp/est_$1.json" \
    >"$tmp/est_$1.out" 2>&1 || { echo "error"; return; }
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["auto"]["train_micro_batch_size_per_gpu"]["value"])' \
    "$tmp/est_$1.json"
}

# 1. remat-estimate shows every decided key, the micro-batch with its reason.
m40=$(micro_at 40000000)
out=$(cat "$tmp/est_40000000.out")
if [[ $m40 =~ ^[0-9]+$ ]] && (( m40 >= 1 )) &&
   grep -qF "\"auto\" values, as remat-train would decide them here:" <<<"$out" &&
   grep -qF "train_micro_batch_size_per_gpu \"auto\" -> $m40: the largest micro-batch whose estimated peak" <<<"$out" &&
   grep -qF "train_batch_size \"auto\" -> $((m40 * 2)): " <<<"$out" &&
   grep -qF "bf16.enabled \"auto\" -> false: the training device, cpu" <<<"$out" &&
   grep -qF "scheduler.params.total_num_steps \"auto\" -> 200: train.steps" <<<"$out" &&
   [[ $(grep -c '"auto" -> ' <<<"$out") -eq 16 ]]; then
  pass "remat-estimate prints the 16 decided keys (micro-batch $m40 at 40 MB per rank)"
else
  fail "remat-estimate prints the decided keys" "$out"
fi

# 2. Its micro-batch fits and never shrinks with more memory.
last=0 ok=1 seen=""
for bytes in 20000000 30000000 40000000 60000000 90000000; do
  m=$(micro_at "$bytes")
  seen+=" $bytes:$m"
  if ! [[ $m =~ ^[0-9]+$ ]] || (( m < last )); then ok=0; fi
  [[ $m =~ ^[0-9]+$ ]] && last=$m
done
if (( ok == 1 && last > m40 )); then
  pass "more memory, a micro-batch at least as large:$seen"
else
  fail "more memory, a micro-batch at least as large:$seen" "$(cat "$tmp/est_90000000.out")"
fi

# 3. remat-train decides the same at 2 ranks, logs each key on rank 0 and trains.
out=$(REMAT_MEMORY_PER_RANK_BYTES=40000000 timeout 300 "$run" -np 2 -- "$train" --config "$tmp/trainer.json" \
      --steps 3 2>&1)
rc=$?
if [[ $rc -eq 0 ]] && grep -qF "train_micro_batch_size_per_gpu \"auto\" -> $m40: " <<<"$out" &&
   grep -qF "batch $((m40 * 2)) = micro $m40 x accumulation 1 x dp 2" <<<"$out" &&
   grep -qF "scheduler.params.warmup_num_steps \"auto\" -> 2: Hugging Face's Trainer fills its warmup_steps" <<<"$out" &&
   [[ $(grep -c '"auto" -> ' <<<"$out") -eq 16 ]] && grep -q "step 3/3" <<<"$out"; then
  pass "remat-train decides as remat-estimate does (micro $m40), logs 16 lines once, trains 3 steps"
else
  fail "remat-train decides, logs and trains (exit $rc)" "$out"
fi

# 4. A key remat cannot decide still refuses "auto", naming it.
expect "train.steps \"auto\" is refused" \
  "'train.steps' must be integer, got string \"auto\" (\"auto\" is filled in by a launcher" \
  "$train" --config "$tmp/trainer.json" --set train.steps=auto

summary
