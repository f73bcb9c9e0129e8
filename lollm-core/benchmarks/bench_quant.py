"""Quantized execution on the real GGUF files: lollm quantized, lollm float32 and llama.cpp, side by side.

For each real GGUF (Qwen2.5-Coder-0.5B-Instruct, Gemma 3 270M), this prints:

1. accuracy: lollm quantized against lollm float32 on the same text of more
   than 500 tokens (lollm.testing.quantized.EVAL_TEXT): top-1 agreement at every
   position and the perplexity of the text under both; then the greedy
   64-token continuation of one prompt from both, beside each other;
2. memory: peak resident memory of each engine in its own fresh process (load,
   one 512-token prefill, a few decode steps), in total and above the process's
   memory before the load, beside the file's size;
3. speed: the three engines loaded in one process and measured in alternating
   rounds (A B C A B C ...) with the same prompt ids, the same number of
   threads; medians per engine and the medians of the per-round ratios.

llama.cpp runs through the ``llama-cpp-python`` package, a benchmark-only
dependency (``nox -s bench_quant`` installs it; it compiles llama.cpp from
source, which takes a while). Usage::

    python lollm-core/benchmarks/bench_quant.py [--model qwen|gemma|all] [--threads 2] [--rounds 3]
        [--skip-accuracy] [--skip-memory] [--skip-speed] [--skip-llama]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch

from lollm.load.options import LoadOptions
from lollm.proof.bench import (LlamaCppEngine, LollmEngine, alternate, machine_load, measure_load, peak_bytes, prompt_ids,
                         reset_peak, rss_bytes)
from lollm.cli.real_models import fetch_gguf

MODELS = {"qwen": "qwen2.5-coder-0.5b-instruct", "gemma": "gemma-3-270m"}
GREEDY_PROMPT = "The history of the Roman Empire begins with the founding of the city of Rome, which legend dates to"


def engines_for(path: str, threads: int, n_ctx: int, with_llama: bool) -> list:
    engines = [LollmEngine(path, LoadOptions(device="cpu", dtype="float32", weights="quantized"), name="lollm quantized"),
               LollmEngine(path, LoadOptions(device="cpu", dtype="float32", weights="float"), name="lollm float32")]
    if with_llama:
        engines.append(LlamaCppEngine(path, threads, n_ctx))
    return engines


# -- 1. accuracy ------------------------------------------------------------------------------------------------


def accuracy(path: str) -> None:
    from lollm.generate.loop import generate
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams
    from lollm.testing.quantized import EVAL_TEXT, compare, logits_of

    greedy = SamplingParams(temperature=0.0)
    texts, logits = {}, {}
    for weights in ("float", "quantized"):
        loaded = open_model(path, LoadOptions(device="cpu", dtype="float32", weights=weights))
        ids = loaded.tokenizer.encode(EVAL_TEXT)
        logits[weights] = logits_of(loaded.model, ids)
        prompt = loaded.tokenizer.encode(GREEDY_PROMPT)
        out = generate(loaded.model, prompt, max_new_tokens=64, sampling=greedy)
        texts[weights] = (loaded.tokenizer.decode(out.new_ids), out.new_ids)
        del loaded
        gc.collect()
    a = compare(logits["float"], logits["quantized"], ids)
    print(f"accuracy over {a.positions} tokens: top-1 agreement {a.top1_rate:.2%} ({a.top1_agree}/{a.positions}), "
          f"perplexity float32 {a.perplexity_float:.3f}, quantized {a.perplexity_quantized:.3f} "
          f"(ratio {a.perplexity_ratio:.4f})")
    same = sum(x == y for x, y in zip(texts["float"][1], texts["quantized"][1]))
    print(f"greedy 64 tokens after {GREEDY_PROMPT!r} (first {same} ids equal):")
    for weights in ("float", "quantized"):
        print(f"  {weights:>9}: {texts[weights][0]!r}")


# -- 2. memory ----------------------------------------------------------------------------------------------------


def memory_worker(engine_name: str, path: str, threads: int) -> dict:
    """In a fresh process: load one engine, run a 512-token prefill and 8 decode steps; report its memory."""
    torch.set_num_threads(threads)
    engine = {e.name: e for e in engines_for(path, threads, 600, with_llama=engine_name == "llama.cpp")}[engine_name]
    if engine_name == "llama.cpp":
        import llama_cpp  # noqa: F401  (imported before the baseline, as torch and lollm are)
    from lollm.load.loader import load_checkpoint

    ids = prompt_ids(load_checkpoint(path).tokenizer, 512)
    gc.collect()
    reset_peak()
    before = rss_bytes()
    engine.load()
    engine.prefill(ids)
    engine.decode(ids[:64], 8)
    return {"engine": engine_name, "before": before, "peak": peak_bytes()}


def memory(path: str, threads: int, with_llama: bool) -> None:
    size = os.path.getsize(path)
    print(f"memory (each engine alone in a fresh process; file {size / 1e6:.0f} MB):")
    print(f"  {'engine':<16} {'peak RSS MB':>12} {'/ file':>7} {'above start MB':>15} {'/ file':>7}")
    for name in ["lollm quantized", "lollm float32"] + (["llama.cpp"] if with_llama else []):
        done = subprocess.run([sys.executable, __file__, "--memory-worker", name, path, "--threads", str(threads)],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"memory worker {name} failed:\n{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        above = r["peak"] - r["before"]
        print(f"  {name:<16} {r['peak'] / 1e6:>12.0f} {r['peak'] / size:>6.2f}× {above / 1e6:>15.0f} {above / size:>6.2f}×")


# -- 3. speed -------------------------------------------------------------------------------------------------------


def speed(path: str, threads: int, rounds: int, prompt_tokens: int, new_tokens: int, with_llama: bool) -> None:
    from lollm.proof.bench import BenchResult
    from lollm.load.loader import load_checkpoint

    torch.set_num_threads(threads)
    ids = prompt_ids(load_checkpoint(path).tokenizer, prompt_tokens)
    engines = engines_for(path, threads, prompt_tokens + new_tokens + 16, with_llama)
    figures = [measure_load(e) for e in engines]
    print(f"speed ({threads} threads, prompt {len(ids)} tokens, decode {new_tokens}, {rounds} alternating rounds; "
          f"{machine_load()} at the start):")
    alternate(engines, figures, ids, new_tokens, rounds, log=lambda line: print("  " + line, flush=True))
    result = BenchResult(figures, len(ids), new_tokens, threads)
    print(f"  {'engine':<16} {'load s':>7} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for f in figures:
        print(f"  {f.name:<16} {f.load_seconds:>7.2f} {f.median('prefill_tok_s'):>14.1f} {f.median('decode_tok_s'):>13.2f}")
    pairs = [("lollm quantized", "lollm float32")]
    if with_llama:
        pairs += [("lollm quantized", "llama.cpp"), ("lollm float32", "llama.cpp")]
    for a, b in pairs:
        for key, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            per_round = " ".join(f"{r:.2f}" for r in result.ratios(a, b, key))
            print(f"  {a} / {b} {label}: {result.ratio(a, b, key):.2f}× (per round: {per_round})")
    print(f"  ({machine_load()} at the end)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["qwen", "gemma", "all"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-llama", action="store_true", help="Leave llama.cpp out (when llama-cpp-python is not installed).")
    parser.add_argument("--memory-worker", nargs=2, metavar=("ENGINE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        print(json.dumps(memory_worker(*args.memory_worker, args.threads)))
        return
    torch.set_num_threads(args.threads)
    for key in (MODELS if args.model == "all" else [args.model]):
        path = str(fetch_gguf(MODELS[key]))
        print(f"\n== {MODELS[key]}: {path}", flush=True)
        if not args.skip_accuracy:
            accuracy(path)
        if not args.skip_memory:
            memory(path, args.threads, not args.skip_llama)
        if not args.skip_speed:
            speed(path, args.threads, args.rounds, args.prompt_tokens, args.new_tokens, not args.skip_llama)


if __name__ == "__main__":
    main()
