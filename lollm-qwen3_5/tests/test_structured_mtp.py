"""Constrained decoding with MTP self-speculative decoding: drafts are judged against the constraint's mask.

A draft is emitted only when it equals the main model's *masked* pick, and the matcher
advances only with emitted tokens; so speculative output equals plain constrained output
token for token (greedy and at temperature 1 with a seed), whatever the draft head proposes.
"""

from __future__ import annotations

import re
import shutil

import pytest

from lollm.generate.loop import generate
from lollm.load.options import LoadOptions
from lollm.generate.sampling import SamplingParams
from lollm.generate.structured import OutputConstraint, compile_constraint

PATTERN = "[a-m]{3,12}( [n-z]{2,6}){1,3}"


@pytest.fixture(scope="module")
def mtp_loaded(tiny_checkpoint, tmp_path_factory):
    """The tiny qwen3_5 with an MTP head (vocab 512) and a byte-level tokenizer of exactly 512 ids."""
    from lollm.load.pipeline import open_model
    from lollm.testing.tiny import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("qwen3_5-mtp-tokenizer") / "model"
    shutil.copytree(tiny_checkpoint("qwen3_5", "multimodal", mtp=True, lively=True), folder)
    write_tiny_tokenizer(folder, vocab_size=512)
    return open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))


def _constrained(loaded, sampling, k=0):
    tokenizer, model = loaded.tokenizer, loaded.model
    stops = {tokenizer.eos_token_id}
    compiled = compile_constraint(OutputConstraint.regex(PATTERN), tokenizer, vocab_size=model.vocab_size, stop_ids=stops)
    ids = tokenizer.encode("Say some words:")
    return generate(model, ids, max_new_tokens=60, sampling=sampling, stop_ids=stops, tokenizer=tokenizer,
                    speculative_tokens=k, constraint=compiled)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0)] + [SamplingParams(temperature=1.0, seed=s) for s in range(4)],
                         ids=["greedy", "seed0", "seed1", "seed2", "seed3"])
def test_speculative_constrained_output_equals_plain(mtp_loaded, sampling):
    plain = _constrained(mtp_loaded, sampling)
    spec = _constrained(mtp_loaded, sampling, k=3)
    assert re.fullmatch(PATTERN, plain.text), plain.text
    assert spec.new_ids == plain.new_ids and spec.text == plain.text
    assert spec.drafted > 0


def test_forbidden_drafts_are_never_accepted(mtp_loaded, monkeypatch):
    """A head that drafts only '!' (which PATTERN forbids everywhere): nothing accepted, the output as plain."""
    model = mtp_loaded.model
    bang = mtp_loaded.tokenizer.encode("!", add_special_tokens=False)
    assert len(bang) == 1
    plain = _constrained(mtp_loaded, SamplingParams(temperature=1.0, seed=7))
    monkeypatch.setattr(model, "draft", lambda cache, pending, n: bang * n)
    spec = _constrained(mtp_loaded, SamplingParams(temperature=1.0, seed=7), k=3)
    assert spec.drafted > 0 and spec.accepted == 0
    assert spec.new_ids == plain.new_ids and re.fullmatch(PATTERN, spec.text)


def test_drafts_of_the_constrained_answer_are_accepted(mtp_loaded, monkeypatch):
    """A head that drafts the plain constrained answer itself: most drafts accepted, the same output."""
    model = mtp_loaded.model
    sampling = SamplingParams(temperature=0)
    prompt = mtp_loaded.tokenizer.encode("Say some words:")
    plain = _constrained(mtp_loaded, sampling)
    truth = prompt + plain.new_ids

    def oracle(cache, pending, n):
        start = cache.length + 1  # `pending` sits at position cache.length; drafts follow it
        return truth[start:start + n]

    monkeypatch.setattr(model, "draft", oracle)
    spec = _constrained(mtp_loaded, sampling, k=3)
    assert spec.new_ids == plain.new_ids
    assert spec.accepted >= 0.8 * spec.drafted > 0
