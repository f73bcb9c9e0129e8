"""The GPU check of ``--attn triton``: parity and speed of every family on a CUDA GPU, in one run.

    python lollm-core/benchmarks/gpu_attention_check.py --out DIR            # on a machine with a CUDA GPU
    TRITON_INTERPRET=1 python lollm-core/benchmarks/gpu_attention_check.py --device cpu --quick   # a dry run here

benchmarks/gpu_attention_check.sh wraps it (environment report, install, the
kernel tests compiled on the GPU). What it does, in order:

1. **parity, tiny checkpoints**: every family's tiny random checkpoint (the ones the
   tests build from real hub configs, plus a gemma4 whose global heads are 512 wide),
   float32 and bfloat16, ``--attn sdpa`` and ``--attn triton``: the parity gate against
   transformers (:func:`lollm.proof.parity.run_parity`), and our triton logits against our
   sdpa logits on the same device (prefill and cached decode) with the greedy ids of both.
   In float32 triton must stay within 1e-4 of sdpa, or, where float32 itself is noisier
   than that, no farther than 1.5 x sdpa's distance from a float64 run of the same model;
2. **parity, real shapes**: Qwen2.5-0.5B and Gemma 3 270M, the real trained weights
   when they are in lollm's cache (or given with ``--qwen25``/``--gemma3``), else
   random weights of the real configuration (the hub config shipped with lollm-core:
   the same shapes, heads and windows; the row says which);
3. **speed**: the same two models in bfloat16, prompt 512 and 4096, 64 decode steps,
   sdpa and triton in alternating rounds (prefill and decode tokens per second,
   median of the rounds); and ``attend`` alone on the attention shapes of Qwen2.5,
   Gemma 3 270M and Gemma 4's global layers (``triton.testing.do_bench``, median ms).

Each step that fails prints a FAIL row with its error and the run goes on; the exit
status is 1 when a gate failed. ``--out DIR`` also writes the tables and a JSON file.
``lollm bench`` itself measures on the CPU only (bench.py loads on the CPU), so
the speed step here times the shared generate loop directly on the GPU.
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
from lollm.load.options import LoadOptions

REPO = Path(__file__).resolve().parents[2]
for tests in ("lollm-qwen/tests", "lollm-gemma/tests", "lollm-qwen3_5/tests"):
    sys.path.insert(0, str(REPO / tests))  # the tiny-checkpoint builders the family tests use

BACKENDS = ("sdpa", "triton")
TINY_FP32_BOUND = 1e-4  # triton against sdpa, our own logits, float32 (the tests' bound)


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------
def tiny_checkpoints(root: Path) -> dict[str, Path]:
    """Every family's tiny random checkpoint, written by transformers as the tests write them."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    made: dict[str, Path] = {}

    def attempt(name, build):
        try:
            made[name] = build(root / name)
        except Exception as exc:  # an older transformers may lack a family: say so, go on
            print(f"FAIL  building tiny {name}: {type(exc).__name__}: {exc}", flush=True)

    import _gemma_testing as gemma
    import _qwen_tiny as qwen
    import qwen3_5_tiny as qwen3_5

    for family in ("qwen2", "qwen3"):
        raw = shrink_config(qwen.real_config(family), **qwen.FAMILIES[family]["overrides"])
        attempt(family, lambda folder, raw=raw: write_tiny_checkpoint(raw, folder, schema="hub"))
    for name in ("gemma2", "gemma3-270m", "gemma4-e2b-text"):
        attempt(name, lambda folder, name=name: write_tiny_checkpoint(gemma.TINY[name](), folder))
    wide = {**gemma.TINY["gemma4-e2b-text"](), "global_head_dim": 512, "head_dim": 256}
    attempt("gemma4-global512", lambda folder: write_tiny_checkpoint(wide, folder))
    for family in ("qwen3_5", "qwen3_5_moe"):
        attempt(family, lambda folder, family=family: qwen3_5.write_tiny(family, "text", folder))
    return made


REAL = {  # name in lollm.cli.real_models -> hub config of the same shape (lollm.cli.hub_configs)
    "qwen2.5-coder-0.5b-instruct": "Qwen__Qwen2.5-0.5B",
    "gemma-3-270m": "google__gemma-3-270m-it",
}


