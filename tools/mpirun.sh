#!/usr/bin/env bash
# Launches a program on NP local ranks: tools/mpirun.sh NP PROGRAM [ARGS...]
# Ranks are processes on this machine (as root, oversubscribed on few cores).
set -euo pipefail
np="$1"
shift
export TMPDIR="${TEST_TMPDIR:-${TMPDIR:-/tmp}}"
# A hung collective ends the job with a TimeoutError instead of hanging it.
export REMAT_COMM_TIMEOUT_S="${REMAT_COMM_TIMEOUT_S:-60}"
exec mpirun --allow-run-as-root --oversubscribe --bind-to none \
  --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
  -x REMAT_COMM_TIMEOUT_S \
  -np "$np" "$@"
