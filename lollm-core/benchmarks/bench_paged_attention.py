"""One layer's attention in an engine step: the SDPA path (decode rows in one padded call, a chunk in its own
call) against lollm's native paged kernel (docs/batch-invariance.md, "Batch invariance in attention"). Qwen2.5-0.5B's shapes, random keys.

    python lollm-core/benchmarks/bench_paged_attention.py [THREADS]   (default 2)
"""
import random
import statistics
import sys
import time

import torch

from lollm import attention
from lollm.batch import Batch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
H, K, D, bs = 14, 2, 64, 16

def step(starts, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(s + c) // bs) for s, c in zip(starts, counts)]
    nb = sum(needed) + 1
    order = (1 + torch.randperm(nb - 1, generator=g)).tolist()
    tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(starts))]
    kp, vp = torch.randn(nb, bs, K, D, generator=g), torch.randn(nb, bs, K, D, generator=g)
    b = Batch(list(starts), list(counts), tables, bs, list(range(len(starts))))
    return torch.randn(1, H, sum(counts), D, generator=g), kp, vp, b

def old(q, kp, vp, b):
    real = attention.paged_attention_op
    attention.paged_attention_op = lambda: None
    try:
        return attention.attend(q, kp, vp, start=b)
    finally:
        attention.paged_attention_op = real

def new(q, kp, vp, b):
    return attention.attend(q, kp, vp, start=b)

random.seed(0)
cases = {"16 decode rows, 200..600 keys": step([random.randint(199, 599) for _ in range(16)], [1] * 16, 1),
         "a 512-token prefill (one chunk)": step([0], [512], 2),
         "a 512-token prefill in chunks of 256 (the second)": step([256], [256], 3)}
print(f"{threads} threads")
for name, args in cases.items():
    reps = 60 if "decode" in name else 15
    old(*args); new(*args)
    for r in range(3):  # rounds; within a round the two alternate call by call: A B A B ...
        a, b_ = [], []
        for _ in range(reps):
            t = time.perf_counter(); old(*args); a.append(time.perf_counter() - t)
            t = time.perf_counter(); new(*args); b_.append(time.perf_counter() - t)
        ma, mb = statistics.median(a) * 1e3, statistics.median(b_) * 1e3
        print(f"  {name}: round {r}: median SDPA path {ma:.2f} ms (min {min(a)*1e3:.2f}), "
              f"native kernel {mb:.2f} ms (min {min(b_)*1e3:.2f}): {mb / ma:.2f}x")
    print(f"  {name}: max |SDPA path - kernel| {(old(*args) - new(*args)).abs().max().item():.2e}")
