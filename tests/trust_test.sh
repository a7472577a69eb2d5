#!/usr/bin/env bash
# remat-train and remat-run against a hostile user's fifth round: a save
# killed at each of its write steps while it replaces another run's save of
# the same step, --overwrite-saves killed while it removes saves, outputs
# named on the run's own inputs or inside its save folder, inputs lying where
# the save folder or a sharded export writes, a key set twice on the command
# line, one --save-dir spelling that names a different folder per rank,
# stale temporary files, a frozen rank, NaN weights at the sample, and the
# messages of bad flags. Each case ends as stated: nothing lost, a clear
# error and a nonzero exit, never a hang.
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

# 1. A run that replaces another run's saves (--overwrite-saves), killed at
#    each write step of its first save, which has the step of the old run's
#    save: the folder always holds a save that resumes (the old run's or the
#    new one's, never a mix), and the next run removes what the killed one
#    left. The fault seam pauses before each file or folder is put in place
#    and says so; the k-th pause is where the kill lands.
rm -rf "$tmp/first"
"$run" -np 2 -- "${tiny[@]}" --steps 5 --set train.save_interval=5 --save-dir "$tmp/first" >"$tmp/first.log" 2>&1 ||
  fail "the first run saves step 5" "$(tail -5 "$tmp/first.log")"
old_id=$(run_id "$tmp/first/step_00000005")
# The pauses of a save at 2 ranks: each rank file, the manifest, the step
# folder, then `latest`.
for k in 1 2 3 4 5; do
  dir="$tmp/kill_$k"
  rm -rf "$dir" && cp -a "$tmp/first" "$dir"
  REMAT_FAULT_SAVE_PAUSE_MS=3000 "$run" -np 2 -- "${tiny[@]}" --steps 10 --set train.save_interval=5 \
    --save-dir "$dir" --overwrite-saves >"$tmp/kill_$k.log" 2>&1 &
  job=$!
  for _ in $(seq 1 900); do
    [[ $(grep -c 'remat fault seam: pausing' "$tmp/kill_$k.log" 2>/dev/null) -ge $k ]] && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  where=$(grep 'remat fault seam: pausing' "$tmp/kill_$k.log" | sed -n "${k}p" | sed -E "s/.*before '([^']*)'.*/\1/")
  pkill -KILL -f "remat-train.*--save-dir $dir" 2>/dev/null
  wait "$job" 2>/dev/null
  sleep 0.5  # the ranks' own exit after mpirun's
  resumed=$("$run" -np 2 -- "${tiny[@]}" --steps 6 --resume "$dir" --save-dir "$dir" 2>&1); rc=$?
  id=$(run_id "$dir/step_00000005")
  left=$(ls -A "$dir" | grep -E '^\.(staging|replaced)_|\.tmp' | tr '\n' ' ')
  if [[ -z "$where" ]]; then
    fail "a save killed at write step $k: the step was reached" "$(tail -5 "$tmp/kill_$k.log")"
  elif [[ $rc -eq 0 && -n "$id" && -z "$left" ]]; then
    whose=$([[ "$id" == "$old_id" ]] && echo "the old run's" || echo "the new run's")
    pass "a save killed before '${where#$dir/}' is put in place leaves $whose step 5, which resumes; nothing left over"
  else
    fail "a save killed before '${where#$dir/}' is put in place leaves a save that resumes (exit $rc, left: $left)" \
      "$resumed" "$(ls -A "$dir")"
  fi
done

# 1b. A first save killed before `latest` is written: the step folder is
#     complete, and the refusal of a new run there names it as what to resume.
dir="$tmp/no_latest"
rm -rf "$dir"
REMAT_FAULT_SAVE_PAUSE_MS=3000 "$run" -np 2 -- "${tiny[@]}" --steps 3 --save-dir "$dir" >"$tmp/no_latest.log" 2>&1 &
job=$!
for _ in $(seq 1 900); do
  grep -q "before '$dir/latest'" "$tmp/no_latest.log" 2>/dev/null && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
