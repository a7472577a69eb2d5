"""Turns gpt_bench and torch_gpt.py results into docs/benchmarks.md and PNG plots.

    /usr/bin/python3 benchmarks/report.py RESULTS.jsonl CONFIG.json docs/benchmarks.md docs/img
"""
import json
import math
import re
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = 2**20


def analytic(cfg, variant, L):
    """Predicted peak activation bytes: what the regions keep plus one block's
    intermediates (and the embedding and head activations), float32.

    Per block, autograd keeps (B batch, T time, C width, H heads, F MLP width):
    LayerNorm outputs and statistics, q|k|v (3BTC), the softmax output and the
    dropped-out probabilities (2 BHTT), the attention output (BTC), the
    residual h (BTC), fc1 and GELU outputs (2 BTF), and the dropout masks,
    which ATen's CPU dropout keeps as float32 tensors of the input's size
    (BHTT + 2 BTC). A checkpoint region keeps only its input (BTC)."""
    B, T, C, H, F, V = cfg["batch"], cfg["seq"], cfg["d_model"], cfg["heads"], cfg["d_ff"], cfg["vocab"]
    btc, bhtt = B * T * C, B * H * T * T
    block = 4 * (7 * btc + 4 * B * T + 2 * bhtt + 2 * B * T * F) + 4 * (bhtt + 2 * btc)  # without its input
    boundary = 4 * btc
    # Embeddings (ids, dropout mask) and head (last block's output, ln_f stats
    # and output, log-softmax output).
    ends = 8 * (B * T + T) + 4 * btc + 4 * (btc + 2 * B * T + btc + B * T * V)
    # selective_op keeps the projections' outputs (mm/addmm): q|k|v, proj,
    # fc1, fc2; the matmul list also the scores and the attention output (bmm).
    kept = 4 * (3 * btc + btc + B * T * F + btc)
    kept_matmuls = kept + 4 * (bhtt + btc)
    if variant == "none":
        return L * (boundary + block) + ends
    if variant in ("full", "offload", "full_reentrant", "full_nonreentrant"):
        return L * boundary + block + ends
    if variant.startswith("every_k2"):
        # The peak is at the start of backward: a checkpointed block recomputes
        # only after the blocks above it have freed their intermediates.
        ck = (L + 1) // 2
        return ck * boundary + (L - ck) * (boundary + block) + ends
    if variant == "selective_op":
        return L * (boundary + kept) + block + ends
    if variant == "selective_op_matmuls":
        return L * (boundary + kept_matmuls) + block + ends
    return None


def run_length(plan):
    """keep,keep,full -> keep×2 full×1"""
    out, prev, n = [], None, 0
    for c in plan.split(","):
        if c == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev}×{n}")
        prev, n = c, 1
    out.append(f"{prev}×{n}")
    return " ".join(out)


