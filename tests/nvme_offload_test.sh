#!/usr/bin/env bash
# offload_optimizer.device "nvme" as remat-train runs it, at 2 ranks:
# - a rank killed with kill -9 in the middle of an optimizer step (some
#   sub-groups of its state file stepped, others not): the save before is
#   intact, the next run resumes it, removes the files the killed run left
#   (saying so) and trains the same losses, bitwise, as a run never stopped;
# - the disk failing in a step (EIO, REMAT_FAULT_NVME_FAIL): the job stops
#   with exit 1 naming the step and the file, and the last save resumes;
# - nvme_path on tmpfs (memory, O_DIRECT or not by kernel version; a
#   filesystem refusing it is runtime's async_io_test's, on a ramfs): the I/O
#   mode said, losses bitwise as on a disk;
# - a job's files are gone at its end;
# - offload_param "nvme" beside it (stage 3, both on disk, max_in_cpu 0):
#   losses bitwise as both on "cpu"; kill -9 mid-step leaves both files of
#   each rank, which the next run removes (saying so) as it resumes the
#   step-2 save bitwise; the --memory-trace labels carry the disk's bytes.
# Prints "[remat-test] N passed, M failed".
set -uo pipefail
train="$(realpath "$1")"
run="$(realpath "$2")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export REMAT_COMM_TIMEOUT_S=60 REMAT_LOG_LEVEL=warn
source "$(dirname "$0")/testlib.sh"

small=(--set model.n_layer=2 --set model.seq_len=32 --set model.d_model=32 --set model.d_ff=64
       --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0 --set train.sample_chars=0
       --set zero_optimization.stage=2 --set zero_optimization.sub_group_size=8000
       --set zero_optimization.offload_optimizer.device=nvme --set train.save_interval=2)
nvme="$tmp/nvme"
mkdir -p "$nvme"
job() { "$run" -np 2 -- "$train" "${small[@]}" --steps 5 --set zero_optimization.offload_optimizer.nvme_path="$1" "${@:2}"; }
losses() { python3 -c 'import json,sys; [print(json.loads(l)["step"], repr(json.loads(l)["loss"])) for l in open(sys.argv[1])]' "$1"; }
state_files() { find "$nvme" -name '*.optimizer' | wc -l; }

job "$nvme" --metrics "$tmp/ref.jsonl" >"$tmp/ref.log" 2>&1
rc=$?
if [[ $rc -eq 0 && $(state_files) -eq 0 && -f "$nvme/remat-optimizer/rank1/lock" ]]; then
  pass "a run with the state on disk trains 5 steps and removes its files"
else
  fail "a run with the state on disk (exit $rc, $(state_files) files left)" "$(tail -20 "$tmp/ref.log")"
fi

# kill_then_resume NAME JOB...: JOB (saving to $tmp/NAME) killed with kill -9
# in step 4, after the first sub-group of rank 1's state file was written
# back (REMAT_FAULT_NVME_KILL), then run again resuming its step-2 save, with
# metrics in $tmp/NAME_resumed.jsonl. Sets rc (the killed job's exit), left
# (the NVMe files it left), rc2 (the resume's exit); logs $tmp/NAME_kill.log
# and $tmp/NAME_resumed.log.
kill_then_resume() {
  local name=$1
  shift
  REMAT_FAULT_NVME_KILL=4 "$@" --save-dir "$tmp/$name" >"$tmp/${name}_kill.log" 2>&1
  rc=$?
  left=$(find "$nvme" \( -name '*.optimizer' -o -name '*.parameters' \) | wc -l)
  "$@" --save-dir "$tmp/$name" --resume "$tmp/$name" --metrics "$tmp/${name}_resumed.jsonl" >"$tmp/${name}_resumed.log" 2>&1
  rc2=$?
}

kill_then_resume sv job "$nvme"
removed=$(grep -c "offload_optimizer nvme: removed '.*\.optimizer' ([0-9]* bytes), left by a run that ended without cleaning up" "$tmp/sv_resumed.log")
if [[ $rc -ne 0 && $left -eq 2 && $rc2 -eq 0 && $removed -eq 2 && $(state_files) -eq 0 ]] &&
    cmp -s <(losses "$tmp/ref.jsonl" | tail -3) <(losses "$tmp/sv_resumed.jsonl"); then
  pass "kill -9 mid-step: the step-2 save resumes, steps 3-5 bitwise as never stopped, the 2 killed files removed"
else
  fail "kill -9 mid-step (exit $rc, $left files left; resume exit $rc2, $removed removals said)" \
    "$(tail -12 "$tmp/sv_kill.log"; tail -12 "$tmp/sv_resumed.log"; losses "$tmp/ref.jsonl"; losses "$tmp/sv_resumed.jsonl")"
