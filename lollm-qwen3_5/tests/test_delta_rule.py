"""The two forms of the delta rule agree, and so do the model's prefill and decode paths."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import qwen3_5_tiny as tiny

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
MIN_COSINE = 0.9999


def _blocks(family):
    return importlib.import_module(f"lollm_qwen3_5.{family}.blocks")


def _inputs(T: int, H: int = 4, Dk: int = 16, Dv: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, Dk, generator=g), dim=-1) * Dk**-0.5
    k = F.normalize(torch.randn(T, H, Dk, generator=g), dim=-1)
    v = torch.randn(T, H, Dv, generator=g)
    g_log = -F.softplus(torch.randn(T, H, generator=g)) * 0.5  # log decay <= 0
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    state = torch.randn(H, Dk, Dv, generator=g) * 0.1
    return q, k, v, g_log, beta, state


def _naive(q, k, v, g, beta, state):
    """The recurrence written with plain matrices, one token at a time (the docstring's formula)."""
    S = state.clone()
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        v_old = torch.einsum("hkv,hk->hv", S, k[t])
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - v_old))
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_chunked_equals_recurrent(family, T):
    blocks = _blocks(family)
    q, k, v, g, beta, state0 = _inputs(T)
    expected, expected_state = _naive(q, k, v, g, beta, state0)

    state_r = state0.clone()
    out_r = blocks.delta_rule_recurrent(q, k, v, g, beta, state_r)
    state_c = state0.clone()
    out_c = blocks.delta_rule_chunked(q, k, v, g, beta, state_c, chunk_size=64)

    for out, state in ((out_r, state_r), (out_c, state_c)):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-5)
    cos = F.cosine_similarity(out_c.reshape(T, -1).double(), out_r.reshape(T, -1).double(), dim=-1)
    assert cos.min() >= 0.99999


@pytest.mark.parametrize("family", FAMILIES)
def test_recurrent_snapshots_hold_the_state_after_each_token(family):
    blocks = _blocks(family)
    q, k, v, g, beta, state0 = _inputs(6)
    history = torch.empty(6, *state0.shape)
    state = state0.clone()
    blocks.delta_rule_recurrent(q, k, v, g, beta, state, states_out=history)
    for t in range(6):
        _, after_t = _naive(q[: t + 1], k[: t + 1], v[: t + 1], g[: t + 1], beta[: t + 1], state0)
        torch.testing.assert_close(history[t], after_t, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, history[-1])


def _cos(a, b):
    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).min())


@pytest.mark.parametrize("family", FAMILIES)
def test_token_by_token_decoding_equals_prefill(family, tiny_checkpoint, load_ours):
    """Recurrent decoding of every position (T=1 steps) equals the chunked prefill of them all."""
    model = load_ours(tiny_checkpoint(family, "text"))
    ids = tiny.random_ids(130, tiny.TINY_TEXT["vocab_size"], seed=5)
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0]
        cache = model.new_cache(len(ids))
        steps = torch.cat([model(torch.tensor([[t]]), cache)[0] for t in ids])
    assert cache.length == len(ids)
    assert torch.equal(steps.argmax(-1), full.argmax(-1))
    assert _cos(steps, full) >= MIN_COSINE


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_equals_prefill_all(family, tiny_checkpoint, load_ours):
    model = load_ours(tiny_checkpoint(family, "multimodal", mtp=True, lively=True))
    ids = tiny.random_ids(140, tiny.TINY_TEXT["vocab_size"], seed=6)
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0]
        cache = model.new_cache(len(ids))
        parts = [model(torch.tensor([ids[:100]]), cache)[0]]  # chunked prefill (2 chunks)
        parts.append(model(torch.tensor([ids[100:120]]), cache)[0])  # a longer continuation: chunked from a state
        parts.append(model(torch.tensor([ids[120:124]]), cache)[0])  # a short one: recorded, recurrent
        parts += [model(torch.tensor([[t]]), cache)[0] for t in ids[124:]]  # decode steps
        incremental = torch.cat(parts)
    assert torch.equal(incremental.argmax(-1), full.argmax(-1))
    assert _cos(incremental, full) >= MIN_COSINE


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_restores_the_state_of_a_shorter_forward(family, tiny_checkpoint, load_ours):
    """After a 5-token forward rolled back to 2 of them, the cache equals one that only saw those 2."""
    model = load_ours(tiny_checkpoint(family, "multimodal", mtp=True, lively=True))
    ids = tiny.random_ids(60, tiny.TINY_TEXT["vocab_size"], seed=7)
    with torch.inference_mode():
        a = model.new_cache(80)
        model(torch.tensor([ids[:50]]), a)
        model(torch.tensor([ids[50:55]]), a)
        a.rollback(52)
        b = model.new_cache(80)
        model(torch.tensor([ids[:50]]), b)
        model(torch.tensor([ids[50:52]]), b)
        assert a.length == b.length == 52
        torch.testing.assert_close(a.recurrent, b.recurrent)
        torch.testing.assert_close(a.conv, b.conv)
        # and the next tokens come out the same
        out_a = model(torch.tensor([ids[52:60]]), a)[0]
        out_b = model(torch.tensor([ids[52:60]]), b)[0]
    # logits of magnitude ~3: the two paths chunk the delta rule differently and differ by ~2e-5 of float32
    # rounding (1e-5 failed on some CPUs); a state that kept one extra token moves them by ~3.5
    torch.testing.assert_close(out_a, out_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_outside_the_last_short_forward_is_refused(family, tiny_checkpoint, load_ours):
    from lollm.errors import GenerationError

    model = load_ours(tiny_checkpoint(family, "text"))
    ids = tiny.random_ids(40, tiny.TINY_TEXT["vocab_size"], seed=8)
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(torch.tensor([ids[:30]]), cache)  # a prefill is not recorded
        with pytest.raises(GenerationError, match="cannot roll the cache back"):
            cache.rollback(20)
        model(torch.tensor([ids[30:34]]), cache)
        with pytest.raises(GenerationError, match="cannot roll the cache back"):
            cache.rollback(30)  # before the recorded forward's first token
        cache.rollback(31)
        with pytest.raises(GenerationError, match="cannot roll the cache back"):
            cache.rollback(30)  # the snapshots are spent
