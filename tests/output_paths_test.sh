#!/usr/bin/env bash
# remat-train's outputs and save folder against paths a user should not lose
# anything to: every output path follows one rule at start (a regular file or
# a new one; never a device, fifo, symbolic link or directory, never two
# outputs on one file), the ranks agree on the paths as written, empty paths
# are refused, --overwrite-saves removes the old saves only once the new run
# has one, an auxiliary output that cannot be written never costs the
# training, and messages cut very long paths and name what works.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$(realpath "$1")"
run="$(realpath "$2")"
estimate="$(realpath "$3")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0)
tiny=("$train" "${small[@]}")
run_id() { sed -nE 's/.*"run_id": "([^"]*)".*/\1/p' "$1/manifest.json"; }

# 1. Nodes, fifos and links at an output path are refused before training and
#    left as they were (the trace used to be renamed over them).
mkfifo "$tmp/fifo"
ln -s "$tmp/fifo" "$tmp/to_fifo"
expect "--memory-trace on a fifo is refused" "--memory-trace '$tmp/fifo' is a fifo, not a regular file" \
  "${tiny[@]}" --steps 2 --memory-trace "$tmp/fifo"
expect "--memory-trace on a symbolic link is refused" \
  "--memory-trace '$tmp/to_fifo' is a symbolic link, not a regular file" \
  "${tiny[@]}" --steps 2 --memory-trace "$tmp/to_fifo"
if mknod "$tmp/null" c 1 3 2>/dev/null; then
  expect "--memory-trace on a device node is refused" "--memory-trace '$tmp/null' is a character device" \
    "${tiny[@]}" --steps 2 --memory-trace "$tmp/null"
  [[ -c "$tmp/null" ]] && pass "the device node is left as it was" || fail "the device node is left as it was"
else
  skip "--memory-trace on a device node" "mknod is not permitted here"
fi
if [[ -p "$tmp/fifo" && -L "$tmp/to_fifo" ]]; then pass "the fifo and the link are left as they were"
else fail "the fifo and the link are left as they were" "$(ls -l "$tmp")"; fi
ln -s "$tmp/est.json" "$tmp/to_est.json"
expect "remat-estimate --json on a symbolic link is refused" \
  "--json '$tmp/to_est.json' is a symbolic link, not a regular file" "$estimate" --json "$tmp/to_est.json"

# 2. The trace's temporary file has a unique name: the user's FILE.tmp stays.
echo "the user's" >"$tmp/trace.json.tmp"
out=$("${tiny[@]}" --steps 2 --memory-trace "$tmp/trace.json" 2>&1)
if [[ $? -eq 0 && -s "$tmp/trace.json" && "$(cat "$tmp/trace.json.tmp")" == "the user's" ]] &&
   [[ -z "$(ls "$tmp" | grep -F 'trace.json.remat-tmp.')" ]]; then
  pass "--memory-trace leaves the user's FILE.tmp alone and no temporary file behind"
else
  fail "--memory-trace leaves the user's FILE.tmp alone and no temporary file behind" "$out" "$(ls "$tmp")"
fi

# 3. Two outputs on one file are refused at start, naming both flags, also
#    through `..` and a symbolic link to the folder.
mkdir -p "$tmp/out"
ln -sfn "$tmp/out" "$tmp/out_link"
expect "--metrics and --memory-trace on one file" \
  "--memory-trace '$tmp/out/x.json' and --metrics '$tmp/out/x.json' are the same file" \
  "${tiny[@]}" --steps 2 --metrics "$tmp/out/x.json" --memory-trace "$tmp/out/x.json"
expect "--metrics and --export on one file through .. and a linked folder" \
  "--export '$tmp/out_link/../out/y' and --metrics '$tmp/out_link/y' are the same file" \
  "${tiny[@]}" --steps 2 --metrics "$tmp/out_link/y" --export "$tmp/out_link/../out/y"
expect "--metrics on the plot beside --memory-trace" \
  "the plot of --memory-trace '$tmp/out/m.png' and --metrics '$tmp/out/m.png' are the same file" \
  "${tiny[@]}" --steps 2 --metrics "$tmp/out/m.png" --memory-trace "$tmp/out/m.json"
if [[ -z "$(ls -A "$tmp/out")" ]]; then pass "nothing was written for the refused runs"
else fail "nothing was written for the refused runs" "$(ls -A "$tmp/out")"; fi

# 4. The ranks compare the paths as written: a --save-dir per rank is refused.
per_rank=(bash -c 'flag=$1; shift; exec "$@" "$flag" "dir$(( ${OMPI_COMM_WORLD_RANK:-$PMIX_RANK} + 1 ))"' _)
for flag in --save-dir --resume --metrics; do
  expect "ranks with a different $flag" "$flag: 'dir1' on rank 0; 'dir2' on rank 1" \
    bash -c 'cd "$1" && shift && exec "$@"' _ "$tmp" "$run" -np 2 -- "${per_rank[@]}" "$flag" "${tiny[@]}" --steps 2