pkill -KILL -f "remat-train.*--save-dir $dir" 2>/dev/null
wait "$job" 2>/dev/null
sleep 0.5
expect "a new run in a folder whose first save lost its 'latest' names the step folder to resume" \
  "Resume that run with --resume $dir/step_00000003" "${tiny[@]}" --steps 3 --save-dir "$dir"
ok_resume=$("${tiny[@]}" --steps 4 --resume "$dir/step_00000003" --save-dir "$dir" 2>&1) &&
  pass "--resume of the step folder it names continues the run" ||
  fail "--resume of the step folder it names continues the run" "$ok_resume"

# 1c. --overwrite-saves killed while it replaces later saves: `latest` is
#     rewritten before any folder goes, so it always names a save that is there.
rm -rf "$tmp/later" && "${tiny[@]}" --steps 4 --set train.save_interval=2 --save-dir "$tmp/later" >/dev/null 2>&1
REMAT_FAULT_SAVE_PAUSE_MS=3000 "${tiny[@]}" --steps 3 --save-dir "$tmp/later" --overwrite-saves \
  >"$tmp/later.log" 2>&1 &
job=$!
for _ in $(seq 1 900); do  # step 3's save leaves `latest` on step 4: the pause before it is --overwrite-saves'
  grep -q "before '$tmp/later/latest'" "$tmp/later.log" 2>/dev/null && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
kill -9 "$job" 2>/dev/null
wait "$job" 2>/dev/null
out=$("${tiny[@]}" --steps 5 --resume "$tmp/later" --save-dir "$tmp/later" 2>&1); rc=$?
if [[ $rc -eq 0 ]]; then
  pass "--overwrite-saves killed while replacing later saves leaves a 'latest' that resumes"
else
  fail "--overwrite-saves killed while replacing later saves leaves a 'latest' that resumes (exit $rc)" "$out" \
    "$(cat "$tmp/later.log")"
fi

# 1d. --overwrite-saves killed while it removes the later saves: each goes
#     out of sight in one rename before its files are removed, so a kill never
#     leaves a step folder missing some of its files, and the next run removes
#     the hidden rest (a folder half removed stands in for a kill inside one).
rm -rf "$tmp/gone" && "${tiny[@]}" --steps 4 --set train.save_interval=1 --save-dir "$tmp/gone" >/dev/null 2>&1
REMAT_FAULT_SAVE_PAUSE_MS=3000 "${tiny[@]}" --steps 1 --save-dir "$tmp/gone" --overwrite-saves >"$tmp/gone.log" 2>&1 &
job=$!
for _ in $(seq 1 900); do
  grep -q "before '$tmp/gone/.removed_step_00000003'" "$tmp/gone.log" 2>/dev/null && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
kill -9 "$job" 2>/dev/null
wait "$job" 2>/dev/null
mkdir -p "$tmp/gone/.removed_step_00000009" && echo half >"$tmp/gone/.removed_step_00000009/rank_1.pt"
whole=$(for d in "$tmp/gone"/step_*; do [[ -f $d/manifest.json && -f $d/rank_0.pt ]] || echo "${d##*/}"; done)
out=$("${tiny[@]}" --steps 2 --resume "$tmp/gone" --save-dir "$tmp/gone" 2>&1); rc=$?
left=$(ls -A "$tmp/gone" | grep -E '^\.(removed|staging|replaced)_' | tr '\n' ' ')
if grep -q "before '$tmp/gone/.removed_step_00000003'" "$tmp/gone.log" && [[ -z "$whole" && $rc -eq 0 && -z "$left" &&
   ! -e "$tmp/gone/step_00000004" && -e "$tmp/gone/step_00000003" ]]; then
  pass "--overwrite-saves killed between two removals leaves whole step folders; the next run removes the hidden rest"
