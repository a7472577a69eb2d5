"""PyTorch's side of benchmarks/gpu_bench.sh: the GPT of benchmarks/torch_gpt.py (the
structure of models/gpt.cc) with the attention remat's blocks run on LibTorch 2.x,
torch.nn.functional.scaled_dot_product_attention (dropout, causal), under PyTorch's
own memory-saving techniques, on a CUDA device (or on the CPU for a dry run).
One JSON object per line, the fields of bench/gpt_bench --device cuda:

    python3 benchmarks/torch_gpt_gpu_bench.py --device cuda --layers 8 --d-model 512 --heads 8 \
        --d-ff 2048 --seq 256 --batch 8 --vocab 512 --steps 5 --warmup 2 --out FILE

Variants: none; full_nonreentrant / full_reentrant (torch.utils.checkpoint around
every block); every_k2_nonreentrant (blocks 0, 2, 4, ...); selective_ac (every block,
torch.utils.checkpoint.create_selective_checkpoint_contexts, PyTorch 2.4 on: the
matmuls and the attention kernels MUST_SAVE, everything else PREFER_RECOMPUTE);
save_on_cpu (torch.autograd.graph.save_on_cpu, pinned on a GPU). A variant this
PyTorch lacks writes a row {"kind": "unavailable", "why": ...}.

Rows: "platform" (device name, versions, date); per variant one "memory" row (one
step: the bytes the forward leaves for the backward, and the step's peak above
its start, from torch.cuda's allocator statistics, which count what remat's
MemoryTracker counts; on the CPU from the profiler's memory events) and "time"
rows (variants interleaved step by step, warm-up dropped; the device
synchronised before each clock read: fwd_ms is the forward alone); one "copy"
row (pinned host <-> device copy bandwidth, GB/s, median of 5 copies of 256 MiB
timed by CUDA events; on the CPU a host-to-host copy, for the dry run only).

--train-step: the training step (forward, backward, AdamW's step) in float32 and
under torch.autocast(bfloat16), without and with full checkpointing, beside
remat's bf16.enabled (benchmarks/dp_bench.cc --engine-only --bf16) for the MFU
table of benchmarks/gpu_report.py. --train-variants picks them (float32_none,
bf16_none, bf16_full); they run interleaved step by step, warm-up dropped.
Rows "train": fwd_bwd_ms (forward and backward), step_ms (AdamW's step and
zero_grad included), peak_bytes (torch.cuda.max_memory_allocated over the step,
everything live counted: parameters, gradients, AdamW state, activations; the
fields of remat's cuda_peak_allocated_bytes; none on the CPU).
"""
import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import Block, Gpt, peak_bytes  # noqa: E402

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # PyTorch 2.0 on
HAS_SAC = hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")  # 2.4 on
VARIANTS = "none,full_nonreentrant,full_reentrant,every_k2_nonreentrant,selective_ac,save_on_cpu"