done
if [[ ! -e "$tmp/dir1" && ! -e "$tmp/dir2" ]]; then pass "no per-rank save folder was created"
else fail "no per-rank save folder was created" "$(ls "$tmp")"; fi

# 5. Empty paths are refused, not taken for "not given".
"${tiny[@]}" --steps 2 --save-dir "$tmp/kept" >/dev/null 2>&1
kept_id=$(run_id "$tmp/kept/step_00000002")
expect "--resume \"\" is refused" "--resume is empty: give it a path, or leave --resume out" \
  "${tiny[@]}" --steps 2 --save-dir "$tmp/kept" --overwrite-saves --resume ""
expect "--config \"\" is refused" "--config is empty: give it a path, or leave --config out" \
  "${tiny[@]}" --steps 2 --config ""
if [[ -n "$kept_id" && "$(run_id "$tmp/kept/step_00000002")" == "$kept_id" ]]; then
  pass "the saves of --save-dir are kept"
else fail "the saves of --save-dir are kept" "$(ls -A "$tmp/kept")"; fi

# 6. --overwrite-saves with --resume from another folder: every save of the
#    other run goes, latest names this run's.
"${tiny[@]}" --steps 3 --set train.save_interval=1 --save-dir "$tmp/other" >/dev/null 2>&1
"${tiny[@]}" --steps 1 --seed 7 --save-dir "$tmp/source" >/dev/null 2>&1
out=$("${tiny[@]}" --steps 2 --seed 7 --resume "$tmp/source" --save-dir "$tmp/other" --overwrite-saves 2>&1)
if [[ $? -eq 0 && "$(ls "$tmp/other" | tr '\n' ' ')" == "latest step_00000002 " &&
      "$(cat "$tmp/other/latest")" == step_00000002 ]]; then
  pass "--overwrite-saves with --resume from elsewhere leaves only this run's saves"
else
  fail "--overwrite-saves with --resume from elsewhere leaves only this run's saves" "$out" "$(ls -A "$tmp/other")"
fi
expect "--resume from elsewhere into a folder of another run's saves is refused" \
  "--save-dir '$tmp/kept' holds the saves of another run" \
  "${tiny[@]}" --steps 2 --seed 7 --resume "$tmp/source" --save-dir "$tmp/kept"

# 7. --overwrite-saves removes the old saves only once the new run's first
#    save is complete: a run that fails before it (here: a non-finite loss)
#    leaves them as they were.
"${tiny[@]}" --steps 3 --set train.save_interval=1 --save-dir "$tmp/old" >/dev/null 2>&1
old_id=$(run_id "$tmp/old/step_00000003")
diverge=(--set optimizer.params.lr=1e6 --set scheduler.type=none --set gradient_clipping=0)
out=$("${tiny[@]}" --steps 30 "${diverge[@]}" --set train.save_interval=0 --save-dir "$tmp/old" \
      --overwrite-saves 2>&1); rc=$?
if [[ $rc -ne 0 && $rc -lt 124 ]] && grep -q "went non-finite" <<<"$out" &&
   [[ "$(ls "$tmp/old" | tr '\n' ' ')" == "latest step_00000001 step_00000002 step_00000003 " &&
      "$(cat "$tmp/old/latest")" == step_00000003 && -n "$old_id" && "$(run_id "$tmp/old/step_00000003")" == "$old_id" ]]; then
  pass "a run with --overwrite-saves that fails before its first save leaves the old saves (exit $rc)"
else
  fail "a run with --overwrite-saves that fails before its first save leaves the old saves (exit $rc)" "$out" \
    "$(ls -A "$tmp/old")"
fi
out=$("${tiny[@]}" --steps 2 --set train.save_interval=2 --save-dir "$tmp/old" --overwrite-saves 2>&1)
if [[ $? -eq 0 && "$(ls "$tmp/old" | tr '\n' ' ')" == "latest step_00000002 " &&
      "$(run_id "$tmp/old/step_00000002")" != "$old_id" ]]; then
  pass "once its first save is complete, the old saves are gone and latest names it"
else
  fail "once its first save is complete, the old saves are gone and latest names it" "$out" "$(ls -A "$tmp/old")"
fi

