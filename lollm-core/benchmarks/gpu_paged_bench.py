"""Time the batched engine with ``--attn triton`` (the paged kernel) beside ``--attn sdpa`` (gather + sdpa).

    python lollm-core/benchmarks/gpu_paged_bench.py --out DIR                  # on a machine with a CUDA GPU
    TRITON_INTERPRET=1 python lollm-core/benchmarks/gpu_paged_bench.py --device cpu --quick   # a dry run here

benchmarks/gpu_paged_check.sh wraps it. Two tables, figures only (no assert on speed):

1. **engine**: qwen2 checkpoints with random weights (the tiny one of the tests, and
   Qwen2.5-0.5B's real shape unless ``--quick``), N greedy requests of the same prompt
   length at once through :class:`lollm.engine.Engine` until all finish, sdpa and triton
   in alternating rounds: output tokens per second and the wall time of the run (median
   of the rounds), and whether both backends produced the same tokens for every request.
2. **attend**: one decode step's attention alone, ``attend(q, k_pool, v_pool, start=batch)``
   on Qwen2.5-0.5B's attention shape (14 query heads, 2 K/V heads, width 64) for B
   sequences of L cached positions whose blocks are scattered over the pool: triton's one
   paged launch against sdpa's gather per sequence (``triton.testing.do_bench``, median ms).

Each part that fails prints a FAIL row with its error and the run goes on; the exit status
is 1 when something failed. ``--out DIR`` also writes the tables and a JSON file.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lollm-qwen" / "tests"))  # the tiny-checkpoint builder of qwen's tests

BACKENDS = ("sdpa", "triton")


def checkpoints(root: Path, quick: bool) -> dict[str, Path]:
    """qwen2 with random weights: the tests' tiny shape, and (unless quick) Qwen2.5-0.5B's real shape."""
    import _qwen_tiny as qwen
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    out = {"qwen2 tiny": write_tiny_checkpoint(shrink_config(qwen.real_config("qwen2")), root / "tiny", schema="hub")}
    if not quick:
        out["Qwen2.5-0.5B shape"] = write_tiny_checkpoint(qwen.real_config("qwen2"), root / "real-shape", schema="hub")
    return out


def run_engine(model, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, dict[str, list[int]]]:
    """All prompts at once through a fresh Engine until every request finishes: (seconds, tokens per request)."""
    from lollm.engine import Engine, EngineConfig
    from lollm.generate.sampling import SamplingParams

    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(kv_blocks=len(prompts) * -(-longest // 16) + 8, max_sequences=len(prompts),
                          max_batch_tokens=max(512, len(prompts)))
    engine = Engine(model, config)
    for i, ids in enumerate(prompts):
        engine.add_request(ids, sampling=SamplingParams(temperature=0.0), max_new_tokens=new_tokens, request_id=str(i))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].append(out.step.token)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def engine_rows(name: str, folder: Path, args) -> list[dict]:
    """Output tokens per second of the engine, sdpa and triton in alternating rounds, at each request count."""
    from lollm.attention import use_backend
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    rows = []
    model = open_model(str(folder), LoadOptions(device=args.device, dtype=args.dtype)).model
    for n in args.requests:
        g = torch.Generator().manual_seed(n)
        prompts = [torch.randint(3, 500, (args.prompt,), generator=g).tolist() for _ in range(n)]
        seconds = {attn: [] for attn in BACKENDS}
        tokens = {}
        try:
            for attn in BACKENDS:  # warm-up: Triton compiles its kernels on the first calls
                with use_backend(attn):
                    tokens[attn] = run_engine(model, prompts, args.new_tokens, args.device)[1]
            for _ in range(args.rounds):
                for attn in BACKENDS:  # A B A B: a drift in clocks or load hits both alike
                    with use_backend(attn):
                        seconds[attn].append(run_engine(model, prompts, args.new_tokens, args.device)[0])
        except Exception as exc:
            rows.append(dict(part="engine", model=name, requests=n, passed=False,
                             error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:]))
            continue
        same = sum(tokens["sdpa"][r] == tokens["triton"][r] for r in tokens["sdpa"])
        for attn in BACKENDS:
            wall = statistics.median(seconds[attn])
            rows.append(dict(part="engine", model=name, dtype=args.dtype, requests=n, prompt=args.prompt,
                             new_tokens=args.new_tokens, attn=attn, seconds=wall,
                             output_tok_s=n * args.new_tokens / wall, same_tokens=f"{same}/{n}"))
    del model
    gc.collect()
    return rows


def decode_step(B: int, L: int, device: str, dtype: torch.dtype, block_size: int = 16):
    """q, pools and Batch of one decode step: B sequences of L cached positions, blocks in random order."""
    from lollm.batch import Batch

    H, K, D = 14, 2, 64  # Qwen2.5-0.5B
    per_seq = -(-(L + 1) // block_size)
    order = torch.randperm(B * per_seq).tolist()
    tables = [order[b * per_seq:(b + 1) * per_seq] for b in range(B)]
    batch = Batch(starts=[L] * B, counts=[1] * B, block_tables=tables, block_size=block_size, state_slots=list(range(B)))
    k_pool, v_pool = (torch.randn(B * per_seq, block_size, K, D, device=device, dtype=dtype) for _ in range(2))
    q = torch.randn(1, H, B, D, device=device, dtype=dtype)
    return q, k_pool, v_pool, batch


def attend_rows(args) -> list[dict]:
    """One decode step's attention alone: triton's paged launch against sdpa's gather loop."""
    from lollm.attention import attend, use_backend

    rows = []
    dtype = getattr(torch, args.dtype)
    for B in args.requests:
        for L in args.context:
            try:
                q, k_pool, v_pool, batch = decode_step(B, L, args.device, dtype)
                ms, outs = {}, {}
                for attn in BACKENDS:
                    with use_backend(attn):
                        outs[attn] = attend(q, k_pool, v_pool, start=batch)
                        ms[attn] = time_ms(lambda: attend(q, k_pool, v_pool, start=batch), args.device)
                diff = (outs["triton"].float() - outs["sdpa"].float()).abs().max().item()
                rows.append(dict(part="attend", dtype=args.dtype, requests=B, context=L, sdpa_ms=ms["sdpa"],
                                 triton_ms=ms["triton"], speedup=ms["sdpa"] / ms["triton"], max_abs_diff=diff))
            except Exception as exc:
                rows.append(dict(part="attend", requests=B, context=L, passed=False,
                                 error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:]))
    return rows


