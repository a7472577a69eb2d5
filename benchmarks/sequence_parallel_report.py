"""The sequence-parallelism section of docs/benchmarks.md.

Reads gpt_bench's memory rows (JSON lines) at tensor-parallel sizes 2 and 4,
with and without --sequence-parallel, at two depths, and writes a markdown
section: the measured per-rank activation peak, the per-layer bytes (the
difference between the two depths over the layers added) beside the
per-layer formula of Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (2022), and the targets.

    python3 benchmarks/sequence_parallel_report.py ROWS.jsonl CONFIG.json   # prints the section
"""
import json
import sys

MiB = 1024 * 1024


def paper_units(t, sp, a, s, h):
    """Per-layer activation bytes over s·b·h in the paper (16-bit activations, 1-byte masks)."""
    core = 5 * a * s / (h * t)
    return 34 / t + core if sp else 10 + 24 / t + core


def remat_units(t, sp, a, s, h):
    """The same count for this float32 GPT, in units of s·b·h floats (4 bytes each).

    Per block autograd keeps: the block input (LayerNorm 1), LayerNorm 1's output
    (qkv's input), the residual dropout mask, the residual h (LayerNorm 2),
    LayerNorm 2's output (fc1's input), the second mask: 6, each 1/t with
    sequence parallelism; q and k (2/t), v (1/t), the attention output (1/t),
    fc1's output and GELU's output (4/t each): 12/t; the softmax output, its
    dropout mask and the dropped probabilities, 3·a·s/(h·t) (float32 masks).
    """
    core = 3 * a * s / (h * t)
    return 18 / t + core if sp else 6 + 12 / t + core


def section(rows, cfg):
    a, s, h, b = cfg["heads"], cfg["seq"], cfg["d_model"], cfg["batch"]
    sbh = s * b * h
    mem = {(r["tp"], r["sequence_parallel"], r["variant"], r["layers"]): r for r in rows
           if r.get("kind") == "memory"}
    tps = sorted({k[0] for k in mem})
    depths = sorted({k[3] for k in mem})
    lo, hi = depths[0], depths[-1]
    out = []
    w = out.append
    targets = []
    w("## Sequence parallelism (`tensor_parallel.sequence_parallel`, per rank)\n")
    w(f"The GPT above (batch {b}, sequence {s}, d_model {h}, {a} heads), "
      f"no checkpointing and full checkpointing, at tensor-parallel sizes {', '.join(map(str, tps))} "
      f"(as many ranks), L = {lo} and {hi}; one step each (the counts do not vary). Per layer: "
      f"(peak at L = {hi} − peak at L = {lo}) / {hi - lo}, which leaves out the embeddings, the head "
      "and the backward's transients. Formula: the per-layer activation bytes of Korthikanti et al. "
      "(2022), s·b·h·(10 + 24/t + 5·a·s/(h·t)) without sequence parallelism and "
      "s·b·h·(34/t + 5·a·s/(h·t)) with it, counted for 16-bit activations and 1-byte masks; "
      "remat's GPT is float32 with float32 masks, for which the same count gives "
      "4·s·b·h·(6 + 12/t + 3·a·s/(h·t)) and 4·s·b·h·(18/t + 3·a·s/(h·t)) "
      "(`remat_units()` in `benchmarks/sequence_parallel_report.py` lists the tensors).\n")
    w("| tp | sequence parallel | peak, none (MiB) | per layer, measured (B) | per layer, float32 count (B) "
      "| measured / count | per layer, paper's formula (B, 16-bit) | checkpoint inputs, full (B) | peak, full (MiB) |")
    w("|---|---|---|---|---|---|---|---|---|")
    for t in tps:
        for sp in (False, True):
            none_hi, none_lo = mem.get((t, sp, "none", hi)), mem.get((t, sp, "none", lo))
            full = mem.get((t, sp, "full", hi))
            if not (none_hi and none_lo and full):
                continue
            slope = (none_hi["peak_bytes"] - none_lo["peak_bytes"]) / (hi - lo)
            count = 4 * sbh * remat_units(t, sp, a, s, h)
            paper = sbh * paper_units(t, sp, a, s, h)
            w(f"| {t} | {'yes' if sp else 'no'} | {none_hi['peak_bytes'] / MiB:.2f} | {slope:.0f} | {count:.0f} "
              f"| {slope / count:.3f} | {paper:.0f} | {full['ckpt_saved_bytes']} | {full['peak_bytes'] / MiB:.2f} |")
    w("")
    for t in tps:
        on, off = mem.get((t, True, "none", hi)), mem.get((t, False, "none", hi))
        fon, foff = mem.get((t, True, "full", hi)), mem.get((t, False, "full", hi))
        if not (on and off and fon and foff):
            continue
        ratio = on["peak_bytes"] / off["peak_bytes"]
        formula = paper_units(t, True, a, s, h) / paper_units(t, False, a, s, h)
        targets.append((f"tp {t}, no checkpointing: peak with / without sequence parallelism ≤ the formula's "
                        f"ratio + 10 % ({formula:.3f} × 1.1 = {formula * 1.1:.3f})",
                        ratio <= formula * 1.1, f"{ratio:.3f} at L = {hi}"))
        targets.append((f"tp {t}, full checkpointing: region inputs exactly 1/{t} of those without",
                        fon["ckpt_saved_bytes"] * t == foff["ckpt_saved_bytes"],
                        f"{fon['ckpt_saved_bytes']} × {t} vs {foff['ckpt_saved_bytes']}"))
    w("| target | met | measured |")
    w("|---|---|---|")
    for name, ok, detail in targets:
        w(f"| {name} | {'met' if ok else 'not met'} | {detail} |")
    w("")
    return out, targets


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    cfg = json.load(open(sys.argv[2]))
    out, targets = section(rows, cfg)
    print("\n".join(out))
    for name, ok, detail in targets:
        print(f"target {'MET    ' if ok else 'NOT MET'} {name}: {detail}", file=sys.stderr)


if __name__ == "__main__":
    main()
