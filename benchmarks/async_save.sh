#!/usr/bin/env bash
# The time a save stops training, blocking vs in the background
# (train.async_save), side by side in one run (benchmarks/async_save_bench.cc),
# on the default GPT widened until a blocking save takes seconds here: prints
# each save and the summary docs/benchmarks.md quotes ("Asynchronous saves").
#   [NP=2] benchmarks/async_save.sh [--d-model 1280 --layers 8 --rounds 3 ...]   (NP: ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //benchmarks:async_save_bench //launch:remat-run >/dev/null 2>&1 ||
  bazel build //benchmarks:async_save_bench //launch:remat-run
out=build/bench/async_save.jsonl
mkdir -p build/bench
bazel-bin/launch/remat-run -np "${NP:-2}" -- bazel-bin/benchmarks/async_save_bench --d-model 1280 --layers 8 --rounds 3 \
  --out "$out" "$@" 2>&1 | grep -vE '^W[0-9]{8}|^WARNING: Logging before'
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
med = statistics.median
blocking = [r for r in rows if r["mode"] == "blocking"]
background = [r for r in rows if r["mode"] == "async"]
quiet = med([r["quiet_step_ms"] for r in rows])
block_ms = med([r["save_call_ms"] for r in blocking])
call_ms = med([r["save_call_ms"] for r in background])
during = [ms for r in background for ms in r["steps_during_write_ms"]]
first = med([r["steps_during_write_ms"][0] for r in background if r["steps_during_write_ms"]])
wait = med([r["wait_ms"] for r in background])
print(f"model: {rows[0]['parameters']} parameters at {rows[0]['ranks']} ranks; {len(blocking)} saves of each kind")
print(f"step without a save (median): {quiet:.0f} ms")
print(f"blocked per save: blocking {block_ms:.0f} ms, background {call_ms:.0f} ms "
      f"({100 * call_ms / block_ms:.1f} % of blocking; target <= 10 %)")
print(f"steps while the files were written: {len(during)} over {len(background)} saves; "
      f"the first after the save (median) {first:.0f} ms = {first / quiet:.2f}x a step without (target <= 1.3x); "
      f"waited at the end {wait:.0f} ms")
quiet_cpu = med([r["quiet_step_cpu_ms"] for r in rows])
first_cpu = med([r["steps_during_write_cpu_ms"][0] for r in background if r["steps_during_write_cpu_ms"]])
block_cpu = med([r["save_call_cpu_ms"] for r in blocking])
print(f"CPU time per rank (every thread): a step without a save {quiet_cpu:.0f} ms; the step during the write "
      f"{first_cpu:.0f} ms (+{first_cpu - quiet_cpu:.0f} ms: the write's); a blocking save {block_cpu:.0f} ms")
print(f"snapshot: {rows[-1]['snapshot_bytes'] / 1e6:.0f} MB of host memory per rank")
PY