else
  fail "--overwrite-saves killed between two removals leaves whole step folders; the next run removes the hidden rest" \
    "(partial: $whole; left: $left; exit $rc)" "$out" "$(ls -A "$tmp/gone")" "$(tail -3 "$tmp/gone.log")"
fi

# 2. Outputs on the run's inputs or inside its save folder are refused at
#    start, and the inputs are left as they were.
mkdir -p "$tmp/io"
echo '{"model": {"n_layer": 2}}' >"$tmp/io/cfg.json"
cp "$tmp/io/cfg.json" "$tmp/io/cfg.orig"
head -c 20000 /dev/urandom | base64 >"$tmp/io/corpus.txt"
cp "$tmp/io/corpus.txt" "$tmp/io/corpus.orig"
expect "--metrics on the --config file is refused" \
  "--metrics '$tmp/io/cfg.json' is the --config file '$tmp/io/cfg.json' this run reads" \
  "${tiny[@]}" --steps 1 --config "$tmp/io/cfg.json" --metrics "$tmp/io/cfg.json"
expect "--export on data.path is refused" "--export '$tmp/io/corpus.txt' is the data.path file" \
  "${tiny[@]}" --steps 1 --set data.path="$tmp/io/corpus.txt" --export "$tmp/io/corpus.txt"
rm -rf "$tmp/sv"
"${tiny[@]}" --steps 2 --save-dir "$tmp/sv" >/dev/null 2>&1
expect "--memory-trace on the save folder's lock is refused" \
  "--memory-trace '$tmp/sv/.lock' lies inside --save-dir '$tmp/sv', which holds this run's saves and their lock" \
  "${tiny[@]}" --steps 4 --resume "$tmp/sv" --save-dir "$tmp/sv" --memory-trace "$tmp/sv/.lock"
expect "--metrics on the save folder's latest is refused" "--metrics '$tmp/sv/latest' lies inside --save-dir" \
  "${tiny[@]}" --steps 4 --resume "$tmp/sv" --save-dir "$tmp/sv" --metrics "$tmp/sv/latest"
expect "--export on a rank file of the save resumed is refused" \
  "--export '$tmp/sv/step_00000002/rank_0.pt' lies inside --resume '$tmp/sv', the save this run reads" \
  "${tiny[@]}" --steps 4 --resume "$tmp/sv/step_00000002" --export "$tmp/sv/step_00000002/rank_0.pt"
out=$("${tiny[@]}" --steps 5 --resume "$tmp/sv" --save-dir "$tmp/sv" --export "$tmp/sv/model.pt" 2>&1) &&
  [[ -s "$tmp/sv/model.pt" && "$(cat "$tmp/sv/latest")" == step_00000005 ]] &&
  pass "an export of the user's beside the saves (--export SV/model.pt) is theirs to write" ||
  fail "an export of the user's beside the saves (--export SV/model.pt) is theirs to write" "$out"
expect "a --save-dir inside the step folder resumed is refused" \
  "--save-dir '$tmp/sv/step_00000002' lies inside --resume '$tmp/sv', the save this run reads" \
  "${tiny[@]}" --steps 4 --resume "$tmp/sv/step_00000002" --save-dir "$tmp/sv/step_00000002"
ln -f "$tmp/sv/step_00000002/rank_0.pt" "$tmp/io/linked.pt"
expect "--metrics on a hard link to a save's rank file is refused" \
  "--metrics '$tmp/io/linked.pt' is a hard link to a file inside --save-dir '$tmp/sv'" \
  "${tiny[@]}" --steps 7 --resume "$tmp/sv" --save-dir "$tmp/sv" --metrics "$tmp/io/linked.pt"
expect "--memory-trace on a --save-dir not yet made is refused at start, not at the traced step" \
  "--memory-trace '$tmp/sv7' is --save-dir '$tmp/sv7'" \
  "${tiny[@]}" --steps 3 --save-dir "$tmp/sv7" --memory-trace "$tmp/sv7"
