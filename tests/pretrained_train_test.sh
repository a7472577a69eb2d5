#!/usr/bin/env bash
# remat-train --pretrained: a run's safetensors --export, loaded by fresh runs
# at other data-parallel sizes, ZeRO stages and tensor-parallel sizes, gives
# the held-out loss the exporting run evaluated (which it prints to 6 digits),
# the same at every size (bitwise where every rank computes the same batches
# in the same order; within 1e-6 relative at tensor-parallel size 2, whose
# row-parallel sums may add in another order); and
# the misuses fail clearly: with --resume, a file of another model, no file.
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
summary
