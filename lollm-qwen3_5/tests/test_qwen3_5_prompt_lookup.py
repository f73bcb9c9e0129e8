"""Prompt lookup (and any drafter) through the one verify path MTP uses: the DeltaNet states roll back too,
so qwen3_5 and qwen3_5_moe give plain decoding's tokens and cache."""

from __future__ import annotations

import pytest
import torch

from lollm.testing.conformance import check_chunked_prefill_is_exact, check_speculation_is_exact, repeating_prompt

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_equals_plain_decoding(family, tiny_checkpoint, load_ours):
    torch.set_num_threads(1)
    model = load_ours(tiny_checkpoint(family, "text", lively=True))
    counts = check_speculation_is_exact(model, repeating_prompt(500))
    for run in ("greedy, scripted", "sampled, scripted"):
        drafted, accepted = counts[run]
        assert 0 < accepted < drafted, (run, counts)
    assert counts["greedy, prompt lookup"][0] > 0, counts


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_whole_prefill(family, tiny_checkpoint, load_ours):
    """The shared loop's chunked prefill across the delta rule's chunks of 64 (chunks of 7 and of 65)."""
    torch.set_num_threads(1)
    model = load_ours(tiny_checkpoint(family, "text", lively=True))
    assert 65 in check_chunked_prefill_is_exact(model, repeating_prompt(500))
