"""Where a packed GGUF run's resident memory goes, step by step, in one fresh process.

    python lollm-core/benchmarks/bench_memory.py FILE.gguf [--prompt-tokens 512] [--new-tokens 8] [--all-imports]

The baseline is this process with torch and lollm imported (``--all-imports``: also the
tokenizer's modules and the native kernel's library). Then, one after the
other: the GGUF metadata parsed (``load_checkpoint``), the tokenizer built from it,
the model loaded packed (``weights="auto"``, the CLI's default for a GGUF), and a
greedy generation (the prompt's prefill in chunks, then the decode steps). Each line
gives the resident memory above the baseline after the step and the peak so far
(Linux's VmHWM), in MB and as a multiple of the file's size: the figure issue 23's
goal (peak ≤ 1.3× the file) is about. docs/measurements.md records the results.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

import lollm  # noqa: F401  (imported before the baseline)
from lollm.proof.bench import peak_bytes, reset_peak, rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a GGUF file")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length, prefilled in chunks (default 512)")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy decode steps after it (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--all-imports", action="store_true",
                        help="import the tokenizer's modules (jinja2, regex) and load the native kernel's library "
                             "before the baseline: every module the run uses counted as an import")
    args = parser.parse_args()

    from lollm.generate.loop import generate
    from lollm.load.loader import load_checkpoint
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    if args.all_imports:
        import lollm.tokenizer  # noqa: F401
        from lollm import native
        native.block_int8_op()
    size = os.path.getsize(args.path)
    gc.collect()
    reset_peak()
    base = rss_bytes()

    def show(step: str) -> None:
        gc.collect()
        now, peak = rss_bytes() - base, peak_bytes() - base
        print(f"| {step} | {now / 1e6:.0f} MB ({now / size:.2f}×) | {peak / 1e6:.0f} MB ({peak / size:.2f}×) |", flush=True)

    imported = "every module the run uses imported" if args.all_imports else "torch and lollm imported"
    print(f"{args.path}: {size / 1e6:.0f} MB; above the process with {imported} ({base / 1e6:.0f} MB)")
    print("| step | resident | peak so far |\n| --- | --- | --- |")
    checkpoint = load_checkpoint(args.path)
    show("GGUF metadata parsed")
    tokenizer = checkpoint.tokenizer
    show("+ tokenizer")
    loaded = open_model(checkpoint, LoadOptions(weights="auto"))
    show(f"+ model loaded ({loaded.model.weights_summary.model_bytes / 1e6:.0f} MB of tensors)")
    text = "def area(radius):\n    return 3.14159 * radius * radius\n\n"
    ids = tokenizer.encode(text * (args.prompt_tokens // 8 + 1))[: args.prompt_tokens]
    with torch.inference_mode():
        generate(loaded.model, ids, max_new_tokens=args.new_tokens, sampling=SamplingParams(temperature=0.0), attn=loaded.attn)
    show(f"+ {len(ids)}-token prefill, {args.new_tokens} decode steps")


if __name__ == "__main__":
    main()
