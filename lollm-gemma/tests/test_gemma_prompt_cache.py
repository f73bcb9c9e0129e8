"""The prompt cache on sliding-window rings: the exact rule for going back, snapshots beyond it,
and turns of a conversation that each equal a cold run (gemma2, gemma3, gemma4 with shared-KV layers)."""

from __future__ import annotations

import pytest
import torch
from _gemma_testing import WINDOW, load_ours, prompt_ids

from lollm.errors import GenerationError
from lollm.testing.conformance import check_prompt_cache_turns

FAMILIES = ["gemma2", "gemma3-270m", "gemma4-e2b-text"]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_ring_goes_back_exactly_as_far_as_it_holds_the_window(tiny, name):
    model = load_ours(tiny(name, "transformers5"))
    ids = prompt_ids(24, seed=3)
    with torch.inference_mode():
        truth = model(torch.tensor([ids]))[0]  # (24, V), no cache
        cache = model.new_cache(32)
        model(torch.tensor([ids[:4]]), cache)  # 4 <= W positions: nothing overwritten yet
        assert all(cache.can_rollback(n) for n in range(5))
        cache.rollback(1)
        out = model(torch.tensor([ids[1:20]]), cache)[0]  # 20 > W: the rings wrap
        assert _cos(out, truth[1:20]) > 0.9999
        # wrapped: one step back at most (n >= written - 1), or all the way to 0
        assert [n for n in range(21) if cache.can_rollback(n)] == [0, 19, 20]
        with pytest.raises(GenerationError, match="cannot roll the cache back"):
            cache.rollback(18)
        cache.rollback(19)
        out = model(torch.tensor([ids[19:21]]), cache)[0]
        assert _cos(out, truth[19:21]) > 0.9999 and torch.equal(out.argmax(-1), truth[19:21].argmax(-1))

        # the rule is tight: forcing the length back to 18 reads a key the ring lost
        cache.length = 18
        wrong = model(torch.tensor([ids[18:20]]), cache)[0]
        assert _cos(wrong, truth[18:20]) < 0.9999

        # a snapshot brings back what a rollback cannot
        cache.rollback(0)
        model(torch.tensor([ids[:12]]), cache)
        snap = cache.snapshot()
        model(torch.tensor([ids[12:22]]), cache)
        assert not cache.can_rollback(12)
        cache.restore(snap)
        assert cache.length == 12
        out = model(torch.tensor([ids[12:24]]), cache)[0]
        assert _cos(out, truth[12:24]) > 0.9999 and torch.equal(out.argmax(-1), truth[12:24].argmax(-1))


@pytest.mark.parametrize("name", FAMILIES)
def test_turns_equal_cold_runs(tiny, name):
    """Every turn is far past the 6-token window: going back inside an answer needs a snapshot."""
    torch.set_num_threads(1)
    model = load_ours(tiny(name, "transformers5"))
    records = check_prompt_cache_turns(model, vocab=500)
    how = [(r.how, r.reused) for r in records]
    # turn lengths: 40, 60 (40+8+12), 98 (60+8+30), 74 (60+2+12), 74, 17; each answer 8 tokens
    assert how == [
        ("cold", 0),
        ("extend", 47),
        ("extend", 67),
        ("snapshot", 59),  # parts at 62, inside answer 2; the snapshot before turn 2's last token
        ("snapshot", 73),  # the same prompt again: the snapshot before its last token
        ("cold", 0),  # only 5 ids in common, and no snapshot that early (the oldest were dropped)
    ], how
    assert WINDOW < 59


def test_without_snapshots_the_rings_fall_back_to_a_full_prefill(tiny):
    model = load_ours(tiny("gemma3-270m", "transformers5"))
    records = check_prompt_cache_turns(model, vocab=500, max_snapshots=0, first=20, message=6, long_message=8, answer=4)
    assert [r.how for r in records] == ["cold", "extend", "extend", "cold", "cold", "cold"]
