"""The GPT of models/gpt.cc in PyTorch, checkpointed with torch.utils.checkpoint.

Run with Debian's python3 and python3-torch 1.13 (the same ATen kernels as
libtorch-dev). Writes one JSON object per measured step, like gpt_bench:

    /usr/bin/python3 benchmarks/torch_gpt.py --layers 2,4 --variants none,full_reentrant \
        --steps 20 --warmup 3 --out results.jsonl

Variants: none; full_reentrant / full_nonreentrant (every block one region);
every_k2_reentrant / every_k2_nonreentrant (blocks 0, 2, 4, ...). PyTorch 1.13
has no selective-op checkpointing.

Peak activation bytes: the profiler's memory events (c10's allocator reports,
the same reports remat's MemoryTracker counts), summed in order over one
training step; the peak of that running sum is the peak above the step's start.
"""
import argparse
import contextlib
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d_model, n_head, d_ff, dropout):
        super().__init__()
        # Registration order as in models/stack.cc: the initialisation draws follow it.
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.n_head = n_head
        self.p = dropout

    def attention(self, x):
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        attn = F.dropout(torch.softmax(scores, -1), self.p, self.training)
        y = torch.matmul(attn, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)

    def forward(self, x):
        h = x + F.dropout(self.attention(x), self.p, self.training)
        m = self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return h + F.dropout(m, self.p, self.training)


class Gpt(nn.Module):
    def __init__(self, vocab, seq_len, n_layer, d_model, n_head, d_ff, dropout):
        super().__init__()
        # One draw seeds the initialisation, as in models/gpt.cc.
        init_seed = int(torch.randint(1 << 62, (1,), dtype=torch.long).item())
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.p = dropout
        self.vocab = vocab
        self.checkpointed = set()
        self.use_reentrant = True
        gen = torch.Generator().manual_seed(init_seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.copy_(torch.empty(m.weight.shape).normal_(0.0, 0.02, generator=gen))
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()

    def loss(self, idx, targets):
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = F.dropout(self.tok_emb(idx) + self.pos_emb(pos), self.p, self.training)
        for i, block in enumerate(self.blocks):
            if i in self.checkpointed:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))


def plan(variant, n_layer):
    """(checkpointed block indices, use_reentrant) of a variant."""
    if variant in ("none", "save_on_cpu"):
        return set(), True
    kind, reentrant = variant.rsplit("_", 1)
    every = {"full": 1, "every_k2": 2}[kind]
    return set(range(0, n_layer, every)), reentrant == "reentrant"


def peak_bytes(prof):
    run = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_us()):  # stable: equal stamps keep their order
        run += e.nbytes()
        peak = max(peak, run)
    return peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="4")
    ap.add_argument("--variants", default="none,full_reentrant,full_nonreentrant")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per variant and L")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--memory-only", action="store_true", help="one profiled step per variant")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = sys.stdout if a.out == "-" else open(a.out, "a")
    variants = a.variants.split(",")
    for n_layer in (int(x) for x in a.layers.split(",")):
        torch.manual_seed(a.seed)
        model = Gpt(a.vocab, a.seq, n_layer, a.d_model, a.heads, a.d_ff, a.dropout)
        model.train()
        data = torch.Generator().manual_seed(a.seed + 1)
        idx = torch.randint(a.vocab, (a.batch, a.seq), generator=data, dtype=torch.long)
        targets = idx.roll(-1, 1)

        def step(variant, profiled):
            model.checkpointed, model.use_reentrant = plan(variant, n_layer)
            # Gradients stay allocated (zeroed in place), on both sides, so the
            # peak counts activations rather than the first gradient allocation.
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            # save_on_cpu: PyTorch's nearest peer of activation offloading
            # (every saved tensor copied to CPU memory; here CPU to CPU).
            offload = (torch.autograd.graph.save_on_cpu() if variant == "save_on_cpu"
                       else contextlib.nullcontext())
            if profiled:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    with offload:
                        loss = model.loss(idx, targets)
                    loss.backward()
                return {"peak_bytes": peak_bytes(prof), "loss": loss.item()}
            t0 = time.perf_counter()
            with offload:
                loss = model.loss(idx, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            return {"fwd_ms": (t1 - t0) * 1e3, "step_ms": (t2 - t0) * 1e3, "loss": loss.item()}

        step("none", False)  # allocates the parameter gradients
        # Memory: one profiled step each (the counts do not vary from step to step).
        for v in variants:
            r = step(v, True)
            out.write(json.dumps({"framework": "pytorch", "variant": v, "layers": n_layer,
                                  "kind": "memory", **r}) + "\n")
        if a.memory_only:
            continue
        # Time: interleaved A B C A B C ..., warm-up steps dropped.
        for s in range(a.warmup + a.steps):
            for v in variants:
                r = step(v, False)
                if s >= a.warmup:
                    out.write(json.dumps({"framework": "pytorch", "variant": v, "layers": n_layer,
                                          "kind": "time", "step": s - a.warmup, **r}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
