"""The section "Data parallelism beside PyTorch DDP and ZeroRedundancyOptimizer"
of docs/benchmarks.md, from the rows benchmarks/dp_bench.sh writes (one file
per platform, each with its .check.jsonl and .platform.json beside it):

    /usr/bin/python3 benchmarks/dp_report.py build/bench/dp.jsonl [build/bench/dp.debian13.jsonl] > dp.md
"""
import json
import os
import statistics
import sys

ORDER = [("remat", "stage0"), ("remat", "stage0_overlap"), ("pytorch", "ddp"), ("remat", "stage1"),
         ("remat", "stage1_overlap"), ("pytorch", "ddp_zero1"), ("remat", "stage2_overlap"),
         ("remat", "stage3_overlap")]
LABEL = {"stage0": "ZeRO stage 0", "stage0_overlap": "ZeRO stage 0, overlap_comm",
         "stage1": "ZeRO stage 1", "stage1_overlap": "ZeRO stage 1, overlap_comm",
         "stage2_overlap": "ZeRO stage 2, overlap_comm", "stage3_overlap": "ZeRO stage 3, overlap_comm",
         "ddp": "DDP", "ddp_zero1": "DDP + ZeroRedundancyOptimizer"}


SETUP = """\
`benchmarks/dp_bench.sh` (bench.sh's step 8; `--debian13` runs it in the Debian 13 chroot). The GPT \
above at L = 8 (1,627,392 parameters), batch 4 per rank, dropout 0.1, AdamW (lr 1e-3, weight decay \
0.01), no checkpointing, no clipping, no accumulation, one intra-op thread per rank, the ranks started \
by `remat-run` (mpirun) on this machine's 2 cores (4 ranks share them). remat: `benchmarks/dp_bench.cc`, \
the Engine at each ZeRO stage with `reduce_bucket_size` (and `allgather_bucket_size`) = the bucket \
below, its collectives over MPI (Open MPI, shared memory). PyTorch: `benchmarks/torch_ddp.py`, the same \
model (the same weights and, per rank, the same batch: seed 1234, data seed 1235 + rank), \
`DistributedDataParallel` (`bucket_cap_mb` = the bucket × 4 B) with AdamW, or with \
`ZeroRedundancyOptimizer(AdamW)` (`overlap_with_ddp` false), over gloo (TCP on the loopback). \
Configurations run one after the other in rounds, every configuration once per round, so that the \
machine's noise spreads over all; each run drops its warm-up steps.

- step ms: rank 0's wall time of forward, backward and optimizer step (the engine's `step()` or \
DDP's `opt.step()` and `zero_grad`), every step started after a barrier; median over all rounds' \
measured steps [min, max].
- local step ms: the same step on a second copy of the model in the same process with no \
communication at all (forward, backward, AdamW over every parameter, gradients zeroed), every rank at \
once after a barrier, so the ranks share the cores as in the data-parallel step. Both frameworks measure \
it the same way. For stages 1-3 it steps AdamW over all parameters where the sharded step runs 1/N of it.
- reduce ms: one blocking all-reduce of a flat float32 buffer as large as all gradients, bucket after \
bucket, through the framework's own communicator (remat's `Communicator`, MPI; PyTorch's \
`dist.all_reduce`, gloo): what stage 0 would add to the local step if nothing overlapped.
- hidden share = 1 − (step − local step) / reduce, from the medians, clamped to [0, 1]; the unclamped \
value in parentheses. It is an estimate: a negative value says the step cost more than the local step \
plus a blocking all-reduce (stage 3's all-gathers, ZeroRedundancyOptimizer's broadcasts and the \
contention of ranks for cores are not in reduce ms); stages 1-3 gain a little from their smaller \
optimizer step.
- bytes sent / rank / step: what a ring algorithm sends per rank for the step's collectives. remat: \
(N − 1)/N × the engine's `zero_comm_bytes` (`StepMetrics`; parallel/zero.h counts an all-reduce as \
2 × its bytes, a reduce-scatter by its input, an all-gather by its output); the engine's two scalar \
all-reduces per step (the non-finite check, 16 B, and the loss mean, 8 B) are left out. PyTorch, from the \
model's size: DDP all-reduces 4P bytes of gradients, 2(N − 1)/N × 4P per rank; ZeroRedundancyOptimizer \
(1.13 and 2.6 alike) then broadcasts every parameter from the rank that stepped it, parameter by \
parameter: (N − 1)/N × 4P per rank on average.
- peak RSS growth / rank: rank 0's VmHWM after the last measured step minus its VmRSS before the first \
step (the high-water mark reset through `/proc/self/clear_refs` after setup), the same for both \
frameworks: the gradients, optimizer state and communication buffers the steps allocate, and the \
activations; the parameters, allocated before, are not in it. Median over the rounds.
- loss at the first measured step: rank 0's own loss after the warm-up steps, with dropout: remat's \
stages agree with each other (the engine seeds the dropout from `train.seed`); PyTorch's draw other masks.
"""


