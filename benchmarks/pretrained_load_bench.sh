#!/usr/bin/env bash
# Engine::load_pretrained's time against the file's size, beside dd reading the
# same file, cold (the file dropped from the page cache) and warm
# (docs/benchmarks.md, "Loading pretrained weights"). Run it alone on the
# machine (other helpers' builds share the disk and the cores):
#
#   flock -o /tmp/remat-build.lock benchmarks/pretrained_load_bench.sh [MB]   # default 400
set -euo pipefail
cd "$(dirname "$0")/.."
mb=${1:-400}
file=/var/tmp/remat_pretrained_bench.safetensors
trap 'rm -f "$file"' EXIT
bazel build //benchmarks:pretrained_load_bench >/dev/null 2>&1
bin=bazel-bin/benchmarks/pretrained_load_bench
export REMAT_LOG_LEVEL=warn
# One rank at stage 0 (it reads the whole file), two at stage 3 (each its half).
launch/remat-run.sh -np 1 -- "$bin" --mb "$mb" --file "$file" | grep '^{'
launch/remat-run.sh -np 2 -- "$bin" --mb "$mb" --stage 3 --file "$file" | grep '^{'
# dd, cold then warm.
"$bin" --evict "$file"
for run in cold warm; do
  echo "dd $run: $(dd if="$file" of=/dev/null bs=16M 2>&1 | tail -1)"
done
