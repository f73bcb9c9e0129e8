"""Prompt lookup (and any drafter) through the one verify path: qwen2 and qwen3 give plain decoding's tokens and cache."""

from __future__ import annotations

from lollm.testing.conformance import check_chunked_prefill_is_exact, check_speculation_is_exact, repeating_prompt

from _qwen_tiny import family, load_ours, tiny_checkpoint, torch  # noqa: F401  (fixtures)


def test_speculative_decoding_equals_plain_decoding(tiny_checkpoint, family):
    torch.set_num_threads(1)
    model = load_ours(tiny_checkpoint(family, num_hidden_layers=3), family)
    counts = check_speculation_is_exact(model, repeating_prompt(500))
    for run in ("greedy, scripted", "sampled, scripted"):
        drafted, accepted = counts[run]
        assert 0 < accepted < drafted, (run, counts)  # both an accepted and a rejected draft went through
    assert counts["greedy, prompt lookup"][0] > 0, counts  # the repeated phrase gave drafts


def test_chunked_prefill_equals_whole_prefill(tiny_checkpoint, family):
    torch.set_num_threads(1)
    model = load_ours(tiny_checkpoint(family, num_hidden_layers=3), family)
    assert check_chunked_prefill_is_exact(model, repeating_prompt(500)) == [7, 65]
