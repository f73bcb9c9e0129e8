"""The native kernel's two routes by row count: AMX tiles against the AVX-512 VNNI vector loops.

    python lollm-core/benchmarks/bench_tiles.py                    # 2 threads, rows 1 .. 512
    python lollm-core/benchmarks/bench_tiles.py --threads 1 --rounds 5

On a CPU with AMX-INT8 (Intel Xeon since Sapphire Rapids) lollm's kernel multiplies from
``lollm.native.tile_min_rows()`` rows with tiles, below that with its vector loops
(docs/native-kernel.md, section 9). This script times both on Qwen2.5-0.5B's shapes: the
vector loops from the build without AMX (``lollm.native.build_variant("vnni")``, the route
``LOLLM_ISA=avx512`` loads), the tiles from the native build, in rounds that alternate A B A B.
Below the tiles' row count the native build runs its vector loops too, so there the tiles are
timed on the rows padded with zeros up to that count: a tile instruction takes 16 rows whatever
their number, and the padding changes no row's output. Both routes add each block's exact int32
sum in the canonical order, so the "same bits" column must say yes on every line. The last
columns time one bfloat16 matmul over weights dequantized beforehand (the path the layers took
for many rows before every route became batch invariant; its dequantization untimed, so a
lower bound) where ``--bf16`` asks.
Not a test: on a shared machine figures are noisy; read the ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_int8_rows import bf16_weights, timer  # its sibling in this folder (a script's folder is on sys.path)
from lollm import native


def layers(g: torch.Generator) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
    """name -> (operator, weights): Q5_0 in pairs of blocks, and int8 per channel and in groups of 32."""
    def q5(n: int, k: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                torch.randint(0, 256, (n, k // 8), dtype=torch.uint8, generator=g),
                (torch.rand(n, k // 32, generator=g) * 0.02).half())

    def int8(groups: int, n: int, group_size: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(-127, 128, (groups, n, group_size), dtype=torch.int8, generator=g),
                torch.rand(groups, n, generator=g) * 0.01)

    return {
        "Q5_0 4864x896 (gate, up)": ("block_q5_linear", q5(4864, 896)),
        "Q5_0 896x896 (q, o)": ("block_q5_linear", q5(896, 896)),
        "int8 896x4864 per channel (down)": ("block_int8_linear", int8(1, 896, 4864)),
        "int8 151936x896 groups of 32 (head)": ("block_int8_linear", int8(28, 151936, 32)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are printed (default 3)")
    parser.add_argument("--rows", default="1,4,8,16,19,32,64,128,256,512",
                        help="row counts, comma-separated (default 1,4,8,16,19,32,64,128,256,512)")
    parser.add_argument("--bf16", action="store_true", help="also time one bfloat16 matmul over weights dequantized beforehand")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.tile_min_rows():
        raise SystemExit(f"the tiles do not run here ({native.status()})")
    tiles, vectors, timed = native.ops(), native.build_variant("vnni"), timer(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; {native.status()}; ms per call, median of {args.rounds} rounds")
    print(f"{'matrix':38} {'rows':>5} {'tiles':>9} {'vectors':>9} {'vectors / tiles':>16} {'same bits':>10} "
          f"{'bf16 matmul':>12} {'bf16 / tiles':>13}")
    for name, (op, weights) in layers(g).items():
        dense = bf16_weights(op, weights) if args.bf16 else None
        big = weights[0].shape[-2 if op == "block_int8_linear" else 0] >= 10000
        repeat = 3 if big else 20
        in_features = weights[0].shape[1] * 2 if op == "block_q5_linear" else weights[0].shape[0] * weights[0].shape[2]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=g)
            padded = torch.cat([x, x.new_zeros(max(0, native.tile_min_rows() - rows), in_features)])
            a, b, c = [], [], []
            for _ in range(args.rounds):  # A B C A B C: a noisy machine hits all alike
                a.append(timed(lambda: getattr(tiles, op)(padded, *weights), repeat))
                b.append(timed(lambda: getattr(vectors, op)(x, *weights), repeat))
                if dense is not None and rows >= 16:
                    c.append(timed(lambda: x.bfloat16() @ dense.T, repeat))
            ya, yb = getattr(tiles, op)(padded, *weights)[:rows], getattr(vectors, op)(x, *weights)
            same = "yes" if torch.equal(ya, yb) else "NO"
            ta, tb = statistics.median(a), statistics.median(b)
            tc = f"{statistics.median(c):12.3f} {statistics.median(c) / ta:12.2f}×" if c else ""
            print(f"{name:38} {rows:5d} {ta:9.3f} {tb:9.3f} {tb / ta:15.2f}× {same:>10} {tc}")


if __name__ == "__main__":
    main()
