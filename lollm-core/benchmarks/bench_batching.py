"""The batched engine on the real Qwen2.5-Coder-0.5B-Instruct: throughput at 1, 4, 16 requests at once.

    python lollm-core/benchmarks/bench_batching.py [--levels 1,4,16] [--prompt-tokens 128] [--new-tokens 64]
        [--rounds 3] [--threads N] [--skip-transformers] [--weights auto|float]

Three things side by side, on one machine, in one process:

* lollm's single-sequence loop (:func:`lollm.generate.loop.generate`, one request): its decode tok/s
  (the rate ``lollm run`` prints) and its output tok/s (new tokens over the whole request,
  prefill included, the figure comparable to a level's throughput);
* lollm's engine on the GGUF with its blocks packed (as ``lollm run`` loads it): at each level
  N, N requests of the same shape submitted at once (:mod:`lollm.proof.bench_batching`);
* transformers' continuous batching (``model.generate_batch``, its ``ContinuousBatchingManager``)
  on the safetensors checkpoint transformers derives from the same GGUF, float32, ``sdpa``
  attention, the same prompts, the same greedy token count (its end-of-sequence id turned off),
  its KV pages of 16 positions, 256 tokens a step and prefix sharing off, as for lollm's engine.

Every round runs everything once, alternating (single, lollm 1, transformers 1, lollm 4,
transformers 4, ...), so a shared machine's load touches every figure alike; ratios are taken
within a round, and the medians of those per-round ratios are printed. Per level: output tok/s,
the TTFT (time to first token, from submission) and ITL (inter-token latency) p50/p95.

Not a test: no figure is asserted. On a shared 2-core machine the figures are noisy; read
the ratios of one run, not runs against each other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lollm.proof.bench import machine_load, prompt_ids
from lollm.proof.bench_batching import LevelFigures, distinct_prompts, measure_level
from lollm.engine import Engine, EngineConfig
from lollm.generate.loop import generate
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.generate.sampling import SamplingParams
from lollm.cli.real_models import derive_safetensors, fetch_gguf
from lollm.load.threads import apply_threads

MODEL = "qwen2.5-coder-0.5b-instruct"
GREEDY = SamplingParams(temperature=0.0)
PAGE = 16  # positions per KV block / page, both engines
STEP_TOKENS = 256  # the most tokens in one step, both engines


def single(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """The single-sequence loop on one request: (decode tok/s, output tok/s with the prefill)."""
    start = time.perf_counter()
    result = generate(model, ids, max_new_tokens=new_tokens, sampling=GREEDY)
    total = time.perf_counter() - start
    return result.decode_tokens_per_second, len(result.new_ids) / total


class Transformers:
    """transformers' continuous batching on the derived safetensors checkpoint, float32."""

    def __init__(self, folder: str, levels: list[int], positions: int):
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=-(-positions // PAGE) * max(levels) + 8,
                                               max_batch_tokens=STEP_TOKENS, allow_block_sharing=False)
        self.generation_config = GenerationConfig
        self.version = transformers.__version__

    def level(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[float]]:
        """All prompts through ``generate_batch`` at once: (output tok/s, TTFTs, inter-token gaps), seconds."""
        config = self.generation_config(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        out = self.model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=self.config,
                                        record_timestamps=True, progress_bar=False)
        outputs = list(out.values())
        if len(outputs) != len(prompts) or any(o.error for o in outputs):
            raise RuntimeError(f"transformers' generate_batch lost or failed requests: {[o.error for o in outputs]}")
        submitted = min(o.created_time for o in outputs)
        end = max(o.timestamps[-1] for o in outputs)
        tokens = sum(len(o.generated_tokens) for o in outputs)
        ttfts = [o.timestamps[0] - o.created_time for o in outputs]
        itls = [b - a for o in outputs for a, b in zip(o.timestamps, o.timestamps[1:])]
        return tokens / (end - submitted), ttfts, itls


def run_rounds(args, loaded, engine, hf, ids) -> tuple[list[tuple[float, float]], dict[str, list[LevelFigures]]]:
    """Every round: the single-sequence request, then each level on lollm's engine and on transformers."""
    singles: list[tuple[float, float]] = []
    figures = {"lollm": [LevelFigures(n) for n in args.levels]}
    if hf is not None:
        figures["transformers"] = [LevelFigures(n) for n in args.levels]
    for r in range(args.rounds):
        singles.append(single(loaded.model, ids, args.new_tokens))
        line = [f"single decode {singles[-1][0]:.1f}"]
        for i, n in enumerate(args.levels):
            prompts = distinct_prompts(ids, n)
            for name, figs in figures.items():
                tok_s, ttfts, itls = (measure_level(engine, prompts, args.new_tokens) if name == "lollm"
                                      else hf.level(prompts, args.new_tokens))
                figs[i].tok_s.append(tok_s)
                figs[i].ttfts += ttfts
                figs[i].itls += itls
                line.append(f"{name}@{n} {tok_s:.1f}")
        print(f"  round {r + 1}/{args.rounds} (output tok/s): " + ", ".join(line), flush=True)
    return singles, figures


