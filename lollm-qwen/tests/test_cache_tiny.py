"""The KV cache: decoding with it gives what one full forward gives, and it never reallocates."""

from __future__ import annotations

import pytest

from _qwen_tiny import (  # noqa: F401  (family and tiny_checkpoint are fixtures)
    assert_logits_close,
    family,
    load_ours,
    prompt,
    tiny_checkpoint,
    torch,
)


@pytest.fixture
def model(tiny_checkpoint, family):
    return load_ours(tiny_checkpoint(family, num_hidden_layers=3), family)


def test_prefill_then_decode_equals_prefill_all(model):
    ids = prompt(model.vocab_size)
    with torch.inference_mode():
        full = model(ids)  # (1, 40, vocab), no cache
        cache = model.new_cache(64)
        steps = [model(ids[:, :8], cache)]  # prefill of 8 on an empty cache
        for t in range(8, ids.shape[1]):  # then one token at a time
            steps.append(model(ids[:, t : t + 1], cache))
    assert cache.length == ids.shape[1]
    assert_logits_close(torch.cat(steps, dim=1), full, "prefill + decode")


def test_chunked_prefill_on_a_non_empty_cache(model):
    """T > 1 tokens after cached ones need an explicit mask (SDPA's is_causal would be wrong)."""
    ids = prompt(model.vocab_size)
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(40)  # exactly full at the end
        chunks = [model(ids[:, a:b], cache) for a, b in ((0, 13), (13, 14), (14, 27), (27, 40))]
    assert cache.length == 40
    assert_logits_close(torch.cat(chunks, dim=1), full, "chunked prefill")


def test_cache_is_preallocated_and_written_in_place(model):
    ids = prompt(model.vocab_size, length=12)
    cache = model.new_cache(32)
    c = model.config
    assert cache.k.shape == cache.v.shape == (c.num_hidden_layers, 1, c.num_key_value_heads, 32, c.head_dim)
    pointers = (cache.k.data_ptr(), cache.v.data_ptr())
    with torch.inference_mode():
        model(ids[:, :4], cache)
        for t in range(4, 12):
            model(ids[:, t : t + 1], cache)
            assert (cache.k.data_ptr(), cache.v.data_ptr()) == pointers
            assert cache.length == t + 1
    assert cache.k[:, :, :, :12].abs().sum(-1).gt(0).all()  # every used position was written
    assert cache.k[:, :, :, 12:].eq(0).all()  # nothing beyond


def test_cache_overflow_raises(model):
    from lollm.errors import GenerationError

    cache = model.new_cache(10)
    with torch.inference_mode():
        model(prompt(model.vocab_size, length=8), cache)
        with pytest.raises(GenerationError, match="10 positions"):
            model(prompt(model.vocab_size, length=3), cache)
    assert cache.length == 8  # the failed call changed nothing


def test_logits_to_keep_with_cache(model):
    ids = prompt(model.vocab_size, length=20)
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(20)
        last = model(ids[:, :19], cache, logits_to_keep=1)
        step = model(ids[:, 19:], cache, logits_to_keep=1)
    assert_logits_close(last, full[:, 18:19])
    assert_logits_close(step, full[:, 19:])


def test_rollback_then_decode_again(model):
    """Speculative decoding rolls the cache back over rejected drafts; what follows must not see them."""
    ids = prompt(model.vocab_size, length=16)
    other = prompt(model.vocab_size, length=4, seed=1)
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(16)
        model(ids[:, :10], cache)
        model(other, cache)  # 4 "drafts" that get rejected
        cache.rollback(10)
        rest = model(ids[:, 10:], cache)
    assert cache.length == 16
    assert_logits_close(rest, full[:, 10:], "after rollback")
    with pytest.raises(ValueError):
        cache.rollback(17)
