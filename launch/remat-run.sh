#!/usr/bin/env bash
# remat-run: launch a program on N ranks with mpirun.
#
#   remat-run -np N [--hostfile F] [other mpirun options] -- PROGRAM ARGS...
#
# Adds what mpirun needs: --allow-run-as-root when run as root; on one machine
# (no --hostfile/--host) shared-memory transport, and --oversubscribe with no
# core binding when N exceeds the cores, and OMP_NUM_THREADS (when unset) of
# cores / N, at least 1, so that the ranks' intra-op thread pools do not spin
# against each other; every REMAT_* variable is passed to the ranks. More than
# 4 ranks per core on one machine is refused unless --oversubscribe is given.
# Prints the command it runs, quoted for a shell.
set -euo pipefail

die() {
  echo "remat-run: $*" >&2
  exit 2
}

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
}

np=""
user_oversubscribe=0
single_node=1
mpi_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -np | -n | --np)
      [[ $# -ge 2 ]] || die "$1 needs a number of ranks"
      [[ -z "$np" ]] || die "the number of ranks is given twice ('$np' and '$2'): give -np once"
      np="$2"
      shift 2
      ;;
    --oversubscribe | -oversubscribe)
      user_oversubscribe=1
      mpi_args+=("$1")
      shift
      ;;
    --hostfile | --machinefile | -hostfile | --host | -host | -H)
      single_node=0
      mpi_args+=("$1" "$2")
      shift 2
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    --)
      shift
      break
      ;;
    *)
      mpi_args+=("$1")
      shift
      ;;
  esac
done

[[ -n "$np" ]] || die "say how many ranks: remat-run -np N -- PROGRAM ARGS"
[[ "$np" =~ ^[1-9][0-9]{0,6}$ ]] || die "-np '$np' is not a positive number of ranks"
[[ $# -gt 0 ]] || die "no program to run: put it after --, e.g. remat-run -np 2 -- remat-train"
command -v mpirun >/dev/null ||
  die "mpirun not found: install Open MPI (Debian/Ubuntu: apt-get install openmpi-bin)"

# Under Bazel's test runner, keep Open MPI's session files in the test's tmp dir.
[[ -n "${TEST_TMPDIR:-}" ]] && export TMPDIR="$TEST_TMPDIR"
# Open MPI 5 will not start without a home directory, and Bazel's test runner
# leaves HOME unset: take the user's from the password database.
if [[ -z "${HOME:-}" ]]; then
  HOME=$(getent passwd "$(id -u)" | cut -d: -f6)
  [[ -d "$HOME" ]] || HOME=${TMPDIR:-/tmp}
  export HOME
fi

# Ranks see a pty under mpirun whatever the real stdout is: say which it is.
if [[ -z "${REMAT_PROGRESS:-}" ]]; then
  if [[ -t 1 ]]; then export REMAT_PROGRESS=bar; else export REMAT_PROGRESS=lines; fi
fi

# LibTorch starts one intra-op thread per core in every rank: N ranks on C
# cores would run N x C spinning threads (measured on 2 cores with 4 ranks and
# LibTorch 2.6: a ZeRO test 20x slower). Share the cores out instead, unless
# the user chose a number.
# nproc counts the cores this process may use, but follows OMP_NUM_THREADS
# and OMP_THREAD_LIMIT when they are set: ask without them.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
if [[ $single_node -eq 1 && -z "${OMP_NUM_THREADS:-}" ]]; then
  threads=$((cores / np))
  export OMP_NUM_THREADS=$((threads < 1 ? 1 : threads))
fi

# Each rank is a whole process (its LibTorch, its memory): far more of them
# than cores only thrashes, and is a typo more often than a plan.
if [[ $single_node -eq 1 && $user_oversubscribe -eq 0 && "$np" -gt $((4 * cores)) ]]; then
  die "-np $np starts $np ranks on this machine's $cores cores (more than 4 per core, each a process with its own" \
      "LibTorch and memory): use fewer ranks, or pass --oversubscribe to mean it"
fi

cmd=(mpirun -np "$np")
[[ $(id -u) -eq 0 ]] && cmd+=(--allow-run-as-root)
if [[ $single_node -eq 1 ]]; then
  cmd+=(--mca btl self,vader --mca btl_vader_single_copy_mechanism none)
  if [[ "$np" -gt "$cores" ]]; then
    [[ $user_oversubscribe -eq 1 ]] || cmd+=(--oversubscribe)
    cmd+=(--bind-to none)
  fi
fi
while IFS= read -r name; do
  cmd+=(-x "$name")
done < <(env | sed -n 's/^\(REMAT_[A-Za-z0-9_]*\)=.*/\1/p')
[[ -n "${OMP_NUM_THREADS:-}" ]] && cmd+=(-x OMP_NUM_THREADS)
cmd+=("${mpi_args[@]}" "$@")
echo "remat-run: $(printf '%q ' "${cmd[@]}" | sed 's/ $//')" >&2

# Open MPI 4's mpirun dies of a segmentation fault in its own abort when the
# reader of its output goes away (`remat-run ... | head`, a `tee` stopped
# early, a service's journal socket closed). Output to a pipe or a socket
# therefore goes through a relay: once the reader is
# gone the relay ends the job with SIGTERM (the ranks stop as on a
# scheduler's SIGTERM) and takes in the rest of the output, so that mpirun
# never writes to a closed pipe. The relay ignores the signals that end a
# job, so that mpirun's last words still have somewhere to go; after the
# exec below, $$ is mpirun. A write that fails while the reader is still
# there (a non-blocking pipe, full: mpirun alone drops what does not fit and
# exits 0) ends the job too, and says so: the output is cut short (and the
# exit status still 0 when the job was over by then).
relay() {
  set +e # a relay that stops leaves mpirun to the closed pipe
  trap '' TERM INT HUP QUIT USR1 USR2
  local why
  { why=$(LC_ALL=C cat 2>&1 >&3); } 3>&1 && return
  # cat killed by SIGPIPE (141), or told EPIPE: the reader is gone.
  if [[ $? -ne 141 && "$why" != *"Broken pipe"* ]]; then
    local hint=""
    if [[ "$why" == *"Resource temporarily unavailable"* ]]; then
      hint=": the output is a non-blocking pipe (the program that started remat-run made it so), which cannot"
      hint+=" take the job's output whole; give remat-run a file or an ordinary pipe"
    fi
    trap '' PIPE
    echo "remat-run: writing the job's output failed ($why): the job is ended, the rest of its output" \
         "discarded$hint" >&2 2>/dev/null
  fi
  kill -TERM $$ 2>/dev/null
  cat >/dev/null
}
has_reader() { [[ -p "$1" || -S "$1" ]]; }
if has_reader /dev/stdout && [[ /dev/stdout -ef /dev/stderr ]]; then
  exec > >(relay) 2>&1
else
  has_reader /dev/stdout && exec > >(relay)
  has_reader /dev/stderr && exec 2> >(relay >&2)
fi
exec "${cmd[@]}"
