"""Prompt lookup (and any drafter) through core's one verify path: llama gives plain decoding's tokens and cache."""

from __future__ import annotations

import pytest
import torch

from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.testing.conformance import check_speculation_is_exact, repeating_prompt

from _llama_tiny import write_tiny


@pytest.mark.parametrize("kind", ["llama2", "llama3"])
def test_speculative_decoding_equals_plain_decoding(kind, tmp_path):
    torch.set_num_threads(1)
    model = open_model(str(write_tiny(kind, tmp_path / kind)), LoadOptions(device="cpu", dtype="float32")).model
    counts = check_speculation_is_exact(model, repeating_prompt(500))
    for run in ("greedy, scripted", "sampled, scripted"):
        drafted, accepted = counts[run]
        assert 0 < accepted < drafted, (run, counts)
    assert counts["greedy, prompt lookup"][0] > 0, counts
