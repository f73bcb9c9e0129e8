"""The gemma families on the ``eager`` attention backend (lollm.attention): the parity gate passes,
and cached decoding past the window (ring-ordered keys) equals the ``sdpa`` path.

The backend really runs: a spy counts its calls (one per layer per forward).
"""

from __future__ import annotations

import pytest
import torch
from _gemma_testing import WINDOW, load_ours, prompt_ids

from lollm import attention
from lollm.generate.loop import generate
from lollm.generate.sampling import SamplingParams
from lollm.load.options import LoadOptions

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
    from lollm.proof.parity import run_parity

    folder = tiny(name, "transformers5")
    ids = prompt_ids(4 * WINDOW + 3)
    report = run_parity(str(folder), ids=ids, options=LoadOptions(dtype="float32", device="cpu", attn="eager"))
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


# -- the triton backend (lollm-core[triton]; Triton's CPU interpreter here, conftest.py) ------------
# The nox gemma session installs the extra: a missing Triton fails these tests, it does not skip them.
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


def _cached_steps(model, ids: list[int], backend: str) -> torch.Tensor:
    """A prefill of 20 (the prefill kernel, past the window), a chunk of 3, then single tokens on the rings."""
    cache = model.new_cache(len(ids))
    with torch.inference_mode(), attention.use_backend(backend):
        steps = [model(torch.tensor([ids[:20]]), cache)[0], model(torch.tensor([ids[20:23]]), cache)[0]]
        steps += [model(torch.tensor([[i]]), cache)[0] for i in ids[23:]]
    return torch.cat(steps)


@pytest.mark.parametrize("name", FAMILIES)
def test_triton_attention_matches_sdpa_prefill_and_cached_decode(tiny, name, triton_calls):
    model = load_ours(tiny(name, "transformers5"))
    ids = prompt_ids(5 * WINDOW, seed=8)
    with torch.inference_mode():
        sdpa = model(torch.tensor([ids]))[0]
        with attention.use_backend("triton"):
            triton = model(torch.tensor([ids]))[0]
    assert triton_calls and set(triton_calls) == {len(ids)}
    diff = (triton - sdpa).abs().max().item()
    assert diff <= TRITON_MAX_DIFF, f"prefill: max |Δ| {diff:.2e}"

    a, b = _cached_steps(model, ids, "triton"), _cached_steps(model, ids, "sdpa")
    assert {20, 3, 1} <= set(triton_calls)
    diff = (a - b).abs().max().item()
    assert diff <= TRITON_MAX_DIFF, f"cached decode: max |Δ| {diff:.2e}"
    assert torch.equal(a.argmax(-1), b.argmax(-1))

    greedy = SamplingParams(temperature=0.0)
    prompt = ids[: 2 * WINDOW]
    ours = generate(model, prompt, max_new_tokens=8, sampling=greedy, attn="triton").new_ids
    assert ours == generate(model, prompt, max_new_tokens=8, sampling=greedy, attn="sdpa").new_ids


def test_parity_cli_with_triton_attention_in_the_interpreter(tmp_path):
    """``LOLLM_ATTN=triton TRITON_INTERPRET=1 lollm parity <folder>`` on a tiny gemma2 (soft-cap, window)
    with the real Gemma 3 tokenizer."""
    import os
    import shutil
    import subprocess
    import sys

    from _gemma_testing import TINY

    from lollm.cli.real_models import derive_safetensors
    from lollm.testing.tiny import write_tiny_checkpoint

    import triton  # noqa: F401  (lollm-core[triton])

    real = derive_safetensors("gemma-3-270m")
    folder = tmp_path / "tiny-gemma2"
    write_tiny_checkpoint({**TINY["gemma2"](), "vocab_size": 262144}, folder, schema="transformers5")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real / name, folder / name)
    env = {**os.environ, "LOLLM_ATTN": "triton", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "parity", str(folder)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "attn triton" in done.stdout and "PASS" in done.stdout
