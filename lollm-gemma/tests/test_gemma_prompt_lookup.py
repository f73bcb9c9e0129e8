"""Prompt lookup (and any drafter) through the one verify path on sliding-window rings: gemma2, gemma3, gemma4
give plain decoding's tokens and cache, the prompt and the output several windows long."""

from __future__ import annotations

import pytest
import torch
from _gemma_testing import WINDOW, load_ours

from lollm.testing.conformance import check_chunked_prefill_is_exact, check_speculation_is_exact, repeating_prompt

FAMILIES = ["gemma2", "gemma3-270m", "gemma4-e2b-text"]


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_decoding_equals_plain_decoding(tiny, name):
    torch.set_num_threads(1)
    model = load_ours(tiny(name, "transformers5"))
    counts = check_speculation_is_exact(model, repeating_prompt(500))
    for run in ("greedy, scripted", "sampled, scripted"):
        drafted, accepted = counts[run]
        assert 0 < accepted < drafted, (run, counts)
    assert counts["greedy, prompt lookup"][0] > 0, counts


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_equals_whole_prefill(tiny, name):
    """The shared loop's chunked prefill on sliding-window rings: chunks of W - 1 and W + 1 across the edge."""
    torch.set_num_threads(1)
    model = load_ours(tiny(name, "transformers5"))
    sizes = check_chunked_prefill_is_exact(model, repeating_prompt(500), window=WINDOW)
    assert WINDOW + 1 in sizes, sizes
