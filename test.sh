#!/usr/bin/env bash
# Installs what is missing, builds everything, runs every test (unit and
# multi-rank under mpirun), and ends with "N passed, M failed" counting test
# cases across all targets. GPU-tagged tests run only where a GPU is visible.
set -uo pipefail
cd "$(dirname "$0")"
tools/install_deps.sh || exit 1

filters="-gpu"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then filters=""; fi

log=$(mktemp)
bazel build //... 2>&1 | tee "$log" | grep -E '^(ERROR|FAILED)|error:' ; build_rc=${PIPESTATUS[0]}
if [[ $build_rc -ne 0 ]]; then
  tail -40 "$log"
  echo "build failed"
  echo "0 passed, 1 failed"
  exit 1
fi

# Compiler warnings in remat's own files (not LibTorch's or the system's):
# Bazel names them by relative path, CMake by path under this tree.
project_warnings() {
  # (ccache's CCACHE_BASEDIR below turns the paths relative to the build folder: ../../engine/...)
  grep -aE "^(\./|$PWD/|(\.\./)+)?[a-z_]+/[A-Za-z0-9_./-]+:[0-9]+:[0-9]+: warning:" "$1" |
    sed -E "s|^$PWD/||; s|^(\.\./)+||" | grep -v '^external/' | sort -u
}
build_warnings=$(project_warnings "$log")

marker=$(mktemp)
bazel test //... --test_tag_filters="$filters" --nocache_test_results 2>&1 | tee "$log" \
  | grep -E '^//|^Executed|^(ERROR|FAILED)'
test_rc=${PIPESTATUS[0]}

passed=0
failed=0
# tally LABEL P F: a line of the summary, P and F added to the totals.
tally() {
  printf '  %-48s passed %4d  failed %d\n' "$1" "$2" "$3"
  passed=$((passed + $2))
  failed=$((failed + $3))
}
# counts_of LOG: "P F" from the last "[remat-test] P passed, F failed" in LOG
# (anywhere on a line: another rank's output may share it); nothing if none.
counts_of() {
  grep -aoE '\[remat-test\] [0-9]+ passed, [0-9]+ failed' "$1" | tail -1 |
    sed -E 's/.* ([0-9]+) passed, ([0-9]+) failed/\1 \2/'
}
# check LABEL LOG COMMAND...: one case, passed when COMMAND exits 0; its
# output goes to LOG, shown when it fails.
check() {
  local label=$1 log=$2
  shift 2
  if "$@" >"$log" 2>&1; then
    tally "$label" 1 0
  else
    cat "$log"
    tally "$label" 0 1
  fi
}

