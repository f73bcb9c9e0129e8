"""Batch invariance on a real checkpoint, on a chosen CPU route: a request's logits alone and in a batch, bit for bit.

The engine promises that a request samples exactly as it would alone (docs/batching.md,
"Batch invariance"). :func:`lollm.testing.batching.check_batch_invariance` checks that promise
for one model; this module feeds it a real checkpoint with requests a server meets: prompts of
many lengths, a token budget that cuts prompts into chunks beside other requests' decode rows,
and requests that arrive while others decode.

The CPU route of lollm's native kernel (AMX tiles, the AVX-512 VNNI loops, AVX2, portable C++) is
chosen once per process from ``LOLLM_AMX`` and ``LOLLM_ISA`` (:mod:`lollm.native`), so a test runs
each route in a process of its own::

    LOLLM_AMX=0 python -m lollm.testing.invariance MODEL.gguf --requests 8,16

It exits with status 0 and one line per batch size when every logit is equal, and with status 1 and
the first difference otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from lollm.engine.engine import EngineConfig
from lollm.testing.batching import check_batch_invariance, invariance_arrivals

#: The requests' text: code and prose, long enough for the longest prompt below.
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "The history of the Roman Empire begins with the founding of the city. Write a poem about the sea. "
        "Explain how a hash map works, step by step, with an example in Python and its complexity. ") * 3
#: Prompt lengths in tokens, mixed so that chunks and decode rows share steps in many ways.
LENGTHS = (5, 37, 12, 80, 3, 51, 24, 66, 9, 43, 18, 71, 30, 7, 58, 15)
#: Blocks of 16 positions, at most 64 tokens a step: an 80-token prompt runs in two or more chunks.
CONFIG = EngineConfig(kv_blocks=1024, block_size=16, max_sequences=16, max_batch_tokens=64)


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts of :data:`LENGTHS` tokens, each cut from :data:`TEXT` at its own offset."""
    ids = tokenizer.encode(TEXT)
    return [ids[3 * i: 3 * i + length] for i, length in enumerate(LENGTHS[:count])]


def check_checkpoint(path: str, counts: list[int], new_tokens: int) -> list[str]:
    """Load ``path`` (packed weights where the file has them) and check ``counts`` requests at once.
    Returns one line per count; AssertionError at the first logit that differs."""
    from lollm import native
    from lollm.engine.llm import LLM

    llm = LLM(path)
    lines = [f"{path}: {llm.model.weights_summary.line()}", native.status()]
    with torch.inference_mode():
        for count in counts:
            arrivals = invariance_arrivals(prompts_for(llm.tokenizer, count), new_tokens)
            check_batch_invariance(llm.model, arrivals, CONFIG)
            lines.append(f"{count} requests: every logit equal alone and batched ({new_tokens} tokens each)")
    return lines


def cpu_routes() -> dict[str, dict[str, str]]:
    """The CPU routes a test forces, each the environment variables that pick it, run once each.

    ``default`` (the tiles where the CPU lends them), ``vnni`` (``LOLLM_AMX=0``: the AVX-512 VNNI
    loops) and ``avx2`` (``LOLLM_ISA=avx2``). On a CPU without AMX-INT8 the default route *is* the
    VNNI loops, the same code with the same variables' effect, so it is run once, as ``vnni``; on
    one without AVX-512 VNNI or AVX2 (read from /proc/cpuinfo) those routes are left out: the
    library refuses them there, naming what is missing.
    """
    from lollm import native

    flags = native._cpu_flags() or set()
    routes: dict[str, dict[str, str]] = {}
    if "amx_int8" in flags or "avx512_vnni" not in flags:
        routes["default"] = {}
    if "avx512_vnni" in flags:
        routes["vnni"] = {"LOLLM_AMX": "0"}
    if "avx2" in flags:
        routes["avx2"] = {"LOLLM_ISA": "avx2"}
    return routes


def run_route(path: str, env: dict[str, str], counts: str = "8,16", new_tokens: int = 12,
              timeout: float = 1800) -> subprocess.CompletedProcess:
    """This module in a fresh process with ``env`` (the route's variables added to the current environment)."""
    import os

    return subprocess.run([sys.executable, "-m", "lollm.testing.invariance", path, "--requests", counts,
                           "--new-tokens", str(new_tokens)], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint folder or .gguf file")
    parser.add_argument("--requests", default="8,16", help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    try:
        lines = check_checkpoint(args.model, [int(c) for c in args.requests.split(",")], args.new_tokens)
    except AssertionError as exc:
        print(f"batch invariance broken: {exc}")
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
