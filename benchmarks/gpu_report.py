"""docs/benchmarks-gpu.md from the rows benchmarks/gpu_bench.sh writes: per shape
DIR/NAME.jsonl (gpt_bench --device cuda and benchmarks/torch_gpt_gpu_bench.py, both
appended) and DIR/shapes.json (each shape's name, label and role); for the bf16
section (benchmarks/mfu_report.py) DIR/mfu_shapes.json and its shapes' rows
(dp_bench --engine-only and torch_gpt_gpu_bench.py --train-step):

    python3 benchmarks/gpu_report.py DIR > docs/benchmarks-gpu.md
"""
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mfu_report  # noqa: E402

MiB = 1 << 20
# (remat variant, PyTorch variant): the rows of the table, in order.
PAIRS = [("none", "none"), ("full", "full_nonreentrant"), ("full_reentrant", "full_reentrant"),
         ("every_k2", "every_k2_nonreentrant"), ("selective_op", "selective_ac"),
         ("selective_op_matmuls", "selective_ac"), ("act_offload", "save_on_cpu")]
LABEL = {"none": "none", "full": "full", "full_reentrant": "full, reentrant regions", "every_k2": "every 2nd block",
         "selective_op": "selective-op (matmuls saved)",
         "selective_op_matmuls": "selective-op (matmuls and attention saved)",
         "act_offload": "activation offloading (pinned, side streams)",
         "full_nonreentrant": "checkpoint, non-reentrant", "every_k2_nonreentrant": "every 2nd block, non-reentrant",
         "selective_ac": "selective AC (matmuls and attention saved)", "save_on_cpu": "save_on_cpu(pin_memory)"}
FULL_SLACK, OFFLOAD_SLACK = 1.03, 1.10


class Side:
    """One framework's rows at one shape."""

    def __init__(self, rows):
        self.memory, self.times, self.fwd, self.unavailable = {}, defaultdict(list), defaultdict(list), {}
        self.copy = self.platform = None
        for r in rows:
            k = r["kind"]
            if k == "memory":
                self.memory[r["variant"]] = r
            elif k == "time":
                self.times[r["variant"]].append(r["step_ms"])
                self.fwd[r["variant"]].append(r["fwd_ms"])
            elif k == "unavailable":
                self.unavailable[r["variant"]] = r["why"]
            elif k == "copy":
                self.copy = r
            elif k == "platform":
                self.platform = r

    def has(self, v):
        return v in self.memory and v in self.times

    def ms(self, v):
        return statistics.median(self.times[v])

    def time_cell(self, v):
        t = self.times[v]
        return f"{statistics.median(t):.2f} [{min(t):.2f}, {max(t):.2f}]"

    def mem_cell(self, v):
        m = self.memory[v]
        return f"{m['held_bytes'] / MiB:.1f} / {m['peak_bytes'] / MiB:.1f}"

    def why(self, v):
        return self.unavailable.get(v, "not run")


def load(folder):
    shapes = json.load(open(os.path.join(folder, "shapes.json")))
    out = []
    for s in shapes:
        rows = [json.loads(line) for line in open(os.path.join(folder, s["name"] + ".jsonl")) if line.strip()]
        out.append((s, Side([r for r in rows if r["framework"] == "remat"]),
                    Side([r for r in rows if r["framework"] == "pytorch"])))
    return out


def limits(remat, torch_side):
    """T_none, T_fwd, the offloaded bytes, the copy bandwidths and the offload bound (ms)."""
    t_none, t_fwd = remat.ms("none"), statistics.median(remat.fwd["none"])
    moved = remat.memory["act_offload"]["offloaded_bytes"] if "act_offload" in remat.memory else None
    d2h = torch_side.copy["d2h_gbps"] if torch_side.copy else None
    h2d = torch_side.copy["h2d_gbps"] if torch_side.copy else None
    bound = None
    if moved is not None and d2h and h2d:
        # Perfect overlap: the forward's copies out hide under the forward, the
        # backward's copies back under the backward, each direction one stream.
        bound = max(t_fwd, moved / (d2h * 1e6)) + max(t_none - t_fwd, moved / (h2d * 1e6))
    return t_none, t_fwd, moved, d2h, h2d, bound


