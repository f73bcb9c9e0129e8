"""Q4_K, Q6_K and Q5_0 from the file's bits in panels (lollm's block_kquants.cpp) against the layers before them, per route.

    python lollm-core/benchmarks/bench_kquants.py                  # 2 threads, rows 1, 16, 128
    python lollm-core/benchmarks/bench_kquants.py --threads 1 --rounds 5 --rows 1 4 16
    python lollm-core/benchmarks/bench_kquants.py --types Q5_0 --threads 1 --rounds 5 --rows 1 4 16 128

A Qwen2.5-0.5B ffn_down matrix (896 outputs, 4864 inputs) in Q4_K, Q6_K and Q5_0, random blocks.
"panels" is Q4_KLinear / Q6_KLinear / Q5_0Linear's kernel, timed in each build of it this CPU runs (the native
one, and the test builds for AVX2 and plain C++: lollm.native.build_variant). "before" is what the
loader made of the same matrix until now: Q4_K an Int4Linear (torch's int4 kernel, bfloat16
activations and scales), Q6_K an Int8Linear requantized per channel (lollm's int8 kernel below 20
rows, the bfloat16 dequantize-then-multiply path from 20 on a CPU with native bfloat16); Q5_0 a
Q5Linear (each channel's pairs of blocks side by side, section 6 of docs/native-kernel.md: the same
bits, the layer that CPUs with AMX tiles keep). Rounds
alternate A B A B; the figure is the median. Not a test: on a shared machine figures are noisy.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from bench_int8_rows import timer  # its sibling in this folder (a script's folder is on sys.path)
from lollm import native
from lollm.gguf.quants import GGML_TYPES_BY_NAME, affine4, dequantize
from lollm.load.packed_kquants import Q4_KLinear, Q5_0Linear, Q6_KLinear
from lollm.load.packed_linear import Int4Linear, Int8Linear, Q5Linear
from lollm.load.quantized import int8_from_float_rows

F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,)}
LAYERS = {"Q4_K": Q4_KLinear, "Q6_K": Q6_KLinear, "Q5_0": Q5_0Linear}


def random_matrix(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A GGUF matrix's bytes: random blocks whose float16 scales are small and finite."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES_BY_NAME[type_name]
    blocks = rng.integers(0, 256, size=(n * k // t.block_size, t.type_size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        blocks[:, at : at + 2] = rng.uniform(0.0005, 0.004, size=(len(blocks), 1)).astype("<f2").view(np.uint8)
    return blocks.reshape(n, -1)


def before(type_name: str, raw: np.ndarray, n: int, k: int) -> torch.nn.Module:
    """The layer the loader built for this matrix before block_kquants.cpp."""
    if type_name == "Q5_0":
        return Q5Linear.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
    if type_name == "Q4_K":
        q, s, o = (torch.from_numpy(a) for a in affine4(raw.reshape(-1), type_name))
        layer = Int4Linear(k, n, 32)
        layer.fill_rows(0, q.view(n, k), s.view(n, -1), o.view(n, -1))
        return layer
    w = torch.from_numpy(dequantize(raw.reshape(-1), type_name)).view(n, k)
    return Int8Linear(*int8_from_float_rows(n, k, lambda a, b: w[a:b]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--types", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timed = timer(args.threads)
    if native.block_int8_op() is None:
        raise SystemExit(native.status())
    builds = {"native": torch.ops.lollm_native}
    for variant in ("avx2", "portable"):
        builds[variant] = native.build_variant(variant)
    n, k = 896, 4864
    print(f"{native.status()}; {args.threads} threads; (N, K) = ({n}, {k}); ms per call, median of {args.rounds} rounds")
    for type_name in args.types:
        cls = LAYERS[type_name]
        raw = random_matrix(type_name, n, k)
        mine = cls.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
        old = before(type_name, raw, n, k)
        parts = [getattr(mine, name) for name, _, _ in cls.PARTS]
        for rows in args.rows:
            x = torch.randn(rows, k)
            repeat = max(3, 400 // rows)
            calls = {f"panels, {builds[b].kquants_instruction_set()}": (lambda b=b: getattr(builds[b], cls.OP)(x, *parts, n))
                     for b in builds}
            calls[f"before, {type(old).__name__}"] = lambda: old(x)
            times = {name: [] for name in calls}
            with torch.inference_mode():
                for round_ in range(args.rounds + 1):  # round 0 warms the threads and caches up, and is not kept
                    for name, fn in calls.items():
                        took = timed(fn, repeat)
                        if round_:
                            times[name].append(took)
            shown = ", ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items())
            print(f"{type_name} rows {rows:4d}: {shown}")


if __name__ == "__main__":
    main()
