#!/usr/bin/env bash
# remat-train against what goes wrong in real runs: unusable save folders,
# two jobs on one folder, unwritable metrics, non-finite losses, damaged or
# mixed-up saves, settings changed between save and resume, bad flags and
# environment, and a stalled rank. Each case must end as stated (a clear error
# and a nonzero exit, or the documented recovery), never hang or go on silently.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$1"
run="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0)
tiny=("$train" "${small[@]}")

# outcome NAME ok|error TEXT ABSENT COMMAND...: the command must succeed (ok)
# or end with a nonzero exit that is not a timeout or a signal (error), print
# TEXT, and print nothing matching ABSENT (a regex; empty: not checked).
outcome() {
  local name="$1" want="$2" text="$3" absent="$4" out rc ended
  shift 4
  out=$(timeout 120 "$@" 2>&1); rc=$?
  if [[ $want == ok ]]; then ended=$((rc == 0)); else ended=$((rc != 0 && rc != 124 && rc < 128)); fi
  if [[ $ended -eq 1 ]] && grep -qF -- "$text" <<<"$out" &&
     { [[ -z "$absent" ]] || ! grep -qE -- "$absent" <<<"$out"; }; then
    pass "$name (exit $rc)"
  else
    fail "$name (exit $rc; wanted $want, '$text'${absent:+ and no '$absent'})" "$out"
  fi
}
ok() { local name="$1" text="$2"; shift 2; outcome "$name" ok "$text" "" "$@"; }

# --- A. Nothing lost ---------------------------------------------------------

# A1. A --save-dir that cannot be used fails before the first step.
touch "$tmp/a_file"
outcome "an unusable --save-dir is refused before training" error "cannot be created" "^step " \
  "${tiny[@]}" --steps 5 --save-dir "$tmp/a_file/saves"
# A folder that exists but takes no files (root writes through permissions).
if [[ $(id -u) -eq 0 ]]; then ro=/proc/self/fdinfo; else mkdir -p "$tmp/ro" && chmod 500 "$tmp/ro"; ro="$tmp/ro"; fi
expect "a read-only --save-dir is refused at start" "is not writable" "${tiny[@]}" --steps 5 --save-dir "$ro"

# A2. A second job on the same --save-dir stops at its start naming the first;
#     the manifest records the run id.
"$run" -np 2 -- "$train" "${small[@]}" --steps 100000 --save-dir "$tmp/shared" \
  >"$tmp/first.log" 2>&1 &
first=$!
for _ in $(seq 1 100); do [[ -s "$tmp/shared/.lock" ]] && break; sleep 0.2; done
expect "a second job on a locked --save-dir is refused" "is in use by another job (pid " \
  "$train" "${small[@]}" --steps 2 --save-dir "$tmp/shared"
kill "$first" 2>/dev/null; wait "$first" 2>/dev/null
for _ in $(seq 1 100); do pgrep -f -- "--steps 100000 --save-dir $tmp/shared" >/dev/null || break; sleep 0.1; done
ok "the lock is released with its job" "loss: first" "$train" "${small[@]}" --steps 2 --save-dir "$tmp/shared"
if grep -q '"run_id": "' "$tmp/shared/step_00000002/manifest.json"; then
  pass "the manifest records the run id"
else
  fail "the manifest records the run id" "$(cat "$tmp/shared/step_00000002/manifest.json")"
fi

# A3. Metrics writes are checked: a full disk (/dev/full) or a file that takes
#     no data is an error at the step it happens.
expect "--metrics on a full disk is an error" "failed at step 1 (No space left on device" \
  "${tiny[@]}" --steps 3 --metrics /dev/full
expect "--metrics that takes no data is an error" "--metrics" \
  "${tiny[@]}" --steps 3 --metrics /proc/version

# --- D. Nothing silently wrong ----------------------------------------------

# D1. A diverging run (lr 1e6, no schedule, no clipping) stops at the first
#     non-finite step and never saves it; with on_nonfinite=skip it drops
#     those updates and finishes.
diverge=(--set optimizer.params.lr=1e6 --set scheduler.type=none --set gradient_clipping=0)
rm -rf "$tmp/diverge"
out=$(timeout 120 "$run" -np 2 -- "$train" "${small[@]}" --steps 30 "${diverge[@]}" \
      --set train.save_interval=1 --save-dir "$tmp/diverge" 2>&1); rc=$?
