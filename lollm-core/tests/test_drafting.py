"""The drafters of lollm.generate.drafting on their own: what prompt lookup proposes, and the errors of a wrong setup."""

from __future__ import annotations

import pytest

from lollm.generate.drafting import MtpDrafter, PromptLookupDrafter, drafter_from_flags
from lollm.errors import GenerationError


def propose(history, n=4, **kw):
    return PromptLookupDrafter(tokens=n, **kw).propose(None, None, history, n)


def test_prompt_lookup_copies_what_followed_the_latest_occurrence():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    history = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 5, 6]
    # the 2-gram (5, 6) last occurred at 5..6 (not at 0..1): what followed it there
    assert propose(history) == [7, 3, 4, 5]
    assert propose(history, n=2) == [7, 3]


def test_prompt_lookup_prefers_the_longest_ngram():
    # (8, 5, 6) occurs once, at 3; (5, 6) also later, at 7: the 3-gram wins
    history = [1, 2, 0, 8, 5, 6, 9, 4, 5, 6, 3, 8, 5, 6]
    assert propose(history) == [9, 4, 5, 6]
    assert propose(history, max_ngram=2) == [3, 8, 5, 6]


def test_prompt_lookup_without_a_match_proposes_nothing():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 4, 1], min_ngram=1) == [2, 3, 4, 1]  # down to 1-grams when asked
    assert propose([7]) == [] and propose([]) == []
    assert PromptLookupDrafter(tokens=4).propose(None, None, [1, 2, 1, 2], 0) == []


def test_bad_drafter_settings_are_named():
    with pytest.raises(GenerationError, match="draft tokens must be an int >= 1"):
        PromptLookupDrafter(tokens=0)
    with pytest.raises(GenerationError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(tokens=2, min_ngram=3, max_ngram=2)
    with pytest.raises(GenerationError, match="choose one"):
        drafter_from_flags(mtp=True, prompt_lookup=True, draft_tokens=3)
    assert drafter_from_flags(mtp=False, prompt_lookup=False, draft_tokens=3) is None
    assert drafter_from_flags(mtp=False, prompt_lookup=True, draft_tokens=5) == PromptLookupDrafter(tokens=5)
    assert drafter_from_flags(mtp=True, prompt_lookup=False, draft_tokens=2) == MtpDrafter(tokens=2)


def test_the_draft_head_drafter_refuses_a_model_without_one():
    class NoHead:
        has_draft_head = False

    with pytest.raises(GenerationError, match="no draft head"):
        MtpDrafter(tokens=2).check(NoHead())