if cmp -s "$tmp/io/cfg.json" "$tmp/io/cfg.orig" && cmp -s "$tmp/io/corpus.txt" "$tmp/io/corpus.orig" &&
   [[ "$(cat "$tmp/sv/latest")" == step_00000005 && ! -e "$tmp/sv7" ]] && "${tiny[@]}" --steps 6 --resume "$tmp/sv" \
     --save-dir "$tmp/sv" >/dev/null 2>&1; then
  pass "the inputs and the save are as they were, and no folder was made for the refused run"
else
  fail "the inputs and the save are as they were, and no folder was made for the refused run" "$(ls -A "$tmp/sv" "$tmp")"
fi
# 2b. What the run reads lying where its output folders write: the save
#     folder's lock, `latest` and step folders (the lock is rewritten in place,
#     `latest` and step folders replaced or removed), and a sharded export's
#     folder (its index and shards replaced). Refused at start, the input kept.
rm -rf "$tmp/in_sv" && mkdir -p "$tmp/in_sv" && cp "$tmp/io/cfg.json" "$tmp/in_sv/.lock"
expect "--config on the lock file of --save-dir is refused" \
  "--config '$tmp/in_sv/.lock' lies inside --save-dir '$tmp/in_sv', where remat writes its lock" \
  "${tiny[@]}" --steps 1 --config "$tmp/in_sv/.lock" --save-dir "$tmp/in_sv"
rm -rf "$tmp/in_sv2" && mkdir -p "$tmp/in_sv2" && cp "$tmp/io/corpus.txt" "$tmp/in_sv2/latest"
expect "data.path on --save-dir's latest is refused (--overwrite-saves)" \
  "data.path '$tmp/in_sv2/latest' lies inside --save-dir '$tmp/in_sv2'" \
  "${tiny[@]}" --steps 1 --set data.path="$tmp/in_sv2/latest" --save-dir "$tmp/in_sv2" --overwrite-saves
rm -rf "$tmp/in_sv3" && cp -a "$tmp/sv" "$tmp/in_sv3" && cp "$tmp/io/cfg.json" "$tmp/in_sv3/step_00000002/my.json"
expect "--config inside a step folder --overwrite-saves removes is refused" \
  "--config '$tmp/in_sv3/step_00000002/my.json' lies inside --save-dir '$tmp/in_sv3'" \
  "${tiny[@]}" --steps 1 --config "$tmp/in_sv3/step_00000002/my.json" --save-dir "$tmp/in_sv3" --overwrite-saves
rm -rf "$tmp/in_sv4" && mkdir -p "$tmp/in_sv4" && ln -f "$tmp/io/cfg.json" "$tmp/in_sv4/.lock"
expect "--config hard-linked as --save-dir's lock is refused" \
  "--config '$tmp/io/cfg.json' is a hard link to a file inside --save-dir '$tmp/in_sv4'" \
  "${tiny[@]}" --steps 1 --config "$tmp/io/cfg.json" --save-dir "$tmp/in_sv4"
rm -f "$tmp/in_sv4/.lock"
rm -rf "$tmp/in_ex" && "${tiny[@]}" --steps 1 --export "$tmp/in_ex/" >/dev/null 2>&1
cp -a "$tmp/in_ex" "$tmp/in_ex.orig"
expect "--pretrained's index inside the sharded --export folder is refused" \
  "--pretrained '$tmp/in_ex/model.safetensors.index.json' lies inside --export '$tmp/in_ex/', the folder the sharded export fills" \
  "${tiny[@]}" --steps 1 --pretrained "$tmp/in_ex/model.safetensors.index.json" --export "$tmp/in_ex/"
rm -rf "$tmp/ex_m" && mkdir "$tmp/ex_m"
expect "--metrics inside the sharded --export folder is refused at start, not after training" \
  "--metrics '$tmp/ex_m/m.jsonl' lies inside --export '$tmp/ex_m/', the sharded export's folder" \
  "${tiny[@]}" --steps 1 --metrics "$tmp/ex_m/m.jsonl" --export "$tmp/ex_m/"
