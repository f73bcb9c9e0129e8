"""The output head through the native kernel with float32 and with float16 block scales, side by side.

    python lollm-core/benchmarks/bench_scale_dtype.py                  # 2 threads, rows 1,4,16
    python lollm-core/benchmarks/bench_scale_dtype.py --threads 1 --rounds 7 --rows 1

:class:`lollm.load.quantized.Int8Linear` keeps a Q8_0 head's block scales in float16, as the file
has them (half the bytes of float32; docs/native-kernel.md, section 1). The kernel reads either
dtype and computes in float32 either way, so the two must give the same outputs bit for bit
(checked here, and in tests/test_native.py); what can differ is time. The head is the largest
matrix of a small model and memory-bound at one row: its scales are 1/16 (float32) or 1/32
(float16) of the bytes its codes take. Every route is timed: the native build (AMX tiles from
their row count, where the CPU has them), and the test builds of the other versions of steps 2
and 3 (``lollm.native.build_variant``: AVX-512 VNNI without tiles, AVX2, plain C++; plain C++
only at one row, it is slow). Rounds alternate float32, float16, float32, float16 so a noisy
machine hits both alike; medians are printed. Not a test.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from bench_int8_rows import timer  # its sibling in this folder (a script's folder is on sys.path)
from lollm import native
#: (name, N, K): Gemma 3 270M's head (tied to its Q8_0 embedding) and Qwen2.5-0.5B's (Q8_0).
HEADS = [("Gemma 3 head 262144x640", 262144, 640), ("Qwen2.5 head 151936x896", 151936, 896)]


def routes():
    """name -> the block_int8_linear operator of each version built here."""
    found = {f"native ({native.status().split('(', 1)[-1].rstrip(')')})": native.block_int8_op()}
    if platform.machine() in ("x86_64", "AMD64"):
        for variant in native.VARIANTS:
            found[variant] = native.build_variant(variant).block_int8_linear
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are printed (default 5)")
    parser.add_argument("--rows", default="1,4,16", help="row counts, comma-separated (default 1,4,16)")
    parser.add_argument("--repeat", type=int, default=3, help="calls per timing, after one warm-up call (default 3)")
    parser.add_argument("--routes", default="", help="only these routes, comma-separated (native, vnni, avx2, portable)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timed = timer(args.threads)
    if native.block_int8_op() is None:
        raise SystemExit(native.status())
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; {native.status()}; ms per call, median of {args.rounds} rounds (f32, f16 alternating)")
    print(f"{'matrix':26} {'route':34} {'rows':>5} {'f32 scales':>11} {'f16 scales':>11} {'f16 / f32':>10} {'identical':>10}")
    for name, n, k in HEADS:
        codes = torch.randint(-127, 128, (k // 32, n, 32), dtype=torch.int8, generator=g)
        half = (torch.rand(k // 32, n, generator=g) * 0.01).half()
        single = half.float()  # the same values in float32
        for route, op in routes().items():
            if args.routes and route.split(" ")[0] not in args.routes.split(","):
                continue
            for rows in (int(r) for r in args.rows.split(",")):
                if route == "portable" and rows > 1:
                    continue
                x = torch.randn(rows, k, generator=g)
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(timed(lambda: op(x, codes, single), args.repeat))
                    b.append(timed(lambda: op(x, codes, half), args.repeat))
                same = torch.equal(op(x, codes, single), op(x, codes, half))
                ta, tb = statistics.median(a), statistics.median(b)
                print(f"{name:26} {route:34} {rows:5d} {ta:11.2f} {tb:11.2f} {tb / ta:9.3f}× {str(same):>10}")


if __name__ == "__main__":
    main()
