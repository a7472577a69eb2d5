#!/usr/bin/env bash
# offload_optimizer on the device ("none"), on the host ("cpu") and on disk
# ("nvme") at stage 1, and at stage 3 offload_param and offload_optimizer
# both on the host ("s3-cpu") and both on disk ("s3-nvme", max_in_cpu 0),
# side by side in one run: remat-train's GPT at one rank, each in turn for
# ROUNDS rounds (so that the machine's drift hits each alike). Prints, per
# configuration, the median step and optimizer-step time (steps 2 on), the
# NVMe step's I/O rate (the moments read + written over its time), what is on
# disk, the process's peak RSS (GNU time), and the losses' equality within
# each stage (docs/benchmarks.md, "Optimizer state and parameters on NVMe").
#   benchmarks/nvme_offload.sh FOLDER [ROUNDS=3] [D_MODEL=512] [LAYERS=8] [SUB_GROUP=1048576]
set -euo pipefail
cd "$(dirname "$0")/.."
folder="${1:?usage: benchmarks/nvme_offload.sh FOLDER [ROUNDS] [D_MODEL] [LAYERS] [SUB_GROUP]}"
rounds="${2:-3}" d_model="${3:-512}" layers="${4:-8}" sub_group="${5:-1048576}"
bazel build //launch:remat-train //launch:remat-run >/dev/null 2>&1 || bazel build //launch:remat-train //launch:remat-run
out=build/bench/nvme_offload
mkdir -p "$out" "$folder"
model=(--set model.d_model="$d_model" --set model.n_layer="$layers" --set model.d_ff=$((4 * d_model))
       --set model.seq_len=128 --set train_micro_batch_size_per_gpu=4 --set train.eval_interval=0
       --set train.sample_chars=0 --steps 6 --set zero_optimization.sub_group_size="$sub_group"
       --set zero_optimization.offload_optimizer.nvme_path="$folder"
       --set zero_optimization.offload_param.nvme_path="$folder" --set zero_optimization.offload_param.max_in_cpu=0
       --set zero_optimization.stage3_param_persistence_threshold=0)
settings() {  # the configuration's own keys
  case "$1" in
    s3-*) echo "--set zero_optimization.stage=3 --set zero_optimization.offload_optimizer.device=${1#s3-}" \
               "--set zero_optimization.offload_param.device=${1#s3-}" ;;
    *) echo "--set zero_optimization.stage=1 --set zero_optimization.offload_optimizer.device=$1" ;;
  esac
}
for round in $(seq 1 "$rounds"); do
  for config in none cpu nvme s3-cpu s3-nvme; do
    # shellcheck disable=SC2046
    /usr/bin/time -f "%M" -o "$out/$config.$round.rss" bazel-bin/launch/remat-run -np 1 -- bazel-bin/launch/remat-train \
      "${model[@]}" $(settings "$config") --metrics "$out/$config.$round.jsonl" >"$out/$config.$round.log" 2>&1
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
losses = {}
for device in ("none", "cpu", "nvme", "s3-cpu", "s3-nvme"):
    rows = [json.loads(l) for r in range(1, rounds + 1) for l in open(f"{out}/{device}.{r}.jsonl")]
    later = [r for r in rows if r["step"] >= 2]
    rss = [int(open(f"{out}/{device}.{r}.rss").read().split()[-1]) * 1024 for r in range(1, rounds + 1)]
    losses[device] = [r["loss"] for r in rows if True][:6]
    line = (f"{device:7s} step {med([r['step_ms'] for r in later]):7.0f} ms  optimizer {med([r['opt_ms'] for r in later]):6.0f} ms"
            f"  peak RSS {med(rss) / 1e6:6.0f} MB ({min(rss) / 1e6:.0f}-{max(rss) / 1e6:.0f})")
    if "host_optimizer_bytes" in rows[-1]:
        line += f"  host optimizer {rows[-1]['host_optimizer_bytes'] / 1e6:.0f} MB"
    if device.endswith("nvme"):
        rate = [(r["nvme_read_bytes"] + r["nvme_written_bytes"]) / (r["nvme_step_ms"] / 1e3) / 1e6 for r in later]
        last = rows[-1]
        disk = last["nvme_state_bytes"] + last.get("nvme_master_bytes", 0) + last.get("nvme_parameter_bytes", 0)
        line += (f"  on disk {disk / 1e6:.0f} MB (moments {last['nvme_state_bytes'] / 1e6:.0f}, masters "
                 f"{last.get('nvme_master_bytes', 0) / 1e6:.0f}, shards {last.get('nvme_parameter_bytes', 0) / 1e6:.0f}),"
                 f" NVMe step {med([r['nvme_step_ms'] for r in later]):.0f} ms"
                 f" at {med(rate):.0f} MB/s ({min(rate):.0f}-{max(rate):.0f})")
    if "host_parameter_bytes" in rows[-1]:
        line += f"  host parameters {rows[-1]['host_parameter_bytes'] / 1e6:.0f} MB"
    print(line)
print("parameters:", json.loads(open(f"{out}/none.1.jsonl").readline()).get("param_bytes", 0) // 4, "elements")
print("stage 1: losses of none, cpu, nvme bitwise equal:", losses["none"] == losses["cpu"] == losses["nvme"])
print("stage 3: losses of s3-cpu, s3-nvme bitwise equal:", losses["s3-cpu"] == losses["s3-nvme"])
PY