fi

# The disk fails in step 4: exit 1 naming the step and the file; the save of step 2 resumes.
REMAT_FAULT_NVME_FAIL=4 job "$nvme" --save-dir "$tmp/sv2" >"$tmp/fail.log" 2>&1
rc=$?
job "$nvme" --save-dir "$tmp/sv2" --resume "$tmp/sv2" --metrics "$tmp/after_fail.jsonl" >"$tmp/after_fail.log" 2>&1
rc2=$?
if [[ $rc -eq 1 ]] && grep -q "NVMe optimizer state, step 4, sub-group 0 of [0-9]* (elements \[0, 8000)) in '$nvme/remat-optimizer/rank[01]/rank[01].optimizer': EIO" "$tmp/fail.log" &&
    grep -q "the optimizer state on disk is no longer whole: check the disk under nvme_path, then resume from the last save" "$tmp/fail.log" &&
    [[ $rc2 -eq 0 ]] && cmp -s <(losses "$tmp/ref.jsonl" | tail -3) <(losses "$tmp/after_fail.jsonl"); then
  pass "the disk failing in step 4: exit 1 naming the step and the file; the step-2 save resumes bitwise"
else
  fail "the disk failing in step 4 (exit $rc, resume exit $rc2)" "$(grep -i "error" "$tmp/fail.log" | head -5; tail -5 "$tmp/after_fail.log")"
fi

# tmpfs: direct I/O where the kernel gives it (Linux 6.6 on), else buffered; said either way.
shm=$(mktemp -d /dev/shm/remat_nvme_XXXXXX)
REMAT_LOG_LEVEL=info job "$shm" --metrics "$tmp/shm.jsonl" >"$tmp/shm.log" 2>&1
rc=$?
mode=$(grep -oE "\((io_uring|libaio|threads), (direct|buffered) I/O\)" "$tmp/shm.log" | head -1)
if [[ $rc -eq 0 && -n $mode ]] && cmp -s <(losses "$tmp/ref.jsonl") <(losses "$tmp/shm.jsonl"); then
  pass "nvme_path on tmpfs: $mode said, 5 losses bitwise as on a disk"
else
  fail "nvme_path on tmpfs (exit $rc)" "$(grep -i "nvme\|direct\|error" "$tmp/shm.log" | head -8)"
fi
rm -rf "$shm"

# sub_group_size below the alignment's 1024 floats: each record padded to
# 4096 bytes, the file many times the state: said at start, and trains bitwise.
REMAT_LOG_LEVEL=warn job "$nvme" --set zero_optimization.sub_group_size=100 --metrics "$tmp/sg100.jsonl" >"$tmp/sg100.log" 2>&1
rc=$?
if [[ $rc -eq 0 ]] && grep -q "zero_optimization.sub_group_size 100 is below 1024 elements (the I/O alignment, 4096 bytes, of float32): each sub-group's moments are padded to it, and the state file is [0-9]* bytes for [0-9]* bytes of moments" "$tmp/sg100.log" &&
    grep -q "Give sub_group_size 1024 or more" "$tmp/sg100.log" && cmp -s <(losses "$tmp/ref.jsonl") <(losses "$tmp/sg100.jsonl"); then
  pass "sub_group_size 100: the padding of each record said with the file's and the state's bytes; 5 losses bitwise"
else
  fail "sub_group_size 100 (exit $rc)" "$(grep -i "sub_group\|error" "$tmp/sg100.log" | head -5)"
fi

# offload_param "nvme" with the optimizer on "nvme" at stage 3: both files on disk.
both=(--set zero_optimization.stage=3 --set zero_optimization.stage3_param_persistence_threshold=0
      --set zero_optimization.offload_param.device=nvme --set zero_optimization.offload_param.max_in_cpu=0)
param_job() { job "$nvme" "${both[@]}" --set zero_optimization.offload_param.nvme_path="$nvme" "$@"; }
param_files() { find "$nvme" -name '*.parameters' | wc -l; }
cpu_both=(--set zero_optimization.offload_optimizer.device=cpu --set zero_optimization.offload_param.device=cpu)
param_job "${cpu_both[@]}" --metrics "$tmp/p_cpu.jsonl" >"$tmp/p_cpu.log" 2>&1
rc_cpu=$?
param_job --metrics "$tmp/p_ref.jsonl" --memory-trace "$tmp/p_trace.json" >"$tmp/p_ref.log" 2>&1
rc=$?
labels=$(python3 -c 'import json,sys; o=json.load(open(sys.argv[1]))["otherData"]; print(all(o.get(k, 0) > 0 for k in ("nvme_parameter_bytes", "nvme_parameter_read_bytes", "nvme_parameter_written_bytes", "nvme_state_bytes")))' "$tmp/p_trace.json" 2>&1)
if [[ $rc_cpu -eq 0 && $rc -eq 0 && $(param_files) -eq 0 && $labels == True ]] &&
    cmp -s <(losses "$tmp/p_cpu.jsonl") <(losses "$tmp/p_ref.jsonl"); then
  pass "offload_param and offload_optimizer on nvme at stage 3: 5 losses bitwise as both on cpu, the trace labels carry the disk's bytes, the files removed"
