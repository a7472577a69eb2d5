"""The bf16 section of docs/benchmarks-gpu.md (benchmarks/gpu_report.py calls
section()): remat's bf16.enabled beside torch.autocast(bfloat16), model FLOP
utilisation, from DIR/mfu_shapes.json and each shape's DIR/NAME.jsonl
(benchmarks/dp_bench.cc --engine-only rows, benchmarks/torch_gpt_gpu_bench.py
--train-step rows).

MFU = (6 N + 12 L d T) FLOPs per token (PaLM's count, Chowdhery et al. 2022,
appendix B: N parameters, L layers, d = d_model, T = sequence length; the
forward and backward of every matmul and of attention's scores and values)
× the step's tokens / its time / the card's dense bf16 peak (PEAKS below, or
GPU_PEAK_TFLOPS in TFLOP/s), float32 rows over the same bf16 peak.
"""
import json
import os
import statistics

GiB = 1 << 30
# Dense bf16 tensor-core peaks, TFLOP/s: NVIDIA's data sheets list them "with
# sparsity"; dense is half (H100 SXM and H200 SXM 1,979 -> 989.5; H100 NVL and
# H200 NVL 1,671 -> 835.5; H100 PCIe 1,513 -> 756.5). First match of the name wins.
PEAKS = [("H200 NVL", 835.5), ("H100 NVL", 835.5), ("H100 PCIe", 756.5), ("H200", 989.5), ("H100", 989.5)]
# The targets and its reference (PyTorch 2.11 autocast on an H200).
FULL_LIMIT = 1.30
REFERENCE = {"L=16 d=1024 T=1024 b=8": "autocast MFU 0.31, full checkpointing 2.7 ×",
             "L=8 d=2048 T=2048 b=4": "at L=24 (1.2B parameters): autocast MFU 0.48, full checkpointing 1.36 ×"}


def peak_tflops(device_name):
    """(peak TFLOP/s or None, where it came from)."""
    env = os.environ.get("GPU_PEAK_TFLOPS")
    if env:
        return float(env), "GPU_PEAK_TFLOPS"
    for key, tflops in PEAKS:
        if key in (device_name or ""):
            return tflops, f"{key}: NVIDIA's data sheet, dense bf16"
    return None, "no bf16 peak known for this device (set GPU_PEAK_TFLOPS)"


class Config:
    """One framework's measured steps at one precision and checkpointing."""

    def __init__(self):
        self.fwd_bwd, self.step, self.peak = [], [], []
        self.params = self.shape = self.layers = None

    def add(self, r, peak):
        self.fwd_bwd.append(r["fwd_bwd_ms"])
        self.step.append(r["step_ms"])
        if peak is not None:
            self.peak.append(peak)
        self.params, self.shape, self.layers = r["params"], r["shape"], r["layers"]

    def flops(self):
        """Model FLOPs of one step: (6N + 12 L d T) per token."""
        s = self.shape
        return (6 * self.params + 12 * self.layers * s["d_model"] * s["seq"]) * s["batch"] * s["seq"]


def load(folder, name):
    """{(framework, precision, checkpointing): Config} of one shape."""
    out = {}
    for line in open(os.path.join(folder, name + ".jsonl")):
        if not line.strip():
            continue
        r = json.loads(line)
        if r["framework"] == "remat" and r.get("engine_only"):
            peak = r.get("cuda_peak_allocated_bytes", r["mem_peak_bytes"])
        elif r["framework"] == "pytorch" and r.get("kind") == "train":
            peak = r.get("peak_bytes")
        else:
            continue
        out.setdefault((r["framework"], r["precision"], r["checkpointing"]), Config()).add(r, peak)
    return out


def med(xs):
    return statistics.median(xs)


def mfu_cell(c, ms, peak):
    tflops = c.flops() / (ms * 1e-3) / 1e12
    return f"{tflops:.3g}" + (f" ({tflops / peak:.3f})" if peak else "")


def verdict(ok):
    return "**met**" if ok else "**missed**"