def real_checkpoints(root: Path, given: dict[str, str | None]) -> dict[str, tuple[Path, str]]:
    """The real Qwen2.5 and Gemma 3 checkpoints if at hand, else random weights of their shapes.

    Returns name -> (folder, "real" or "random weights, real shape"). Nothing is
    downloaded: a GPU machine may reach no network.
    """
    from lollm.cli.hub_configs import hub_configs_dir
    from lollm.cli.real_models import cache_dir
    from lollm.testing.tiny import write_tiny_checkpoint

    out = {}
    for name, hub in REAL.items():
        candidates = [Path(given[name])] if given.get(name) else []
        candidates.append(cache_dir() / name / "safetensors")
        found = next((c for c in candidates if (c / "config.json").exists() and (c / "tokenizer.json").exists()), None)
        if found is not None:
            out[name] = (found, "real")
            continue
        raw = json.loads((hub_configs_dir() / hub / "config.json").read_text(encoding="utf-8"))
        raw = raw.get("text_config", raw) if raw.get("model_type") == "gemma3" else raw
        try:
            out[name] = (write_tiny_checkpoint(raw, root / f"{name}-random"), "random weights, real shape")
        except Exception as exc:
            print(f"FAIL  writing a random {name}: {type(exc).__name__}: {exc}", flush=True)
    return out