# Add up the "[remat-test] N passed, M failed" line of each target that ran.
echo
echo "test cases per target:"
while IFS= read -r file; do
  target="//$(dirname "${file#bazel-testlogs/}" | sed 's|/\([^/]*\)$|:\1|')"
  counts=$(counts_of "$file")
  if [[ -z "$counts" ]]; then
    echo "  $target  no summary (crashed or timed out): counted as 1 failed"
    failed=$((failed + 1))
    continue
  fi
  tally "$target" $counts
done < <(find -L bazel-testlogs -name test.log -newer "$marker" | sort)
rm -f "$marker" "$log"

# The CMake build beside Bazel (tests are not run twice): the user's install
# command (tools/install.sh: libraries and tools, no tests), then the same
# build folder with the tests and benchmarks compiled too, then a project that
# uses find_package(remat) and the examples, against that install.
# Compiled objects cached across runs and checkouts of this machine (paths
# taken relative to the tree, so a clone elsewhere hits too): the CMake builds
# below then cost what changed, as Bazel's disk cache does for Bazel.
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR="$PWD"
fi
cmake_log=build/cmake.log
examples_log=build/examples.log
mkdir -p build
rm -f "$examples_log"
if { tools/install.sh --prefix "$PWD/build/install" --build-dir build/cmake &&
     cmake -S . -B build/cmake -DREMAT_BUILD_TESTS=ON -DREMAT_BUILD_BENCHMARKS=ON &&
     cmake --build build/cmake -j"$(nproc)"; } >"$cmake_log" 2>&1; then
  tally "cmake build and install (tools/install.sh)" 1 0
  if { cmake -S tests/cmake_consumer -B build/consumer -G Ninja \
         -DCMAKE_PREFIX_PATH="$PWD/build/install" && cmake --build build/consumer &&
       build/consumer/consumer; } >>"$cmake_log" 2>&1; then
    tally "find_package(remat) consumer" 1 0
  else
    tail -20 "$cmake_log"
    tally "find_package(remat) consumer" 0 1
  fi
  # The examples (examples/): projects outside remat built against the same
  # install and trained at 2 ranks; each check of the script is a case.
  tests/examples_test.sh "$PWD/build/install" "$PWD/build/examples" >"$examples_log" 2>&1
  counts=$(counts_of "$examples_log")
  if [[ -z "$counts" ]]; then
    tail -20 "$examples_log"
    counts="0 1"
  elif [[ ${counts#* } -ne 0 ]]; then
    grep -a -A12 '^\[ FAILED \]' "$examples_log" | head -60
  fi
  tally "examples (tests/examples_test.sh)" $counts
else
  tail -30 "$cmake_log"
  tally "cmake build and install (tools/install.sh)" 0 1
fi

# Warning-free project code (what was compiled in this run: cached objects
# print nothing again).
build_warnings+=$'\n'$(project_warnings "$cmake_log")
[[ -f "$examples_log" ]] && build_warnings+=$'\n'$(project_warnings "$examples_log")
build_warnings=$(sed '/^$/d' <<<"$build_warnings" | sort -u)
if [[ -z "$build_warnings" ]]; then
  tally "no compiler warnings in remat's code" 1 0
else
  echo "$build_warnings" | head -20
  tally "no compiler warnings in remat's code" 0 1
fi

# The floors and walls of docs/architecture.md: no package includes one above
# it or another's internal headers (the check first proves it catches both).
check "layering (docs/architecture.md)" build/layering.log \
  bash -c 'tools/check_layering.sh --self-test && tools/check_layering.sh'

# The rooms of docs/architecture.md: no package's files include each other in a
# loop (tools/room_exceptions.txt: a private member's internal header); the
# check first proves it catches one.
check "rooms (tools/check_rooms.py)" build/rooms.log \
  bash -c 'tools/check_rooms.py --self-test && tools/check_rooms.py'

# The sizes of docs/architecture.md: no function over 80 lines and no class
# over 300 (library, launch/, benchmarks/), no library file over 720,
# declarative tables excepted (tools/size_exceptions.txt); the check first
# proves it catches a long function and a long class.
check "sizes (tools/check_sizes.sh)" build/sizes.log bash -c 'tools/check_sizes.sh --self-test && tools/check_sizes.sh'

# ASan + UBSan (float-cast-overflow included) over the config parser and its
# fuzz test; the full sanitizer run is tools/sanitize.sh without --quick.
tools/sanitize.sh --quick >build/sanitize.log 2>&1
counts=$(counts_of build/sanitize.log)
if [[ -z "$counts" ]]; then
  tail -20 build/sanitize.log
  counts="0 1"
elif [[ ${counts#* } -ne 0 ]]; then
  tail -40 build/sanitize.log
fi
tally "sanitizers (tools/sanitize.sh --quick)" $counts

if [[ $test_rc -ne 0 && $failed -eq 0 ]]; then
  echo "bazel test failed (exit $test_rc) without a failing case: counted as 1 failed"
  failed=1
fi

# The second platform: Debian 13 with LibTorch 2.6, Open MPI 5 and g++ 14 in a
# chroot (tools/debian13.sh), the same test.sh there. REMAT_SKIP_DEBIAN13=1
# skips it for quick local runs; CI never sets it.
echo "$(. /etc/os-release && echo "$NAME $VERSION_ID") (LibTorch $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null)): $passed passed, $failed failed"
if [[ "${REMAT_SKIP_DEBIAN13:-0}" != 1 ]]; then
  leg_log=build/debian13.log
  tools/debian13.sh >"$leg_log" 2>&1
  line=$(grep -aE '^[0-9]+ passed, [0-9]+ failed$' "$leg_log" | tail -1)
  if [[ -z "$line" ]]; then
    tail -40 "$leg_log"
    echo "Debian 13 leg: no summary (see $leg_log): counted as 1 failed"
    failed=$((failed + 1))
  else
    grep -aE '^  (//|cmake|find_package|examples|layering|rooms|sizes|no compiler|sanitizers)' "$leg_log" | sed 's/^/  [debian 13] /'
    grep -a '^debian13:' "$leg_log"
    p=$(sed -E 's/([0-9]+) passed.*/\1/' <<<"$line")
    f=$(sed -E 's/.* ([0-9]+) failed/\1/' <<<"$line")
    echo "Debian 13 (LibTorch 2.6): $p passed, $f failed"
    passed=$((passed + p))
    failed=$((failed + f))
  fi
fi
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