def budget_section(rows, w, img_dir):
    """The memory planner beside every fixed policy at each budget; returns targets."""
    mem, times, infeasible = {}, defaultdict(list), {}
    steps = defaultdict(dict)  # (variant, L) -> step -> (wall ms, thread CPU ms)
    for r in rows:
        if r.get("infeasible"):
            infeasible[(r["variant"], r["layers"])] = r
        elif r["kind"] == "memory":
            mem[(r["variant"], r["layers"])] = r
        else:
            times[(r["variant"], r["layers"])].append(r["step_ms"])
            steps[(r["variant"], r["layers"])][r["step"]] = (r["step_ms"], r.get("step_cpu_ms"))

    def extra_over_none(v, L, which):
        """The median over steps of the variant's step minus none's of the same round (paired)."""
        own, base = steps[(v, L)], steps[("none", L)]
        d = [own[s][which] - base[s][which] for s in own if s in base and own[s][which] is not None
             and base[s][which] is not None]
        return median(d)

    layers = sorted({L for _, L in mem})
    targets = []
    w("## Memory budget planner (variant auto)\n")
    w("For each budget (a fraction of the measured peak without checkpointing) the planner profiles "
      "the step once per depth (every block under keep, selective_op, selective_op_matmuls and full, "
      "2 rounds, thread CPU time) and solves for the least extra time whose predicted peak fits. "
      "Beside it: every fixed policy, and the fastest fixed policy whose measured peak fits the same "
      "budget. Times: variants interleaved step by step; median [min, max]. \"As fast\" allows half "
      "the fixed policy's spread. Extra ms, predicted / measured: the plan's predicted extra time per "
      "step (the time model of docs/checkpointing.md: each checkpointed block's recompute) beside the "
      "median over steps of its step minus none's step of the same round, in thread CPU time and in "
      "wall time (on a loaded shared machine wall time also counts the waits for a core).\n")
    fig, axes = plt.subplots(1, len(layers), figsize=(6 * len(layers), 4.5), squeeze=False)
    for ax, L in zip(axes[0], layers):
        none = mem[("none", L)]["peak_bytes"]
        t_none = median(times[("none", L)])
        fixed = sorted(v for v, LL in mem if LL == L and not v.startswith("auto"))
        autos = sorted((v for v, LL in mem if LL == L and v.startswith("auto")), key=lambda v: int(v[4:]))
        w(f"### L = {L}\n")
        w("| fixed policy | peak MiB (× none) | step ms, median [min, max] (× none) |")
        w("|---|---|---|")
        for v in sorted(fixed, key=lambda v: mem[(v, L)]["peak_bytes"]):
            p, ts = mem[(v, L)]["peak_bytes"], times[(v, L)]
            w(f"| {v} | {p / MiB:.2f} ({p / none:.3f}) | {median(ts):.1f} [{min(ts):.1f}, {max(ts):.1f}] "
              f"({median(ts) / t_none:.3f}) |")
        w("")
        w("| budget | plan | predicted / measured peak MiB | planner step ms | extra ms CPU predicted / measured | "
          "extra ms wall predicted / measured | fastest fixed policy that fits | its step ms | planner as fast | "
          "strictly faster |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        for v in autos:
            r = mem[(v, L)]
            budget, peak, pred = r["budget_bytes"], r["peak_bytes"], r["predicted_peak_bytes"]
            ts = times[(v, L)]
            fits = [f for f in fixed if mem[(f, L)]["peak_bytes"] <= budget]
            best = min(fits, key=lambda f: median(times[(f, L)])) if fits else None
            cpu_pred, cpu_meas = r["predicted_extra_cpu_ms"], extra_over_none(v, L, 1)
            wall_pred, wall_meas = r.get("predicted_extra_wall_ms", float("nan")), extra_over_none(v, L, 0)
            line = (f"| {v[4:]} % = {budget / MiB:.2f} MiB | {run_length(r['plan'])} | {pred / MiB:.2f} / "
                    f"{peak / MiB:.2f} | {median(ts):.1f} [{min(ts):.1f}, {max(ts):.1f}] | "
                    f"{cpu_pred:.1f} / {cpu_meas:.1f} | {wall_pred:.1f} / {wall_meas:.1f} | ")
            if cpu_meas == cpu_meas and cpu_meas > 0:
                targets.append((f"planner at {v[4:]} % (L = {L}): predicted extra time within 20 % of the "
                                "measured (thread CPU time)", abs(cpu_pred / cpu_meas - 1) <= 0.20,
                                f"{cpu_pred:.1f} / {cpu_meas:.1f} ms = {cpu_pred / cpu_meas:.2f}; wall "
                                f"{wall_pred:.1f} / {wall_meas:.1f} ms"))
            if best:
                bt = times[(best, L)]
                spread = (max(bt) - min(bt)) / median(bt) / 2
                as_fast = median(ts) <= median(bt) * (1 + spread)
                strict = median(ts) < median(bt)
                line += (f"{best} ({mem[(best, L)]['peak_bytes'] / MiB:.2f} MiB) | {median(bt):.1f} "
                         f"[{min(bt):.1f}, {max(bt):.1f}] | {'yes' if as_fast else 'no'} | "
                         f"{'yes' if strict else 'no'} ({median(ts) / median(bt):.3f}) |")
                targets.append((f"planner at {v[4:]} % (L = {L}) at least as fast as the fastest fixed policy "
                                "that fits (within half its spread)", as_fast,
                                f"{median(ts):.1f} vs {best} {median(bt):.1f} ms"))
                targets.append((f"planner at {v[4:]} % (L = {L}) strictly faster than every fixed policy "
                                "that fits", strict, f"ratio {median(ts) / median(bt):.3f}"))
            else:
                line += "none fits | | | |"
            targets.append((f"planner at {v[4:]} % (L = {L}): measured peak ≤ 1.05 × budget and within "
                            "10 % of the prediction", peak <= 1.05 * budget and abs(peak / pred - 1) <= 0.10,
                            f"{peak / budget:.3f} × budget, {peak / pred:.3f} × predicted"))
            w(line)
        for (v, LL), r in sorted(infeasible.items()):
            if LL == L:
                w(f"| {v[4:]} % = {r['budget_bytes'] / MiB:.2f} MiB | infeasible: the smallest peak any plan "
                  f"reaches is {r['smallest_feasible_bytes'] / MiB:.2f} MiB | | | | | | | | |")
        w("")
        # Step time against peak: fixed policies, the planner, the frontier.
        pts = [(mem[(v, L)]["peak_bytes"] / none, median(times[(v, L)]) / t_none, v) for v in fixed]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", label="fixed policies")
        for x, y, v in pts:
            ax.annotate(v, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        apts = [(mem[(v, L)]["peak_bytes"] / none, median(times[(v, L)]) / t_none, v) for v in autos]
        ax.scatter([p[0] for p in apts], [p[1] for p in apts], color="tab:red", marker="*", s=120,
                   label="planner (auto)")
        for x, y, v in apts:
            ax.annotate(v, (x, y), fontsize=7, color="tab:red", xytext=(3, -10), textcoords="offset points")
        frontier, best_t = [], float("inf")
        for x, y, _ in sorted(pts + apts):
            if y < best_t:
                frontier.append((x, y))
                best_t = y
        ax.step([p[0] for p in frontier], [p[1] for p in frontier], where="post", color="gray",
                linewidth=0.8, label="lower-left frontier")
        for f in sorted({int(v[4:]) for v in autos}):
            ax.axvline(f / 100, color="tab:red", linewidth=0.5, linestyle=":")
        ax.set_xlabel("peak activation / none")
        ax.set_ylabel("step time / none")
        ax.set_title(f"L = {L}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{img_dir}/budget_frontier.png", dpi=110)
    w("![step time against peak memory](img/budget_frontier.png)\n")
    return targets


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def sections(text):
    """The '## ' sections of a markdown text, as (heading, text) in order."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [(part.splitlines()[0], part.rstrip("\n")) for part in parts if part.startswith("## ")]


# Sections of docs/benchmarks.md that other scripts write (host_adam_bench,
# benchmarks/bf16_bench.sh) or that hold a GPU run's figures: carried over from
# the existing file as they are, instead of being dropped by this rewrite.
KEPT = ("## Fused host AdamW", "## bf16 beside float32", "## On a GPU")


def kept_sections(md_path):
    try:
        old = open(md_path).read()
    except FileNotFoundError:
        return []
    return [text for heading, text in sections(old) if heading.startswith(KEPT)]


def main():
    results_path, cfg_path, md_path, img_dir = sys.argv[1:5]
    budget_path = sys.argv[5] if len(sys.argv) > 5 else None
    sequence_parallel_md = sys.argv[6] if len(sys.argv) > 6 else None
    dp_md = sys.argv[7] if len(sys.argv) > 7 else None
    cfg = json.load(open(cfg_path))
    rows = [json.loads(l) for l in open(results_path) if l.strip()]
    mem = {}
    times = defaultdict(lambda: defaultdict(list))
    fwd = defaultdict(lambda: defaultdict(list))
    tp_rows = {}
    check = {}
    for r in rows:
        if r.get("kind") == "check":
            check[r["framework"]] = r["loss"]
        elif r.get("tp", 1) > 1:
            tp_rows[r["variant"]] = r
        elif r["kind"] == "memory":
            mem[(r["framework"], r["variant"], r["layers"])] = r["peak_bytes"]
        else:
            times[r["framework"]][r["variant"]].append(r["step_ms"])
            fwd[r["framework"]][r["variant"]].append(r["fwd_ms"])
    layers = sorted({k[2] for k in mem})
    series = sorted({(k[0], k[1]) for k in mem}, key=lambda s: (s[0] != "remat", s[1]))
    L_t = cfg["time_layers"]

    out = []
    w = out.append
    w("# Benchmarks: remat against PyTorch's own checkpointing\n")
    w("Written by `./bench.sh` from one run on this machine "
      f"({cfg['machine']}); do not edit by hand.\n")
    w("## Setup\n")
    w(f"- The GPT of `models/gpt.cc`: batch {cfg['batch']}, sequence {cfg['seq']}, d_model "
      f"{cfg['d_model']}, {cfg['heads']} heads, d_ff {cfg['d_ff']}, vocabulary {cfg['vocab']}, "
      f"dropout {cfg['dropout']}, float32, 1 thread, seed {cfg['seed']}. PyTorch: the same model in "
      "`benchmarks/torch_gpt.py`, Debian's python3-torch "
      f"{cfg['torch_version']} (the same ATen kernels as libtorch-dev), `torch.utils.checkpoint` with "
      "`use_reentrant` true and false at the same block boundaries.")
    if "remat" in check and "pytorch" in check:
        d = abs(check["remat"] - check["pytorch"])
        w(f"- Same function: the first step's loss without dropout is {check['remat']!r} in remat "
          f"and {check['pytorch']!r} in PyTorch (difference {d:.2g}).")
    w("- Peak activation bytes = peak live tensor bytes during one training step minus the live "
      "bytes at its start, parameter gradients already allocated. remat: `MemoryTracker` "
      "(c10's allocator reports). PyTorch: the profiler's memory events (the same reports), "
      "summed in order. One step per variant and depth (the counts do not vary).")
    w(f"- Time: at L = {L_t}, variants interleaved step by step within each framework's process, "
      f"{cfg['warmup']} warm-up steps dropped, {cfg['steps']} measured steps per variant; median "
      "[min, max]. ρ = (T_variant − T_none) / T_forward,none, per framework.")
    w("- The analytic prediction counts what autograd keeps per block (see `analytic()` in "
      "`benchmarks/report.py`): each region's input, plus one block's intermediates during its "
      "recompute, plus the embedding and head activations. It leaves out transient gradient "
      "buffers, so measured peaks sit above it.\n")

    w("## Peak activation memory against depth\n")
    w("Each cell: measured MiB (fraction of the same framework's none; analytic prediction "
      "in MiB, measured / predicted).\n")
    w("| framework | variant | " + " | ".join(f"L = {L}" for L in layers) + " |")
    w("|---|---" + "|---" * len(layers) + "|")
    for f, v in series:
        cells = []
        for L in layers:
            b = mem.get((f, v, L))
            none = mem.get((f, "none", L))
            pred = analytic(cfg, v, L)
            if b is None:
                cells.append("")
                continue
            cell = f"{b / MiB:.2f} ({b / none:.3f}" if none else f"{b / MiB:.2f} ("
            if pred:
                cell += f"; {pred / MiB:.2f}, {b / pred:.3f}"
            cells.append(cell + ")")
        w(f"| {f} | {v} | " + " | ".join(cells) + " |")
    w("\n![peak activation bytes against depth](img/peak_vs_layers.png)\n")

    w(f"## Step time at L = {L_t}\n")
    w("| framework | variant | step ms, median [min, max] | time vs none | ρ | remat vs PyTorch |")
    w("|---|---|---|---|---|---|")
    ratio = {}
    rho = {}
    for f in ("remat", "pytorch"):
        if "none" not in times[f]:
            continue
        t_none, f_none = median(times[f]["none"]), median(fwd[f]["none"])
        for v, ts in sorted(times[f].items(), key=lambda kv: kv[0] != "none"):
            t = median(ts)
            ratio[(f, v)] = t / t_none
            rho[(f, v)] = (t - t_none) / f_none
            other = ""
            if f == "remat":
                peer = {"none": "none", "full": "full_nonreentrant", "full_reentrant": "full_reentrant",
                        "every_k2": "every_k2_nonreentrant",
                        "every_k2_reentrant": "every_k2_reentrant",
                        "act_offload": "save_on_cpu"}.get(v)
                if peer and peer in times["pytorch"]:
                    other = f"{t / median(times['pytorch'][peer]):.3f} (vs {peer})"
            w(f"| {f} | {v} | {t:.1f} [{min(ts):.1f}, {max(ts):.1f}] | {t / t_none:.3f} | "
              f"{rho[(f, v)]:.3f} | {other} |")
    w("\n![time relative to no checkpointing](img/time_ratio.png)\n")

    if tp_rows:
        w("## Partitioned checkpoints at tensor-parallel size 2 (2 ranks, per rank)\n")
        w("| variant | ckpt_saved_bytes | peak activation |")
        w("|---|---|---|")
        for v, r in sorted(tp_rows.items()):
            w(f"| {v} | {r['ckpt_saved_bytes']} | {r['peak_bytes'] / MiB:.2f} MiB |")
        w("")

    targets = []
    L_max = layers[-1]
    full = {L: mem.get(("remat", "full", L)) for L in layers}
    pt = {L: min(x for x in (mem.get(("pytorch", "full_reentrant", L)), mem.get(("pytorch", "full_nonreentrant", L))) if x)
          for L in layers if mem.get(("pytorch", "full_reentrant", L))}
    le_pt = all(full[L] <= pt[L] for L in pt)
    worst = max((full[L] / pt[L] for L in pt), default=float("nan"))
    targets.append(("full-checkpoint peak activation ≤ PyTorch's (the lower of its two modes) at every L",
                    le_pt, f"worst remat / PyTorch = {worst:.3f}"))
    # The issue-level target of the non-reentrant mode: at or below PyTorch's
    # use_reentrant=False, and the reentrant mode at or below use_reentrant=True.
    for ours, theirs in (("full", "full_nonreentrant"), ("full_reentrant", "full_reentrant")):
        pairs = [(L, mem.get(("remat", ours, L)), mem.get(("pytorch", theirs, L))) for L in layers]
        pairs = [(L, a, b) for L, a, b in pairs if a and b]
        if pairs:
            targets.append((f"remat {ours} peak activation ≤ PyTorch {theirs} at every L",
                            all(a <= b for _, a, b in pairs),
                            "remat − PyTorch bytes: " + ", ".join(f"{a - b:+d}" for _, a, b in pairs)))
    within = [full[L] / analytic(cfg, "full", L) for L in layers]
    targets.append(("full-checkpoint peak within 10% of the analytic minimum at every L",
                    all(x <= 1.10 for x in within), "measured / predicted: " + ", ".join(f"{x:.3f}" for x in within)))
    if ("remat", "full") in rho:
        pt_rho = min(rho.get(("pytorch", v), math.inf) for v in ("full_reentrant", "full_nonreentrant"))
        targets.append(("full-checkpoint ρ ≤ 1.05", rho[("remat", "full")] <= 1.05, f"ρ = {rho[('remat', 'full')]:.3f}"))
        targets.append(("full-checkpoint ρ ≤ PyTorch's", rho[("remat", "full")] <= pt_rho,
                        f"remat {rho[('remat', 'full')]:.3f}, PyTorch best {pt_rho:.3f}"))
    if ("remat", "full") in rho and ("remat", "full_reentrant") in rho:
        a, b = times["remat"]["full"], times["remat"]["full_reentrant"]
        spread = (max(b) - min(b)) / median(b) / 2
        targets.append(("non-reentrant full step time not worse than reentrant (within half the reentrant spread)",
                        median(a) <= median(b) * (1 + spread),
                        f"ρ non-reentrant {rho[('remat', 'full')]:.3f}, reentrant {rho[('remat', 'full_reentrant')]:.3f}; "
                        f"median ratio {median(a) / median(b):.3f}"))
    sel = mem.get(("remat", "selective_op", L_t)), mem.get(("remat", "none", L_t))
    if all(sel) and ("remat", "selective_op") in ratio:
        targets.append(("selective_op activation memory ≤ 0.5 × none", sel[0] <= 0.5 * sel[1], f"{sel[0] / sel[1]:.3f} × none at L = {L_t}"))
        targets.append(("selective_op step time ≤ 1.10 × none", ratio[("remat", "selective_op")] <= 1.10,
                        f"{ratio[('remat', 'selective_op')]:.3f} × none"))
    for L in layers:
        a, b = mem.get(("remat", "selective_op", L)), mem.get(("remat", "none", L))
        if a and b and L != L_t:
            targets.append((f"selective_op activation memory ≤ 0.5 × none at L = {L}", a <= 0.5 * b, f"{a / b:.3f} × none"))
    offload = [(L, mem.get(("remat", "act_offload", L)), mem.get(("remat", "none", L))) for L in layers]
    offload = [(L, a, b) for L, a, b in offload if a and b]
    if offload:
        targets.append(("activation offloading: device-side peak activation ≤ 0.25 × none at every L",
                        all(a <= 0.25 * b for _, a, b in offload),
                        ", ".join(f"{a / b:.3f}" for _, a, b in offload) + " × none"))
    if ("remat", "act_offload") in ratio:
        targets.append(("activation offloading: step time ≤ 1.15 × none (CPU copies)",
                        ratio[("remat", "act_offload")] <= 1.15,
                        f"{ratio[('remat', 'act_offload')]:.3f} × none"))
    if "full" in tp_rows and "partitioned" in tp_rows:
        a, b = tp_rows["full"]["ckpt_saved_bytes"], tp_rows["partitioned"]["ckpt_saved_bytes"]
        targets.append(("partitioned per-rank checkpoint bytes = 1/mp of unpartitioned (mp = 2)", 2 * b == a, f"{b} of {a}"))
    if sequence_parallel_md:
        # Written whole by benchmarks/sequence_parallel_bench.sh, its targets included.
        w(open(sequence_parallel_md).read())
    if dp_md:
        # Written whole by benchmarks/dp_bench.sh (benchmarks/dp_report.py), its targets included.
        w(open(dp_md).read())
    if budget_path:
        targets += budget_section([json.loads(l) for l in open(budget_path) if l.strip()], w, img_dir)
    for text in kept_sections(md_path):
        w(text + "\n")
    w("## Targets\n")
    w("| target | met | measured |")
    w("|---|---|---|")
    for name, ok, detail in targets:
        w(f"| {name} | {'met' if ok else 'not met'} | {detail} |")
    w("")
    w("## Notes on the figures\n")
    w("- remat's `full` and `every_k2` are non-reentrant regions (the default), `*_reentrant` the "
      "reentrant ones; PyTorch's are `use_reentrant=False` and `True`. A region keeps the RNG "
      "states its forward drew from (here the default CPU generator, 5056 bytes; the tracker's "
      "state is forked only at tensor-parallel size > 1), as PyTorch keeps the CPU state.")
    w("- Measured peaks include transient gradient buffers of the backward (gradients of the "
      "logits, of a block's outputs and inputs while they are combined), which the analytic "
      "minimum leaves out; their share falls as L grows.")
    w("- selective_op keeps private copies of the projections' outputs per block (q|k|v, proj, "
      "fc1, fc2: the default list, `aten::mm` and `aten::addmm`) so that the recompute replays "
      "them, and recomputes the attention core; selective_op_matmuls (`matmul_save_ops()`, the "
      "default before) also keeps the B·H·T·T attention scores and the attention output. Ten "
      "B·T·C tensors per block (with the region input) are the floor of any list that recomputes "
      "no matmul: at L = 8 the head and one block's recompute add a fixed 4 MiB on top, so "
      "0.5 × none is out of reach for an op list there and within reach from L = 16 on.")
    w("- act_offload is remat's activation offloading (OffloadActivations, torchtune's defaults, "
      "no checkpointing): on this CPU-only build the host copies live in an arena outside c10's "
      "allocator, so the peak counts what stays on the \"device\". PyTorch 1.13's nearest peer, "
      "`torch.autograd.graph.save_on_cpu`, copies CPU tensors into CPU memory of the same "
      "allocator: its peak cannot drop on a CPU-only machine, and its time shows the copies' cost.")
    w("- On this CPU-only machine offloaded copies are CPU memory too: the offload variant "
      "shows the cost of the copies, not the device memory it frees on a GPU.")
    open(md_path, "w").write("\n".join(out) + "\n")
    for name, ok, detail in targets:
        print(f"target {'MET    ' if ok else 'NOT MET'} {name}: {detail}")

    # Plots.
    fig, ax = plt.subplots(figsize=(8, 5))
    for f, v in series:
        ys = [mem.get((f, v, L)) for L in layers]
        ax.plot(layers, [y / MiB if y else None for y in ys], marker="o" if f == "remat" else "x",
                linestyle="-" if f == "remat" else "--", label=f"{f} {v}")
    ax.set_xlabel("layers L")
    ax.set_ylabel("peak activation (MiB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(layers)
    ax.set_xticklabels([str(L) for L in layers])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Peak activation bytes per training step")
    fig.tight_layout()
    fig.savefig(f"{img_dir}/peak_vs_layers.png", dpi=110)
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{f}\n{v}" for (f, v) in ratio]
    ax.bar(range(len(ratio)), list(ratio.values()), color=["tab:blue" if f == "remat" else "tab:orange" for f, _ in ratio])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ratio)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(f"step time / none (L = {L_t})")
    ax.set_title("Step time relative to no checkpointing (median)")
    fig.tight_layout()
    fig.savefig(f"{img_dir}/time_ratio.png", dpi=110)


if __name__ == "__main__":
    main()