else
  fail "offload_param and offload_optimizer on nvme (exit $rc_cpu/$rc, $(param_files) files left, labels $labels)" \
    "$(tail -8 "$tmp/p_ref.log"; losses "$tmp/p_cpu.jsonl"; losses "$tmp/p_ref.jsonl")"
fi
kill_then_resume psv param_job
removed=$(grep -c "offload_param nvme: removed '.*\.parameters' ([0-9]* bytes), left by a run that ended without cleaning up" "$tmp/psv_resumed.log")
if [[ $rc -ne 0 && $left -eq 4 && $rc2 -eq 0 && $removed -eq 2 && $(param_files) -eq 0 ]] &&
    cmp -s <(losses "$tmp/p_ref.jsonl" | tail -3) <(losses "$tmp/psv_resumed.jsonl"); then
  pass "offload_param nvme, kill -9 mid-step: both ranks' shard files left, removed by the next run, which resumes steps 3-5 bitwise"
else
  fail "offload_param nvme, kill -9 mid-step (exit $rc, $left files left; resume exit $rc2, $removed removals said)" \
    "$(tail -6 "$tmp/psv_kill.log"; tail -8 "$tmp/psv_resumed.log"; losses "$tmp/p_ref.jsonl"; losses "$tmp/psv_resumed.jsonl")"
fi

# Nothing sharded (every parameter below the persistence threshold): the
# warning says to lower the threshold to put the shards on disk, not in host memory.
param_job --set zero_optimization.stage3_param_persistence_threshold=100000 >"$tmp/p_none.log" 2>&1
rc=$?
if [[ $rc -eq 0 ]] && grep -q "offload_param has nothing to offload: no parameter is sharded .* lower the threshold (0 shards every parameter) to keep the shards on disk (past offload_param.max_in_cpu)" "$tmp/p_none.log"; then
  pass "offload_param nvme with nothing sharded: the warning says how to put the shards on disk"
else
  fail "offload_param nvme with nothing sharded (exit $rc)" "$(grep -i "nothing to offload\|error" "$tmp/p_none.log")"
fi

# The ranks stopped with SIGTERM (as mpirun stops them on a Ctrl-C, and a
# scheduler at the end of a job) in the middle of a run with every NVMe file
# in use: the files go with the ranks, nothing is left for the next run to
# sweep. (The ranks are signalled themselves: Open MPI 4's mpirun forwards a
# SIGTERM, Open MPI 5's does not end the job on one.) A job still alive 60 s
# later is killed and failed, not waited for.
"$run" -np 2 -- "$train" "${small[@]}" "${both[@]}" --steps 1000000 --set zero_optimization.offload_param.nvme_path="$nvme" \
  --set zero_optimization.offload_optimizer.nvme_path="$nvme" >"$tmp/p_int.log" 2>&1 &
job_pid=$!
for _ in $(seq 1 100); do
  [[ $(param_files) -eq 2 && $(state_files) -eq 2 ]] && break
  sleep 0.2
done
started=$(( $(param_files) + $(state_files) ))
sleep 1
pkill -TERM -f -- "remat-train .*offload_param.nvme_path=$nvme"
killed=$?
for _ in $(seq 1 300); do
  kill -0 "$job_pid" 2>/dev/null || break
  sleep 0.2
done
if kill -0 "$job_pid" 2>/dev/null; then
  pkill -KILL -f -- "offload_param.nvme_path=$nvme"
  killed=timeout
fi
wait "$job_pid"
rc=$?
left=$(find "$nvme" -name 'rank*.parameters' -o -name 'rank*.optimizer' -o -name 'rank*.masters' | wc -l)
if [[ $started -eq 4 && $killed -eq 0 && $rc -ne 0 && $left -eq 0 ]]; then
  pass "the ranks stopped with SIGTERM mid-run: the NVMe files of the 2 ranks are removed with them (exit $rc)"
else
  fail "the ranks stopped with SIGTERM mid-run ($started files seen, pkill $killed, exit $rc, $left left)" "$(tail -5 "$tmp/p_int.log"; find "$nvme")"
fi

summary
