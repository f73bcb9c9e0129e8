"""The caches: incremental decoding equals one-shot prefill past the window; rings stay bounded.

A prompt of N tokens is run once without a cache (every position at once), and
again through the cache in pieces: a prefill, sometimes a chunk of several
tokens after it, then one token at a time. The logits of the last 16 positions,
all far past the 6-token window (the ring has wrapped several times), must agree.
"""

from __future__ import annotations

import pytest
import torch
from _gemma_testing import WINDOW, load_ours, prompt_ids

from lollm.errors import GenerationError

FAMILIES = ["gemma2", "gemma3-270m", "gemma3-4b", "gemma4-e2b-text"]
N = 6 * WINDOW  # 36 tokens: 6 windows
# (prefill length, chunk length) before the one-token decode steps
SPLITS = [
    (1, 0),  # decode from the very first token
    (3, 7),  # a short prefill, then a chunk that crosses the window (start > 0, T > 1)
    (2 * WINDOW + 1, 0),  # a prefill longer than the window, then decode
    (N - 16, 5),  # a long prefill, then a chunk, then decode
]


def _incremental(model, ids: list[int], prefill: int, chunk: int) -> torch.Tensor:
    """Logits of every position, computed through the cache piece by piece: (N, V)."""
    cache = model.new_cache(len(ids))
    pieces = [ids[:prefill]]
    if chunk:
        pieces.append(ids[prefill : prefill + chunk])
    pieces += [[i] for i in ids[prefill + chunk :]]
    out = []
    for piece in pieces:
        out.append(model(torch.tensor([piece]), cache)[0])
    assert cache.length == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("name", FAMILIES)
def test_incremental_decode_equals_prefill(tiny, name):
    model = load_ours(tiny(name, "transformers5"))
    ids = prompt_ids(N, seed=1)
    with torch.inference_mode():
        one_shot = model(torch.tensor([ids]))[0]  # (N, V)
        for prefill, chunk in SPLITS:
            steps = _incremental(model, ids, prefill, chunk)
            a, b = steps[-16:].double(), one_shot[-16:].double()
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            assert cos.min() >= 0.9999, f"split {prefill}+{chunk}: min cosine {float(cos.min()):.6f}"
            assert torch.equal(a.argmax(-1), b.argmax(-1)), f"split {prefill}+{chunk}: argmax differs"


@pytest.mark.parametrize("keep", [1, 3])
def test_gemma4_prefill_keeping_last_logits(tiny, keep):
    """gemma4 carries only the kept positions through its KV-sharing layers; same logits."""
    model = load_ours(tiny("gemma4-e2b-text", "transformers5"))
    ids = torch.tensor([prompt_ids(3 * WINDOW + 2, seed=2)])
    with torch.inference_mode():
        full = model(ids)[:, -keep:]
        kept = model(ids, model.new_cache(ids.shape[1] + 4), logits_to_keep=keep)
    assert kept.shape == full.shape
    torch.testing.assert_close(kept, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_sliding_cache_memory_is_bounded_by_the_window(tiny, name):
    model = load_ours(tiny(name, "transformers5"))
    types = model.config.layer_types
    small, big = model.new_cache(64), model.new_cache(4096)
    for layer_type, a, b in zip(types, small.layers, big.layers):
        if a is None:  # a gemma4 KV-sharing layer keeps nothing
            assert b is None
            continue
        if layer_type == "sliding_attention":
            assert a.k.shape[2] == b.k.shape[2] == WINDOW
            assert a.k.numel() == b.k.numel() and a.v.numel() == b.v.numel()
        else:
            assert (a.k.shape[2], b.k.shape[2]) == (64, 4096)
    tiny_cache = model.new_cache(3)  # shorter than the window: the ring is too
    assert all(layer is None or layer.k.shape[2] == 3 for layer in tiny_cache.layers)


def test_cache_refuses_to_overflow(tiny):
    model = load_ours(tiny("gemma3-270m", "transformers5"))
    cache = model.new_cache(8)
    with torch.inference_mode():
        model(torch.tensor([prompt_ids(6)]), cache)
        with pytest.raises(GenerationError, match="holds 8 positions"):
            model(torch.tensor([prompt_ids(3)]), cache)


def test_gemma4_kv_sharing_layers_keep_no_cache(tiny):
    model = load_ours(tiny("gemma4-e2b-text", "transformers5"))
    cache = model.new_cache(32)
    config = model.config
    for i, layer in enumerate(cache.layers):
        assert (layer is None) == (i >= config.first_kv_shared_layer)
    # layer 5 (sliding) reads layer 3's keys, layer 9 (global) reads layer 4's
    assert [config.kv_source(i) for i in range(10)] == [0, 1, 2, 3, 4, 3, 3, 3, 3, 4]


def test_sliding_layer_cache_bytes_bounded_by_window_after_4000_tokens(tiny):
    """A 4,000-token greedy generation through the shared loop: each sliding-window layer's cache
    holds exactly WINDOW positions of keys and values (the ring), each global layer the whole text."""
    from lollm.generate.loop import generate
    from lollm.generate.sampling import SamplingParams
    from lollm_gemma.gemma3.kv import FullKV, SlidingWindowKV

    model = load_ours(tiny("gemma3-long", "transformers5"))
    made = []
    new_cache = model.new_cache

    def spy(max_tokens):
        made.append(new_cache(max_tokens))
        return made[-1]

    model.new_cache = spy
    prompt = prompt_ids(8)
    result = generate(model, prompt, max_new_tokens=4000, sampling=SamplingParams(temperature=0.0))
    assert len(result.new_ids) == 4000
    cache = made[-1]  # the cache the loop allocated (lollm.generate.memory first sizes one built on the meta device)
    assert cache.length >= 4000
    cfg = model.config
    per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # k and v, float32
    sliding = [layer for layer in cache.layers if isinstance(layer, SlidingWindowKV)]
    full = [layer for layer in cache.layers if isinstance(layer, FullKV)]
    assert sliding and full
    for layer in sliding:
        assert layer.k.numel() * 4 + layer.v.numel() * 4 == WINDOW * per_position
    for layer in full:
        assert layer.k.numel() * 4 + layer.v.numel() * 4 == cache.max_tokens * per_position