def verdict(ok):
    return "**met**" if ok else "**missed**"


def targets_of(shape, remat, torch_side, lim):
    """(target, figures, verdict) rows at one shape."""
    t_none, t_fwd, _, _, _, bound = lim
    out = []
    for v in ("full", "full_reentrant"):
        if remat.has(v):
            r = remat.ms(v) / (t_none + t_fwd)
            out.append((f"{LABEL[v]} ≤ {FULL_SLACK:.2f} × (T_none + T_fwd)",
                        f"{remat.ms(v):.2f} ms / {t_none + t_fwd:.2f} ms = {r:.3f}", verdict(r <= FULL_SLACK)))
    if remat.has("act_offload"):
        if bound is None:
            out.append(("activation offloading ≤ 1.10 × its bound", "no copy bandwidth measured", "n/a"))
        else:
            r = remat.ms("act_offload") / bound
            out.append((f"activation offloading ≤ {OFFLOAD_SLACK:.2f} × its bound",
                        f"{remat.ms('act_offload'):.2f} ms / {bound:.2f} ms = {r:.3f}", verdict(r <= OFFLOAD_SLACK)))
    if shape["role"] == "compute-bound" and remat.has("selective_op"):
        if not torch_side.has("selective_ac"):
            out.append(("selective-op ≤ selective AC's time at ≤ its peak", "", torch_side.why("selective_ac")))
        else:
            tr, tp = remat.ms("selective_op"), torch_side.ms("selective_ac")
            pr, pp = remat.memory["selective_op"]["peak_bytes"], torch_side.memory["selective_ac"]["peak_bytes"]
            out.append(("selective-op ≤ selective AC's time at ≤ its peak",
                        f"{tr:.2f} / {tp:.2f} ms = {tr / tp:.3f}; peak {pr / MiB:.1f} / {pp / MiB:.1f} MiB = "
                        f"{pr / pp:.3f}", verdict(tr <= tp and pr <= pp)))
    if shape["role"] == "launch-bound":
        for rv, tv in PAIRS:
            if not remat.has(rv):
                continue
            if not torch_side.has(tv):
                out.append((f"{LABEL[rv]} ≤ PyTorch's {LABEL[tv]}", "", torch_side.why(tv)))
                continue
            r = remat.ms(rv) / torch_side.ms(tv)
            out.append((f"{LABEL[rv]} ≤ PyTorch's {LABEL[tv]}", f"{remat.ms(rv):.2f} / {torch_side.ms(tv):.2f} ms = "
                        f"{r:.3f}", verdict(r <= 1.0)))
    return out


SETUP = """\
What it measures: the GPT of models/gpt.h (remat's `benchmarks/gpt_bench --device cuda`) beside the \
same GPT written in PyTorch (`benchmarks/torch_gpt_gpu_bench.py`: the same layers, parameters and \
initial weights, attention through `scaled_dot_product_attention` with dropout and the causal mask, as \
remat's blocks call it on LibTorch 2.x), float32, dropout 0.1, one training step (forward and backward, \
no optimizer) per measurement, at a launch-bound and a compute-bound shape. Each side runs in its own \
process; per variant one step measures memory, then the variants run interleaved step by step, the \
warm-up steps dropped.

- ms: the step's wall time, the device synchronised before the clock is read; median [min, max] over \
the timed steps.
- held / peak MiB: the device memory the forward leaves for the backward, and the step's peak above \
its start (both from the caching allocator's reports: remat's MemoryTracker, PyTorch's \
`torch.cuda.memory_allocated` / `max_memory_allocated`).
- T_none: the plain step; T_fwd: its forward alone (remat's, synchronised after the forward). Full \
checkpointing recomputes every block's forward once: T_none + T_fwd is its floor.
- Copy bandwidth: one large copy (256 MiB on a GPU) each way between pinned host memory and the device, timed by CUDA \
events, median of 5. Offload bound, with B the bytes remat's activation offloading moves each way \
(its `offloaded_bytes`): max(T_fwd, B / D2H) + max(T_none − T_fwd, B / H2D): at best the copies out \
hide under the forward and the copies back under the backward, one copy stream each way.
"""


