#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on the embedded
# default configuration across REMAT_NP ranks (default 2). Extra arguments go
# to remat-run, e.g. ./run.sh --set tensor_parallel.size=2
set -euo pipefail
cd "$(dirname "$0")"
tools/install_deps.sh
bazel build //launch:remat-run 2>&1 | grep -E '^(ERROR|FAILED)|error:' || true
[[ -x bazel-bin/launch/remat-run ]] || { echo "remat: build failed: run 'bazel build //launch:remat-run'" >&2; exit 1; }
exec tools/mpirun.sh "${REMAT_NP:-2}" bazel-bin/launch/remat-run "$@"