if cmp -s "$tmp/in_sv/.lock" "$tmp/io/cfg.json" && cmp -s "$tmp/in_sv2/latest" "$tmp/io/corpus.txt" &&
   cmp -s "$tmp/in_sv3/step_00000002/my.json" "$tmp/io/cfg.json" && cmp -s "$tmp/io/cfg.json" "$tmp/io/cfg.orig" &&
   diff -r "$tmp/in_ex" "$tmp/in_ex.orig" >/dev/null && [[ -e "$tmp/in_sv3/step_00000005" && -z "$(ls -A "$tmp/ex_m")" ]]; then
  pass "the inputs in the output folders are as they were"
else
  fail "the inputs in the output folders are as they were" "$(ls -AR "$tmp/in_sv" "$tmp/in_sv2" "$tmp/in_sv3" "$tmp/in_ex")"
fi
# The plot script beside the trace: the user's file of that name is refused, remat's own replaced.
echo "print('mine')" >"$tmp/io/t.plot.py"
expect "a file of the user's where the plot script goes is refused at start" \
  "'$tmp/io/t.plot.py' exists and is not remat's plotting script" \
  "${tiny[@]}" --steps 1 --memory-trace "$tmp/io/t.json"
[[ "$(cat "$tmp/io/t.plot.py")" == "print('mine')" ]] && pass "the user's t.plot.py is left as it was" ||
  fail "the user's t.plot.py is left as it was" "$(head -3 "$tmp/io/t.plot.py")"

# Where the plot cannot be drawn and its script cannot be written beside the
# trace (here a python3 that fails and leaves a folder where the script goes),
# the message reads as one sentence with the true reason and what to run.
mkdir -p "$tmp/fakebin"
printf '%s\n' '#!/bin/sh' '[ "$1" = -c ] && exit 0' 'mkdir -p "${2%.json}.plot.py"' 'echo "cannot draw here"' 'exit 1' \
  >"$tmp/fakebin/python3"
chmod +x "$tmp/fakebin/python3"
out=$(PATH="$tmp/fakebin:$PATH" "${tiny[@]}" --steps 2 --memory-trace "$tmp/io/p.json" 2>&1); rc=$?
if [[ $rc -eq 0 ]] && grep -qF "drawing its plot failed (cannot draw here); to see why, its plotting script could not be written to '$tmp/io/p.plot.py' (it is a directory now): draw the plot with tools/plot_memory_trace.py of remat's source, given the trace and the plot's path" <<<"$out"; then
  pass "a plot script that cannot be written is said in one sentence with its reason"
else
  fail "a plot script that cannot be written is said in one sentence with its reason (exit $rc)" "$out"
fi

# A sharded --export (a folder whose earlier export's files it replaces) that
# holds an input: the --pretrained index's folder, a --save-dir made inside it.
"${tiny[@]}" --steps 1 --export "$tmp/shards/" --export-max-shard-size 20000 >/dev/null 2>&1
cp -a "$tmp/shards" "$tmp/shards.orig"
expect "a folder --export holding the --pretrained index and shards is refused" \
  "--pretrained '$tmp/shards/model.safetensors.index.json' lies inside --export '$tmp/shards/', the folder the sharded export fills" \
  "${tiny[@]}" --steps 1 --pretrained "$tmp/shards/model.safetensors.index.json" --export "$tmp/shards/"
diff -r "$tmp/shards" "$tmp/shards.orig" >/dev/null && pass "the --pretrained shards are left as they were" ||
  fail "the --pretrained shards are left as they were" "$(ls "$tmp/shards")"
rm -rf "$tmp/outdir"
expect "a --save-dir inside a folder --export is refused at start" \
  "--save-dir '$tmp/outdir/sv' lies inside --export '$tmp/outdir/', the sharded export's folder" \
  "${tiny[@]}" --steps 2 --save-dir "$tmp/outdir/sv" --export "$tmp/outdir/"
