"""qwen3_5 and qwen3_5_moe on the ``eager`` attention backend (lollm.attention): the parity gate
passes, and self-speculative decoding through the MTP head (whose attention also goes through the
seam) gives exactly the plain greedy tokens of the ``sdpa`` path.

The backend really runs: a spy counts its calls (one per attention layer per forward).
"""

from __future__ import annotations

import pytest

import qwen3_5_tiny as tiny
from lollm import attention
from lollm.generate.loop import generate
from lollm.generate.sampling import SamplingParams
from lollm.load.options import LoadOptions

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
    from lollm.proof.parity import run_parity

    folder = tiny_checkpoint(family, "text")
    ids = tiny.random_ids(70, tiny.TINY_TEXT["vocab_size"], seed=5)
    report = run_parity(str(folder), ids=ids, options=LoadOptions(dtype="float32", device="cpu", attn="eager"))
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


# -- the triton backend (lollm-core[triton]; Triton's CPU interpreter here, conftest.py) ------------
# The nox qwen3_5 session installs the extra: a missing Triton fails these tests, it does not skip them.
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


def _cached_steps(model, ids: list[int], backend: str):
    """A prefill of 20 (the prefill kernel), a chunk of 3 (split-K, causal inside), then single tokens."""
    import torch

    cache = model.new_cache(len(ids))
    with torch.inference_mode(), attention.use_backend(backend):
        steps = [model(torch.tensor([ids[:20]]), cache)[0], model(torch.tensor([ids[20:23]]), cache)[0]]
        steps += [model(torch.tensor([[i]]), cache)[0] for i in ids[23:]]
    return torch.cat(steps)


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_attention_matches_sdpa_prefill_and_cached_decode(family, tiny_checkpoint, load_ours, triton_calls):
    import torch

    model = load_ours(tiny_checkpoint(family, "text"))
    ids = tiny.random_ids(30, tiny.TINY_TEXT["vocab_size"], seed=9)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_with_triton_attention_equals_sdpa_greedy(family, tiny_checkpoint, load_ours, triton_calls):
    """--mtp's verify steps (T = 1 + drafts) run the split-K kernel; the tokens are plain greedy's."""
    model = load_ours(tiny_checkpoint(family, "multimodal", mtp=True, lively=True))
    prompt = tiny.random_ids(21, tiny.TINY_TEXT["vocab_size"], seed=6)
    greedy = SamplingParams(temperature=0)
    plain = generate(model, prompt, max_new_tokens=12, sampling=greedy, attn="sdpa")
    spec = generate(model, prompt, max_new_tokens=12, sampling=greedy, speculative_tokens=3, attn="triton")
    assert spec.new_ids == plain.new_ids and spec.drafted > 0
    assert {1, 4} <= set(triton_calls)  # single-token draft steps, 1 + 3 token verify steps


def test_parity_cli_with_triton_attention_in_the_interpreter(tmp_path, qwen_tokenizer_files):
    """``LOLLM_ATTN=triton TRITON_INTERPRET=1 lollm parity <folder>`` on a tiny qwen3_5 with the real Qwen tokenizer."""
    import os
    import shutil
    import subprocess
    import sys

    import triton  # noqa: F401  (lollm-core[triton])

    folder = tiny.write_tiny("qwen3_5", "text", tmp_path / "tiny-qwen3_5", vocab_size=151936)
    for f in qwen_tokenizer_files:
        shutil.copy(f, folder)
    env = {**os.environ, "LOLLM_ATTN": "triton", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "parity", str(folder)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "attn triton" in done.stdout and "PASS" in done.stdout
