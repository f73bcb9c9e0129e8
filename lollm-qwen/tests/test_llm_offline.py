"""lollm.LLM on qwen2: a tiny random checkpoint, and the real Qwen2.5-Coder-0.5B GGUF (packed weights).

Every completion is held to the single-sequence loop run alone on the same ids (greedy tokens,
seeded samples, log-probabilities, a regex constraint); on the real GGUF, 8 prompts of
different lengths through one engine, where the one allowed difference is a proven near-tie
(lollm.testing.batching.assert_same_greedy). The Python snippet of docs/offline-batch.md runs
as written on both checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from _qwen_tiny import chat_checkpoint  # noqa: F401  (a fixture)
from lollm.generate.loop import generate
from lollm.generate.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["hello there", "tell me a story about a cat and a dog", "2+2", "the quick brown fox jumps over the lazy dog",
           "write a function", "why is the sky blue? explain it to a child in three sentences please"]
REAL_PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Explain in two sentences what a hash map is.",
    "def fibonacci(n):",
    "List three uses of the `git stash` command.",
    "Translate 'good morning' into Spanish and German.",
    "Write a SQL query that counts the rows of a table named orders, grouped by customer_id, "
    "and returns only customers with more than five orders, sorted by the count descending.",
    "Hi",
]
DOC = Path(__file__).resolve().parents[2] / "docs" / "offline-batch.md"


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    from lollm.engine.llm import LLM

    return LLM(str(chat_checkpoint), device="cpu", threads=1)


def alone(llm, ids, sampling=GREEDY, n=10, **kwargs):
    return generate(llm.model, ids, max_new_tokens=n, sampling=sampling, stop_ids=llm.stop_ids, tokenizer=llm.tokenizer,
                    **kwargs)


def test_greedy_and_seeded_completions_equal_solo_runs(llm):
    assert llm.batched
    settings = [GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=1), GREEDY,
                SamplingParams(temperature=0.7, top_p=0.8, seed=2, repetition_penalty=1.1), GREEDY,
                SamplingParams(temperature=1.0, seed=3)]
    done = llm.generate(PROMPTS, settings, max_new_tokens=10)
    assert [c.index for c in done] == list(range(len(PROMPTS)))
    for c, text, params in zip(done, PROMPTS, settings):
        solo = alone(llm, c.prompt_ids, params)
        assert c.prompt == text and (c.token_ids, c.text, c.finish_reason) == (solo.new_ids, solo.text, solo.stop_reason)


def test_chat_and_logprobs_equal_solo(llm):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    done = llm.chat(conversations, GREEDY, max_new_tokens=6, logprobs=3)
    for c, conv in zip(done, conversations):
        ids = llm.tokenizer.encode_chat(conv, add_generation_prompt=True)
        solo = alone(llm, ids, n=6, logprobs=3)
        assert c.prompt_ids == ids and c.token_ids == solo.new_ids and len(c.logprobs) == len(c.token_ids)
        for a, b in zip(c.logprobs, solo.logprobs):
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_regex_constraint_is_applied_per_request(llm):
    from lollm.generate.structured import OutputConstraint, compile_constraint

    constraint = OutputConstraint.regex(r"[a-z]{2,6} [0-9]{1,3}")
    done = llm.generate(PROMPTS[:3], SamplingParams(temperature=1.0, seed=5), max_new_tokens=16, constraint=constraint)
    compiled = compile_constraint(constraint, llm.tokenizer, vocab_size=llm.model.vocab_size, stop_ids=llm.stop_ids)
    for c in done:
        assert re.fullmatch(r"[a-z]{2,6} [0-9]{1,3}", c.text), c.text
        solo = alone(llm, c.prompt_ids, SamplingParams(temperature=1.0, seed=5), n=16, constraint=compiled)
        assert c.token_ids == solo.new_ids


def _snippet_namespace(model_path: Path, capsys, doc: Path = DOC) -> dict:
    """The offline batch snippet of ``doc`` (docs/offline-batch.md, README.md), its model replaced by
    ``model_path``; the names it defines."""
    text = doc.read_text(encoding="utf-8")
    match = re.search(r"<!-- tested: offline batch snippet -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{doc} has no python block after '<!-- tested: offline batch snippet -->'"
    code = match.group(1)
    spec = re.search(r'LLM\("([^"]+)"', code).group(1)
    namespace: dict = {}
    exec(compile(code.replace(spec, str(model_path)), str(doc), "exec"), namespace)
    printed = capsys.readouterr().out
    for c in namespace["completions"]:
        assert f"[{c.index}] {c.finish_reason}, {len(c.token_ids)} tokens" in printed and c.text in printed
    return namespace


@pytest.mark.parametrize("doc", [DOC, DOC.parents[1] / "README.md"], ids=["offline-batch.md", "README.md"])
def test_the_docs_snippet_runs_on_a_tiny_checkpoint(chat_checkpoint, capsys, doc):
    namespace = _snippet_namespace(chat_checkpoint, capsys, doc)
    assert len(namespace["completions"]) == 3 and namespace["llm"].batched


# -- the real Qwen2.5-Coder-0.5B-Instruct GGUF ---------------------------------------------------


@pytest.fixture(scope="module")
def real_llm():
    from lollm.engine.llm import LLM
    from lollm.cli.real_models import fetch_gguf

    return LLM(str(fetch_gguf("qwen2.5-coder-0.5b-instruct")))


@pytest.mark.real
def test_real_gguf_8_prompts_equal_their_solo_greedy_runs(real_llm):
    """Packed weights, the engine against the single-sequence loop (lollm.generate.loop): the engine attends
    through the paged kernel, the loop through torch's SDPA, whose last bits int8 activations magnify. A
    near-tie is therefore judged against that measured difference (path_noise, times the kit's noise
    factor), not 1e-3. (The engine against itself, alone and batched, is bit for bit: test_batch_invariance.)"""
    from lollm.testing.batching import TIE_BOUND, assert_same_greedy, path_noise
    from lollm.testing.conformance import NOISE_FACTOR

    done = real_llm.generate(REAL_PROMPTS, GREEDY, max_new_tokens=24)
    assert real_llm.batched and real_llm.model.weights_summary.packed > 0
    with torch.inference_mode():
        for c in done:
            solo = alone(real_llm, c.prompt_ids, n=24)
            noise = path_noise(real_llm.model, c.prompt_ids + solo.new_ids[:8])
            assert noise < 0.5, f"prompt {c.index}: the two paths part by {noise:.3g} in a logit"  # bfloat16-sized, not a bug
            assert_same_greedy(real_llm.model, c.prompt_ids, c.token_ids, solo.new_ids, f"prompt {c.index}",
                               tie_bound=max(TIE_BOUND, NOISE_FACTOR * noise))
            if c.token_ids == solo.new_ids:
                assert (c.text, c.finish_reason) == (solo.text, solo.stop_reason)
    assert done[1].text.strip() and "Paris" in done[1].text


@pytest.mark.real
def test_the_docs_snippet_runs_on_the_real_gguf(capsys):
    from lollm.cli.real_models import fetch_gguf

    namespace = _snippet_namespace(fetch_gguf("qwen2.5-coder-0.5b-instruct"), capsys)
    completions = namespace["completions"]
    assert "Paris" in completions[2].text
    assert all(c.finish_reason in ("eos", "max_new_tokens") and c.text.strip() for c in completions)
