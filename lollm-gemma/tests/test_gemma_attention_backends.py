"""The gemma families on the ``eager`` attention backend (lollm.attention): the parity gate passes,
and cached decoding past the window (ring-ordered keys) equals the ``sdpa`` path.

The backend really runs: a spy counts its calls (one per layer per forward).
"""

from __future__ import annotations

import pytest
import torch
from _gemma_testing import WINDOW, load_ours, prompt_ids

from lollm import attention
from lollm.generate import generate
from lollm.sampling import SamplingParams

FAMILIES = ["gemma2", "gemma3-270m", "gemma4-e2b-text"]  # soft-cap; sliding/global; 512-wide heads + shared KV


@pytest.fixture
def eager_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = attention.BACKENDS["eager"]

    def counting(q, k, v, **kw):
        calls.append(q.shape[2])
        return real.attend(q, k, v, **kw)

    monkeypatch.setitem(attention.BACKENDS, "eager", attention.Backend("eager", real.summary, counting))
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_gate_with_eager_attention(tiny, name, eager_calls):
    from lollm.parity import run_parity

    folder = tiny(name, "transformers5")
    ids = prompt_ids(4 * WINDOW + 3)
    report = run_parity(str(folder), ids=ids, dtype="float32", device="cpu", attn="eager")
    assert report.attn == "eager" and report.passed, report.min_cosine
    assert report.argmax_matches == report.num_tokens
    assert eager_calls and set(eager_calls) == {len(ids)}  # every layer attended through eager


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_decoding_with_eager_attention_equals_sdpa(tiny, name, eager_calls):
    model = load_ours(tiny(name, "transformers5"))
    ids = prompt_ids(5 * WINDOW, seed=3)
    with torch.inference_mode():
        one_shot = model(torch.tensor([ids]))[0]  # sdpa, no cache
        assert not eager_calls
        cache = model.new_cache(len(ids))
        with attention.use_backend("eager"):
            steps = [model(torch.tensor([ids[: 2 * WINDOW + 1]]), cache)[0]]  # a prefill past the window
            steps += [model(torch.tensor([[i]]), cache)[0] for i in ids[2 * WINDOW + 1 :]]  # ring-ordered keys
    assert eager_calls.count(1) == model.num_layers * (len(ids) - 2 * WINDOW - 1)
    a, b = torch.cat(steps)[-16:].double(), one_shot[-16:].double()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.99999

    greedy = SamplingParams(temperature=0.0)
    prompt = ids[: 2 * WINDOW]
    ours = generate(model, prompt, max_new_tokens=8, sampling=greedy, attn="eager").new_ids
    assert ours == generate(model, prompt, max_new_tokens=8, sampling=greedy, attn="sdpa").new_ids
