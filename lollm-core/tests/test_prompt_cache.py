"""lollm.generate.prompt_cache: what is reused, decided from what a cache says it can do, and never a wrong state.

The fake model's next token depends on *every* token its cache has absorbed
(a running hash, like a recurrent state), so a state reused wrongly changes
the output: each check compares a turn with the prompt cache to a cold run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lollm.errors import GenerationError
from lollm.generate.loop import generate
from lollm.generate.prompt_cache import PromptCache, common_prefix_length
from lollm.generate.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
V = 97


class HashCache:
    """No rollback, no snapshot: only the running hash of what went in."""

    def __init__(self, max_tokens: int):
        self.length = 0
        self.max_tokens = max_tokens
        self.state = 0
        self.history = [0]  # the state after each length, for the subclasses

    def absorb(self, ids: list[int]) -> None:
        assert self.length + len(ids) <= self.max_tokens
        del self.history[self.length + 1 :]
        for t in ids:
            self.state = (self.state * 31 + t + 1) % 1_000_003
            self.history.append(self.state)
        self.length += len(ids)


class RollbackCache(HashCache):
    """A full KV cache: any length can come back."""

    def can_rollback(self, length: int) -> bool:
        return 0 <= length <= self.length

    def rollback(self, length: int) -> None:
        assert self.can_rollback(length)
        self.length, self.state = length, self.history[length]


class RecurrentCache(HashCache):
    """A recurrent state: back to 0 only, but snapshots of the (small) state."""

    def can_rollback(self, length: int) -> bool:
        return length in (0, self.length)

    def rollback(self, length: int) -> None:
        assert self.can_rollback(length)
        self.length, self.state = length, self.history[length]

    def snapshot(self):
        return (self.length, self.state)

    def restore(self, snap) -> None:
        self.length, self.state = snap


class HashLM(nn.Module):
    """The next token is ``state % V``, very sure of itself; records every forward's (length before, T)."""

    def __init__(self, cache_class, max_context: int = 512):
        super().__init__()
        self.vocab_size, self.max_context, self.num_layers, self.eos_token_ids = V, max_context, 1, ()
        self.cache_class = cache_class
        self.scale = nn.Parameter(torch.ones(()))
        self.calls: list[tuple[int, int]] = []
        self.fail_at_call: int | None = None

    def new_cache(self, max_tokens: int):
        return self.cache_class(max_tokens)

    def forward(self, input_ids, cache=None, *, logits_to_keep=0, hidden_states=None):
        ids = input_ids[0].tolist()
        if cache is None:
            cache = self.cache_class(len(ids))
        self.calls.append((cache.length, len(ids)))
        if self.fail_at_call is not None and len(self.calls) == self.fail_at_call:
            cache.absorb(ids[: len(ids) // 2 + 1])  # half-way through, like an interrupted forward
            cache.length -= 1  # and the model did not get to advance the length
            raise KeyboardInterrupt
        rows = []
        for t in ids:
            cache.absorb([t])
            row = torch.full((V,), -10.0)
            row[cache.state % V] = 10.0
            rows.append(row)
        logits = torch.stack(rows)[None] * self.scale
        return logits[:, -logits_to_keep:] if logits_to_keep else logits


def cold(model, prompt, n=6):
    return generate(model, prompt, max_new_tokens=n, sampling=GREEDY).new_ids


def warm(model, cache, prompt, n=6):
    result = generate(model, prompt, max_new_tokens=n, sampling=GREEDY, prompt_cache=cache)
    assert result.new_ids == cold(model, prompt, n), f"{cache.last}: the prompt cache changed the output"
    return result


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


@pytest.mark.parametrize("kind", [HashCache, RollbackCache, RecurrentCache])
def test_a_conversation_that_grows_is_extended_by_every_kind_of_cache(kind):
    model = HashLM(kind)
    cache = PromptCache(model, 256)
    p1 = list(range(10, 30))
    r1 = warm(model, cache, p1)
    assert (cache.last.how, cache.last.reused) == ("cold", 0)
    p2 = p1 + r1.new_ids + [5, 6, 7]
    r2 = warm(model, cache, p2)
    # the cache holds the prompt and every answer token but the last (never run)
    assert (cache.last.how, cache.last.reused) == ("extend", len(p1) + len(r1.new_ids) - 1)
    assert r2.reused_tokens == cache.last.reused and cache.last.prefilled == len(p2) - cache.last.reused


def test_a_full_kv_cache_rolls_back_to_the_common_prefix():
    model = HashLM(RollbackCache)
    cache = PromptCache(model, 256)
    p1 = list(range(10, 40))
    warm(model, cache, p1)
    p2 = p1[:17] + [3, 3, 3]
    warm(model, cache, p2)
    assert (cache.last.how, cache.last.reused) == ("rollback", 17)
    warm(model, cache, p2)  # the same prompt again: only its last token runs
    assert (cache.last.how, cache.last.reused, cache.last.prefilled) == ("rollback", len(p2) - 1, 1)


def test_a_recurrent_cache_resumes_from_the_newest_snapshot_at_or_before_the_divergence():
    model = HashLM(RecurrentCache)
    cache = PromptCache(model, 256)
    p1 = list(range(10, 40))
    r1 = warm(model, cache, p1)
    # snapshots: just before p1's last token, and after the answer
    assert [n for n, _ in cache.snapshots] == [len(p1) - 1, len(p1) + len(r1.new_ids) - 1]
    p2 = p1 + r1.new_ids[:2] + [4, 4]  # parts inside the answer
    warm(model, cache, p2)
    assert (cache.last.how, cache.last.reused) == ("snapshot", len(p1) - 1)
    # the snapshot after the old answer is gone (its positions are rewritten); a new one before p2's end
    assert [n for n, _ in cache.snapshots][:2] == [len(p1) - 1, len(p2) - 1]
    warm(model, cache, p2)  # regenerate
    assert (cache.last.how, cache.last.reused) == ("snapshot", len(p2) - 1)
    warm(model, cache, [1, 2, 3, 4])  # nothing in common
    assert (cache.last.how, cache.last.reused) == ("cold", 0)


def test_without_rollback_or_snapshots_only_a_continuation_is_reused():
    model = HashLM(HashCache)
    cache = PromptCache(model, 256)
    p1 = list(range(10, 40))
    warm(model, cache, p1)
    warm(model, cache, p1[:20] + [1])
    assert cache.last.how == "cold"
    recurrent = PromptCache(HashLM(RecurrentCache), 256, max_snapshots=0)
    warm(recurrent.model, recurrent, p1)
    warm(recurrent.model, recurrent, p1[:20] + [1])
    assert recurrent.last.how == "cold" and not recurrent.snapshots


def test_snapshots_are_bounded():
    model = HashLM(RecurrentCache)
    cache = PromptCache(model, 512, max_snapshots=3)
    prompt = list(range(10, 20))
    for turn in range(4):
        result = warm(model, cache, prompt)
        prompt = prompt + result.new_ids + [turn + 1] * 3
    assert len(cache.snapshots) == 3
    lengths = [n for n, _ in cache.snapshots]
    assert lengths == sorted(lengths) and lengths[-1] == cache.cache.length


def test_an_interrupted_generation_is_never_reused():
    """A forward interrupted half-way leaves the state unknown: the next turn uses a snapshot or starts cold."""
    for kind in (RollbackCache, RecurrentCache):
        model = HashLM(kind)
        cache = PromptCache(model, 256)
        p1 = list(range(10, 40))
        r1 = warm(model, cache, p1)
        p2 = p1 + r1.new_ids + [8, 8, 8]
        model.fail_at_call = len(model.calls) + 3  # a decode step of the next generation
        with pytest.raises(KeyboardInterrupt):
            generate(model, p2, max_new_tokens=6, sampling=GREEDY, prompt_cache=cache)
        model.fail_at_call = None
        warm(model, cache, p2)
        assert cache.last.how in ("snapshot", "cold"), f"{kind.__name__}: {cache.last}"


def test_a_cancelled_generation_keeps_a_consistent_cache():
    model = HashLM(RecurrentCache)
    cache = PromptCache(model, 256)
    p1 = list(range(10, 40))
    steps = iter(range(100))
    result = generate(model, p1, max_new_tokens=20, sampling=GREEDY, prompt_cache=cache, should_stop=lambda: next(steps) >= 2)
    assert result.stop_reason == "cancelled" and len(result.new_ids) == 3
    warm(model, cache, p1 + result.new_ids + [9])
    assert (cache.last.how, cache.last.reused) == ("extend", len(p1) + 2)


def test_the_session_context_bounds_prompt_and_answer():
    model = HashLM(RollbackCache, max_context=512)
    cache = PromptCache(model, 40)
    with pytest.raises(GenerationError, match="context is 40"):
        generate(model, list(range(40)), max_new_tokens=4, sampling=GREEDY, prompt_cache=cache)
    result = generate(model, list(range(30)), max_new_tokens=50, sampling=GREEDY, prompt_cache=cache)
    assert len(result.new_ids) == 10 and result.stop_reason == "context"
    assert PromptCache(model, 10_000).max_tokens == 512  # never more than the model's context


def test_logprobs_and_on_token():
    model = HashLM(RollbackCache)
    seen = []
    result = generate(model, [5, 6, 7], max_new_tokens=4, sampling=GREEDY, logprobs=2,
                      on_token=lambda t, lp: seen.append((t, lp)))
    assert [t for t, _ in seen] == result.new_ids and [lp for _, lp in seen] == result.logprobs
    for token, entry in zip(result.new_ids, result.logprobs):
        assert entry.token == token and len(entry.top) == 2 and entry.top[0][0] == token
        # logits +10 on one id, -10 on the 96 others: log p = -log(1 + 96 e^-20)
        assert entry.logprob == pytest.approx(-torch.log1p(torch.tensor(96 * torch.e**-20.0)).item(), abs=1e-6)
        assert entry.top[1][1] == pytest.approx(-20.0, abs=1e-3)
