#!/usr/bin/env bash
# Checks that each package's library sources include only the packages below
# it (docs/architecture.md). Tests, launch/ and benchmarks/ sit on top and may
# include anything. Prints each offending include; exits 1 if there is one.
set -uo pipefail
cd "$(dirname "$0")/.."

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

bad=0
for pkg in "${!allowed[@]}"; do
  for file in "$pkg"/*.h "$pkg"/*.cc; do
    [[ -f "$file" && "$file" != *_test.cc ]] || continue
    while IFS= read -r dep; do
      [[ " ${allowed[$pkg]} " == *" $dep "* ]] && continue
      echo "$file includes $dep/: $pkg/ may include only ${allowed[$pkg]// /, } (docs/architecture.md)"
      bad=1
    done < <(sed -nE 's/^#include "([a-z_]+)\/.*/\1/p' "$file" | sort -u)
  done
done
[[ $bad -eq 0 ]] && echo "layering: every package includes only the packages below it"
exit $bad