[[ ! -e "$tmp/outdir/sv/step_00000002" ]] && pass "nothing was trained or saved for the refused run" ||
  fail "nothing was trained or saved for the refused run" "$(ls -R "$tmp/outdir")"
# Another output inside a folder --export: written during the run, it made
# the export refuse the folder after training, the model kept nowhere.
mkdir -p "$tmp/expdir"
expect "--metrics inside a folder --export is refused at start" \
  "--metrics '$tmp/expdir/m.jsonl' lies inside --export '$tmp/expdir/', the sharded export's folder" \
  "${tiny[@]}" --steps 2 --metrics "$tmp/expdir/m.jsonl" --export "$tmp/expdir/"
expect "--memory-trace inside a folder --export is refused at start" \
  "--memory-trace '$tmp/expdir/t.json' lies inside --export '$tmp/expdir/'" \
  "${tiny[@]}" --steps 2 --memory-trace "$tmp/expdir/t.json" --export "$tmp/expdir/"
[[ -z "$(ls -A "$tmp/expdir")" ]] && pass "nothing was written into the export's folder" ||
  fail "nothing was written into the export's folder" "$(ls -A "$tmp/expdir")"

# 3. One --save-dir spelling that is a different folder on each rank (a
#    working directory per rank, as with node-local disks) is refused at start.
mkdir -p "$tmp/node0" "$tmp/node1"
per_node=(bash -c 'cd "$1/node${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}" && shift && exec "$@"' _ "$tmp")
expect "a --save-dir that names a different folder on each rank is refused" \
  "--save-dir 'saves' is not the folder rank 0 has: rank 1 does not find rank 0's record of this run" \
  "$run" -np 2 -- "${per_node[@]}" "${tiny[@]}" --steps 2 --save-dir saves
if [[ ! -e "$tmp/node0/saves/step_00000002" && ! -e "$tmp/node1/saves/step_00000002" ]]; then
  pass "no step was saved into the split folder"
else
  fail "no step was saved into the split folder" "$(ls -R "$tmp/node0" "$tmp/node1")"
fi

# 4. An export killed before its rename leaves a temporary file, which the next
#    export of that path removes.
echo "partial" >"$tmp/io/model.pt.remat-tmp.Zz9Yx8"
out=$("${tiny[@]}" --steps 1 --export "$tmp/io/model.pt" 2>&1); rc=$?
if [[ $rc -eq 0 && ! -e "$tmp/io/model.pt.remat-tmp.Zz9Yx8" && -s "$tmp/io/model.pt" ]]; then
  pass "the next export removes the temporary file a killed one left"
else
  fail "the next export removes the temporary file a killed one left (exit $rc)" "$out" "$(ls -A "$tmp/io")"
fi

# A file of the user's named like a temporary of another kind, or the run's
# own config under such a name, is never taken for one.
cp "$tmp/io/cfg.json" "$tmp/io/out.pt.tmp.config"
echo mine >"$tmp/io/out.pt.tmp.backup"
out=$("${tiny[@]}" --config "$tmp/io/out.pt.tmp.config" --steps 1 --export "$tmp/io/out.pt" --metrics "$tmp/io/out.pt.m" 2>&1); rc=$?
if [[ $rc -eq 0 && -s "$tmp/io/out.pt.tmp.config" && -s "$tmp/io/out.pt.tmp.backup" ]]; then
  pass "files of the user's beside an output are left alone"
else
  fail "files of the user's beside an output are left alone (exit $rc)" "$out" "$(ls -A "$tmp/io")"
fi

# 5. Flags: --memory-trace-samples read as --steps is, refused without
#    --memory-trace; --device named as typed, with the closest device.
expect "--memory-trace-samples that is not a number" \
  "--memory-trace-samples 'abc' is not a number: give a whole number from 4" \
  "${tiny[@]}" --steps 1 --memory-trace "$tmp/io/s.json" --memory-trace-samples abc
