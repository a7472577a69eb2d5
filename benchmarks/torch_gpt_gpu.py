"""PyTorch's side of the GPU memory check: the GPT of benchmarks/torch_gpt.py on a
CUDA device, at the shapes of engine/gpu_test.cc's memory case (L=8, d_model 512,
8 heads, d_ff 2048, seq 256, vocab 512, batch 8, dropout 0.1), checkpointed with
torch.utils.checkpoint. Per variant: the device memory the forward leaves for the
backward, the step's peak above its start (torch.cuda memory statistics: what
remat's MemoryTracker reads from the same caching allocator), and the median
step time of 5 steps after 2 warm-ups. tools/gpu_checks.sh runs it beside
gpu_test; its lines start "torch-gpu:".
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import Gpt, plan  # noqa: E402

LAYERS, D, HEADS, FF, SEQ, VOCAB, BATCH = 8, 512, 8, 2048, 256, 512, 8


def main():
    torch.manual_seed(0)
    model = Gpt(VOCAB, SEQ, LAYERS, D, HEADS, FF, 0.1).cuda()
    gen = torch.Generator().manual_seed(99)
    x = torch.randint(VOCAB, (BATCH, SEQ), generator=gen).cuda()
    y = torch.randint(VOCAB, (BATCH, SEQ), generator=gen).cuda()
    for variant in ("none", "full_reentrant", "full_nonreentrant", "every_k2_nonreentrant"):
        model.checkpointed, model.use_reentrant = plan(variant, LAYERS)
        held = peak = 0
        times = []
        for step in range(7):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            loss = model.loss(x, y)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            loss.backward()
            torch.cuda.synchronize()
            if step >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
            peak = torch.cuda.max_memory_allocated() - base
        print(f"torch-gpu: {variant:22s} held {held / 2**20:8.1f} MiB  peak {peak / 2**20:8.1f} MiB  "
              f"step {statistics.median(times):7.2f} ms (median of {len(times)})", flush=True)


if __name__ == "__main__":
    main()
