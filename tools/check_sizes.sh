#!/usr/bin/env bash
# Checks the size rules of docs/architecture.md on the library packages
# (tests, launch/, benchmarks/ and examples/ excepted): no function over 80
# lines and no file over 720 lines, except the declarative tables listed in
# tools/size_exceptions.txt with their reason. Prints each offender with what
# to change; exits 1 if there is one. Needs universal-ctags (tools/install_deps.sh).
set -uo pipefail
cd "$(dirname "$0")/.."

readonly max_function=80 max_file=720
readonly packages=(runtime nn rng data optim checkpointing parallel models engine)
command -v ctags >/dev/null || { echo "check_sizes: ctags not found: run tools/install_deps.sh" >&2; exit 2; }

mapfile -t files < <(find "${packages[@]}" \( -name '*.cc' -o -name '*.h' \) ! -name '*_test.cc' ! -name '*_test.h' | sort)
# "path<TAB>function" pairs allowed over the limit.
mapfile -t allowed < <(sed -nE 's/^([^#[:space:]]+)[[:space:]]+([^[:space:]]+).*/\1\t\2/p' tools/size_exceptions.txt)
is_allowed() {
  local entry
  for entry in "${allowed[@]}"; do [[ "$entry" == "$1" ]] && return 0; done
  return 1
}

bad=0
while IFS=$'\t' read -r file first last name; do
  lines=$((last - first + 1))
  ((lines > max_function)) || continue
  is_allowed "$file"$'\t'"$name" && continue
  echo "$file:$first: $name is $lines lines (at most $max_function): split it into named steps, or list it in tools/size_exceptions.txt if it is a declarative table"
  bad=1
done < <(ctags -x --_xformat='%F	%n	%e	%N' --kinds-c++=f --fields=+ne --language-force=c++ "${files[@]}")

for file in "${files[@]}"; do
  lines=$(wc -l <"$file")
  ((lines > max_file)) || continue
  is_allowed "$file"$'\t'"(file)" && continue
  echo "$file: $lines lines (at most $max_file): split it by role"
  bad=1
done

[[ $bad -eq 0 ]] && echo "sizes: every library function within $max_function lines and every file within $max_file (tables excepted: tools/size_exceptions.txt)"
exit $bad
