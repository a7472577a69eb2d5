#!/usr/bin/env bash
# Checks the floors and walls of docs/architecture.md:
#   floors: each package's library sources (its folder and subfolders, tests
#     excepted) include only the packages below it. Tests, launch/, benchmarks/
#     and examples/ sit on top and may include any package.
#   walls: a header in a package's subfolder (pkg/internal/..., engine/save/...)
#     is the package's own: only files in that package (its tests included)
#     include it; everything else includes the package's top-level headers.
# Prints each offending include with what to change; exits 1 if there is one.
#
#   tools/check_layering.sh              # this tree
#   tools/check_layering.sh --self-test  # a made-up tree with known faults
set -uo pipefail

declare -A allowed=(
  [runtime]="runtime"
  [nn]="nn runtime"
  [rng]="rng runtime"
  [data]="data runtime"
  [optim]="optim runtime"
  [checkpointing]="checkpointing nn rng runtime"
  [parallel]="parallel nn optim rng runtime"
  [models]="models nn parallel rng runtime"
  [engine]="engine checkpointing parallel models data nn optim rng runtime"
)
# Folders above every package: they include public headers only.
top_folders="launch benchmarks examples tests"

# includes FILE: the remat includes of FILE ("pkg/..." with a known package), one a line.
includes() {
  sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([a-z_]+\/[^"]+)".*/\1/p' "$1" | sort -u |
    while IFS= read -r inc; do
      [[ -n ${allowed[${inc%%/*}]+x} ]] && echo "$inc"
    done
}

# check: the floors and walls of the tree in the current folder.
check() {
  local bad=0 pkg file inc dep
  for pkg in "${!allowed[@]}"; do
    [[ -d $pkg ]] || continue
    while IFS= read -r file; do
      while IFS= read -r inc; do
        dep=${inc%%/*}
        if [[ $file != *_test.cc && " ${allowed[$pkg]} " != *" $dep "* ]]; then
          echo "$file includes $inc: $pkg/ may include only ${allowed[$pkg]// /, } (docs/architecture.md)"
          bad=1
        fi
        if [[ $inc == */*/* && $dep != "$pkg" ]]; then
          echo "$file includes $inc: ${inc%/*}/ is $dep/'s own; include a public header" \
               "of $dep/ (one at its top level), or make this one public there (docs/architecture.md)"
          bad=1
        fi
      done < <(includes "$file")
    done < <(find "$pkg" \( -name '*.h' -o -name '*.cc' \) -type f | sort)
  done
  for top in $top_folders; do
    [[ -d $top ]] || continue
    while IFS= read -r file; do
      while IFS= read -r inc; do
        [[ $inc == */*/* ]] || continue
        dep=${inc%%/*}
        echo "$file includes $inc: ${inc%/*}/ is $dep/'s own; include a public header" \
             "of $dep/ (one at its top level), or make this one public there (docs/architecture.md)"
        bad=1
      done < <(includes "$file")
    done < <(find "$top" \( -name '*.h' -o -name '*.cc' \) -type f | sort)
  done
  return $bad
}

# self_test: a tree with one fault of each kind must fail with each named, and
# the same tree without them must pass.
self_test() {
  local tmp out rc expected line
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$tmp/runtime/internal" "$tmp/nn/internal" "$tmp/engine/save" "$tmp/launch"
  printf '#pragma once\n' >"$tmp/runtime/error.h"
  printf '#pragma once\n' >"$tmp/runtime/internal/backend.h"
  printf '#pragma once\n' >"$tmp/engine/save/manifest.h"
  printf '#include "runtime/internal/backend.h"\n#include "runtime/error.h"\n' >"$tmp/runtime/runtime.cc"
  printf '#include "runtime/internal/backend.h"\n' >"$tmp/runtime/internal/backend.cc"
  printf '#include "engine/save/manifest.h"\n' >"$tmp/engine/engine.cc"
  printf '#include "runtime/error.h"\n' >"$tmp/nn/internal/hook.h"
  printf '#include "engine/engine.h"\n' >"$tmp/launch/train.cc"
  out=$(cd "$tmp" && check) || { echo "layering self-test: a clean tree failed:"; echo "$out"; return 1; }
  printf '#include "runtime/internal/backend.h"\n' >"$tmp/nn/module_call.cc"
  printf '#include "engine/engine.h"\n' >"$tmp/nn/internal/hook.h"
  printf '#include "engine/save/manifest.h"\n' >"$tmp/launch/train.cc"
  out=$(cd "$tmp" && check)
  rc=$?
  expected=(
    "nn/module_call.cc includes runtime/internal/backend.h: runtime/internal/ is runtime/'s own"
    "nn/internal/hook.h includes engine/engine.h: nn/ may include only nn, runtime"
    "launch/train.cc includes engine/save/manifest.h: engine/save/ is engine/'s own"
  )
  for line in "${expected[@]}"; do
    if [[ $out != *"$line"* ]]; then
      echo "layering self-test: expected \"$line\" in:"; echo "$out"; return 1
    fi
  done
  if [[ $rc -ne 1 || $(wc -l <<<"$out") -ne ${#expected[@]} ]]; then
    echo "layering self-test: expected exit 1 and ${#expected[@]} lines, got exit $rc:"; echo "$out"; return 1
  fi
  echo "layering self-test: a clean tree passes; each of ${#expected[@]} faults is reported, exit 1"
}

if [[ ${1:-} == --self-test ]]; then
  self_test
  exit $?
fi
cd "$(dirname "$0")/.."
check
bad=$?
[[ $bad -eq 0 ]] && echo "layering: every package includes only the packages below it and the public headers of others"
exit $bad
