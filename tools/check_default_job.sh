#!/usr/bin/env bash
# Runs the default job (remat-run -np 2 -- remat-train --config configs/default.json)
# and compares its losses, step by step and bitwise as printed, with the
# baseline in tools/default_job_losses.txt, then every metrics record with
# tools/default_job_metrics.jsonl: the same keys, and the same values apart from
# the timings (keys ending in _ms, tokens_per_s). Prints the first difference,
# or "120 of 120 losses bitwise equal" and "120 of 120 metrics records equal";
# exits nonzero when any differs.
#   tools/check_default_job.sh [BIN_DIR]   (default: bazel-bin/launch)
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-bazel-bin/launch}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin/remat-run" -np 2 -- "$bin/remat-train" --config configs/default.json --metrics "$tmp/m.jsonl" \
  >"$tmp/run.log" 2>&1 || { tail -20 "$tmp/run.log"; echo "the default job failed"; exit 1; }
python3 - "$tmp/m.jsonl" tools/default_job_losses.txt <<'PY'
import json, sys
run = [repr(json.loads(line)["loss"]) for line in open(sys.argv[1])]
base = [line.strip() for line in open(sys.argv[2]) if line.strip() and not line.startswith("#")]
for step, (a, b) in enumerate(zip(run, base), 1):
    if a != b:
        sys.exit(f"step {step}: loss {a}, baseline {b}")
if len(run) != len(base):
    sys.exit(f"{len(run)} steps run, {len(base)} in the baseline")
print(f"{len(run)} of {len(base)} losses bitwise equal ({base[0]} first, {base[-1]} last)")
PY
[[ $? -eq 0 ]] || exit 1
python3 - "$tmp/m.jsonl" tools/default_job_metrics.jsonl <<'PY'
import json, sys
def timing(key): return key.endswith("_ms") or key == "tokens_per_s"
run = [json.loads(line) for line in open(sys.argv[1])]
base = [json.loads(line) for line in open(sys.argv[2])]
for r, b in zip(run, base):
    if sorted(r) != sorted(b):
        sys.exit(f"step {r.get('step')}: keys {sorted(set(r) ^ set(b))} differ from the baseline")
    for key in b:
        if not timing(key) and r[key] != b[key]:
            sys.exit(f"step {r['step']}: {key} {r[key]!r}, baseline {b[key]!r}")
if len(run) != len(base):
    sys.exit(f"{len(run)} records, {len(base)} in the baseline")
print(f"{len(run)} of {len(base)} metrics records equal ({len(base[0])} keys; timings by key only)")
PY