expect "--memory-trace-samples without --memory-trace" \
  "--memory-trace-samples bounds the samples of --memory-trace, which is not given" \
  "${tiny[@]}" --steps 1 --memory-trace-samples 100
out=$("${tiny[@]}" --steps 1 --memory-trace "$tmp/io/s.json" --memory-trace-samples 1e3 2>&1); rc=$?
[[ $rc -eq 0 && -s "$tmp/io/s.json" ]] && pass "--memory-trace-samples 1e3 is read as 1000" ||
  fail "--memory-trace-samples 1e3 is read as 1000 (exit $rc)" "$out"
for spec in CPU:cpu gpu:cuda Cuda:cuda; do
  expect "--device ${spec%%:*} names the flag and offers ${spec#*:}" \
    "'--device' = \"${spec%%:*}\" is not a device (did you mean \"${spec#*:}\"?)" \
    "${tiny[@]}" --steps 1 --device "${spec%%:*}"
done

# 5b. One key set twice on the command line with different values: the last
#     is used and said to be (the flag --steps comes after every --set).
out=$(REMAT_LOG_LEVEL=warn "${tiny[@]}" --set train.steps=3 --steps 1 --set train.steps=2 --seed 5 --set train.seed=5 2>&1); rc=$?
if [[ $rc -eq 0 ]] && grep -qF "train.steps is given 3 times with different values (--set train.steps=3, --set train.steps=2, --steps 1): the last, --steps 1, is used" <<<"$out" &&
   ! grep -qF "train.seed is given" <<<"$out"; then
  pass "a key set twice with different values says which is used (and the same value twice says nothing)"
else
  fail "a key set twice with different values says which is used (and the same value twice says nothing) (exit $rc)" "$out"
fi

