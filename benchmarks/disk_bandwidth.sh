#!/usr/bin/env bash
# The disk's sequential bandwidth, fio beside remat's asynchronous I/O
# (runtime/async_io.h) in one run on the same folder: direct I/O (O_DIRECT),
# queue depth 8 (DeepSpeed's aio.queue_depth default), at each block size
# (1 MiB: remat's and DeepSpeed's aio.block_size default; 256 KiB: a common
# tuned value). fio uses its libaio engine, what DeepSpeed's aio op builds on,
# and its io_uring engine; remat each of its backends (benchmarks/aio_bench.cc).
# Prints the machine's facts and a markdown table (docs/benchmarks.md, "Disk:
# fio and remat's asynchronous I/O"): MB/s (10^6 bytes/s) and remat / fio
# (libaio engine) for each row. Run it under the build lock on a shared machine.
#
#   bazel build //benchmarks:aio_bench
#   benchmarks/disk_bandwidth.sh [FOLDER] [SIZE_MIB] [ROUNDS]
#
# FOLDER defaults to /var/tmp/remat-disk-bench (the root filesystem: on this
# machine /tmp is the same disk); SIZE_MIB to 1024.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/var/tmp/remat-disk-bench}
size_mib=${2:-1024}
repeats=${3:-3}
bench=bazel-bin/benchmarks/aio_bench
command -v fio >/dev/null || { echo "disk_bandwidth: fio is missing (tools/install_deps.sh installs it)" >&2; exit 1; }
[[ -x $bench ]] || { echo "disk_bandwidth: build it first: bazel build //benchmarks:aio_bench" >&2; exit 1; }
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; rm -f "$dir/fio_bench.bin"' EXIT

echo "folder: $dir ($(df -T "$dir" | awk 'NR == 2 { print $2 " on " $1 }'), $(df -h "$dir" | awk 'NR == 2 { print $4 }') free)"
echo "kernel: $(uname -r); fio: $(fio --version); cores: $(nproc)"

# fio's MB/s of one run: one job, queue depth 8, fallocate'd file.
fio_rate() {  # ENGINE RW BLOCK_KIB
  fio --name=seq --filename="$dir/fio_bench.bin" --size="${size_mib}M" --rw="$2" --bs="${3}k" \
    --direct=1 --ioengine="$1" --iodepth=8 --numjobs=1 --output-format=json 2>/dev/null |
    python3 -c 'import json, sys; j = json.load(sys.stdin)["jobs"][0]
op = "write" if j["write"]["io_bytes"] else "read"
print(round(j[op]["bw_bytes"] / 1e6))'
}

# REPEATS rounds, each running every fio row and then remat's at each block
# size, so that drift in the machine's load hits both alike; medians below.
for ((r = 0; r < repeats; r++)); do
  for kib in 1024 256; do
    for op in write read; do
      for engine in libaio io_uring; do
        echo "fio-$engine $((kib << 10)) $op $(fio_rate "$engine" "$op" "$kib") 0" >>"$tmp/rows"
      done
    done
    "$bench" --dir "$dir" --size-mib "$size_mib" --block-kib "$kib" -n 1 >"$tmp/out"
    grep -v '^#' "$tmp/out" | tail -n +2 >>"$tmp/rows"
  done
done
grep '^#' "$tmp/out" | sed 's/^# //'

python3 - "$tmp/rows" <<'PY'
import collections, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    who, block, op, rate, _ = line.split()
    runs[(who, int(block), op)].append(float(rate))
def median(key):
    rates = sorted(runs[key])
    return rates[len(rates) // 2], (rates[-1] - rates[0]) / rates[len(rates) // 2], len(rates)
names = ["fio-libaio", "fio-io_uring", "io_uring", "libaio", "threads"]
print("MB/s: the median of %d runs [spread: (max - min) / median]" % median(("fio-libaio", 1 << 20, "read"))[2])
print()
print("| block | op | fio libaio | fio io_uring | remat io_uring | remat libaio | remat threads | remat / fio libaio (io_uring, libaio, threads) |")
print("|---|---|---|---|---|---|---|---|")
for block in sorted({k[1] for k in runs}, reverse=True):
    for op in ("write", "read"):
        cells = [median((n, block, op)) for n in names]
        base = cells[0][0]
        shown = ["%.0f [%.0f %%]" % (c[0], 100 * c[1]) for c in cells]
        ratios = ", ".join("%.0f %%" % (100 * c[0] / base) for c in cells[2:])
        print("| %d KiB | %s | %s | %s |" % (block >> 10, op, " | ".join(shown), ratios))
PY
