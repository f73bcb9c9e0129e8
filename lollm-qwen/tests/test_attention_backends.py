"""qwen2 and qwen3 on the ``eager`` attention backend (lollm.attention): the parity gate passes,
and cached decoding (prefill, a chunk after the cache, single tokens) equals the ``sdpa`` path.

The backend really runs: a spy counts its calls (one per layer per forward).
"""

from __future__ import annotations

import pytest

from _qwen_tiny import family, load_ours, prompt, tiny_checkpoint, torch  # noqa: F401  (fixtures)
from lollm import attention
from lollm.generate.loop import generate
from lollm.generate.sampling import SamplingParams
from lollm.load.options import LoadOptions


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
    from lollm.proof.parity import run_parity

    folder = tiny_checkpoint(family, "hub")
    ids = prompt(512)[0].tolist()
    report = run_parity(str(folder), ids=ids, options=LoadOptions(dtype="float32", device="cpu", attn="eager"))
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


# -- the triton backend (lollm-core[triton]; Triton's CPU interpreter here, conftest.py) ------------
# The nox qwen session installs the extra: a missing Triton fails these tests, it does not skip them.
# Bound: logits within 1e-4 of the sdpa path at float32, prefill and cached decode alike.

TRITON_MAX_DIFF = 1e-4


@pytest.fixture
def triton_calls(monkeypatch) -> list[int]:
    """Counts the triton backend's calls (the number of queries of each); fails where Triton is missing."""
    import triton  # noqa: F401  (lollm-core[triton])

    calls: list[int] = []
    real = attention.BACKENDS["triton"]

    def counting(q, k, v, **kw):
        calls.append(q.shape[2])
        return real.attend(q, k, v, **kw)

    monkeypatch.setitem(attention.BACKENDS, "triton", attention.Backend("triton", real.summary, counting, real.check))
    return calls


def _cached_steps(model, ids, backend: str) -> torch.Tensor:
    """A prefill of 20 (the prefill kernel), a chunk of 3 (split-K, causal inside), then single tokens."""
    cache = model.new_cache(ids.shape[1])
    with torch.inference_mode(), attention.use_backend(backend):
        steps = [model(ids[:, :20], cache)[0], model(ids[:, 20:23], cache)[0]]
        steps += [model(ids[:, i : i + 1], cache)[0] for i in range(23, ids.shape[1])]
    return torch.cat(steps)


def test_triton_attention_matches_sdpa_prefill_and_cached_decode(tiny_checkpoint, family, triton_calls):
    model = load_ours(tiny_checkpoint(family, "hub"), family)
    ids = prompt(512, length=30, seed=7)
    with torch.inference_mode():
        one_shot = {"sdpa": model(ids)[0]}
        with attention.use_backend("triton"):
            one_shot["triton"] = model(ids)[0]
    assert triton_calls == [30] * model.num_layers
    diff = (one_shot["triton"] - one_shot["sdpa"]).abs().max().item()
    assert diff <= TRITON_MAX_DIFF, f"prefill: max |Δ| {diff:.2e}"

    a, b = _cached_steps(model, ids, "triton"), _cached_steps(model, ids, "sdpa")
    assert {20, 3, 1} <= set(triton_calls)
    diff = (a - b).abs().max().item()
    assert diff <= TRITON_MAX_DIFF, f"cached decode: max |Δ| {diff:.2e}"
    assert torch.equal(a.argmax(-1), b.argmax(-1))

    greedy = SamplingParams(temperature=0.0)
    first = ids[0, :9].tolist()
    ours = generate(model, first, max_new_tokens=8, sampling=greedy, attn="triton").new_ids
    assert ours == generate(model, first, max_new_tokens=8, sampling=greedy, attn="sdpa").new_ids


def test_parity_cli_with_triton_attention_in_the_interpreter(tiny_checkpoint, tmp_path):
    """``LOLLM_ATTN=triton TRITON_INTERPRET=1 lollm parity <folder>`` on a tiny qwen3 with the real Qwen tokenizer."""
    import os
    import shutil
    import subprocess
    import sys

    from lollm.cli.real_models import derive_safetensors

    import triton  # noqa: F401  (lollm-core[triton])

    real = derive_safetensors("qwen2.5-coder-0.5b-instruct")
    folder = tiny_checkpoint("qwen3", "hub", vocab_size=151936)  # the real tokenizer's ids must fit
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real / name, folder / name)
    env = {**os.environ, "LOLLM_ATTN": "triton", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "parity", str(folder)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "attn triton" in done.stdout and "PASS" in done.stdout