bad_step=$(grep -oE 'step [0-9]+: the (loss|gradients)' <<<"$out" | head -1 | grep -oE '[0-9]+')
latest=$(sed -E 's/step_0*//' "$tmp/diverge/latest" 2>/dev/null)
if [[ $rc -ne 0 && -n "$bad_step" ]] && grep -q "went non-finite" <<<"$out" &&
   [[ -z "$latest" || "$latest" -lt "$bad_step" ]]; then
  pass "a non-finite step stops the run (step $bad_step) and the latest save (${latest:-none}) is before it"
else
  fail "a non-finite step stops the run before saving it" "$out" "latest: $latest"
fi
m="$tmp/skip.jsonl"
ok "on_nonfinite=skip drops the non-finite updates and finishes" "loss: first" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 10 "${diverge[@]}" \
  --set train.on_nonfinite=skip --metrics "$m"
if grep -q '"skipped":true' "$m"; then pass "skipped steps are marked in the metrics"; else
  fail "skipped steps are marked in the metrics" "$(head -3 "$m")"; fi

# D2. A bit flipped in a saved file is found on resume, naming the file.
rm -rf "$tmp/saves"
"$run" -np 2 -- "$train" "${small[@]}" --steps 4 --set train.save_interval=2 \
  --save-dir "$tmp/saves" >/dev/null 2>&1
cp -r "$tmp/saves" "$tmp/flipped"
flip_bit "$tmp/flipped/step_00000004/rank_1.pt"
expect "a flipped bit in a rank file is an error naming it" "step_00000004/rank_1.pt' is damaged" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/flipped"

# B2. Files mixed from two steps (with the manifest edited to match their
#     checksums) or swapped between ranks are refused before the first step.
mix() {  # mix DEST FROM_STEP FROM_RANK TO_RANK: rank file FROM_RANK of FROM_STEP becomes TO_RANK of step 4
  python3 - "$@" <<'EOF'
import json, shutil, sys
dest, from_step, from_rank, to_rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
src = f"{dest}/{from_step}"
shutil.copy(f"{src}/rank_{from_rank}.pt", f"{dest}/step_00000004/rank_{to_rank}.pt")
entry = json.load(open(f"{src}/manifest.json"))["files"][from_rank]
manifest_path = f"{dest}/step_00000004/manifest.json"
manifest = json.load(open(manifest_path))
manifest["files"][to_rank] = dict(entry, name=f"rank_{to_rank}.pt")
json.dump(manifest, open(manifest_path, "w"))
EOF
}
cp -r "$tmp/saves" "$tmp/mixed" && mix "$tmp/mixed" step_00000002 1 1
expect "a rank file from another step is refused" "the folder mixes files of different saves" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/mixed"
cp -r "$tmp/saves" "$tmp/swapped" && cp -r "$tmp/saves/step_00000004" "$tmp/swapped/orig" &&
  mix "$tmp/swapped" orig 1 0 && mix "$tmp/swapped" orig 0 1
# (whichever rank reads its file first reports: rank 0 finds rank 1's file, or the other way round)
expect "rank files swapped between ranks are refused" "holds step 4 of rank" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/swapped"
ok "the untouched save resumes" "loss: first" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/saves"

# D3. --steps and --seed are validated like --set; nothing to do says so.
expect "--steps -1 is an error" "'train.steps' = -1 must be >= 0" "${tiny[@]}" --steps -1
expect "--seed -5 is an error" "'train.seed' = -5 must be >= 0" "${tiny[@]}" --seed -5
expect "--steps beyond int64 is an error" "'train.steps' = 99999999999999999999 is out of range" \
  "${tiny[@]}" --steps 99999999999999999999
outcome "--steps 0 says there is nothing to train and prints no loss" ok "nothing to train" \
  "loss: first" "${tiny[@]}" --steps 0
outcome "resuming at or past the end says so and prints no loss" ok \
  "nothing to train: train.steps is 4 and the run resumed at step 4" "loss: first" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 4 --resume "$tmp/saves"

# D4. number_checkpoints below the regions the policy marks.
expect "number_checkpoints below the region count is an error" \
  "number_checkpoints is 1 but the policy marks 2 regions" \
  "${tiny[@]}" --steps 1 --set activation_checkpointing.variant=full \
  --set activation_checkpointing.number_checkpoints=1

