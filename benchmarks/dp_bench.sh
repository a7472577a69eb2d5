#!/usr/bin/env bash
# Data parallelism beside PyTorch: remat's Engine (benchmarks/dp_bench.cc) at
# ZeRO stages 0 and 1 with overlap_comm on and off, stages 2 and 3, against
# PyTorch's DistributedDataParallel and DDP + ZeroRedundancyOptimizer over gloo
# (benchmarks/torch_ddp.py), on the same GPT at world sizes 2 and 4, one
# intra-op thread per rank. Rounds interleave every configuration, so the
# machine's noise hits all alike. First a check: rank 0's first-step loss of
# remat stage 0 and DDP at world 2 without dropout agree. Writes the rows to
# OUT.jsonl (and OUT.check.jsonl) and the markdown section of docs/benchmarks.md
# to build/bench/dp.md (benchmarks/dp_report.py), with the Debian 13 rows too
# when build/bench/dp.debian13.jsonl exists. bench.sh runs it as its step 8.
#
#   benchmarks/dp_bench.sh [OUT.jsonl]             # this machine (about 12 minutes on 2 cores)
#   benchmarks/dp_bench.sh --debian13              # the same in the Debian 13 chroot (LibTorch and
#                                                  # PyTorch 2.6; tools/debian13.sh), rows copied
#                                                  # back to build/bench/dp.debian13.jsonl
#   DP_ROUNDS=2 DP_STEPS=3 DP_WARMUP=1 DP_WORLDS="2 4" DP_BUCKET=250000 benchmarks/dp_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=/usr/bin/python3

if [[ "${1:-}" == "--debian13" ]]; then
  root=${REMAT_DEBIAN13_ROOT:-/var/cache/remat/debian13}
  # A folder of its own in the chroot, so a ./test.sh running there meanwhile keeps /src/remat.
  src=/src/remat-dp-bench
  REMAT_DEBIAN13_SRC=$src tools/debian13.sh --exec \
    "DP_ROUNDS=${DP_ROUNDS:-2} DP_STEPS=${DP_STEPS:-3} DP_WARMUP=${DP_WARMUP:-1} DP_WORLDS='${DP_WORLDS:-2 4}' \
     DP_BUCKET=${DP_BUCKET:-250000} benchmarks/dp_bench.sh build/bench/dp.jsonl"
  mkdir -p build/bench
  cp "$root$src/build/bench/dp.jsonl" build/bench/dp.debian13.jsonl
  cp "$root$src/build/bench/dp.check.jsonl" build/bench/dp.debian13.check.jsonl
  cp "$root$src/build/bench/dp.platform.json" build/bench/dp.debian13.platform.json
  [[ -f build/bench/dp.jsonl ]] || { cat "$root$src/build/bench/dp.md"; exit 0; }
  $py benchmarks/dp_report.py build/bench/dp.jsonl build/bench/dp.debian13.jsonl >build/bench/dp.md
  cat build/bench/dp.md
  exit 0
fi

rows=${1:-build/bench/dp.jsonl}
check=${rows%.jsonl}.check.jsonl
mkdir -p "$(dirname "$rows")" build/bench
: >"$rows"
: >"$check"
rounds=${DP_ROUNDS:-2}
steps=${DP_STEPS:-3}
warmup=${DP_WARMUP:-1}
worlds=${DP_WORLDS:-2 4}
bucket=${DP_BUCKET:-250000}
$py -c "import torch" 2>/dev/null || { echo "dp_bench.sh: needs $py with torch (python3-torch)" >&2; exit 1; }
bazel build //benchmarks:dp_bench //launch:remat-run >/dev/null 2>&1 || bazel build //benchmarks:dp_bench //launch:remat-run
model=(--layers 8 --batch 4 --seq 64 --d-model 128 --heads 4 --d-ff 512 --vocab 128 --seed 1234 --bucket "$bucket")
export REMAT_LOG_LEVEL=warn OMP_NUM_THREADS=1
run=bazel-bin/launch/remat-run
log=${rows%.jsonl}.log
: >"$log"
# Each run on its own rendezvous port (gloo's store), and ended if it hangs;
# the ranks' stderr goes to $log.
port=29600
remat() { timeout 600 "$run" -np "$1" -- bazel-bin/benchmarks/dp_bench "${@:2}" 2>>"$log" || echo "dp_bench: failed: remat $*" >&2; }
pytorch() {
  port=$((port + 1))
  timeout 600 "$run" -np "$1" -- "$py" benchmarks/torch_ddp.py --port "$port" "${@:2}" 2>>"$log" ||
    echo "dp_bench: failed: pytorch $*" >&2
}

echo "dp_bench: first-step loss at world 2, dropout 0, stage 0 / DDP" >&2
remat 2 "${model[@]}" --dropout 0 --stage 0 --overlap-comm false --warmup 0 --steps 1 --reduce-reps 1 --out "$check"
pytorch 2 "${model[@]}" --dropout 0 --mode ddp --warmup 0 --steps 1 --reduce-reps 1 --out "$check"

# world, framework, configuration
configs=()
for n in $worlds; do
  configs+=("$n remat 0 false" "$n remat 0 true" "$n remat 1 false" "$n remat 1 true" "$n remat 2 true"
            "$n remat 3 true" "$n pytorch ddp" "$n pytorch ddp_zero1")
done
for ((r = 1; r <= rounds; r++)); do
  echo "dp_bench: round $r of $rounds (${#configs[@]} runs)" >&2
  for c in "${configs[@]}"; do
    set -- $c
    if [[ $2 == remat ]]; then
      remat "$1" "${model[@]}" --stage "$3" --overlap-comm "$4" --steps "$steps" --warmup "$warmup" --out "$rows"
    else
      pytorch "$1" "${model[@]}" --mode "$3" --steps "$steps" --warmup "$warmup" --out "$rows"
    fi
  done
done

cat >"${rows%.jsonl}.platform.json" <<JSON
{"platform": "$(. /etc/os-release; echo "$PRETTY_NAME")",
 "libtorch": "$(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo unknown)",
 "torch_version": "$($py -c 'import torch; print(torch.__version__)')",
 "mpi": "$(mpirun --version 2>/dev/null | head -1)",
 "machine": "$(getconf _NPROCESSORS_ONLN) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)",
 "rounds": $rounds, "steps": $steps, "warmup": $warmup, "bucket": $bucket}
JSON
others=()
[[ "$rows" == build/bench/dp.jsonl && -f build/bench/dp.debian13.jsonl ]] && others+=(build/bench/dp.debian13.jsonl)
$py benchmarks/dp_report.py "$rows" "${others[@]}" >build/bench/dp.md
cat build/bench/dp.md
