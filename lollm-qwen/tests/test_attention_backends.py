"""qwen2 and qwen3 on the ``eager`` attention backend (lollm.attention): the parity gate passes,
and cached decoding (prefill, a chunk after the cache, single tokens) equals the ``sdpa`` path.

The backend really runs: a spy counts its calls (one per layer per forward).
"""

from __future__ import annotations

import pytest

from _qwen_tiny import family, load_ours, prompt, tiny_checkpoint, torch  # noqa: F401  (fixtures)
from lollm import attention
from lollm.generate import generate
from lollm.sampling import SamplingParams


@pytest.fixture
def eager_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = attention.BACKENDS["eager"]

    def counting(q, k, v, **kw):
        calls.append(q.shape[2])
        return real.attend(q, k, v, **kw)

    monkeypatch.setitem(attention.BACKENDS, "eager", attention.Backend("eager", real.summary, counting))
    return calls


def test_parity_gate_with_eager_attention(tiny_checkpoint, family, eager_calls):
    from lollm.parity import run_parity

    folder = tiny_checkpoint(family, "hub")
    ids = prompt(512)[0].tolist()
    report = run_parity(str(folder), ids=ids, dtype="float32", device="cpu", attn="eager")
    assert report.attn == "eager" and report.passed, report.min_cosine
    assert report.argmax_matches == report.num_tokens
    assert eager_calls and set(eager_calls) == {len(ids)}  # every layer attended through eager


def test_cached_decoding_with_eager_attention_equals_sdpa(tiny_checkpoint, family, eager_calls):
    model = load_ours(tiny_checkpoint(family, "hub"), family)
    ids = prompt(512, length=24, seed=4)
    with torch.inference_mode():
        one_shot = model(ids)[0]  # sdpa, no cache
        assert not eager_calls
        cache = model.new_cache(ids.shape[1])
        with attention.use_backend("eager"):
            steps = [model(ids[:, :9], cache)[0], model(ids[:, 9:13], cache)[0]]  # prefill, then a chunk
            steps += [model(ids[:, i : i + 1], cache)[0] for i in range(13, ids.shape[1])]
    assert eager_calls.count(1) == model.num_layers * (ids.shape[1] - 13)
    a, b = torch.cat(steps).double(), one_shot.double()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.99999

    greedy = SamplingParams(temperature=0.0)
    first = ids[0, :9].tolist()
    ours = generate(model, first, max_new_tokens=8, sampling=greedy, attn="eager").new_ids
    assert ours == generate(model, first, max_new_tokens=8, sampling=greedy, attn="sdpa").new_ids
