"""The section "bf16 beside float32" of docs/benchmarks.md, from the rows
benchmarks/bf16_bench.sh writes (benchmarks/dp_bench.cc --engine-only, with its
.platform.json beside them):

    /usr/bin/python3 benchmarks/bf16_report.py build/bench/bf16.jsonl > bf16.md
"""
import json
import os
import statistics
import sys
from collections import defaultdict

MiB = 1 << 20
CKPT = {"none": "none", "full": "full"}


def cell(xs):
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]"


def main():
    path = sys.argv[1]
    rows = [json.loads(line) for line in open(path) if line.strip()]
    plat_path = path[:-len(".jsonl")] + ".platform.json"
    plat = json.load(open(plat_path)) if os.path.exists(plat_path) else {}
    steps, fwd_bwd, peak, act, first_loss, runs = (defaultdict(list) for _ in range(6))
    for r in rows:
        key = (r["stage"], r["checkpointing"], r["precision"])
        steps[key].append(r["step_ms"])
        fwd_bwd[key].append(r["fwd_bwd_ms"])
        peak[key].append(r["mem_peak_bytes"])
        act[key].append(r["mem_act_peak_bytes"])
        if r["step"] == 0:
            first_loss[key].append(r["loss"])
            runs[key].append(1)
    if not rows:
        sys.exit("bf16_report.py: no rows in " + path)
    r0 = rows[0]
    s = r0["shape"]
    w = print
    w("## bf16 beside float32 (`bf16.enabled`, ZeRO stages 0 and 3)\n")
    w(f"From one run of `benchmarks/bf16_bench.sh` on {plat.get('date', '?')}: {plat.get('platform', '?')}, "
      f"LibTorch {plat.get('libtorch', '?')}, {plat.get('machine', '?')} "
      f"(CPU flag {plat.get('cpu_bf16') or 'none'}), BLAS `{plat.get('blas', '?')}`; "
      f"{plat.get('rounds', '?')} rounds × {plat.get('steps', '?')} measured steps (after "
      f"{plat.get('warmup', '?')} warm-up) per configuration, the configurations one after the other in "
      "each round.\n")
    w(f"The GPT above at L = {r0['layers']} ({r0['params']:,} parameters), batch {s['batch']} per rank, sequence "
      f"{s['seq']}, d_model {s['d_model']}, {s['heads']} heads, d_ff {s['d_ff']}, vocabulary {s['vocab']}, dropout "
      f"{r0['dropout']}, AdamW (lr 1e-3, weight decay 0.01), `overlap_comm`, {r0['world']} ranks (`remat-run`), "
      "one intra-op thread per rank, trained through the Engine (`benchmarks/dp_bench.cc --engine-only`) with "
      "`bf16.enabled` true (float32 masters and AdamW state, bf16 compute copies, gradients reduced in bf16: "
      "docs/parallel.md, \"bf16 at every stage\") or false (float32), and `activation_checkpointing.variant` "
      "none or full.\n")
    w("- step ms: rank 0's wall time of forward, backward and optimizer step, every step started after a "
      "barrier; median over all rounds' measured steps [min, max].")
    w("- peak MiB: rank 0's highest live tensor bytes during the step (c10's allocator reports, `MemoryTracker` "
      "started before the model was built): parameters, the float32 masters and bf16 copies, gradients, AdamW "
      "state, activations. act MiB: the activations' peak above the forward's start (`mem_act_peak_bytes`). "
      "Both are the same in every round.")
    w("- loss: rank 0's loss at the first measured step, median over the rounds (dropout on; the same weights, "
      "data and dropout seed in both precisions).")
    mm = plat.get("matmul_gflops")
    if mm:
        w(f"- matmul GFLOP/s on one thread, the same run ([{mm['m']}, {mm['k']}] × [{mm['k']}, {mm['n']}], "
          f"Debian's python3-torch on the same ATen): float32 {mm['float32']:.1f}, bf16 {mm['bfloat16']:.1f}.")
    w("")
    w("| stage | checkpointing | float32 step ms | bf16 step ms | bf16 / float32 time | float32 peak MiB | "
      "bf16 peak MiB | bf16 / float32 peak | float32 act MiB | bf16 act MiB | loss float32 / bf16 |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(k[0], k[1]) for k in steps}, key=lambda k: (k[0], k[1] != "none"))
    for stage, ckpt in keys:
        f, b = (stage, ckpt, "float32"), (stage, ckpt, "bf16")
        if f not in steps or b not in steps:
            continue
        tf, tb = statistics.median(steps[f]), statistics.median(steps[b])
        pf, pb = statistics.median(peak[f]), statistics.median(peak[b])
        lf = statistics.median(first_loss[f]) if first_loss[f] else float("nan")
        lb = statistics.median(first_loss[b]) if first_loss[b] else float("nan")
        w(f"| {stage} | {CKPT.get(ckpt, ckpt)} | {cell(steps[f])} | {cell(steps[b])} | {tb / tf:.3f} | "
          f"{pf / MiB:.2f} | {pb / MiB:.2f} | {pb / pf:.3f} | {statistics.median(act[f]) / MiB:.2f} | "
          f"{statistics.median(act[b]) / MiB:.2f} | {lf:.4f} / {lb:.4f} |")
    w("\nFull checkpointing's cost, step time with / without (medians):\n")
    w("| stage | float32 full / none | bf16 full / none |")
    w("|---|---|---|")
    for stage in sorted({k[0] for k in steps}):
        ratios = []
        for prec in ("float32", "bf16"):
            a, n = (stage, "full", prec), (stage, "none", prec)
            ratios.append(f"{statistics.median(steps[a]) / statistics.median(steps[n]):.3f}"
                          if a in steps and n in steps else "not run")
        w(f"| {stage} | {ratios[0]} | {ratios[1]} |")
    w("")


if __name__ == "__main__":
    main()