def targets(shape, rows, peak):
    """(target, figures, verdict) at one shape."""
    out = []
    r, t = rows.get(("remat", "bf16", "none")), rows.get(("pytorch", "bf16", "none"))
    if r and t and peak:
        rm, tm = r.flops() / med(r.fwd_bwd) / 1e9 / peak, t.flops() / med(t.fwd_bwd) / 1e9 / peak
        rs, ts = r.flops() / med(r.step) / 1e9 / peak, t.flops() / med(t.step) / 1e9 / peak
        out.append(("remat bf16 MFU ≥ PyTorch autocast's (forward + backward)",
                    f"{rm:.3f} vs {tm:.3f}; whole step {rs:.3f} vs {ts:.3f}", verdict(rm >= tm)))
    elif r and t:
        out.append(("remat bf16 MFU ≥ PyTorch autocast's", "", "n/a: no bf16 peak for this device"))
    for fw, label in (("remat", "remat bf16"), ("pytorch", "PyTorch autocast")):
        n, f = rows.get((fw, "bf16", "none")), rows.get((fw, "bf16", "full"))
        if not (n and f):
            continue
        ratio = med(f.fwd_bwd) / med(n.fwd_bwd)
        figures = (f"{med(f.fwd_bwd):.1f} / {med(n.fwd_bwd):.1f} ms = {ratio:.3f}; whole step "
                   f"{med(f.step) / med(n.step):.3f}")
        if fw == "remat":
            out.append((f"{label}: full checkpointing ≤ {FULL_LIMIT:.2f} × the step (forward + backward)", figures,
                        verdict(ratio <= FULL_LIMIT)))
        else:
            out.append((f"({label}'s full checkpointing, for comparison)", figures, ""))
    return out


def section(folder, plat, w):
    path = os.path.join(folder, "mfu_shapes.json")
    if not os.path.exists(path):
        return
    shapes = json.load(open(path))
    peak, source = peak_tflops(plat.get("device_name"))
    w("\n## bf16 beside torch.autocast: model FLOP utilisation\n")
    w("remat: `bf16.enabled` through the Engine (`benchmarks/dp_bench.cc --engine-only --bf16`: float32 masters "
      "and AdamW state, bf16 compute copies made once per step, ZeRO stage 0, one rank), each configuration its "
      "own process. PyTorch: the same GPT (`torch_gpt_gpu_bench.py --train-step`), float32 parameters, the "
      "forward under `torch.autocast(bfloat16)`, `torch.optim.AdamW` (its default implementation), the "
      "configurations interleaved step by step in one process. Both: lr 1e-3, weight decay 0.01, dropout 0.1, "
      "full checkpointing = every block one non-reentrant region; a training step (forward, backward, AdamW's "
      "step), the device synchronised before each clock read; median over the timed steps.\n")
    w(f"- FLOPs per token: 6N + 12·L·d·T (N every parameter, L layers, d = d_model, T the sequence), × batch × T "
      f"per step. Peak: {f'{peak:.1f} TFLOP/s ({source})' if peak else 'unknown: ' + source}; float32 rows "
      "over the same bf16 peak.")
    w("- TFLOP/s (MFU): forward + backward, and the whole step with AdamW. peak GiB: the caching allocator's "
      "highest allocated bytes over a step (everything live: parameters, masters, copies, gradients, AdamW "
      "state, activations; remat's `cuda_peak_allocated_bytes`, PyTorch's `max_memory_allocated`).\n")
    w("| shape | framework | precision | checkpointing | fwd+bwd ms | step ms | TFLOP/s (MFU), fwd+bwd | "
      "TFLOP/s (MFU), step | peak GiB |")
    w("|---|---|---|---|---|---|---|---|---|")
    rows_of = {}
    for s in shapes:
        rows = rows_of[s["name"]] = load(folder, s["name"])
        first = True
        for fw in ("remat", "pytorch"):
            for prec, ckpt in (("float32", "none"), ("bf16", "none"), ("bf16", "full")):
                c = rows.get((fw, prec, ckpt))
                if c is None:
                    continue
                fb, st = med(c.fwd_bwd), med(c.step)
                mem = f"{max(c.peak) / GiB:.2f}" if c.peak else "n/a"
                name = "PyTorch autocast" if fw == "pytorch" and prec == "bf16" else fw
                label = f"{s['label']} (N = {c.params:,})" if first else ""
                w(f"| {label} | {name} | {prec} | {ckpt} | {fb:.2f} | {st:.2f} | "
                  f"{mfu_cell(c, fb, peak)} | {mfu_cell(c, st, peak)} | {mem} |")
                first = False
    w("\n| shape | target | figures | verdict |")
    w("|---|---|---|---|")
    for s in shapes:
        for name, figures, v in targets(s, rows_of[s["name"]], peak):
            w(f"| {s['label']} | {name} | {figures} | {v} |")
        if s["label"] in REFERENCE:
            w(f"| {s['label']} | the issue's reference (H200, PyTorch 2.11, forward + backward) | "
              f"{REFERENCE[s['label']]} | |")
