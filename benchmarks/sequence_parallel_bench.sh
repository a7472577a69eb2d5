#!/usr/bin/env bash
# Per-rank activation memory of the GPT with and without sequence parallelism
# at tensor-parallel sizes 2 and 4 (gpt_bench under remat-run, memory only),
# and its section of docs/benchmarks.md (benchmarks/sequence_parallel_report.py),
# printed. bench.sh runs it as its step 7; alone it takes about a minute.
#
#   benchmarks/sequence_parallel_bench.sh [ROWS.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-build/bench/sequence_parallel.jsonl}
mkdir -p "$(dirname "$rows")"
: >"$rows"
bazel build //benchmarks:gpt_bench //launch:remat-run >/dev/null 2>&1 || bazel build //benchmarks:gpt_bench //launch:remat-run
model=(--batch 4 --seq 64 --d-model 128 --heads 4 --d-ff 512 --vocab 128 --seed 1234)
export REMAT_LOG_LEVEL=warn
for tp in 2 4; do
  for sp in "" --sequence-parallel; do
    bazel-bin/launch/remat-run -np "$tp" -- bazel-bin/benchmarks/gpt_bench "${model[@]}" --layers 4,8 --tp "$tp" \
      $sp --variants none,full --memory-only --out "$rows" >/dev/null
  done
done
cat >"${rows%.jsonl}.config.json" <<JSON
{"batch": 4, "seq": 64, "d_model": 128, "heads": 4, "d_ff": 512, "vocab": 128}
JSON
/usr/bin/python3 benchmarks/sequence_parallel_report.py "$rows" "${rows%.jsonl}.config.json"
