#!/usr/bin/env bash
# Background saves (train.async_save) killed with kill -9 at each of their
# write steps, at 2 ranks: the rank files written by the background threads
# while training goes on, then the manifest, the step folder and `latest`
# written at a later step. Each kill must leave the previous save intact: the
# next run resumes it and trains the same losses, bitwise, as a run resumed
# from it without a kill, and removes what the killed save left. A failure
# injected into one rank's background write (REMAT_FAULT_SAVE_FAIL) stops
# every rank with the same error (at 1 rank too), naming the save to resume,
# and keeps the previous save the latest. A step stopped on a non-finite loss
# keeps the background save before it. Completion and a useless
# train.async_save are logged.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$(realpath "$1")"
run="$(realpath "$2")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0
       --set zero_optimization.stage=2)
tiny=("$train" "${small[@]}")
async=(--set train.async_save=true --set train.save_interval=2)

# Every process below `pid` (mpirun's ranks), deepest first.
descendants() {
  local child
  for child in $(pgrep -P "$1"); do
    descendants "$child"
    echo "$child"
  done
}

# The losses of steps 3 and 4 in a metrics file, one per line.
losses() { grep -E '"step":(3|4)[,}]' "$1" | grep -oE '"loss":[^,]*'; }

# The save of step 2 every case starts from, and the losses a run resumed
# from it trains (no kill, blocking saves).
rm -rf "$tmp/base"
"$run" -np 2 -- "${tiny[@]}" --steps 2 --save-dir "$tmp/base" >"$tmp/base.log" 2>&1 ||
  fail "the first run saves step 2" "$(tail -5 "$tmp/base.log")"
rm -rf "$tmp/reference"
cp -a "$tmp/base" "$tmp/reference"
"$run" -np 2 -- "${tiny[@]}" --steps 4 --resume "$tmp/reference" --save-dir "$tmp/reference" \
  --metrics "$tmp/reference.jsonl" >"$tmp/reference.log" 2>&1 ||
  fail "a run resumed from step 2 trains to step 4" "$(tail -5 "$tmp/reference.log")"
want=$(losses "$tmp/reference.jsonl")

# The pauses of the background save of step 4 at 2 ranks: each rank's file
# (in its background thread, in either order), then, at the save of step 6
# that completes it, its manifest, its step folder and `latest`. The fault
# seam pauses before each is put in place and says so; the k-th pause is
# where the kill lands.
for k in 1 2 3 4 5; do
  dir="$tmp/kill_$k"
  rm -rf "$dir" && cp -a "$tmp/base" "$dir"
  REMAT_FAULT_SAVE_PAUSE_MS=3000 "$run" -np 2 -- "${tiny[@]}" "${async[@]}" --steps 6 --resume "$dir" \
    --save-dir "$dir" >"$tmp/kill_$k.log" 2>&1 &
  job=$!
  for _ in $(seq 1 900); do
    [[ $(grep -c 'remat fault seam: pausing' "$tmp/kill_$k.log" 2>/dev/null) -ge $k ]] && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  where=$(grep 'remat fault seam: pausing' "$tmp/kill_$k.log" | sed -n "${k}p" | sed -E "s/.*before '([^']*)'.*/\1/")
  kill -9 $(descendants "$job") "$job" 2>/dev/null
  wait "$job" 2>/dev/null
  sleep 0.5
  latest=$(cat "$dir/latest" 2>/dev/null)
  resumed=$("$run" -np 2 -- "${tiny[@]}" --steps 4 --resume "$dir" --save-dir "$dir" \
            --metrics "$tmp/resumed_$k.jsonl" 2>&1); rc=$?
  got=$(losses "$tmp/resumed_$k.jsonl" 2>/dev/null)
  left=$(ls -A "$dir" | grep -E '^\.(staging|replaced)_|\.tmp' | tr '\n' ' ')
  if [[ -z "$where" ]]; then
    fail "a background save killed at write step $k: the step was reached" "$(tail -5 "$tmp/kill_$k.log")"
  elif [[ $rc -eq 0 && "$latest" == step_00000002 && -n "$got" && "$got" == "$want" && -z "$left" ]]; then
    pass "a background save killed before '${where#$dir/}' is put in place leaves step 2 the latest; it resumes bitwise; nothing left over"
  else
    fail "a background save killed before '${where#$dir/}' leaves step 2 resumable (exit $rc, latest $latest, left: $left)" \
      "$resumed" "want: $want" "got: $got"
  fi
done

# Training went on while the files of step 4 were written: the last step
# (6) was reported before the manifest's pause (a blocking save puts the
# manifest in place at step 4, before step 5 trains; a background one once
# the rank files are written, their pauses 3 s each, which steps 5 and 6 of
# this model take far less than), and both rank files' pauses came before
# the manifest's. Whether step 6 comes before or after the rank files'
# pauses depends on how long their serialization takes on a loaded machine,
# so it is not asserted.
line_of() { grep -nE "$1" "$tmp/kill_3.log" | head -1 | cut -d: -f1; }
order=$(grep -nE '^step 6/6|pausing .*(rank_[01]\.pt|manifest\.json)' "$tmp/kill_3.log" | cut -d: -f1 | tr '\n' ' ')
step6=$(line_of '^step 6/6'); rank0=$(line_of 'pausing .*rank_0\.pt')
rank1=$(line_of 'pausing .*rank_1\.pt'); manifest=$(line_of 'pausing .*manifest\.json')
if [[ -n "$step6" && -n "$rank0" && -n "$rank1" && -n "$manifest" ]] &&
   (( step6 < manifest && rank0 < manifest && rank1 < manifest )); then
  pass "training went on to step 6 while the save of step 4 was in the background"