def report(args, singles, figures) -> None:
    """The table, then the ratios (medians of per-round ratios) and TTFT at the highest level."""
    decode = statistics.median(s[0] for s in singles)
    single_out = statistics.median(s[1] for s in singles)
    print(f"\nsingle-sequence loop, 1 request: decode {decode:.2f} tok/s, output {single_out:.2f} tok/s (prefill included)")
    print(f"{'engine':<14} {'at once':>7} {'output tok/s':>12} {'TTFT p50 ms':>11} {'TTFT p95 ms':>11} "
          f"{'ITL p50 ms':>10} {'ITL p95 ms':>10}")
    for name, figs in figures.items():
        for f in figs:
            print(f"{name:<14} {f.concurrency:>7} {f.median_tok_s:>12.2f} {f.ttft(50) * 1e3:>11.0f} "
                  f"{f.ttft(95) * 1e3:>11.0f} {f.itl(50) * 1e3:>10.1f} {f.itl(95) * 1e3:>10.1f}")
    lollm = figures["lollm"]
    print("\nratios (median of the per-round ratios):")
    for f in lollm:
        per_level = [a / b for a, b in zip(f.tok_s, lollm[0].tok_s)]
        per_decode = [a / s[0] for a, s in zip(f.tok_s, singles)]
        line = (f"  lollm@{f.concurrency}: {statistics.median(per_level):.2f}× lollm@{lollm[0].concurrency}, "
                f"{statistics.median(per_decode):.2f}× the single-sequence decode rate")
        if "transformers" in figures:
            hf = next(h for h in figures["transformers"] if h.concurrency == f.concurrency)
            line += f", {statistics.median(a / b for a, b in zip(f.tok_s, hf.tok_s)):.2f}× transformers@{f.concurrency}"
        print(line)
    if "transformers" in figures:
        hf = figures["transformers"]
        for f in hf[1:]:
            per_level = [a / b for a, b in zip(f.tok_s, hf[0].tok_s)]
            print(f"  transformers@{f.concurrency}: {statistics.median(per_level):.2f}× transformers@{hf[0].concurrency}")
    top = max(args.levels)
    for name, figs in figures.items():
        f = next(x for x in figs if x.concurrency == top)
        print(f"  {name} at {top} at once: TTFT p50 {f.ttft(50):.2f} s, p95 {f.ttft(95):.2f} s")
    print(f"({machine_load()} at the end)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16", help="requests at once, comma-separated (default 1,4,16)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores free now, as lollm run chooses; on a busy 2-core machine "
                             "2 threads can be many times slower than 1)")
    parser.add_argument("--skip-transformers", action="store_true", help="lollm alone")
    parser.add_argument("--weights", choices=["auto", "float"], default="auto",
                        help="lollm's weights: auto (the GGUF's blocks packed, as lollm run) or float (dequantized)")
    args = parser.parse_args()
    args.levels = sorted(int(n) for n in args.levels.split(","))
    args.threads = apply_threads(args.threads).threads
    gguf = str(fetch_gguf(MODEL))
    loaded = open_model(gguf, LoadOptions(device="cpu", dtype="float32", weights=args.weights))
    ids = prompt_ids(loaded.tokenizer, args.prompt_tokens)
    positions = args.prompt_tokens + args.new_tokens
    engine = Engine(loaded.model, EngineConfig(kv_blocks=-(-positions // PAGE) * max(args.levels), block_size=PAGE,
                                               max_sequences=max(args.levels), max_batch_tokens=STEP_TOKENS,
                                               prefix_caching=False))
    hf = None if args.skip_transformers else Transformers(str(derive_safetensors(MODEL)), args.levels, positions)
    kept = "packed GGUF blocks" if args.weights == "auto" else "float32 (dequantized)"
    print(f"bench_batching: {gguf} (lollm: {kept}; {'transformers ' + hf.version + ': derived safetensors, float32' if hf else 'transformers skipped'}), "
          f"prompt {len(ids)} tokens, {args.new_tokens} new tokens per request, levels {args.levels}, {args.rounds} rounds, "
          f"{args.threads} threads, {machine_load()}", flush=True)
    measure_level(engine, [ids[:16]], 2)  # warm-ups: the first calls allocate and pick kernels
    single(loaded.model, ids[:16], 2)
    if hf is not None:
        hf.level([ids[:16]], 2)
    singles, figures = run_rounds(args, loaded, engine, hf, ids)
    report(args, singles, figures)


if __name__ == "__main__":
    main()
