#!/usr/bin/env bash
# remat-train --pretrained: a run's safetensors --export, loaded by fresh runs
# at other data-parallel sizes, ZeRO stages and tensor-parallel sizes, gives
# the held-out loss the exporting run evaluated (which it prints to 6 digits),
# the same at every size (bitwise where every rank computes the same batches
# in the same order; within 1e-6 relative at tensor-parallel size 2, whose
# row-parallel sums may add in another order); and
# the misuses fail clearly: with --resume, a file of another model (saying what
# remat-train can do), no file, /dev/null, a pickle; no output may overwrite
# the weights (file, folder, index and shards); --export-max-shard-size needs
# a folder --export; the load report says it is rank 0's share.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$1"
run="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.sample_chars=0 --set train.eval_interval=0)
loss_of() { sed -nE 's/^pretrained .*: held-out loss (.*)/\1/p' <<<"$1"; }

# The weights: 3 steps at 2 ranks, exported as one safetensors file.
if ! out=$("$run" -np 2 -- "$train" "${small[@]}" --steps 3 --set train.eval_interval=3 \
             --export "$tmp/gpt.safetensors" 2>&1); then
  fail "remat-train exports a safetensors file" "$out"
  summary
  exit
fi
trained=$(sed -nE 's/^step 3: held-out loss (.*)/\1/p' <<<"$out")
declare -A loss
for layout in "np2 stage3:2:--set zero_optimization.stage=3" "np1 stage0:1:" \
              "np2 stage1:2:--set zero_optimization.stage=1" "np2 tp2:2:--set tensor_parallel.size=2"; do
  IFS=: read -r label np sets <<<"$layout"
  # shellcheck disable=SC2086
  out=$("$run" -np "$np" -- "$train" "${small[@]}" --steps 1 $sets --pretrained "$tmp/gpt.safetensors" 2>&1)
  loss[$label]=$(loss_of "$out")
  [[ -n ${loss[$label]} ]] || fail "remat-train --pretrained ($label) prints the held-out loss" "$out"
done
ref=${loss[np2 stage3]}
if [[ -n $trained && -n $ref ]] && awk -v a="$ref" -v b="$trained" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 5e-6 * b) }'; then
  pass "the export reloaded at np2 stage3 evaluates the exporting run's held-out loss ($ref; printed $trained)"
else
  fail "the export reloaded at np2 stage3 evaluates the exporting run's held-out loss ($ref; printed $trained)" "$out"
fi
for label in "np1 stage0" "np2 stage1"; do
  if [[ -n $ref && ${loss[$label]} == "$ref" ]]; then
    pass "the export reloaded at $label evaluates the held-out loss of np2 stage3 bitwise ($ref)"
  else
    fail "the export reloaded at $label evaluates the held-out loss of np2 stage3 bitwise (${loss[$label]} vs $ref)"
  fi
done
if [[ -n $ref && -n ${loss[np2 tp2]} ]] &&
   awk -v a="${loss[np2 tp2]}" -v b="$ref" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-6 * b) }'; then
  pass "the export reloaded at tensor-parallel size 2 evaluates it within 1e-6 relative (${loss[np2 tp2]} vs $ref)"
else
  fail "the export reloaded at tensor-parallel size 2 evaluates it within 1e-6 relative (${loss[np2 tp2]} vs $ref)"
fi

expect "--pretrained with --resume is refused" "--pretrained with --resume: a save holds its weights already" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/gpt.safetensors" --resume "$tmp"
expect "--pretrained of another model names the parameters the file lacks" \
  "model parameters the file lacks: 'blocks.2." \
  "$run" -np 2 -- "$train" "${small[@]}" --set model.n_layer=3 --steps 1 --pretrained "$tmp/gpt.safetensors"
expect "--pretrained of a missing file names it" "$tmp/absent.safetensors" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/absent.safetensors"
expect_all "--pretrained of another model says what remat-train can do" "--pretrained '$tmp/gpt.safetensors'" \
  "it has no name map" "load_pretrained(path, options): fine-tuning from safetensors" -- \
  "$run" -np 1 -- "$train" "${small[@]}" --set model.n_layer=3 --steps 1 --pretrained "$tmp/gpt.safetensors"
expect_all "--pretrained /dev/null names the flag and the path, not the reader" "--pretrained '/dev/null'" \
  "is not a file nor a folder" -- "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --pretrained /dev/null
out=$("$run" -np 1 -- "$train" "${small[@]}" --steps 1 --pretrained /dev/null 2>&1)
if grep -q "SafetensorsSet" <<<"$out"; then fail "--pretrained /dev/null does not name the reader's class" "$out"; else
  pass "--pretrained /dev/null does not name the reader's class"; fi

# A pickle export (a zip archive) is not safetensors: said as such.
if "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --export "$tmp/gpt.pt" >/dev/null 2>&1; then
  expect_all "--pretrained of a pickle export says it is not safetensors" "is a zip archive" \
    "read from safetensors only" "--export model.safetensors" -- \
    "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/gpt.pt"
else
  fail "remat-train exports a pickle"
fi

# The weights are an input: no output of the run may overwrite them (a file,
# a sharded folder, an index and its shards), and they are left as they were.
sum_before=$(cat "$tmp/gpt.safetensors" | cksum)
for flag in --metrics --memory-trace --export; do
  expect "$flag onto the --pretrained file is refused" "is the --pretrained file" \
    "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/gpt.safetensors" $flag "$tmp/gpt.safetensors"
done
[[ $(cat "$tmp/gpt.safetensors" | cksum) == "$sum_before" ]] && pass "the --pretrained file is unchanged" ||
  fail "the --pretrained file is unchanged"
if "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --export "$tmp/shards/" --export-max-shard-size 40KB \
     >/dev/null 2>&1; then
  expect "--export into the --pretrained folder is refused" "which holds the weights this run loads" \
    "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/shards" --export "$tmp/shards"
  shard=$(ls "$tmp/shards" | grep -m1 '^model-0')
  expect "--metrics onto a shard the --pretrained index names is refused" "is the --pretrained file" \
    "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --pretrained "$tmp/shards/model.safetensors.index.json" \
    --metrics "$tmp/shards/$shard"
else
  fail "remat-train exports a sharded folder"
fi

# --export-max-shard-size only bounds a folder's shards.
expect "--export-max-shard-size with a file --export is refused" "is one file, not a folder" \
  "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --export "$tmp/one.safetensors" --export-max-shard-size 1MB
expect "--export-max-shard-size without --export is refused" "--export is not given" \
  "$run" -np 1 -- "$train" "${small[@]}" --steps 1 --export-max-shard-size 1MB

# The load report is rank 0's share, said as such.
out=$(REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" "${small[@]}" --steps 1 --set zero_optimization.stage=3 \
        --pretrained "$tmp/gpt.safetensors" 2>&1)
if grep -q "rank 0 of 2, for its own share, read" <<<"$out"; then
  pass "the load report says its bytes are rank 0's share"
else
  fail "the load report says its bytes are rank 0's share" "$out"
fi
summary