def load(path):
    return [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []


def hidden_share(step, local, reduce):
    """1 - (step - local) / reduce, clamped to [0, 1]; the unclamped value beside it."""
    raw = 1 - (step - local) / reduce if reduce > 0 else float("nan")
    return min(1.0, max(0.0, raw)), raw


def platform_section(path, w, targets):
    rows = load(path)
    base = path[:-len(".jsonl")]
    checks = load(base + ".check.jsonl")
    info = json.load(open(base + ".platform.json")) if os.path.exists(base + ".platform.json") else {}
    name = info.get("platform", os.path.basename(path))
    w(f"### {name}: LibTorch {info.get('libtorch', '?')}, PyTorch {info.get('torch_version', '?')}\n")
    if info:
        w(f"{info.get('machine', '')}; {info.get('mpi', '')}; {info['rounds']} rounds × {info['steps']} "
          f"measured steps (after {info['warmup']} warm-up) per configuration; buckets of "
          f"{info['bucket']} elements ({info['bucket'] * 4 / 2**20:.3f} MiB).\n")
    by = {}
    for r in rows:
        by.setdefault((r["world"], r["framework"], r["mode"]), []).append(r)
    # The engine's reduce_wait_ms (the backward's end waiting on reductions in
    # flight), where the engine reports it.
    wait = any("reduce_wait_ms" in r for r in rows)
    w("| ranks | framework | configuration | step ms, median [min, max] | local step ms | reduce ms "
      "| hidden share | bytes sent / rank / step | peak RSS growth / rank (MiB) | loss at the first measured step |"
      + (" reduce wait ms |" if wait else ""))
    w("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if wait else ""))
    medians = {}
    for world in sorted({k[0] for k in by}):
        for fw, mode in ORDER:
            rs = by.get((world, fw, mode))
            if not rs:
                continue
            t = [r["step_ms"] for r in rs]
            step = statistics.median(t)
            local = statistics.median(r["local_step_ms"] for r in rs)
            reduce = statistics.median(r["reduce_ms"] for r in rs)
            share, raw = hidden_share(step, local, reduce)
            rss = statistics.median(r["peak_rss_growth_bytes"] for r in rs) / 2**20
            first = [r["loss"] for r in rs if r["step"] == 0]
            medians[(world, mode)] = step
            w(f"| {world} | {fw} | {LABEL[mode]} | {step:.1f} [{min(t):.1f}, {max(t):.1f}] | {local:.1f} "
              f"| {reduce:.1f} | {share:.2f} ({raw:+.2f}) | {rs[0]['bytes_sent']:,} | {rss:.1f} "
              f"| {statistics.median(first):.4f} |"
              + (f" {statistics.median(r['reduce_wait_ms'] for r in rs):.1f} |"
                 if wait and all("reduce_wait_ms" in r for r in rs) else " - |" if wait else ""))
    w("")
    loss = {c["framework"]: c["loss"] for c in checks}
    if "remat" in loss and "pytorch" in loss:
        a, b = loss["remat"], loss["pytorch"]
        ok = abs(a - b) <= 1e-5 * max(1.0, abs(b))
        w(f"First-step loss at 2 ranks, dropout 0 (rank 0): remat stage 0 {a:.6f}, PyTorch DDP {b:.6f} "
          f"(|difference| {abs(a - b):.2e}): {'agree' if ok else 'DIFFER'}.\n")
        targets.append((f"{name}: first-step loss, remat stage 0 = DDP (2 ranks, dropout 0, within 1e-5)", ok,
                        f"{a:.6f} vs {b:.6f}"))
    for world in sorted({k[0] for k in by}):
        for ours, theirs, what in (("stage0_overlap", "ddp", "stage 0 (overlap) step time ≤ DDP's"),
                                   ("stage1_overlap", "ddp_zero1", "stage 1 (overlap) ≤ ZeroRedundancyOptimizer's")):
            if (world, ours) in medians and (world, theirs) in medians:
                a, b = medians[(world, ours)], medians[(world, theirs)]
                targets.append((f"{name}, {world} ranks: {what}", a <= b,
                                f"{a:.1f} ms vs {b:.1f} ms ({a / b:.3f} ×)"))


def main():
    out = []
    w = out.append
    targets = []
    w("## Data parallelism beside PyTorch DDP and ZeroRedundancyOptimizer\n")
    w(SETUP)
    for path in sys.argv[1:]:
        platform_section(path, w, targets)
    w("### Targets (data parallelism)\n")
    w("| target | met | measured (median step ms) |")
    w("|---|---|---|")
    for name, ok, detail in targets:
        w(f"| {name} | {'met' if ok else 'not met'} | {detail} |")
    w("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
