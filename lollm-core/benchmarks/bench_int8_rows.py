"""The packed layers' kernel by row count, route by route, on Qwen2.5-0.5B's shapes.

    python lollm-core/benchmarks/bench_int8_rows.py                          # 2 threads, the route in force
    python lollm-core/benchmarks/bench_int8_rows.py --threads 1 --routes native,avx2,portable --rows 1,4,16
    python lollm-core/benchmarks/bench_int8_rows.py --baseline /tmp/old/block_int8.cpp --bf16
    python lollm-core/benchmarks/bench_int8_rows.py --sweep --baseline /tmp/old/block_int8.cpp --rows 1,4

Int8Linear and Q5Linear run lollm's native kernel (:mod:`lollm.native`, docs/native-kernel.md)
at every row count: one row of a decode step, four of a prompt-lookup verify, 128 of a prefill
chunk, hundreds in an engine step. This script times the kernel on each route asked for
(``--routes``: ``native``, the route in force, and the test builds ``vnni``, ``avx2``,
``portable`` of :data:`lollm.native.VARIANTS`) beside two optional references:

* ``--baseline FILE``: another block_int8.cpp (an earlier commit's, say ``git show
  main:lollm-core/src/lollm/native/block_int8.cpp > /tmp/old/block_int8.cpp``), built for the
  same route under its own namespace, timed in the same rounds: "today" against "yours".
* ``--bf16``: one bfloat16 matmul over weights dequantized beforehand, the path the layers took
  from 20 rows before the kernel's multi-row loops (it rounded differently, so a row's output
  depended on the rows beside it). Its dequantization is not timed: the figure is a lower bound.

``--sweep`` times instead a decode-like pass: one call on each of 24 layers' distinct matrices
(q and o 896 x 896 and gate and up 4864 x 896 in Q5_0, down 896 x 4864 in int8 per channel: 240
MB, beyond the L3 cache, so the weights come from memory as in a real decode step).

Rounds alternate the columns (A B C A B C) and the medians are printed; with one thread the clock
is the thread's CPU time, which a busy machine disturbs less. Not a test: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from lollm import native

#: A route's flags for a baseline build (as lollm.native builds the same route from the current source).
ROUTE_FLAGS = {"native": [], **native.VARIANTS}


def baseline_ops(source: Path, route: str):
    """``source`` (a block_int8.cpp) built for ``route`` under the namespace ``lollm_baseline_<route>``."""
    from torch.utils import cpp_extension

    namespace = f"lollm_baseline_{route}"
    cpp_extension.load(name=f"{namespace}_{abs(hash(source.read_bytes())) % 10**8}", sources=[str(source)],
                       is_python_module=False, verbose=False, extra_include_paths=[str(source.parent)],
                       extra_cflags=["-O3", "-march=native", "-fopenmp", *ROUTE_FLAGS[route], f"-DLOLLM_NATIVE_NAMESPACE={namespace}"],
                       extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, namespace)


def route_ops(route: str):
    return native.ops() if route == "native" else native.build_variant(route)


def q5(n: int, k: int, g: torch.Generator):
    """(operator, weights, K) of a random Q5_0 matrix (n, k) in pairs of blocks."""
    return ("block_q5_linear", (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                                torch.randint(0, 256, (n, k // 8), dtype=torch.uint8, generator=g),
                                (torch.rand(n, k // 32, generator=g) * 0.02).half()), k)


def int8(groups: int, n: int, group_size: int, g: torch.Generator):
    """(operator, weights, K) of a random int8 matrix: codes (groups, n, group_size), float32 scales."""
    return ("block_int8_linear", (torch.randint(-127, 128, (groups, n, group_size), dtype=torch.int8, generator=g),
                                  torch.rand(groups, n, generator=g) * 0.01), groups * group_size)


def matrices(g: torch.Generator) -> dict[str, tuple[str, tuple[torch.Tensor, ...], int]]:
    """name -> (operator, weights, K): Qwen2.5-0.5B's shapes, Q5_0 in pairs of blocks and int8."""
    return {"Q5_0 896 -> 896 (q, o)": q5(896, 896, g), "Q5_0 896 -> 4864 (gate, up)": q5(4864, 896, g),
            "Q5_0 4864 -> 896 (down)": q5(896, 4864, g), "int8 896 -> 4864 per channel": int8(1, 4864, 896, g),
            "int8 4864 -> 896 per channel (down)": int8(1, 896, 4864, g),
            "int8 head 896 -> 151936, groups of 32": int8(28, 151936, 32, g)}