def time_ms(fn, device: str) -> float:
    """Median milliseconds of fn(): triton.testing.do_bench on a GPU, a few plain calls elsewhere."""
    if device.startswith("cuda"):
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def table(rows: list[dict]) -> str:
    """The rows as an aligned text table (every key of every row a column)."""
    columns = list(dict.fromkeys(key for row in rows for key in row if key != "trace"))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v if v is not None else "")  # noqa: E731
    widths = {c: max(len(c), *(len(fmt(row.get(c))) for row in rows)) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(fmt(row.get(c)).rjust(widths[c]) for c in columns) for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64], help="requests at once (engine) / B (attend)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length of every request")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096], help="cached positions (attend)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the tiny model only, small sizes: a dry run")
    parser.add_argument("--out", help="folder for tables.txt and results.json")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt, args.new_tokens, args.context, args.rounds = [3], 8, 3, [40], 1
    print(f"torch {torch.__version__} | device {args.device} | dtype {args.dtype}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, folder in checkpoints(Path(tmp), args.quick).items():
                rows += engine_rows(name, folder, args)
                print(table([r for r in rows if r["part"] == "engine"]), flush=True)
        except Exception as exc:  # a checkpoint that cannot be written or loaded: say so, go on to attend
            rows.append(dict(part="engine", passed=False, error=f"{type(exc).__name__}: {exc}",
                             trace=traceback.format_exc()[-2000:]))
    rows += attend_rows(args)
    failed = [r for r in rows if r.get("passed") is False]
    text = "\n\n".join(table([r for r in rows if r["part"] == part]) for part in ("engine", "attend"))
    print("\n" + text)
    for row in failed:
        print(f"FAIL  {row}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "paged-tables.txt").write_text(text + "\n", encoding="utf-8")
        (Path(args.out) / "paged-results.json").write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