# 8. A full disk under the auxiliary outputs (a private tmpfs filled up): the
#    trace and the metrics are warned about and dropped, no temporary file is
#    left, and training and its saves go on.
if [[ $(id -u) -eq 0 ]]; then ns=(unshare -m --propagation unchanged); else ns=(unshare -rm); fi
with_tmpfs=("${ns[@]}" bash -c 'mount --make-rprivate / 2>/dev/null
  mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"' _)
full_fs="$tmp/full_fs"
mkdir -p "$full_fs"
if "${with_tmpfs[@]}" 8k "$full_fs" true 2>/dev/null; then
  out=$("${with_tmpfs[@]}" 8k "$full_fs" bash -c 'fs=$1; shift
    head -c 1M /dev/zero >"$fs/fill" 2>/dev/null
    "$@"; rc=$?
    echo "left on the disk: $(ls -A "$fs" | tr "\n" " ")"
    exit $rc' _ "$full_fs" "${tiny[@]}" --steps 3 --memory-trace "$full_fs/t.json" --metrics "$full_fs/m.jsonl" \
      --save-dir "$tmp/full_saves" 2>&1); rc=$?
  if [[ $rc -eq 0 ]] && grep -qF "the memory timeline of step 2 is not written, and training goes on" <<<"$out" &&
     grep -qF "writing the --metrics file '$full_fs/m.jsonl' failed at step 1" <<<"$out" &&
     grep -qF "no memory timeline of step 2 was written" <<<"$out" &&
     grep -qx "left on the disk: fill m.jsonl " <<<"$out" && [[ "$(cat "$tmp/full_saves/latest")" == step_00000003 ]]; then
    pass "a trace and metrics on a full disk are dropped with a warning; training and its save go on"
  else
    fail "a trace and metrics on a full disk are dropped with a warning; training and its save go on" "$out"
  fi
  # A save whose disk fills up (filled while step 2's rank file waits for its
  # rename) names the newest complete save.
  out=$("${with_tmpfs[@]}" 8m "$full_fs" bash -c 'fs=$1; shift
    REMAT_FAULT_SAVE_PAUSE_MS=500 "$@" & job=$!
    for _ in $(seq 1 600); do [[ -e $fs/saves/.staging_step_00000002/rank_0.pt.tmp ]] && break; sleep 0.05; done
    head -c 16M /dev/zero >"$fs/fill" 2>/dev/null
    wait $job; rc=$?
    echo "left in the save folder: $(ls -A "$fs/saves" | tr "\n" " ")"
    exit $rc' _ "$full_fs" "${tiny[@]}" --steps 3 --set train.save_interval=1 --save-dir "$full_fs/saves" 2>&1); rc=$?
  expect_text="The newest complete save is step 1 in '$full_fs/saves' (its 'latest'): free space there, then run again"
  if [[ $rc -ne 0 && $rc -lt 124 ]] && grep -qF "$expect_text" <<<"$out" &&
     grep -qx "left in the save folder: .lock latest step_00000001 " <<<"$out"; then
    pass "a save on a full disk names the newest complete save and leaves no partial file (exit $rc)"
  else
    fail "a save on a full disk names the newest complete save and leaves no partial file (exit $rc)" "$out"
  fi
else
  skip "outputs on a full disk" "no tmpfs can be mounted here (${ns[*]})"
fi

# 9. Messages: the plot command works outside a source checkout (the script
#    is written beside the trace), and a path of 100,000 characters is cut.
out=$("${tiny[@]}" --steps 2 --memory-trace "$tmp/plotted.json" 2>&1)
if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null || python3 -c 'import matplotlib' 2>/dev/null; then
  skip "the command that draws the memory plot" "python3 has matplotlib here: the plot is drawn"
elif grep -qF "then run python3 '$tmp/plotted.plot.py' '$tmp/plotted.json' '$tmp/plotted.png'" <<<"$out" &&
     diff -q <(grep -v '^$' "$tmp/plotted.plot.py") <(grep -v '^$' "$(dirname "$0")/../tools/plot_memory_trace.py") \
       >/dev/null && ! grep -q "tools/plot" <<<"$out"; then
  pass "the command that draws the memory plot names the script written beside the trace"
else
  fail "the command that draws the memory plot names the script written beside the trace" "$out"
fi
long="$tmp/$(printf 'd%.0s' $(seq 1 100000))/m.json"
out=$("${tiny[@]}" --steps 2 --memory-trace "$long" 2>&1); rc=$?
if [[ $rc -ne 0 && $rc -lt 124 ]] && grep -qF "characters long, more than a path may have here" <<<"$out" &&
   (( ${#out} < 2000 )) && grep -qF "dddd/m.json'" <<<"$out"; then
  pass "a path of 100,000 characters is refused with its ends shown (${#out} characters of output)"
else
  fail "a path of 100,000 characters is refused with its ends shown" "${out:0:3000}"
fi

summary
