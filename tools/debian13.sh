#!/usr/bin/env bash
# The second supported platform: Debian 13 (trixie) with LibTorch 2.6, Open MPI 5
# and g++ 14, in a chroot on this machine.
#
#   tools/debian13.sh            # create or reuse the chroot, then build and test there
#   tools/debian13.sh --prepare  # only create the chroot and install the dependencies
#   tools/debian13.sh --exec CMD # copy the tree in and run CMD (bash) there instead of ./test.sh
#
# The tree goes to /src/remat in the chroot, or REMAT_DEBIAN13_SRC (a job that
# must not disturb a ./test.sh running there meanwhile takes a folder of its own).
# The chroot lives in REMAT_DEBIAN13_ROOT (default /var/cache/remat/debian13),
# made once with debootstrap from the mirror this machine's apt sources name,
# and reused afterwards (delete the folder to start afresh: nothing of the host
# is ever left mounted in it). The working tree
# is copied into it (build outputs left out), and ./test.sh runs there with its
# own Bazel caches and CMake build folder: nothing built against LibTorch 1.13
# is reused for 2.6 (Bazel does not hash /usr/include). The last line is
# test.sh's "N passed, M failed" for this platform.
set -uo pipefail
cd "$(dirname "$0")/.."

root=${REMAT_DEBIAN13_ROOT:-/var/cache/remat/debian13}
suite=trixie
ready="$root/.remat-ready"
packages=(g++ cmake ninja-build bazel-bootstrap bazel-platforms libtorch-dev libopenmpi-dev
          openmpi-bin libspdlog-dev nlohmann-json3-dev libgtest-dev libgmock-dev libcli11-dev
          zlib1g-dev procps python3 python3-torch universal-ctags ca-certificates git
          libopenblas0-openmp libblas3 ccache liburing-dev libaio-dev fio)

say() { echo "debian13: $*" >&2; }
fail() {
  say "$*"
  echo "0 passed, 1 failed"
  exit 1
}

[[ $(id -u) -eq 0 ]] || fail "creating and entering a chroot needs root"

# The first Debian mirror this machine's apt sources name.
mirror() {
  local uri
  uri=$(grep -hoE '^(URIs:|deb) *[a-z]+://[^ ]*/debian/?( |$)' \
          /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
        grep -oE '[a-z]+://[^ ]*' | head -1)
  echo "${uri:-http://deb.debian.org/debian}"
}

# Runs a command in the chroot with the host's /proc, /sys, /dev, /dev/pts and
# /dev/shm. The bind mounts are made in a private mount namespace: they exist
# only for that command and vanish with it, so nothing of the host stays
# mounted below $root (where a later rm -rf would reach into it).
enter() {
  unshare --mount --propagation private /bin/bash -c '
    set -e
    root=$1; shift
    for dir in /proc /sys /dev /dev/pts /dev/shm; do
      mkdir -p "$root$dir"
      mount --bind "$dir" "$root$dir"
    done
    exec chroot "$root" "$@"' enter "$root" \
    /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 CI="${CI:-}" REMAT_SKIP_DEBIAN13=1 "$@"
}

# Removes the chroot, never reaching into a file system mounted below it.
remove_root() {
  if grep -q " ${root%/}/" /proc/self/mounts; then
    say "something is mounted below $root; unmount it before the chroot can be made afresh:"
    grep " ${root%/}/" /proc/self/mounts | cut -d' ' -f2 >&2
    return 1
  fi
  rm -rf --one-file-system "$root"
}

prepare() {
  # Ready, with this package list installed (a longer list installs what is new).
  [[ -f "$ready" && "$(cat "$ready")" == "${packages[*]}" ]] && return 0
  local start=$SECONDS
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
      { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; } ||
      return 1
  fi
  local from
  from=$(mirror)
  if [[ ! -x "$root/usr/bin/apt-get" ]]; then
    say "creating the $suite chroot in $root from $from (a few minutes)"
    remove_root || return 1
    mkdir -p "$root"
    debootstrap --variant=minbase "$suite" "$root" "$from" >"$root.debootstrap.log" 2>&1 ||
      { tail -20 "$root.debootstrap.log" >&2; return 1; }
  fi
  printf 'deb %s %s main\n' "$from" "$suite" >"$root/etc/apt/sources.list"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  say "installing the build dependencies in the chroot"
  enter /bin/sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends ${packages[*]}" >"$root.install.log" 2>&1 ||
    { tail -20 "$root.install.log" >&2; return 1; }
  echo "${packages[*]}" >"$ready"
  say "chroot ready in $((SECONDS - start)) s"
}

prepare || fail "could not prepare the Debian 13 chroot in $root (see the lines above)"
# g++ 14 reports a false -Warray-bounds / -Wstringop-overflow inside LibTorch's Function::apply (a
# std::vector<bool>::reserve) wherever it is inlined into remat's code; Debian's
# Bazel reads this file after its own settings.
printf '%s\n' "build --copt=-Wno-array-bounds --copt=-Wno-stringop-overflow" >"$root/etc/bazel.bazelrc"
[[ "${1:-}" == "--prepare" ]] && exit 0

# A copy of the working tree, without build outputs or the chroot's own leftovers.
src_in=${REMAT_DEBIAN13_SRC:-/src/remat}
src="$root$src_in"
mkdir -p "$src"
find "$src" -mindepth 1 -maxdepth 1 ! -name build ! -name 'bazel-*' -exec rm -rf --one-file-system {} +
tar -c --exclude=./build --exclude='./bazel-*' --exclude=./.git . |
  tar -x -C "$src" || fail "could not copy the tree into $src"
say "$(enter /bin/sh -c 'g++ --version | head -1; dpkg-query -W -f="libtorch-dev \${Version}, " libtorch-dev; mpirun --version | head -1')"
start=$SECONDS
if [[ "${1:-}" == "--exec" ]]; then
  enter /bin/bash -c "cd $src_in && ${2:?--exec needs a command}"
  exit $?
fi
enter /bin/bash -c "cd $src_in && ./test.sh"
rc=$?
say "test.sh in the chroot took $((SECONDS - start)) s (exit $rc)"
exit $rc
