"""Chunked prefill: run a prompt through the cache in pieces of at most :data:`PREFILL_CHUNK_TOKENS` positions.

A prefill over P positions in one forward holds activations that grow with P:
the hidden states (P, hidden), each MLP's (P, intermediate) pair, and each attention
layer's scores, (heads, P, P + cached) for the math backend. On a 512-token prompt
of Qwen2.5-0.5B that made the peak resident memory 1.96x the GGUF file (issue 23).
Run in chunks, the same positions pass through the same cache one piece after the
other: each chunk's queries see the cache the previous chunks wrote, exactly as the
decode steps and speculative verify rows do, so the logits are those of a whole
prefill (up to float rounding), and the activations are bounded by the chunk, not
by the prompt. Every family supports it without code of its own: a family's
``forward(ids, cache)`` already accepts any number of new positions after what the
cache holds (the conformance suite feeds uneven chunks, chunks across a sliding
window's edge and across a delta-rule chunk).

The price is a little speed: a chunk's matmuls are smaller, and each chunk
re-reads the weights once. At 128 positions per chunk the weight reads are
amortized over 128 rows, so the cost is small (see docs/measurements.md).
"""

from __future__ import annotations

from typing import Any

import torch

from lollm.model import Cache, CausalLM

#: The most prompt positions one prefill forward runs. Longer prompts run in chunks
#: of this size, one after the other, through the same cache: the activations of a
#: prefill stay bounded by 128 positions whatever the prompt's length. A tunable of
#: this module, not an option: change it here (tests set it small to cross chunk edges).
PREFILL_CHUNK_TOKENS = 128


def run_prompt(model: CausalLM, ids: list[int], cache: Cache, device: torch.device, images: Any = None) -> torch.Tensor:
    """Run ``ids`` after what ``cache`` holds, in chunks of at most :data:`PREFILL_CHUNK_TOKENS`.

    ``ids``: a non-empty list of ints; ``cache``: the model's cache (``model.new_cache``),
    which the forwards advance by ``len(ids)`` positions. ``images``: the prompt's
    :class:`lollm.vision.spec.ImageBatch` (docs/vision.md) or None; each forward receives it,
    and a chunk that would end inside an image runs on to the image's end (an image's tokens
    attend to each other, so one forward holds all of them). Returns the logits of the
    last position, (1, 1, vocab) float. Errors are the model's (a full cache, an id
    outside the vocabulary), raised by the chunk that meets them; ValueError for no ids.
    """
    chunk = max(1, int(PREFILL_CHUNK_TOKENS))
    spans = [] if images is None else images.spans()  # positions from 0 = the cache's first
    extra = {} if images is None else {"images": images}
    logits, start, offset = None, 0, cache.length
    while start < len(ids):
        end = min(start + chunk, len(ids))
        end = max([end] + [b - offset for a, b in spans if a - offset < end < b - offset])  # never cut an image
        piece = torch.tensor([ids[start:end]], dtype=torch.long, device=device)
        logits = model(piece, cache, logits_to_keep=1, **extra)
        start = end
    if logits is None:
        raise ValueError("run_prompt got no ids: a prefill needs at least one position")
    return logits
