#!/usr/bin/env bash
# Installs what is missing, builds, and trains the default GPT on the embedded
# corpus across REMAT_NP ranks (default 2). Extra arguments go to remat-train,
# e.g. ./run.sh --set activation_checkpointing.variant=selective_op --steps 50
set -euo pipefail
cd "$(dirname "$0")"
tools/install_deps.sh
bazel build //launch:remat-train //launch:remat-run //launch:remat-estimate 2>&1 | grep -E '^(ERROR|FAILED)|error:' || true
[[ -x bazel-bin/launch/remat-train ]] || { echo "remat: build failed: run 'bazel build //launch:remat-train'" >&2; exit 1; }
exec bazel-bin/launch/remat-run -np "${REMAT_NP:-2}" -- \
  bazel-bin/launch/remat-train --config configs/default.json "$@"
