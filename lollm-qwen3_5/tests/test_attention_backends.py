"""qwen3_5 and qwen3_5_moe on the ``eager`` attention backend (lollm.attention): the parity gate
passes, and self-speculative decoding through the MTP head (whose attention also goes through the
seam) gives exactly the plain greedy tokens of the ``sdpa`` path.

The backend really runs: a spy counts its calls (one per attention layer per forward).
"""

from __future__ import annotations

import pytest

import qwen3_5_tiny as tiny
from lollm import attention
from lollm.generate import generate
from lollm.sampling import SamplingParams

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture
def eager_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = attention.BACKENDS["eager"]

    def counting(q, k, v, **kw):
        calls.append(q.shape[2])
        return real.attend(q, k, v, **kw)

    monkeypatch.setitem(attention.BACKENDS, "eager", attention.Backend("eager", real.summary, counting))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_gate_with_eager_attention(family, tiny_checkpoint, eager_calls):
    from lollm.parity import run_parity

    folder = tiny_checkpoint(family, "text")
    ids = tiny.random_ids(70, tiny.TINY_TEXT["vocab_size"], seed=5)
    report = run_parity(str(folder), ids=ids, dtype="float32", device="cpu", attn="eager")
    assert report.attn == "eager" and report.passed, report.min_cosine
    assert report.argmax_matches == report.num_tokens
    assert eager_calls and set(eager_calls) == {len(ids)}  # every attention layer went through eager


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_with_eager_attention_equals_sdpa_greedy(family, tiny_checkpoint, load_ours, eager_calls):
    model = load_ours(tiny_checkpoint(family, "multimodal", mtp=True, lively=True))
    prompt = tiny.random_ids(21, tiny.TINY_TEXT["vocab_size"], seed=6)
    greedy = SamplingParams(temperature=0)
    plain = generate(model, prompt, max_new_tokens=24, sampling=greedy, attn="sdpa")
    assert not eager_calls
    spec = generate(model, prompt, max_new_tokens=24, sampling=greedy, speculative_tokens=3, attn="eager")
    assert spec.new_ids == plain.new_ids and spec.drafted > 0
    assert {1, 4} <= set(eager_calls)  # single-token draft steps, 1 + 3 token verify steps