def random_ids(folder: Path, n: int, seed: int = 0) -> list[int]:
    """n token ids in [3, min(vocab, 500)) (clear of the special and multimodal ids at the top)."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vocab = raw.get("vocab_size") or raw.get("text_config", {}).get("vocab_size")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 500), (n,), generator=g).tolist()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# 1-2. Parity
# ---------------------------------------------------------------------------
def parity_rows(name: str, folder: Path, kind: str, device: str, dtype: str, ids: list[int] | None) -> list[dict]:
    """The gate against transformers for each backend, then our triton against our sdpa."""
    from lollm.proof.parity import run_parity

    rows = []
    for attn in BACKENDS:
        row = dict(step="parity", model=name, kind=kind, dtype=dtype, attn=attn)
        try:
            start = time.perf_counter()
            report = run_parity(str(folder), ids=ids, options=LoadOptions(dtype=dtype, device=device, attn=attn))
            row.update(gate="PASS" if report.passed else "FAIL", argmax=f"{report.argmax_matches}/{report.num_tokens}",
                       min_cosine=report.min_cosine, max_abs_diff=report.max_abs_diff,
                       seconds=time.perf_counter() - start)
            # Random weights give nearly flat logits: in bfloat16 a near tie may flip an argmax between
            # the GPU and transformers on the CPU. Such rows are figures; float32 and real weights are gates.
            if dtype == "float32" or kind == "real":
                row["passed"] = report.passed
        except Exception as exc:
            row.update(passed=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        rows.append(row)
        free(device)
    rows.append(ours_against_ours(name, folder, kind, device, dtype, ids))
    free(device)
    return rows


def ours_against_ours(name: str, folder: Path, kind: str, device: str, dtype: str, ids: list[int] | None) -> dict:
    """Our logits with triton against ours with sdpa on the same device: one prefill, then a
    cached run (a prefill of 2/3 of the ids, a chunk of 3, single tokens); greedy ids of 16 steps."""
    from lollm.attention import use_backend
    from lollm.generate.loop import generate
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    row = dict(step="triton vs sdpa", model=name, kind=kind, dtype=dtype, attn="triton")
    try:
        loaded = open_model(str(folder), LoadOptions(device=device, dtype=dtype))
        model = loaded.model
        if ids is None:
            ids = random_ids(folder, 60)
        x = torch.tensor([ids], device=loaded.device)
        cut = 2 * len(ids) // 3
        logits, greedy = {}, {}
        for attn in BACKENDS:
            with torch.inference_mode(), use_backend(attn):
                one_shot = model(x)[0].float()
                cache = model.new_cache(len(ids))
                steps = [model(x[:, :cut], cache)[0], model(x[:, cut : cut + 3], cache)[0]]
                steps += [model(x[:, i : i + 1], cache)[0] for i in range(cut + 3, len(ids))]
            logits[attn] = (one_shot, torch.cat(steps).float())
            greedy[attn] = generate(model, ids[:cut], max_new_tokens=16, sampling=SamplingParams(temperature=0.0), attn=attn).new_ids
        prefill = (logits["triton"][0] - logits["sdpa"][0]).abs().max().item()
        cached = (logits["triton"][1] - logits["sdpa"][1]).abs().max().item()
        same_argmax = bool(torch.equal(logits["triton"][1].argmax(-1), logits["sdpa"][1].argmax(-1)))
        row.update(prefill_max_abs_diff=prefill, cached_max_abs_diff=cached, same_argmax=same_argmax,
                   same_greedy_ids=greedy["triton"] == greedy["sdpa"])
        if dtype == "float32" and kind == "tiny":  # the tests' gate; bf16 and real shapes are figures
            # How far each backend is from the same model run in float64 (on the CPU): where float32 itself
            # is noisier than the bound (gemma4's 512-wide heads at scale 1), triton must be no worse than sdpa.
            exact = open_model(str(folder), LoadOptions(device="cpu", dtype="float32")).model.double()
            with torch.inference_mode(), use_backend("sdpa"):
                exact = exact(x.cpu())[0]
            for attn in BACKENDS:
                row[f"{attn}_vs_float64"] = (logits[attn][0].cpu().double() - exact).abs().max().item()
            close = max(prefill, cached) <= TINY_FP32_BOUND or row["triton_vs_float64"] <= 1.5 * row["sdpa_vs_float64"]
            row["passed"] = close and same_argmax and row["same_greedy_ids"]
        del loaded, model
    except Exception as exc:
        row.update(passed=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
    return row


# ---------------------------------------------------------------------------
# 3. Speed
# ---------------------------------------------------------------------------
def bench_rows(name: str, folder: Path, kind: str, device: str, dtype: str, prompts: list[int],
               new_tokens: int, rounds: int) -> list[dict]:
    """Prefill and decode tokens per second through the shared generate loop, backends in alternating rounds."""
    from lollm.generate.loop import generate
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    rows = []
    try:
        model = open_model(str(folder), LoadOptions(device=device, dtype=dtype)).model
    except Exception as exc:
        return [dict(step="bench", model=name, kind=kind, dtype=dtype, passed=False, error=f"{type(exc).__name__}: {exc}")]
    greedy = SamplingParams(temperature=0.0)
    for n in prompts:
        ids = random_ids(folder, n, seed=n)
        figures = {attn: [] for attn in BACKENDS}
        try:
            for attn in BACKENDS:  # warm-up: Triton compiles its kernels on the first calls
                generate(model, ids, max_new_tokens=4, sampling=greedy, attn=attn)
            for _ in range(rounds):
                for attn in BACKENDS:  # A B A B: a drift in clocks or load hits both alike
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    result = generate(model, ids, max_new_tokens=new_tokens + 1, sampling=greedy, attn=attn)
                    figures[attn].append((n / result.prefill_seconds, (len(result.new_ids) - 1) / result.decode_seconds))
        except Exception as exc:
            rows.append(dict(step="bench", model=name, kind=kind, dtype=dtype, prompt=n, passed=False,
                             error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:]))
            continue
        for attn in BACKENDS:
            rows.append(dict(step="bench", model=name, kind=kind, dtype=dtype, prompt=n, attn=attn,
                             prefill_tok_s=statistics.median(f[0] for f in figures[attn]),
                             decode_tok_s=statistics.median(f[1] for f in figures[attn])))
    del model
    free(device)
    return rows


ATTENTION_SHAPES = {  # (query heads H, key/value heads K, head width D, window)
    "Qwen2.5-0.5B": (14, 2, 64, None),
    "Gemma3-270M global": (4, 1, 256, None),
    "Gemma3-270M sliding": (4, 1, 256, 512),
    "Gemma4 global (512 wide)": (8, 1, 512, None),
}


def attention_rows(device: str, dtype: str, lengths: list[int]) -> list[dict]:
    """``attend`` alone, sdpa against triton: a prefill of S queries, and one decode query over S keys."""
    from triton.testing import do_bench

    from lollm.attention import attend, use_backend

    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    rows = []
    for shape, (H, K, D, window) in ATTENTION_SHAPES.items():
        for S in lengths:
            for what, T in (("prefill", S), ("decode", 1)):
                g = torch.Generator(device=device).manual_seed(S)
                q = torch.randn(1, H, T, D, device=device, dtype=dt, generator=g)
                k, v = (torch.randn(1, K, S, D, device=device, dtype=dt, generator=g) for _ in range(2))
                row = dict(step="attend", shape=shape, dtype=dtype, what=what, keys=S)
                try:
                    for attn in BACKENDS:
                        with use_backend(attn):
                            run = lambda: attend(q, k, v, start=S - T, window=window, scale=1.0 if D == 512 else None)  # noqa: E731
                            run()
                            row[f"{attn}_ms"] = do_bench(run, warmup=25, rep=100, return_mode="median")
                except Exception as exc:
                    row.update(passed=False, error=f"{type(exc).__name__}: {exc}")
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------
def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def table(rows: list[dict], columns: list[str]) -> str:
    shown = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(s[i]) for s in shown]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(s[i].rjust(w) for i, w in enumerate(widths)) for s in shown]
    for r in rows:
        if r.get("error"):
            lines.append(f"FAIL {r.get('model', r.get('shape'))} {r.get('dtype')} {r.get('attn', '')}: {r['error'][:300]}")
    return "\n".join(lines)


def environment(device: str) -> dict:
    import triton

    env = dict(python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__, device=device)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(gpu=props.name, sms=props.multi_processor_count, memory_gb=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu with TRITON_INTERPRET=1: a slow dry run)")
    parser.add_argument("--out", type=Path, help="write tables.txt and results.json here")
    parser.add_argument("--qwen25", help="folder of the real Qwen2.5-0.5B safetensors checkpoint (default: lollm's cache)")
    parser.add_argument("--gemma3", help="folder of the real Gemma 3 270M safetensors checkpoint (default: lollm's cache)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 4096], help="prompt lengths of the speed step")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny checkpoints only, float32 only (the CPU dry run)")
    args = parser.parse_args()

    from lollm.attention import resolve_backend
    from lollm.load.pipeline import pick_device

    device = str(pick_device(args.device))
    resolve_backend("triton", device)  # a clear error now rather than a FAIL in every row
    env = environment(device)
    print("environment:", json.dumps(env), flush=True)
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    rows: list[dict] = []
    root = Path(tempfile.mkdtemp(prefix="lollm-gpu-check-"))

    # 1. every family's tiny checkpoint
    for name, folder in tiny_checkpoints(root).items():
        for dtype in dtypes:
            rows += parity_rows(name, folder, "tiny", device, dtype, random_ids(folder, 40))
            print(table(rows[-3:], ["model", "dtype", "step", "attn", "gate", "argmax", "min_cosine", "max_abs_diff",
                                    "prefill_max_abs_diff", "cached_max_abs_diff", "same_greedy_ids"]), flush=True)
    # 2-3. the real shapes: parity, then speed
    if not args.quick:
        real = real_checkpoints(root, {"qwen2.5-coder-0.5b-instruct": args.qwen25, "gemma-3-270m": args.gemma3})
        for name, (folder, kind) in real.items():
            for dtype in dtypes:
                ids = None if kind == "real" else random_ids(folder, 60)  # real: the gate's default prompt
                rows += parity_rows(name, folder, kind, device, dtype, ids)
                print(table(rows[-3:], ["model", "kind", "dtype", "step", "attn", "gate", "argmax", "min_cosine",
                                        "max_abs_diff", "prefill_max_abs_diff", "cached_max_abs_diff"]), flush=True)
        for name, (folder, kind) in real.items():
            rows += bench_rows(name, folder, kind, device, "bfloat16", args.prompts, args.new_tokens, args.rounds)
        if device.startswith("cuda"):
            rows += attention_rows(device, "bfloat16", args.prompts)

    parity = [r for r in rows if r["step"] in ("parity", "triton vs sdpa")]
    bench = [r for r in rows if r["step"] == "bench"]
    attend_rows = [r for r in rows if r["step"] == "attend"]
    text = "\n\n".join([
        "environment: " + json.dumps(env),
        "parity (gate: lollm parity against transformers; 'triton vs sdpa': our logits, same device)\n" + table(parity, [
            "model", "kind", "dtype", "step", "attn", "gate", "passed", "argmax", "min_cosine", "max_abs_diff",
            "prefill_max_abs_diff", "cached_max_abs_diff", "sdpa_vs_float64", "triton_vs_float64", "same_argmax",
            "same_greedy_ids"]),
        f"speed (generate loop, greedy, {args.new_tokens} decode steps, median of {args.rounds} alternating rounds)\n"
        + table(bench, ["model", "kind", "dtype", "prompt", "attn", "prefill_tok_s", "decode_tok_s"]),
        "attend alone (median ms, triton.testing.do_bench)\n"
        + table(attend_rows, ["shape", "dtype", "what", "keys", "sdpa_ms", "triton_ms"]),
    ])
    print("\n" + text, flush=True)
    failed = [r for r in rows if r.get("passed") is False]
    print(f"\n{len(failed)} failed" if failed else "\nevery gate passed")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tables.txt").write_text(text + "\n", encoding="utf-8")
        (args.out / "results.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