# 6. A value of megabytes is cut in the error, its ends kept: a data.path of
#    1 MB in a config file, and a 100 kB --save-dir (an argument's limit).
python3 -c 'import json; print(json.dumps({"data": {"path": "/nowhere/" + "x" * 1000000}}))' >"$tmp/io/long.json"
long="$tmp/$(head -c 100000 /dev/zero | tr '\0' 'x')"
for what in "data.path" "--save-dir"; do
  if [[ $what == data.path ]]; then out=$("${tiny[@]}" --steps 1 --config "$tmp/io/long.json" 2>&1); rc=$?
  else out=$("${tiny[@]}" --steps 1 --save-dir "$long" 2>&1); rc=$?; fi
  if [[ $rc -ne 0 && $rc -lt 124 && ${#out} -lt 4000 ]] && grep -qF "characters)..." <<<"$out"; then
    pass "a $what of megabytes is cut in the error (${#out} characters printed, exit $rc)"
  else
    fail "a $what of megabytes is cut in the error (${#out} characters printed, exit $rc)" "${out:0:600}"
  fi
done

# 7. remat-run: far more ranks than cores is refused unless asked for, a
#    repeated -np is refused, and the command printed is quoted.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
expect "remat-run refuses more than 4 ranks per core" \
  "-np 10000 starts 10000 ranks on this machine's $cores cores (more than 4 per core" \
  "$run" -np 10000 -- true
expect "remat-run refuses -np given twice" "the number of ranks is given twice ('2' and '3'): give -np once" \
  "$run" -np 2 -np 3 -- true
out=$("$run" -np 1 -- echo "two words" 2>&1)
grep -qF 'echo two\ words' <<<"$out" && pass "remat-run prints its command quoted" ||
  fail "remat-run prints its command quoted" "$out"
threads=$(( cores / 2 < 1 ? 1 : cores / 2 ))
out=$(OMP_NUM_THREADS=100000 "$run" -np 2 -- "${tiny[@]}" --steps 1 2>&1); rc=$?
if [[ $rc -eq 0 ]] && grep -qF "asks for more intra-op threads than this machine's $cores cores: using $threads, the cores shared by its 2 ranks" <<<"$out"; then
  pass "OMP_NUM_THREADS beyond the cores becomes the cores over the ranks ($threads)"
else
  fail "OMP_NUM_THREADS beyond the cores becomes the cores over the ranks ($threads, exit $rc)" "$out"
fi

# 8. --overwrite-saves after a resume from elsewhere names what it removed for what it is.
rm -rf "$tmp/ow" && cp -a "$tmp/first" "$tmp/ow"
out=$(REMAT_LOG_LEVEL=warn "${tiny[@]}" --steps 4 --resume "$tmp/sv/step_00000002" --save-dir "$tmp/ow" --overwrite-saves 2>&1)
grep -qF "removed 1 save(s) of an earlier run from '$tmp/ow'" <<<"$out" &&
  pass "--overwrite-saves after resuming elsewhere says it removed an earlier run's saves" ||
  fail "--overwrite-saves after resuming elsewhere says it removed an earlier run's saves" "$out"

# 9. A model whose weights are not finite: the sample at the end is a clear
#    error naming why, with no stack trace.
expect_all "a sample from NaN weights is a clear error" "the end-of-run sample cannot be drawn" \
  "set train.sample_chars=0 to skip the sample" -- "${tiny[@]}" --steps 2 --set train.sample_chars=20 \
  --set optimizer.params.lr=1e30 --set scheduler.type=none --set gradient_clipping=0 --set train.on_nonfinite=skip
out=$(timeout 120 "${tiny[@]}" --steps 2 --set train.sample_chars=20 --set optimizer.params.lr=1e30 \
      --set scheduler.type=none --set gradient_clipping=0 --set train.on_nonfinite=skip 2>&1)
grep -qE 'frame #|0x[0-9a-f]{8,}' <<<"$out" && fail "no stack trace with the sample's error" "$out" ||
  pass "no stack trace with the sample's error"

# 10. remat-estimate where not even one sequence fits the "auto" micro-batch:
#     the table at micro-batch 1, then remat-train's refusal (exit 2), and no
#     advice to run remat-estimate.
out=$(REMAT_MEMORY_PER_RANK_BYTES=200000 "$estimate" --set train_micro_batch_size_per_gpu=auto 2>&1); rc=$?
if [[ $rc -eq 2 ]] && grep -q "^Estimated memory per rank" <<<"$out" &&
   grep -qF "remat-train refuses this config: train_micro_batch_size_per_gpu is \"auto\" and not even a micro-batch of 1 fits" <<<"$out" &&
   ! grep -q "remat-estimate prints" <<<"$out"; then
  pass "remat-estimate shows the table at micro-batch 1 where the \"auto\" micro-batch cannot fit (exit 2)"
else
  fail "remat-estimate shows the table at micro-batch 1 where the \"auto\" micro-batch cannot fit (exit $rc)" "$out"
fi
# remat-estimate started by a launcher as several ranks printed one table per
# rank, each for 1 rank over the host divided by the launcher's ranks.
expect "remat-estimate under mpirun says to give -np instead" \
  "remat-estimate runs as one process and estimates the ranks it is given with -np; it was started as rank" \
  "$run" -np 2 -- "$estimate"
# Two sizes that print alike at one digit are shown with more (the default
# GPT at one rank needs 13.21 MiB; 13,800,000 bytes are 13.16 MiB).
out=$(REMAT_MEMORY_PER_RANK_BYTES=13800000 "$train" --steps 1 2>&1); rc=$?
amounts=$(grep -oE "needs about [0-9.]+ [KMG]iB per rank .* but about [0-9.]+ [KMG]iB" <<<"$out" |
          sed -E 's/needs about ([0-9.]+ [KMG]iB).* but about ([0-9.]+ [KMG]iB)/\1|\2/')
if [[ $rc -ne 0 && -n "$amounts" && "${amounts%%|*}" != "${amounts##*|}" ]]; then
  pass "the fit refusal shows its two amounts apart ($amounts)"
else
  fail "the fit refusal shows its two amounts apart ($amounts, exit $rc)" "$out"
fi

summary
