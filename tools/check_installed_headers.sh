#!/usr/bin/env bash
# Checks the walls of an installed remat: every header under PREFIX/include/remat
# includes, of remat's own headers ("pkg/..."), only ones that were installed
# too, so a public header never reaches an internal one (pkg/internal/...,
# engine/save/...) or a test-only one. Prints each offending include; exits 1 if
# there is one.
#
#   tools/check_installed_headers.sh PREFIX
set -uo pipefail
prefix=${1:?usage: tools/check_installed_headers.sh PREFIX}
root=$(find "$prefix" -type d -path '*/include/remat' -print -quit)
[[ -n $root ]] || { echo "installed headers: no include/remat under $prefix" >&2; exit 1; }

packages="runtime nn rng data optim checkpointing parallel models engine"
bad=0 count=0
while IFS= read -r header; do
  count=$((count + 1))
  while IFS= read -r included; do
    [[ " $packages " == *" ${included%%/*} "* ]] || continue
    [[ -f $root/$included ]] && continue
    echo "${header#"$root"/} includes \"$included\", which is not installed: make it public (a top-level" \
         "header of its package) or keep it out of the installed header"
    bad=1
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/p' "$header")
done < <(find "$root" -name '*.h' | sort)
[[ $count -gt 0 ]] || { echo "installed headers: none under $root" >&2; exit 1; }
[[ $bad -eq 0 ]] && echo "installed headers: all $count include only installed remat headers"
exit $bad
