#!/usr/bin/env bash
# The largest GPT that trains on one device, with the optimizer on it, on the
# host (zero_optimization.offload_optimizer "cpu") and on disk ("nvme": the
# masters and the Adam moments in files under OUT/nvme; docs/memory.md,
# "Offloading the optimizer" and "The optimizer state on NVMe"): bf16, ZeRO
# stage 2, one rank, full checkpointing, a fixed width. For each,
# remat-estimate --device cuda finds the most layers whose estimated device
# peak fits the device, whose host part fits the host and whose files fit the
# disk (its verdict); remat-train then trains that model a few steps, and the
# run's measured peaks (and the process's peak RSS) stand beside the
# estimate. One "fit:" line per case; the exit status is 0 when each
# predicted model trained.
#
#   benchmarks/offload_fit.sh [OUT]            # GPU machine: build/gpu's binaries (tools/gpu_checks.sh
#                                              #   builds them), the card's capacity, this host's memory
#   benchmarks/offload_fit.sh --dry-run [OUT]  # here: the CPU standing in for a 48 MiB device with
#                                              #   24 MiB of host, tiny widths, build/cmake's binaries
#   benchmarks/offload_fit.sh --cpu [OUT]      # this machine: the CPU is the device and the host, a
#                                              #   rank limited to FIT_MEMORY_BYTES (REMAT_MEMORY_PER_RANK_BYTES,
#                                              #   default 96 MiB), bazel-bin's binaries
#
# Environment: BIN (the folder of remat-estimate, remat-train and remat-run),
# FIT_HOST_BYTES (the host memory the verdict allows, default: the estimator's
# own, this host's physical memory over the ranks).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=gpu
if [[ ${1:-} == --dry-run || ${1:-} == --cpu ]]; then
  mode=${1#--}
  shift
fi
out=${1:-build/offload-fit}
mkdir -p "$out" "$out/nvme"
sub_group=1000000
if [[ $mode == dry-run ]]; then
  bin=${BIN:-build/cmake} device=cpu steps=2 most=64 sub_group=16384 estimate_device=cuda
  export REMAT_MEMORY_PER_RANK_BYTES=$((48 << 20))
  host=(--host-memory "${FIT_HOST_BYTES:-$((24 << 20))}")
  shape=(--set model.d_model=64 --set model.n_head=4 --set model.d_ff=256 --set model.seq_len=64)
elif [[ $mode == cpu ]]; then
  # The host is the device: the verdict is the rank's memory against the peak,
  # which with the optimizer on the host includes it, and on disk does not.
  bin=${BIN:-bazel-bin/launch} device=cpu steps=2 most=256 sub_group=65536 estimate_device=cpu
  export REMAT_MEMORY_PER_RANK_BYTES=${FIT_MEMORY_BYTES:-$((96 << 20))}
  host=()
  shape=(--set model.d_model=128 --set model.n_head=4 --set model.d_ff=512 --set model.seq_len=64)
else
  bin=${BIN:-build/gpu} device=cuda steps=3 most=512 estimate_device=cuda
  host=()
  [[ -n ${FIT_HOST_BYTES:-} ]] && host=(--host-memory "$FIT_HOST_BYTES")
  # About 50M parameters a layer: tens of layers fit an 80 GB card.
  shape=(--set model.d_model=2048 --set model.n_head=16 --set model.d_ff=8192 --set model.seq_len=1024)
fi
for tool in remat-estimate remat-train remat-run; do
  [[ -x $bin/$tool ]] || { echo "offload_fit.sh: no $bin/$tool (build it, or set BIN)" >&2; exit 2; }
done
common=(--set bf16.enabled=true --set zero_optimization.stage=2 --set activation_checkpointing.variant=full
        --set train_micro_batch_size_per_gpu=1 --set gradient_accumulation_steps=1 "${shape[@]}")
offload=(--set zero_optimization.offload_optimizer.device=cpu --set zero_optimization.offload_optimizer.pin_memory=true)
on_disk=(--set zero_optimization.offload_optimizer.device=nvme --set zero_optimization.offload_optimizer.nvme_path="$out/nvme"
         --set zero_optimization.sub_group_size=$sub_group)

# fits LAYERS ARGS...: the estimator's verdict on that many layers (exit 0: fits).
fits() {
  local layers=$1
  shift
  "$bin/remat-estimate" --device "$estimate_device" "${host[@]}" "${common[@]}" "$@" --set model.n_layer="$layers" \
    >"$out/estimate.log" 2>&1
}

# peak_of METRICS: the most bytes remat's tracker measured in a step of that run.
peak_of() {
  python3 -c 'import json,sys; print(max(json.loads(l)["mem_peak_bytes"] for l in open(sys.argv[1]) if l.strip()))' "$1"
}

# largest ARGS...: the most layers that fit (0: not even one), doubling then bisecting.
largest() {
  local lo=0 hi=1
  while ((hi <= most)) && fits "$hi" "$@"; do
    lo=$hi
    hi=$((hi * 2))
  done
  ((hi > most)) && hi=$((most + 1))
  while ((hi - lo > 1)); do
    local mid=$(((lo + hi) / 2))
    if fits "$mid" "$@"; then lo=$mid; else hi=$mid; fi
  done
  echo "$lo"
}

rc=0
for case in device host disk; do
  args=()
  [[ $case == host ]] && args=("${offload[@]}")
  [[ $case == disk ]] && args=("${on_disk[@]}")
  layers=$(largest "${args[@]}")
  if ((layers == 0)); then
    echo "fit: optimizer on the $case: not even one layer fits"
    rc=1
    continue
  fi
  fits "$layers" "${args[@]}" --json "$out/$case-estimate.json"
  cp "$out/estimate.log" "$out/$case-estimate.log"
  label=$case-L$layers
  if ! timeout 1200 /usr/bin/time -f "%M" -o "$out/$label.rss" "$bin/remat-run" -np 1 -- "$bin/remat-train" --device "$device" --steps "$steps" \
      --metrics "$out/$label.jsonl" "${common[@]}" "${args[@]}" --set model.n_layer="$layers" \
      >"$out/$label.log" 2>&1; then
    tail -5 "$out/$label.log"
    echo "fit: optimizer on the $case: $layers layers predicted to fit, but the run failed ($out/$label.log)"
    rc=1
    continue
  fi
  python3 - "$case" "$layers" "$out/$case-estimate.json" "$out/$label.jsonl" "$out/$label.log" "$out/$label.rss" <<'EOF' || rc=1
import json, re, sys
case, layers, estimate, metrics, log, rss = sys.argv[1:7]
rows = [json.loads(l) for l in open(metrics) if l.strip()]
row = next(r for r in json.load(open(estimate))["rows"] if r["configured"])
params = re.search(r"\(([0-9]+) parameters on this rank\)", open(log, errors="replace").read())
size = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
peak = max(r.get("cuda_peak_allocated_bytes", r.get("mem_peak_bytes", 0)) for r in rows)
step = sorted(r["step_ms"] for r in rows)[len(rows) // 2]
line = (f"fit: optimizer on the {case}: {layers} layers"
        + (f" ({int(params.group(1)) / 1e6:.1f}M parameters)" if params else "")
        + f" trained {len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, median step {step:.0f} ms;"
        f" device peak {size(peak)} measured, {size(row['peak_bytes'])} estimated")
if case in ("host", "disk"):
    host = max(r.get("host_optimizer_bytes", 0) for r in rows)
    line += f"; host optimizer {size(host)} measured, {size(row['host_optimizer_bytes'])} estimated"
if case == "disk":
    disk = max(r.get("nvme_state_bytes", 0) + r.get("nvme_master_bytes", 0) for r in rows)
    line += f"; on disk {size(disk)} measured, {size(row.get('disk_bytes', 0) + row.get('disk_master_bytes', 0))} estimated"
line += f"; process peak RSS {size(int(open(rss).read().split()[-1]) * 1024)}"
print(line)
EOF
  if [[ $mode == cpu ]]; then
    # The estimate's pick against the limit as measured (remat's tracked peak):
    # where it is over, fewer layers in proportion until one is within it.
    limit=$REMAT_MEMORY_PER_RANK_BYTES
    l=$layers
    peak=$(peak_of "$out/$label.jsonl")
    while ((peak > limit && l > 1)); do
      l=$((l * limit / peak))
      ((l < 1)) && l=1
      "$bin/remat-run" -np 1 -- "$bin/remat-train" --device "$device" --steps "$steps" --metrics "$out/$case-M$l.jsonl" \
        "${common[@]}" "${args[@]}" --set model.n_layer="$l" >"$out/$case-M$l.log" 2>&1 || { rc=1; break; }
      peak=$(peak_of "$out/$case-M$l.jsonl")
    done
    echo "fit: optimizer on the $case, measured: $l layers train within the limit of $((limit >> 20)) MiB (device peak" \
         "$((peak >> 20)) MiB measured; the estimate chose $layers)"
  fi
done
exit $rc
