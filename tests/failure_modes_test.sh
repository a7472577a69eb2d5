#!/usr/bin/env bash
# Whole-job failure modes under mpirun: each case must end with a nonzero exit
# and a clear message within a bounded time, never hang or segfault.
# Prints "[remat-test] N passed, M failed" like the gtest binaries.
set -uo pipefail
peer_exit="$1"
stalled_peer="$2"
remat_smoke="$3"
remat_run="$4"
source "$(dirname "$0")/testlib.sh"

expect "peer exits during a collective" "exited" \
  "$remat_run" -np 2 -- "$peer_exit"
REMAT_COMM_TIMEOUT_S=2 expect "stalled peer times out" "remat timeout: allReduce(seq=0" \
  "$remat_run" -np 2 -- "$stalled_peer"
# With the debug mode on, the message says what its check found instead of
# advising the mode it runs in.
out=$(REMAT_COMM_TIMEOUT_S=2 REMAT_DEBUG_COLLECTIVES=1 timeout 120 "$remat_run" -np 2 -- "$stalled_peer" 2>&1)
if [[ $? -ne 0 ]] && grep -q "REMAT_DEBUG_COLLECTIVES is on and not every rank reached" <<<"$out" &&
   ! grep -q "Run with REMAT_DEBUG_COLLECTIVES=1" <<<"$out"; then
  pass "stalled peer under REMAT_DEBUG_COLLECTIVES=1: the timeout says what the check found"
else
  fail "stalled peer under REMAT_DEBUG_COLLECTIVES=1: the timeout says what the check found" "$out"
fi
# REMAT_DEBUG_COLLECTIVES changes what every collective exchanges: set on rank 1
# alone it hung start-up for good (rank 1 waited to create a communicator the
# others never made). Every rank now refuses it in the first exchange.
on_rank1=(bash -c '[[ $OMPI_COMM_WORLD_RANK == 1 ]] && export REMAT_DEBUG_COLLECTIVES=1; exec "$@"' _)
expect "REMAT_DEBUG_COLLECTIVES on rank 1 only is refused at start" \
  "the ranks of this job were started with different REMAT_DEBUG_COLLECTIVES: <not set> on rank 0; '1' on rank 1" \
  env -u REMAT_DEBUG_COLLECTIVES "$remat_run" -np 2 -- "${on_rank1[@]}" "$remat_smoke"
# A rank stopped before MPI_Init (on a loaded machine, "2 s into a run" can
# still be LibTorch loading) held the others in MPI_Init for good, past any
# REMAT_COMM_TIMEOUT_S: the job now ends at the timeout. Rank 1 stops itself
# before it starts the program; mpirun ends it with the job.
stop_rank1=(bash -c '[[ $OMPI_COMM_WORLD_RANK == 1 ]] && kill -STOP $$; exec "$@"' _)
start=$SECONDS
out=$(REMAT_COMM_TIMEOUT_S=2 timeout 60 "$remat_run" -np 2 -- "${stop_rank1[@]}" "$remat_smoke" 2>&1); rc=$?
took=$((SECONDS - start))
if [[ $rc -ne 0 && $rc -ne 124 && $took -le 7 ]] &&
   grep -qF "[rank 0/2] remat timeout: MPI_Init (every rank of the job starting MPI) did not complete within 2 s" <<<"$out"; then
  pass "a rank stopped before MPI_Init ends the job at the timeout ($took s, exit $rc)"
else
  fail "a rank stopped before MPI_Init ends the job at the timeout (took $took s, wanted <= 2 + 5 s; exit $rc)" "$out"
fi
expect "unknown config key" "unknown key 'model.n_layr'; did you mean 'model.n_layer'?" \
  "$remat_run" -np 2 -- "$remat_smoke" --set model.n_layr=8
expect "tensor_parallel.size does not divide the world" \
  "tensor_parallel.size=2 does not divide the world size 3" \
  "$remat_run" -np 3 -- "$remat_smoke" --set tensor_parallel.size=2
expect "malformed config file" "malformed JSON: parse error at line 1, column 2" \
  bash -c "echo '{,}' > \"\${TEST_TMPDIR:-/tmp}/bad.json\" && \"$remat_smoke\" --config \"\${TEST_TMPDIR:-/tmp}/bad.json\""
expect "inconsistent batch sizes" "train_batch_size (10) must equal train_micro_batch_size_per_gpu (16) x gradient_accumulation_steps (1) x data-parallel size (1) = 16" \
  "$remat_smoke" --set train_batch_size=10
expect "launcher variables disagree with MPI" "launch several processes with mpirun" \
  env RANK=0 WORLD_SIZE=2 "$remat_smoke"
expect "unknown backend" "unknown communication backend 'gloo'" \
  "$remat_smoke" --backend gloo

summary
