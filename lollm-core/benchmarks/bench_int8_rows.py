"""Int8Linear by row count: lollm's native kernel, torch's int8 kernel and dequantize-then-multiply, on Qwen2.5-0.5B's shapes.

    python lollm-core/benchmarks/bench_int8_rows.py                # 2 threads, rows 1 .. 256
    python lollm-core/benchmarks/bench_int8_rows.py --threads 1 --rounds 5

``_weight_int8pack_mm`` reads the int8 codes once per row of activations, so its
time grows with the rows: right for a decode step (1 row), wrong for a prefill or
an engine step of many sequences. The other path dequantizes the codes to
bfloat16 1024 channels at a time and runs one bfloat16 matrix multiplication for
all rows (:meth:`lollm.load.quantized.Int8Linear._dequantized_matmul`). lollm's native
kernel (:mod:`lollm.native`, docs/native-kernel.md) reads the codes once for all rows
but pays its arithmetic per row. The table gives the three times per matrix (medians
of rounds that alternate A B C A B C) and the row counts where lollm switches
(:func:`lollm.load.quantized.native_gemm_rows`: 20, or 256 where the kernel has AMX tiles, and
``GEMM_MIN_ROWS_GROUPED`` where the native kernel is not built). The native column here is
the kernel at every row count, tiles from 8 rows included where they run
(benchmarks/bench_tiles.py sets the two routes side by side).

Shapes: the MLP's 4864 x 896 (per-channel int8, one kernel call) and the output
head's 151936 x 896 in groups of 32 (one kernel call per group). Not a test: on a
shared machine figures are noisy; read the ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lollm import native
from lollm.load.packed_linear import GEMM_MIN_ROWS_GROUPED, Int8Linear, native_bf16_matmul, native_gemm_rows


def timed(fn, repeat: int) -> float:
    """Milliseconds per call, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def kernel_path(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The int8 kernel whatever the row count (forward's few-rows branch)."""
    flat = x.to(torch.bfloat16)
    if layer.codes.shape[0] == 1:
        return torch.ops.aten._weight_int8pack_mm(flat, layer.codes[0], layer._bf16_scale()[0])
    pieces = flat.view(flat.shape[0], -1, layer.group_size)
    y = torch.zeros(flat.shape[0], layer.out_features)  # float32, as forward sums the groups
    for g in range(layer.codes.shape[0]):
        y += torch.ops.aten._weight_int8pack_mm(pieces[:, g].contiguous(), layer.codes[g], layer._bf16_scale()[g])
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layers = {
        "mlp 4864x896, per channel": Int8Linear(torch.randint(-127, 128, (1, 4864, 896), dtype=torch.int8, generator=g),
                                                torch.rand(1, 4864, generator=g) * 0.01),
        "mlp down 896x4864, per channel": Int8Linear(torch.randint(-127, 128, (1, 896, 4864), dtype=torch.int8, generator=g),
                                                     torch.rand(1, 896, generator=g) * 0.01),
        "head 151936x896, groups of 32": Int8Linear(torch.randint(-127, 128, (28, 151936, 32), dtype=torch.int8, generator=g),
                                                    torch.rand(28, 151936, generator=g) * 0.01),
    }
    op = native.block_int8_op()
    print(f"threads {args.threads}; {native.status()}; native bfloat16 matmul: {native_bf16_matmul()}")
    print(f"lollm dequantizes and multiplies from {native_gemm_rows()} rows; below, the native kernel where it is built, "
          f"else torch's int8 kernel (the grouped head then dequantizes from {GEMM_MIN_ROWS_GROUPED})")
    print(f"{'matrix':32} {'rows':>5} {'native ms':>10} {'torch int8 ms':>14} {'dequant+mm ms':>14} {'max |Δ| / max |y|':>18}")
    for name, layer in layers.items():
        repeat = 20 if layer.out_features < 10000 else 2
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, layer.in_features, generator=g)
            a, b, c = [], [], []
            for _ in range(args.rounds):  # A B C A B C: a noisy machine hits all alike
                if op is not None:
                    c.append(timed(lambda: op(x, layer.codes, layer.scale), repeat))
                a.append(timed(lambda: kernel_path(layer, x), repeat))
                b.append(timed(lambda: layer._dequantized_matmul(x.to(torch.bfloat16)), repeat))
            ref = kernel_path(layer, x).float()
            diff = float((layer._dequantized_matmul(x.to(torch.bfloat16)) - ref).abs().max() / ref.abs().max())
            kc = f"{statistics.median(c):10.2f}" if c else f"{'-':>10}"
            print(f"{name:32} {rows:5d} {kc} {statistics.median(a):14.2f} {statistics.median(b):14.2f} {diff:18.1e}")


if __name__ == "__main__":
    main()
