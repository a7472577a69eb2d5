#!/usr/bin/env bash
# remat-train against what goes wrong in real runs: unusable save folders,
# two jobs on one folder, another run's saves, exports that cannot be written,
# unwritable metrics, non-finite losses, damaged, missing, edited or mixed-up
# saves, settings changed between save and resume, bad flags and environment,
# and a stalled rank. Each case must end as stated (a clear error
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
  last_out=$out
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

# A4. Exports on a small disk: a tmpfs of a given size, private to one command
#     (a mount namespace): "${with_tmpfs[@]}" SIZE DIR COMMAND...
# Root needs no user namespace, which a chroot (the Debian 13 leg) refuses; nor
# can unshare make a chroot's root private, so the command does (where / is a
# mount point) before mounting, and the tmpfs never shows outside.
if [[ $(id -u) -eq 0 ]]; then ns=(unshare -m --propagation unchanged); else ns=(unshare -rm); fi
with_tmpfs=("${ns[@]}" bash -c 'mount --make-rprivate / 2>/dev/null
  mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"' _)
small_fs="$tmp/small_fs"
mkdir -p "$small_fs"
if "${with_tmpfs[@]}" 64k "$small_fs" true 2>/dev/null; then
  # An export that cannot fit (about 100 KiB on 64 KiB) stops the run at start.
  outcome "an --export without room on its disk is refused before training" error \
    "--export '$small_fs/model.pt' needs about" "^step " \
    "${with_tmpfs[@]}" 64k "$small_fs" "${tiny[@]}" --steps 20 --export "$small_fs/model.pt"
  # An export whose disk fills up during training (filled while the final
  # save pauses) fails after that save: a plain error naming the save that
  # holds the trained state, and no temporary file left.
  rm -rf "$tmp/full_disk"
  out=$("${with_tmpfs[@]}" 1m "$small_fs" bash -c '
    fs=$1 save=$2; shift 2
    REMAT_FAULT_SAVE_PAUSE_MS=1000 "$@" & job=$!
    for _ in $(seq 1 400); do [[ -e $save/.staging_step_00000003/rank_0.pt.tmp ]] && break; sleep 0.05; done
    head -c 2M /dev/zero >"$fs/fill" 2>/dev/null
    wait $job; rc=$?
    echo "left on the disk: $(ls -A "$fs" | tr "\n" " ")"
    exit $rc' _ "$small_fs" "$tmp/full_disk" "${tiny[@]}" --steps 3 --save-dir "$tmp/full_disk" \
    --export "$small_fs/model.pt" 2>&1); rc=$?
  if [[ $rc -ne 0 && $rc -lt 124 ]] && grep -qF "remat error: --export '$small_fs/model.pt': writing" <<<"$out" &&
     grep -qF "The trained state of step 3 is in the save in '$tmp/full_disk'" <<<"$out" &&
     grep -qx "left on the disk: fill " <<<"$out" && [[ "$(cat "$tmp/full_disk/latest")" == step_00000003 ]]; then
    pass "an export that fails after training removes its temporary file and names the save (exit $rc)"
  else
    fail "an export that fails after training removes its temporary file and names the save (exit $rc)" "$out"
  fi
else
  skip "exports on a full disk" "no tmpfs can be mounted here (${ns[*]})"
fi

# A5. A --save-dir whose latest is not a file is refused before training
#     (another run's saves: A6, below).
mkdir -p "$tmp/latest_dir/latest"
outcome "a --save-dir whose latest is a directory is refused before training" error \
  "latest' is a directory, where remat keeps the name of the latest save" "^step " \
  "${tiny[@]}" --steps 2 --save-dir "$tmp/latest_dir"

# A3. Metrics paths are checked at start: a device (/dev/full) or a file in a
#     folder that takes no file is refused before training (a write that fails
#     later is a warning: tests/output_paths_test.sh).
expect "--metrics on a device is refused before training" \
  "--metrics '/dev/full' is a character device, not a regular file" \
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
expect_all "a flipped bit in a rank file is an error naming it and the newest intact save" \
  "step_00000004/rank_1.pt' is damaged" "The newest intact save is '$tmp/flipped/step_00000002'" -- \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/flipped"
cp -r "$tmp/saves" "$tmp/missing" && rm "$tmp/missing/step_00000004/rank_1.pt"
expect_all "a missing rank file is named with its step and the newest intact save" \
  "step_00000004/rank_1.pt' is missing: the manifest of the step 4 save" \
  "The newest intact save is '$tmp/missing/step_00000002'" -- \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/missing"

# D5. A manifest edited by hand (two parameters of the same size renamed into
#     each other: every field still well-formed) is refused naming it, and so
#     is the same edit with the manifest's checksum recomputed (each rank file
#     repeats its own layout).
cp -r "$tmp/saves" "$tmp/renamed"
sed -i 's/blocks\.0\.ln1\.weight/SWAP/; s/blocks\.0\.ln2\.weight/blocks.0.ln1.weight/; s/SWAP/blocks.0.ln2.weight/' \
  "$tmp/renamed/step_00000004/manifest.json"
expect_all "a manifest with two parameter names swapped is refused naming it" \
  "step_00000004/manifest.json' was modified or damaged after it was saved" \
  "The newest intact save is '$tmp/renamed/step_00000002'" -- \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/renamed"
reseal "$tmp/renamed/step_00000004/manifest.json"
expect "the same edit with its checksum recomputed is refused by the rank file's own layout" \
  "manifest.json' was modified or damaged after it was saved" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/renamed"

# B2. Files mixed from two steps (with the manifest edited to match their
#     checksums, its own recomputed) or swapped between ranks are refused
#     before the first step.
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
  reseal "$1/step_00000004/manifest.json"
}
cp -r "$tmp/saves" "$tmp/mixed" && mix "$tmp/mixed" step_00000002 1 1
expect "a rank file from another step is refused" "the folder mixes files of different saves" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/mixed"
cp -r "$tmp/saves" "$tmp/swapped" && cp -r "$tmp/saves/step_00000004" "$tmp/swapped/orig" &&
  mix "$tmp/swapped" orig 1 0 && mix "$tmp/swapped" orig 0 1
# (whichever rank reads its file first reports: rank 0 finds rank 1's file, or the other way round)
expect "rank files swapped between ranks are refused as swapped" "the rank files of this save were renamed or swapped" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/swapped"
ok "the untouched save resumes" "loss: first" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 6 --resume "$tmp/saves"

# A6. A --save-dir holding another run's saves (steps 2 and 4) is refused
#     before training unless the run resumes them or says --overwrite-saves;
#     `latest` never moves back to an earlier step.
cp -r "$tmp/saves" "$tmp/taken"
outcome "a new run in a --save-dir holding another run's saves is refused before training" error \
  "--save-dir '$tmp/taken' holds the saves of another run (2 step folder(s), latest step 4)" "^step " \
  "${tiny[@]}" --steps 2 --save-dir "$tmp/taken"
cp -r "$tmp/saves" "$tmp/branch"
ok "a run resumed from step 2 into its --save-dir says that latest stays on step 4" \
  "'latest' stays on step 4 until this run passes it" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 3 --set train.save_interval=1 \
  --resume "$tmp/branch/step_00000002" --save-dir "$tmp/branch"
if [[ "$(cat "$tmp/branch/latest")" == step_00000004 && -f "$tmp/branch/step_00000003/manifest.json" ]]; then
  pass "latest does not move back: step 3 saved, latest still names step 4"
else
  fail "latest does not move back: step 3 saved, latest still names step 4" "$(ls "$tmp/branch")" \
    "latest: $(cat "$tmp/branch/latest")"
fi
ok "--overwrite-saves lets a new run take a folder of another run's saves" "loss: first" \
  "${tiny[@]}" --steps 2 --save-dir "$tmp/taken" --overwrite-saves
if [[ "$(cat "$tmp/taken/latest")" == step_00000002 && ! -e "$tmp/taken/step_00000004" ]] &&
   grep -q '"world_size": 1' "$tmp/taken/step_00000002/manifest.json"; then
  pass "--overwrite-saves removed the other run's saves: latest names this run's step 2"
else
  fail "--overwrite-saves removed the other run's saves: latest names this run's step 2" "$(ls "$tmp/taken")"
fi

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
expect "resuming with another seed names it and what to do" \
  "was made with train.seed = 1234 but this run has 7: a resumed run keeps the settings its saved state depends on; resume with --set train.seed=1234" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/saves" --seed 7
# A dangling latest names its target and the newest complete step.
cp -r "$tmp/saves" "$tmp/dangling" && rm -rf "$tmp/dangling/step_00000004"
expect "a dangling latest names its target and the newest intact save" \
  "names 'step_00000004', which does not exist. The newest intact save is '$tmp/dangling/step_00000002'" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/dangling"
# A hand-edited manifest (its checksum recomputed: each field is checked too).
cp -r "$tmp/saves" "$tmp/edited" &&
  sed -i 's/"world_size": 2/"world_size": "two"/' "$tmp/edited/step_00000004/manifest.json" &&
  reseal "$tmp/edited/step_00000004/manifest.json"
expect "a hand-edited manifest names the field" "'world_size' must be an integer" \
  "$run" -np 2 -- "$train" "${small[@]}" --steps 8 --resume "$tmp/edited"
expect "a directory as --config is named" "is a directory; give --config a JSON file" \
  "$train" --config "$tmp"
expect "a directory as data.path is named" "is a directory; point it at a text file" \
  "${tiny[@]}" --set data.path="$tmp"
expect "a device as data.path stops at the size limit" "holds more than 268435456 bytes" \
  "${tiny[@]}" --set data.path=/dev/zero
# lr 1e38: AdamW's first update scalar (lr / (1 - beta1)) leaves float; it
# ended as LibTorch's "unexpected error" naming no setting.
expect "a learning rate beyond float's range in the update names the key" \
  "overflows the parameters' arithmetic (value cannot be converted to type float without overflow): lower optimizer.params.lr" \
  "${tiny[@]}" --steps 2 --set optimizer.params.lr=1e38 --set scheduler.type=none
expect "1e999 through --set names the key" "'optimizer.params.lr' holds a number beyond what a double holds" \
  "${tiny[@]}" --set optimizer.params.lr=1e999
outcome "a bad REMAT_FAULT_SAVE_PAUSE_MS is refused at start" error \
  "REMAT_FAULT_SAVE_PAUSE_MS='soon' is not a whole number" "^step " \
  env REMAT_FAULT_SAVE_PAUSE_MS=soon "${tiny[@]}" --steps 3 --save-dir "$tmp/knob"
# The fault-injection pause is bounded: 1e12 ms stalled the first save for good.
outcome "a REMAT_FAULT_SAVE_PAUSE_MS beyond a minute is refused at start" error \
  "REMAT_FAULT_SAVE_PAUSE_MS='1000000000000' is not a whole number of milliseconds from 0 to 60000 (1 minute)" "^step " \
  env REMAT_FAULT_SAVE_PAUSE_MS=1000000000000 "${tiny[@]}" --steps 3 --save-dir "$tmp/knob"
# OMP_NUM_THREADS=100000 ended in a segmentation fault (exit 139) at the first
# layer norm, LibTorch starting that many OpenMP threads: the cores bound it.
cores=$(getconf _NPROCESSORS_ONLN)
ok "OMP_NUM_THREADS beyond the cores is lowered to them, with a warning" \
  "OMP_NUM_THREADS=100000 asks for more intra-op threads than this machine's $cores cores: using $cores" \
  env OMP_NUM_THREADS=100000 "${tiny[@]}" --steps 1
outcome "an OMP_NUM_THREADS of 0 is refused at start" error \
  "OMP_NUM_THREADS='0' is not a whole number of threads >= 1" "^step " env OMP_NUM_THREADS=0 "${tiny[@]}" --steps 1

# The library float32 products reach is said once at start, its threads the
# rank's share of the cores; the reference BLAS put first (Debian's netlib,
# what LibTorch reached before OpenBLAS was installed) is warned of.
share=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
share=$((share / 2 < 1 ? 1 : share / 2))  # what remat-run gives each of 2 ranks
ok "the BLAS of float32 products is named with each rank's threads" \
  "CPU float32 matrix products run on OpenBLAS 0." env REMAT_LOG_LEVEL=info "$run" -np 2 -- "$train" "${small[@]}" --steps 1
if grep -qF "; $share thread$([[ $share -gt 1 ]] && echo s)) from" <<<"$last_out"; then
  pass "OpenBLAS runs the rank's share of the cores ($share thread(s))"
else
  fail "OpenBLAS runs the rank's share of the cores ($share thread(s))" "$last_out"
fi
ok "the reference BLAS put first is warned of" "CPU float32 matrix products run on the reference BLAS from" \
  env LD_LIBRARY_PATH="/usr/lib/$(uname -m)-linux-gnu/blas" "${tiny[@]}" --steps 1

# --- B. No hangs -------------------------------------------------------------

# B3. A step that cannot fit in memory is refused before anything is built.
expect "a micro-batch beyond the machine's memory is refused with the estimate" \
  "is available to each rank on this host: no ZeRO stage or checkpointing policy fits; lower train_micro_batch_size_per_gpu" \
  "${tiny[@]}" --set train_micro_batch_size_per_gpu=2000000000

# B1. A stalled rank (SIGSTOP) at several points of a ZeRO-3 step ends the job
#     soon after the collective timeout, the error printed at once.
#     The delays count from the first step, and the rank stopped is a child of
#     the job's mpirun: counted from the launch and picked as the newest
#     process with the job's command line, the stop on a loaded machine (mpirun
#     slow to start its ranks) hit mpirun itself, the ranks trained on, and
#     the case ran into its own 30 s limit ("34.3 s, exit 137"). A rank stopped
#     while the job starts (in or before MPI_Init, which has no timeout of its
#     own) ends it at the timeout too: MpiSession bounds MPI_Init.
#     The bound is the timeout plus 5 s for the abort and mpirun's teardown of
#     the stopped rank: 0.1 s on an idle machine, up to 2.8 s measured at a
#     load average of 11 on 2 cores (over 1.2 x the timeout there), so a
#     loaded CI machine meets it and a hang does not.
timeout_s=10
for delay in 2 3.5 5; do
  rm -rf "$tmp/stall_saves"
  REMAT_COMM_TIMEOUT_S=$timeout_s "$run" -np 2 -- "$train" "${small[@]}" --steps 100000 \
    --set zero_optimization.stage=3 --set activation_checkpointing.variant=full \
    --set model.n_layer=4 --set train.save_interval=1 --save-dir "$tmp/stall_saves" >"$tmp/stall.log" 2>&1 &
  job=$!  # remat-run, then the mpirun it becomes; the ranks are its children
  for _ in $(seq 1 600); do grep -q '^step 1/' "$tmp/stall.log" && break; sleep 0.1; done
  sleep "$delay"
  victim=$(pgrep -P "$job" | tail -1)
  kill -STOP "$victim" 2>/dev/null
  stopped=$(date +%s.%N)
  for _ in $(seq 1 $((timeout_s * 30))); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
  ended=$(date +%s.%N)
  kill -CONT "$victim" 2>/dev/null
  if kill -0 "$job" 2>/dev/null; then
    kill -9 $(pgrep -P "$job") "$job" 2>/dev/null
  fi
  wait "$job" 2>/dev/null; rc=$?
  took=$(awk -v a="$stopped" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')
  if [[ $rc -ne 0 && -n "$victim" ]] && awk -v t="$took" -v l="$timeout_s" 'BEGIN { exit !(t <= l + 5) }' &&
     grep -q "did not complete within $timeout_s s" "$tmp/stall.log" &&
     grep -qE "The newest complete save is step [0-9]+ in '$tmp/stall_saves' \(its 'latest'\): run again with the same settings and --resume" "$tmp/stall.log"; then
    pass "a rank stopped ${delay} s into a ZeRO-3 run ends the job in ${took} s (timeout ${timeout_s} s), naming the save to resume"
  else
    fail "a rank stopped ${delay} s into a ZeRO-3 run ends the job within ${timeout_s} + 5 s (took ${took} s, exit $rc, rank ${victim:-not found})" \
      "$(tail -5 "$tmp/stall.log")"
  fi
done

summary