def main():
    shapes = load(sys.argv[1])
    w = print
    plat = next((t.platform for _, _, t in shapes if t.platform), {})
    w("# GPU benchmark: remat beside PyTorch on the same kernels\n")
    w(f"Generated by `benchmarks/gpu_bench.sh` on {plat.get('date', '?')}: {plat.get('device_name', '?')}, "
      f"PyTorch {plat.get('torch', '?')} (CUDA {plat.get('cuda') or 'none'}), Python {plat.get('python', '?')}; "
      "remat's gpt_bench built against the LibTorch of that PyTorch.\n")
    if plat.get("cuda") is None:
        w("**Dry run on the CPU** (tiny shapes, no pinned memory, no GPU): it checks that the benchmark runs "
          "end to end; its figures say nothing about a GPU.\n")
    w(SETUP)
    w("## Step time and memory\n")
    w("| shape | remat variant | remat ms | remat held / peak MiB | PyTorch variant | PyTorch ms | "
      "PyTorch held / peak MiB | remat / PyTorch time | peak |")
    w("|---|---|---|---|---|---|---|---|---|")
    for s, remat, torch_side in shapes:
        first = True
        for rv, tv in PAIRS:
            if not remat.has(rv):
                continue
            cells = [s["label"] if first else "", LABEL[rv], remat.time_cell(rv), remat.mem_cell(rv), LABEL[tv]]
            if torch_side.has(tv):
                ratio = remat.ms(rv) / torch_side.ms(tv)
                peak = remat.memory[rv]["peak_bytes"] / max(torch_side.memory[tv]["peak_bytes"], 1)
                cells += [torch_side.time_cell(tv), torch_side.mem_cell(tv), f"{ratio:.2f}", f"{peak:.2f}"]
            else:
                cells += [torch_side.why(tv), "", "", ""]
            w("| " + " | ".join(cells) + " |")
            first = False
    w("\n## Limits\n")
    w("| shape | T_none ms | T_fwd ms | T_none + T_fwd ms | offloaded MiB each way | D2H GB/s | H2D GB/s | "
      "offload bound ms | activation offloading ms |")
    w("|---|---|---|---|---|---|---|---|---|")
    lims = {}
    for s, remat, torch_side in shapes:
        lim = lims[s["name"]] = limits(remat, torch_side)
        t_none, t_fwd, moved, d2h, h2d, bound = lim

        def f(x, fmt):
            return "n/a" if x is None else format(x, fmt)
        off = remat.time_cell("act_offload") if remat.has("act_offload") else "not run"
        w(f"| {s['label']} | {t_none:.2f} | {t_fwd:.2f} | {t_none + t_fwd:.2f} | "
          f"{f(None if moved is None else moved / MiB, '.1f')} | {f(d2h, '.1f')} | {f(h2d, '.1f')} | "
          f"{f(bound, '.2f')} | {off} |")
    w("\n## Targets\n")
    w("Benchmark targets, not timed tests (docs/benchmarks-gpu.md is overwritten by each run).\n")
    w("| shape | target | figures | verdict |")
    w("|---|---|---|---|")
    for s, remat, torch_side in shapes:
        for name, figures, v in targets_of(s, remat, torch_side, lims[s["name"]]):
            w(f"| {s['label']} ({s['role']}) | {name} | {figures} | {v} |")
    mfu_report.section(sys.argv[1], plat, w)
    w("\n## How to run\n")
    w("On a GPU machine, inside `tools/gpu_checks.sh run` or alone after a CMake build of `gpt_bench` "
      "against the CUDA PyTorch (`-DREMAT_BUILD_BENCHMARKS=ON`):\n")
    w("    benchmarks/gpu_bench.sh                      # writes docs/benchmarks-gpu.md")
    w("    benchmarks/gpu_bench.sh --dry-run            # on a CPU, tiny shapes, into build/gpu-bench-dry/")


if __name__ == "__main__":
    main()