class SdpaBlock(Block):
    """torch_gpt.Block with the fused attention of models/stack.cc on LibTorch 2.x
    (the same math; without SDPA, on PyTorch 1.13, Block's written-out attention)."""

    def attention(self, x):
        if not HAS_SDPA:
            return super().attention(x)
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def sac_context_fn():
    """The selective activation checkpointing policy: matmuls and attention saved."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def unavailable(variant):
    if variant == "selective_ac" and not HAS_SAC:
        return f"n/a (PyTorch < 2.4: {torch.__version__})"
    return None


def block_runner(variant, n_layer):
    """The function that runs block i under a variant."""
    if variant in ("none", "save_on_cpu"):
        return lambda i, b, x: b(x)
    if variant == "selective_ac":
        ctx = sac_context_fn()
        return lambda i, b, x: checkpoint(b, x, use_reentrant=False, context_fn=ctx)
    kind, mode = variant.rsplit("_", 1)
    every = {"full": 1, "every_k2": 2}[kind]
    return lambda i, b, x: checkpoint(b, x, use_reentrant=mode == "reentrant") if i % every == 0 else b(x)


def model_loss(model, idx, targets, run):
    """Gpt.loss of benchmarks/torch_gpt.py, each block through `run`."""
    T = idx.size(1)
    pos = torch.arange(T, dtype=torch.long, device=idx.device)
    x = F.dropout(model.tok_emb(idx) + model.pos_emb(pos), model.p, model.training)
    for i, block in enumerate(model.blocks):
        x = run(i, block, x)
    logits = model.head(model.ln_f(x)).float()
    return F.cross_entropy(logits.view(-1, model.vocab), targets.view(-1))


class Device:
    """Synchronisation, memory statistics and copies on the device of the run."""

    def __init__(self, name):
        self.cuda = name == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def offload(self, variant):
        if variant == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=self.cuda)
        return _null()

    def memory_step(self, forward):
        """(held, peak) bytes of one step: after the forward, and above the step's start."""
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = forward()
            self.sync()
            held = torch.cuda.memory_allocated() - base
            loss.backward()
            self.sync()
            return held, torch.cuda.max_memory_allocated() - base, loss.item()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as pf:
            loss = forward()
        fwd_events = [e.nbytes() for e in pf.profiler.kineto_results.events() if e.name() == "[memory]"]
        held = sum(fwd_events)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as pb:
            loss.backward()
        return held, max(peak_bytes(pf), held + peak_bytes(pb)), loss.item()

    def copy_bandwidth(self, nbytes, repeats=5):
        """(D2H, H2D) GB/s of one copy of `nbytes` between pinned host memory and the device."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dev.fill_(1)
        out = []
        for dst, src in ((host, dev), (dev, host)):
            times = []
            for _ in range(repeats + 1):  # the first warms up
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    times.append(time.perf_counter() - t0)
            out.append(nbytes / statistics.median(times[1:]) / 1e9)
        return out


def train_step_bench(a, dev, model, idx, targets, write):
    """The --train-step rows: float32 and autocast(bfloat16) training steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    params = sum(p.numel() for p in model.parameters())
    shape = {"batch": a.batch, "seq": a.seq, "d_model": a.d_model, "heads": a.heads, "d_ff": a.d_ff,
             "vocab": a.vocab}
    variants = a.train_variants.split(",")
    for v in variants:
        if v not in ("float32_none", "bf16_none", "bf16_full"):
            sys.exit(f"torch_gpt_gpu_bench.py: unknown train variant '{v}' (float32_none, bf16_none, bf16_full)")

    def autocast(v):
        if v.startswith("bf16"):
            return torch.autocast(device_type=dev.device.type, dtype=torch.bfloat16)
        return _null()

    for s in range(a.warmup + a.steps):
        for v in variants:
            precision, ckpt = v.split("_")
            run = block_runner("full_nonreentrant" if ckpt == "full" else "none", a.layers)
            opt.zero_grad(set_to_none=False)
            dev.sync()
            if dev.cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with autocast(v):
                loss = model_loss(model, idx, targets, run)
            loss.backward()
            dev.sync()
            t1 = time.perf_counter()
            opt.step()
            dev.sync()
            t2 = time.perf_counter()
            if s >= a.warmup:
                row = {"kind": "train", "precision": precision, "checkpointing": ckpt, "step": s - a.warmup,
                       "fwd_bwd_ms": (t1 - t0) * 1e3, "step_ms": (t2 - t0) * 1e3, "loss": loss.item(),
                       "params": params, "shape": shape}
                if dev.cuda:
                    row["peak_bytes"] = torch.cuda.max_memory_allocated()
                write(row)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def platform_row(dev):
    name = torch.cuda.get_device_name(0) if dev.cuda else f"CPU ({platform.processor() or platform.machine()})"
    return {"kind": "platform", "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "sdpa": HAS_SDPA, "selective_ac": HAS_SAC, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--copy-mib", type=int, default=256, help="size of the timed pinned copies; 0: none")
    ap.add_argument("--out", default="-")
    ap.add_argument("--train-step", action="store_true",
                    help="training steps with AdamW, float32 and autocast(bfloat16) (--train-variants)")
    ap.add_argument("--train-variants", default="float32_none,bf16_none,bf16_full")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_gpt_gpu_bench.py --device cuda: this PyTorch sees no CUDA device; use --device cpu")
    dev = Device(a.device)
    out = sys.stdout if a.out == "-" else open(a.out, "a")

    def write(row):
        out.write(json.dumps({"framework": "pytorch", "layers": a.layers, "device": a.device, **row}) + "\n")
        out.flush()

    write(platform_row(dev))
    torch.manual_seed(a.seed)
    model = Gpt(a.vocab, a.seq, a.layers, a.d_model, a.heads, a.d_ff, a.dropout)
    for block in model.blocks:
        block.__class__ = SdpaBlock  # the same parameters, the fused attention
    model.to(dev.device).train()
    data = torch.Generator().manual_seed(a.seed + 1)
    idx = torch.randint(a.vocab, (a.batch, a.seq), generator=data, dtype=torch.long)
    targets = idx.roll(-1, 1).to(dev.device)
    idx = idx.to(dev.device)

    if a.train_step:
        train_step_bench(a, dev, model, idx, targets, write)
        return
    variants = []
    for v in a.variants.split(","):
        why = unavailable(v)
        if why:
            write({"variant": v, "kind": "unavailable", "why": why})
        else:
            variants.append(v)
    runners = {v: block_runner(v, a.layers) for v in variants}

    def forward(v):
        # Gradients stay allocated (zeroed in place) on both sides, so the
        # peak counts activations rather than the first gradient allocation.
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        with dev.offload(v):
            return model_loss(model, idx, targets, runners[v])

    model_loss(model, idx, targets, block_runner("none", a.layers)).backward()  # allocates the gradients
    for v in variants:
        held, peak, loss = dev.memory_step(lambda: forward(v))
        write({"variant": v, "kind": "memory", "held_bytes": held, "peak_bytes": peak, "loss": loss})
    for s in range(a.warmup + a.steps):
        for v in variants:
            dev.sync()
            t0 = time.perf_counter()
            loss = forward(v)
            dev.sync()
            t1 = time.perf_counter()
            loss.backward()
            dev.sync()
            t2 = time.perf_counter()
            if s >= a.warmup:
                write({"variant": v, "kind": "time", "step": s - a.warmup, "fwd_ms": (t1 - t0) * 1e3,
                       "step_ms": (t2 - t0) * 1e3, "loss": loss.item()})
    if a.copy_mib > 0:
        d2h, h2d = dev.copy_bandwidth(a.copy_mib << 20)
        write({"kind": "copy", "bytes": a.copy_mib << 20, "pinned": dev.cuda, "d2h_gbps": d2h, "h2d_gbps": h2d})


if __name__ == "__main__":
    main()
