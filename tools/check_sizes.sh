#!/usr/bin/env bash
# Checks the size rules of docs/architecture.md: no function over 80 lines in
# the library packages and the applications (launch/, benchmarks/), no class
# or struct over 300 lines in either, and no library file over 720 lines
# (tests and examples/ excepted), except the declarative tables listed in
# tools/size_exceptions.txt with their reason. Prints each offender with what
# to change; exits 1 if there is one. Needs universal-ctags (tools/install_deps.sh).
#   tools/check_sizes.sh             check the tree
#   tools/check_sizes.sh --self-test check that an offender of each kind is caught
set -uo pipefail
cd "$(dirname "$0")/.."

readonly max_function=80 max_class=300 max_file=720
readonly packages=(runtime nn rng data optim checkpointing parallel models engine)
readonly applications=(launch benchmarks)
command -v ctags >/dev/null || { echo "check_sizes: ctags not found: run tools/install_deps.sh" >&2; exit 2; }

sources() {  # the .cc and .h files under the given folders, tests apart
  find "$@" \( -name '*.cc' -o -name '*.h' \) ! -name '*_test.cc' ! -name '*_test.h' | sort
}
# "path<TAB>name" pairs allowed over the limit (name: a function, a class, or "(file)").
mapfile -t allowed < <(sed -nE 's/^([^#[:space:]]+)[[:space:]]+([^[:space:]]+).*/\1\t\2/p' tools/size_exceptions.txt)
is_allowed() {
  local entry
  for entry in "${allowed[@]}"; do [[ "$entry" == "$1" ]] && return 0; done
  return 1
}

# check FILE...: prints each function, class and file over its limit; returns 1 if any.
check() {
  local bad=0 file first last name kind lines limit
  while IFS=$'\t' read -r file first last name kind; do
    lines=$((last - first + 1))
    case "$kind" in
      function) limit=$max_function ;;
      class | struct) limit=$max_class ;;
      *) continue ;;
    esac
    ((lines > limit)) || continue
    is_allowed "$file"$'\t'"$name" && continue
    if [[ $kind == function ]]; then
      echo "$file:$first: $name is $lines lines (at most $max_function): split it into named steps, or list it in tools/size_exceptions.txt if it is a declarative table"
    else
      echo "$file:$first: $kind $name is $lines lines (at most $max_class): split its roles into classes of their own, or list it in tools/size_exceptions.txt with the reason"
    fi
    bad=1
  done < <(ctags -x --_xformat='%F	%n	%e	%N	%K' --kinds-c++=fcs --fields=+neK --language-force=c++ "$@")
  return $bad
}

check_files() {  # FILE...: library files over max_file lines
  local bad=0 file lines
  for file in "$@"; do
    lines=$(wc -l <"$file")
    ((lines > max_file)) || continue
    is_allowed "$file"$'\t'"(file)" && continue
    echo "$file: $lines lines (at most $max_file): split it by role"
    bad=1
  done
  return $bad
}

if [[ "${1:-}" == "--self-test" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  { echo "int long_function() {"; for i in $(seq 81); do echo "  int a$i = $i;"; done; echo "  return 0;"; echo "}"; } >"$tmp/f.cc"
  { echo "class Big {"; echo " public:"; for i in $(seq 300); do echo "  int a$i = $i;"; done; echo "};"; } >"$tmp/c.h"
  { echo "struct Fine {"; for i in $(seq 10); do echo "  int a$i = $i;"; done; echo "};"; } >"$tmp/ok.h"
  out=$(check "$tmp/f.cc" "$tmp/c.h" "$tmp/ok.h")
  rc=$?
  if [[ $rc -eq 1 ]] && grep -q 'long_function is 84 lines' <<<"$out" && grep -q 'class Big is 303 lines' <<<"$out" &&
     ! grep -q Fine <<<"$out"; then
    echo "check_sizes self-test: an 84-line function and a 303-line class caught, a small struct passed"
    exit 0
  fi
  echo "check_sizes self-test failed (exit $rc):"
  echo "$out"
  exit 1
fi

mapfile -t library < <(sources "${packages[@]}")
mapfile -t apps < <(sources "${applications[@]}")
bad=0
check "${library[@]}" "${apps[@]}" || bad=1
check_files "${library[@]}" || bad=1
[[ $bad -eq 0 ]] && echo "sizes: every function within $max_function lines and every class within $max_class" \
  "(library, launch/, benchmarks/), every library file within $max_file (tables excepted: tools/size_exceptions.txt)"
exit $bad
