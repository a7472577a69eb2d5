"""The GPT of benchmarks/torch_gpt.py trained data parallel by PyTorch over gloo.

The PyTorch side of benchmarks/dp_bench.cc, the same phases and JSON fields
(framework "pytorch"). One process per rank, started by mpirun (rank and size
from Open MPI's environment; gloo rendezvous on 127.0.0.1:--port):

    bazel-bin/launch/remat-run -np 2 -- /usr/bin/python3 benchmarks/torch_ddp.py --mode ddp \
        --bucket 250000 --steps 5 --warmup 2 --out rows.jsonl

Modes: ddp (DistributedDataParallel, bucket_cap_mb = bucket x 4 bytes / 2^20,
AdamW) and ddp_zero1 (the same DDP with ZeroRedundancyOptimizer(AdamW),
overlap_with_ddp False). Each rank runs three phases, every step started after
a barrier: the data-parallel steps (forward, backward, optimizer step; wall
time) with the peak RSS growth over them (VmHWM after minus VmRSS before, the
high-water mark reset through /proc/self/clear_refs); the same step on a copy
of the model with no communication (local_step_ms); one blocking all-reduce of
a flat buffer as large as all gradients in buckets of --bucket elements
(reduce_ms, the median of the repetitions).

bytes_sent (per rank per step) is computed from the model's size P (4P bytes
of fp32 parameters): DDP all-reduces every gradient once, which a ring does by
sending 2(N-1)/N x 4P bytes per rank. ZeroRedundancyOptimizer (PyTorch 1.13
and 2.6 alike) then broadcasts each parameter from the rank that stepped it,
parameter by parameter (parameters_as_bucket_view False): N-1 copies of 4P
bytes leave the ranks, (N-1)/N x 4P per rank on average.
"""
import argparse
import copy
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import Gpt  # noqa: E402


class LossOf(nn.Module):
    """Gpt.loss as the forward DDP wraps (DDP's hooks follow forward calls)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return self.model.loss(idx, targets)


def status_bytes(field):
    text = open("/proc/self/status").read()
    return int(re.search(field + r":\s+(\d+)", text).group(1)) * 1024


def reset_rss_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["ddp", "ddp_zero1"], default="ddp")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bucket", type=int, default=250000, help="gradient bucket (elements)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reduce-reps", type=int, default=5)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("USE_LIBUV", "0")  # PyTorch 2.6's TCPStore: the libuv one is not built in
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    torch.manual_seed(a.seed)
    model = Gpt(a.vocab, a.seq, a.layers, a.d_model, a.heads, a.d_ff, a.dropout)
    local = copy.deepcopy(model)
    model.train()
    local.train()
    numel = sum(p.numel() for p in model.parameters())
    data = torch.Generator().manual_seed(a.seed + 1 + rank)
    idx = torch.randint(a.vocab, (a.batch, a.seq), generator=data, dtype=torch.long)
    targets = idx.roll(-1, 1)

    ddp = DistributedDataParallel(LossOf(model), bucket_cap_mb=a.bucket * 4 / 2**20,
                                  find_unused_parameters=False)
    if a.mode == "ddp":
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      overlap_with_ddp=False, lr=1e-3, weight_decay=0.01)

    # Phase 1: the data-parallel steps.
    measured = []
    dist.barrier()
    reset_rss_peak()
    rss_before = status_bytes("VmRSS")
    for s in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = ddp(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        ms = (time.perf_counter() - t0) * 1e3
        if s >= a.warmup:
            measured.append((ms, loss.item()))
    rss_peak = status_bytes("VmHWM")

    # Phase 2: the same step with no data-parallel communication.
    local_ms = []
    adamw = torch.optim.AdamW(local.parameters(), lr=1e-3, weight_decay=0.01)
    for s in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = local.loss(idx, targets)
        loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=False)
        if s >= a.warmup:
            local_ms.append((time.perf_counter() - t0) * 1e3)

    # Phase 3: every gradient all-reduced once, bucket after bucket, blocking.
    reduce_ms = []
    flat = torch.ones(numel)
    for r in range(1 + a.reduce_reps):
        dist.barrier()
        t0 = time.perf_counter()
        for off in range(0, numel, a.bucket):
            dist.all_reduce(flat.narrow(0, off, min(a.bucket, numel - off)))
        if r > 0:
            reduce_ms.append((time.perf_counter() - t0) * 1e3)

    if rank == 0:
        grad_bytes = 4 * numel
        sent = 2 * (world - 1) / world * grad_bytes
        if a.mode == "ddp_zero1":
            sent += (world - 1) / world * grad_bytes
        out = sys.stdout if a.out == "-" else open(a.out, "a")
        for s, (ms, loss) in enumerate(measured):
            out.write(json.dumps({
                "framework": "pytorch", "mode": a.mode, "world": world, "bucket": a.bucket,
                "layers": a.layers, "dropout": a.dropout, "step": s, "step_ms": ms, "loss": loss,
                "params": numel, "bytes_sent": int(sent),
                "peak_rss_growth_bytes": rss_peak - rss_before, "peak_rss_bytes": rss_peak,
                "local_step_ms": local_ms[s], "reduce_ms": statistics.median(reduce_ms),
                "torch_version": torch.__version__}) + "\n")
        out.flush()
    # Every collective is complete on every rank. Leave without tearing the
    # gloo group down: its teardown at exit spun for minutes in 1 of ~10 runs
    # at 2 ranks on PyTorch 1.13 (rank 0, the store's host, after rank 1 left).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
