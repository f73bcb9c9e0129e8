"""Generation, the layer of core above loading and below the batched engine: one request, start to end.

The shared generate loop (:mod:`lollm.generate.loop`: prefill, then one token per step),
the sampler (:mod:`~lollm.generate.sampling`), grammar masks for structured output
(:mod:`~lollm.generate.structured`), speculative drafters (:mod:`~lollm.generate.drafting`),
prefix reuse across calls (:mod:`~lollm.generate.prompt_cache`), KV-cache sizing
(:mod:`~lollm.generate.memory`) and a multi-turn chat (:mod:`~lollm.generate.conversation`; its
terminal, a command's, is :mod:`lollm.cli.chat`). docs/architecture.md draws the layers.

``from lollm.generate import generate`` (and the loop's other public names) still works:
they are looked up in :mod:`lollm.generate.loop` on first use, so that importing a
torch-free module of this package (``lollm.generate.structured``'s checks) does not
import torch.
"""

from __future__ import annotations

import importlib

#: The loop's public names, importable from the package as they were before it became one.
_LOOP = ("TokenLogprobs", "GenerationResult", "check_prompt_ids", "stop_token_ids", "token_logprobs",
         "Step", "check_request", "generate_steps", "TextStep", "stream_text", "generate")


def __getattr__(name: str):
    if name not in _LOOP:
        raise AttributeError(f"module 'lollm.generate' has no attribute {name!r}")
    value = getattr(importlib.import_module("lollm.generate.loop"), name)
    globals()[name] = value
    return value