# --- E. Errors that say what is wrong -----------------------------------------

# Settings that shape the saved state are named when they differ; the ZeRO
# stage is not one of them (the embedded default config uses stage 3).
ok "resuming under another ZeRO stage re-slices the save" "loss: first" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/saves" --set zero_optimization.stage=0
expect "resuming with another optimizer names it" "was made with optimizer.type = AdamW but this run has Adam" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/saves" --set optimizer.type=Adam
# A dangling latest names its target and the newest complete step.
cp -r "$tmp/saves" "$tmp/dangling" && rm -rf "$tmp/dangling/step_00000004"
expect "a dangling latest names its target and the newest complete save" \
  "names 'step_00000004', which does not exist. The newest complete save is '$tmp/dangling/step_00000002'" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/dangling"
# A hand-edited manifest.
cp -r "$tmp/saves" "$tmp/edited" &&
  sed -i 's/"world_size": 2/"world_size": "two"/' "$tmp/edited/step_00000004/manifest.json"
expect "a hand-edited manifest names the field" "'world_size' must be an integer" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/edited"
expect "a directory as --config is named" "is a directory; give --config a JSON file" \
  "$train" --config "$tmp"
expect "a directory as data.path is named" "is a directory; point it at a text file" \
  "${tiny[@]}" --set data.path="$tmp"
expect "a device as data.path stops at the size limit" "holds more than 268435456 bytes" \
  "${tiny[@]}" --set data.path=/dev/zero
expect "1e999 through --set names the key" "'optimizer.params.lr' holds a number beyond what a double holds" \
  "${tiny[@]}" --set optimizer.params.lr=1e999
outcome "a bad REMAT_FAULT_SAVE_PAUSE_MS is refused at start" error \
  "REMAT_FAULT_SAVE_PAUSE_MS='soon' is not a whole number" "^step " \
  env REMAT_FAULT_SAVE_PAUSE_MS=soon "${tiny[@]}" --steps 3 --save-dir "$tmp/knob"

# --- B. No hangs -------------------------------------------------------------

# B3. A step that cannot fit in memory is refused before anything is built.
expect "a micro-batch beyond the machine's memory is refused with the estimate" \
  "is available to each rank on this host: lower train_micro_batch_size_per_gpu" \
  "${tiny[@]}" --set train_micro_batch_size_per_gpu=2000000000

# B1. A stalled rank (SIGSTOP) at several points of a ZeRO-3 step ends the job
#     within 1.2 x the collective timeout, the error printed at once.
timeout_s=10
for delay in 2 3.5 5; do
  REMAT_COMM_TIMEOUT_S=$timeout_s "$run" -np 2 -- "$train" "${small[@]}" --steps 100000 \
    --set zero_optimization.stage=3 --set activation_checkpointing.variant=full \
    --set model.n_layer=4 >"$tmp/stall.log" 2>&1 &
  job=$!
  sleep "$delay"
  victim=$(pgrep -f -n -- "--steps 100000 --set zero_optimization.stage=3")
  kill -STOP "$victim" 2>/dev/null
  stopped=$(date +%s.%N)
  for _ in $(seq 1 $((timeout_s * 30))); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
  ended=$(date +%s.%N)
  kill -CONT "$victim" 2>/dev/null
  if kill -0 "$job" 2>/dev/null; then
    kill -9 "$job" 2>/dev/null
    pkill -9 -f -- "--steps 100000 --set zero_optimization.stage=3"
  fi
  wait "$job" 2>/dev/null; rc=$?
  took=$(awk -v a="$stopped" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')
  if [[ $rc -ne 0 ]] && awk -v t="$took" -v l="$timeout_s" 'BEGIN { exit !(t <= 1.2 * l) }' &&
     grep -q "did not complete within $timeout_s s" "$tmp/stall.log"; then
    pass "a rank stopped ${delay} s into a ZeRO-3 run ends the job in ${took} s (timeout ${timeout_s} s)"
  else
    fail "a rank stopped ${delay} s into a ZeRO-3 run ends the job within 1.2 x ${timeout_s} s (took ${took} s, exit $rc)" \
      "$(tail -5 "$tmp/stall.log")"
  fi
done

summary