else
  fail "training went on to step 6 while the save of step 4 was in the background (lines: $order)" "$(cat "$tmp/kill_3.log")"
fi

# A background write that fails on rank 1: every rank stops with the same
# error, naming rank 1 and the step; step 2 stays the latest and nothing of
# step 4 is left.
dir="$tmp/fail"
rm -rf "$dir" && cp -a "$tmp/base" "$dir"
out=$(REMAT_FAULT_SAVE_FAIL=1 timeout 120 "$run" -np 2 -- "${tiny[@]}" "${async[@]}" --steps 6 --resume "$dir" \
      --save-dir "$dir" 2>&1); rc=$?
left=$(ls -A "$dir" | grep -E '^\.(staging|replaced)_|\.tmp|step_00000004' | tr '\n' ' ')
guidance="The newest complete save is step 2 in '$dir' (its 'latest'): free space there, then run again with the same settings and --resume $dir"
if [[ $rc -ne 0 && $rc -lt 124 && "$(cat "$dir/latest")" == step_00000002 && -z "$left" ]] &&
   grep -qF "failed on rank 1" <<<"$out" && grep -qF "the background save of step 4" <<<"$out" &&
   grep -qF "$guidance" <<<"$out"; then
  pass "a failed background write is the same error on every rank, naming the save to resume; step 2 stays the latest (exit $rc)"
else
  fail "a failed background write is the same error on every rank, naming the save to resume (exit $rc, left: $left)" "$out"
fi
# At one rank: the same suffix and guidance.
dir="$tmp/fail1"
rm -rf "$dir"
"$run" -np 1 -- "${tiny[@]}" --steps 2 --save-dir "$dir" >/dev/null 2>&1
out=$(REMAT_FAULT_SAVE_FAIL=0 timeout 120 "$run" -np 1 -- "${tiny[@]}" "${async[@]}" --steps 6 --resume "$dir" \
      --save-dir "$dir" 2>&1); rc=$?
guidance="The newest complete save is step 2 in '$dir' (its 'latest'): free space there, then run again with the same settings and --resume $dir"
if [[ $rc -ne 0 && $rc -lt 124 && "$(cat "$dir/latest" 2>/dev/null)" == step_00000002 ]] &&
   grep -qF "(the background save of step 4 failed on rank 0 of 1)" <<<"$out" && grep -qF "$guidance" <<<"$out"; then
  pass "at one rank a failed background write names the rank, the step and the save to resume (exit $rc)"
else
  fail "at one rank a failed background write names the rank, the step and the save to resume (exit $rc)" "$out"
fi

# A step that stops on a non-finite loss first completes the background save
# of the step before it, as a blocking save is complete by then: that save is
# the latest and nothing of it is left staged (at 1 and 2 ranks).
for np in 1 2; do
  dir="$tmp/nonfinite_$np"
  rm -rf "$dir"
  out=$(timeout 120 "$run" -np $np -- "${tiny[@]}" --set train.async_save=true --set train.save_interval=1 \
        --set optimizer.params.lr=1e38 --set scheduler.params.warmup_max_lr=1e38 \
        --set scheduler.params.warmup_num_steps=1 --set gradient_clipping=0 --steps 40 --save-dir "$dir" 2>&1); rc=$?
  bad=$(sed -nE 's/.*step ([0-9]+): the loss.* went non-finite.*/\1/p' <<<"$out" | head -1)
  want_latest=$(printf 'step_%08d' $(( ${bad:-1} - 1 )))
  left=$(ls -A "$dir" 2>/dev/null | grep -E '^\.(staging|replaced)_' | tr '\n' ' ')
  if [[ $rc -ne 0 && $rc -lt 124 && -n "$bad" && "$(cat "$dir/latest" 2>/dev/null)" == "$want_latest" && -z "$left" ]] &&
     ! grep -qF "was not completed" <<<"$out"; then
    pass "np $np: a step stopped on a non-finite loss keeps the background save before it ($want_latest; exit $rc)"
  else
    fail "np $np: a step stopped on a non-finite loss keeps the background save before it (step $bad, latest $(cat "$dir/latest" 2>/dev/null), left: $left)" "$out"
  fi
done

# A background save says when it is complete; train.async_save without a
# save folder says it has no effect.
dir="$tmp/logged"
rm -rf "$dir"
out=$(REMAT_LOG_LEVEL=info timeout 120 "$run" -np 2 -- "${tiny[@]}" "${async[@]}" --steps 2 --save-dir "$dir" 2>&1)
if grep -qE "saved step 2 to '$dir' \(written in the background; [0-9]+ ms after the step\)" <<<"$out"; then
  pass "a background save logs its completion"
else
  fail "a background save logs its completion" "$out"
fi
out=$(timeout 120 "$run" -np 2 -- "${tiny[@]}" "${async[@]}" --steps 1 2>&1)
if [[ $(grep -c "train.async_save is true but no --save-dir is given" <<<"$out") -eq 1 ]]; then
  pass "train.async_save without --save-dir is said once to have no effect"
else
  fail "train.async_save without --save-dir is said once to have no effect" "$out"
fi

summary