def bf16_weights(op: str, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The matrix (N, K) in bfloat16, as the removed many-rows path multiplied it."""
    if op == "block_q5_linear":
        from lollm.load.packed_linear import Q5Linear

        return Q5Linear(*weights).dequantize().bfloat16()
    codes, scale = weights
    groups, n, group_size = codes.shape
    return (codes.float() * scale.float()[..., None]).transpose(0, 1).reshape(n, groups * group_size).bfloat16()


def timer(threads: int):
    clock = time.thread_time if threads == 1 else time.perf_counter

    def timed(fn, repeat: int) -> float:
        """Milliseconds per call, after one warm-up call."""
        fn()
        start = clock()
        for _ in range(repeat):
            fn()
        return (clock() - start) / repeat * 1e3

    return timed


def table(args, timed) -> None:
    g = torch.Generator().manual_seed(0)
    print(f"{'matrix':40} {'route':9} {'rows':>5} {'ms':>9} {'baseline ms':>12} {'ms / baseline':>14} {'bf16 matmul ms':>15} {'ms / bf16':>10}")
    for name, (op, weights, k) in matrices(g).items():
        if args.matrices and not any(part in name for part in args.matrices.split(",")):
            continue
        dense = bf16_weights(op, weights) if args.bf16 else None
        for route in args.routes.split(","):
            ours, theirs = getattr(route_ops(route), op), None
            if args.baseline:
                theirs = getattr(baseline_ops(Path(args.baseline), route), op)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=g)
                repeat = max(1, min(50, int(3e8 / (rows * dense_size(weights)))))
                a, b, c = [], [], []
                for _ in range(args.rounds):  # A B C A B C: a noisy machine hits all alike
                    a.append(timed(lambda: ours(x, *weights), repeat))
                    if theirs is not None:
                        b.append(timed(lambda: theirs(x, *weights), repeat))
                    if dense is not None:
                        c.append(timed(lambda: x.bfloat16() @ dense.T, repeat))
                ta = statistics.median(a)
                tb = f"{statistics.median(b):12.3f} {ta / statistics.median(b):13.2f}×" if b else f"{'':12} {'':14}"
                tc = f"{statistics.median(c):15.3f} {ta / statistics.median(c):9.2f}×" if c else ""
                print(f"{name:40} {route:9} {rows:5d} {ta:9.3f} {tb} {tc}", flush=True)


def dense_size(weights: tuple[torch.Tensor, ...]) -> int:
    return weights[0].numel() * (2 if weights[0].dtype == torch.uint8 else 1)  # Q5_0's nibbles hold 2 codes a byte


def sweep(args, timed) -> None:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(24):  # distinct weights for every layer: 240 MB in all
        layers += [q5(896, 896, g), q5(896, 896, g), q5(4864, 896, g), q5(4864, 896, g), int8(1, 896, 4864, g)]
    for route in args.routes.split(","):
        builds = {"yours": route_ops(route)}
        if args.baseline:
            builds["baseline"] = baseline_ops(Path(args.baseline), route)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=g) for k in (896, 4864)}
            times = {key: [] for key in builds}
            for _ in range(args.rounds):
                for key, ops in builds.items():
                    times[key].append(timed(lambda: [getattr(ops, op)(xs[k], *w) for op, w, k in layers], 1))
            line = "  ".join(f"{key} {statistics.median(t):8.2f} ms" for key, t in times.items())
            ratio = f"  yours / baseline {statistics.median(times['yours']) / statistics.median(times['baseline']):.2f}×" if args.baseline else ""
            print(f"sweep of 120 matrices, {route:9} {rows:4d} rows: {line}{ratio}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,4,16,64,128,512")
    parser.add_argument("--routes", default="native", help="comma-separated: native, vnni, avx2, portable (x86 builds)")
    parser.add_argument("--baseline", help="another block_int8.cpp to time beside this one, route for route")
    parser.add_argument("--bf16", action="store_true", help="also time one bfloat16 matmul over weights dequantized beforehand")
    parser.add_argument("--matrices", help="comma-separated parts of the names of the matrices to time (default: all)")
    parser.add_argument("--sweep", action="store_true", help="a decode-like pass over 24 layers' distinct matrices instead")
    args = parser.parse_args()
    if args.routes != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("the vnni, avx2 and portable builds are x86 instruction sets")
    torch.set_num_threads(args.threads)
    if native.ops() is None:
        raise SystemExit(native.status())
    print(f"threads {args.threads}; {native.status()}; ms per call, median of {args.rounds} alternating rounds"
          f"{'; clock: thread CPU time' if args.threads == 1 else ''}")
    (sweep if args.sweep else table)(args, timer(args.threads))


if __name__ == "__main__":
    main()
