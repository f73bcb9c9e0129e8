"""MTP self-speculative decoding: lossless, rolls both caches back, and its draft head keeps a correct cache."""

from __future__ import annotations

import torch
import pytest

import qwen3_5_tiny as tiny
from lollm.errors import GenerationError
from lollm.generate.loop import generate
from lollm.generate.sampling import SamplingParams

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
GREEDY = SamplingParams(temperature=0)
VOCAB = tiny.TINY_TEXT["vocab_size"]
PROMPTS = [tiny.random_ids(n, VOCAB, seed=20 + n) for n in (7, 33, 90)]


@pytest.fixture(scope="module")
def mtp_models(tiny_checkpoint, load_ours):
    return {family: load_ours(tiny_checkpoint(family, "multimodal", mtp=True, lively=True)) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_equals_greedy(family, k, mtp_models):
    model = mtp_models[family]
    assert model.has_draft_head
    for prompt in PROMPTS:
        plain = generate(model, prompt, max_new_tokens=64, sampling=GREEDY)
        spec = generate(model, prompt, max_new_tokens=64, sampling=GREEDY, speculative_tokens=k)
        assert len(plain.new_ids) == 64
        assert len(set(plain.new_ids)) > 16  # a varied continuation: a wrong cache state would show
        assert spec.new_ids == plain.new_ids
        assert spec.drafted > 0 and 0 <= spec.accepted <= spec.drafted


def _oracle_draft(model, prompt, continuation, *, wrong=False):
    """A draft() that returns the true greedy continuation (or always a wrong token), after running the real head."""
    truth = list(prompt) + list(continuation)
    real_draft = model.draft

    def draft(cache, pending, num_tokens):
        real_draft(cache, pending, num_tokens)  # keep the head's own cache bookkeeping exercised
        start = cache.length + 1  # `pending` sits at position cache.length; drafts follow it
        tokens = truth[start : start + num_tokens]
        return [(t + 1) % VOCAB for t in tokens] if wrong else tokens

    return draft


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_that_drafts_right_is_accepted_and_stays_exact(family, mtp_models, monkeypatch):
    model = mtp_models[family]
    prompt = PROMPTS[1]
    plain = generate(model, prompt, max_new_tokens=64, sampling=GREEDY)
    monkeypatch.setattr(model, "draft", _oracle_draft(model, prompt, plain.new_ids))
    spec = generate(model, prompt, max_new_tokens=64, sampling=GREEDY, speculative_tokens=3)
    assert spec.new_ids == plain.new_ids
    assert spec.acceptance_rate >= 0.9, (spec.accepted, spec.drafted)
    assert spec.drafted >= 45  # about 64 / (3 + 1) verify steps of 3 drafts each


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_that_always_drafts_wrong_stays_exact(family, mtp_models, monkeypatch):
    model = mtp_models[family]
    prompt = PROMPTS[2]
    plain = generate(model, prompt, max_new_tokens=40, sampling=GREEDY)
    monkeypatch.setattr(model, "draft", _oracle_draft(model, prompt, plain.new_ids, wrong=True))
    spec = generate(model, prompt, max_new_tokens=40, sampling=GREEDY, speculative_tokens=3)
    assert spec.new_ids == plain.new_ids
    assert spec.accepted == 0 and spec.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_leaves_the_main_cache_alone(family, mtp_models):
    model = mtp_models[family]
    with torch.inference_mode():
        cache = model.new_cache(64)
        logits = model(torch.tensor([PROMPTS[1]]), cache)
        before = (cache.length, cache.k[:-1].clone(), cache.conv.clone(), cache.recurrent.clone())
        drafts = model.draft(cache, int(logits[0, -1].argmax()), 3)
    assert len(drafts) == 3 and all(0 <= d < VOCAB for d in drafts)
    assert cache.length == before[0]
    assert torch.equal(cache.k[:-1], before[1])  # every slot but the MTP head's own
    assert torch.equal(cache.conv, before[2]) and torch.equal(cache.recurrent, before[3])


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_cache_after_speculative_steps_equals_a_fresh_run(family, mtp_models):
    """Drive draft / verify / rollback by hand with partly right drafts, then check the MTP head's K/V.

    Every confirmed position of the head's cache must hold what one MTP forward over
    all pairs (h_p, x_{p+1}) computes: the catch-up overwrote the provisional rows.
    """
    model = mtp_models[family]
    prompt = PROMPTS[1]
    truth = prompt + generate(model, prompt, max_new_tokens=40, sampling=GREEDY).new_ids
    with torch.inference_mode():
        cache = model.new_cache(len(truth) + 8)
        pending = int(model(torch.tensor([prompt]), cache, logits_to_keep=1)[0, -1].argmax())
        for step in range(8):
            model.draft(cache, pending, 3)  # the real head runs (its drafts are random)
            start = cache.length
            right = step % 4  # 0 .. 3 correct drafts, then a wrong one
            drafts = truth[start + 1 : start + 1 + right] + [(truth[start + 1 + right] + 1) % VOCAB][: 3 - right]
            logits = model(torch.tensor([[pending] + drafts]), cache)[0]
            picks = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and picks[accepted] == drafts[accepted]:
                accepted += 1
            assert accepted == right
            cache.rollback(start + 1 + accepted)
            pending = picks[accepted]
            assert pending == truth[cache.length]
        model.draft(cache, pending, 1)  # catch up to the last confirmed position
        L = cache.length
        assert cache.mtp_length == L

        hidden: list[torch.Tensor] = []
        model(torch.tensor([truth[:L]]), hidden_states=hidden)  # final-normed hidden of every position
        fresh = model.new_cache(L)
        positions = torch.arange(L)
        cos, sin = model.model.rotary_emb(positions, torch.float32)
        embeds = model.model.embed_tokens(torch.tensor([truth[1 : L + 1]]))
        model.mtp(embeds, hidden[-1], cos, sin, fresh, 0)
    slot = cache.mtp_slot
    # (the hidden states of incremental and one-shot runs differ in rounding only: ~1e-5)
    torch.testing.assert_close(cache.k[slot, :, :, :L], fresh.k[slot, :, :, :L], rtol=1e-3, atol=2e-4)
    torch.testing.assert_close(cache.v[slot, :, :, :L], fresh.v[slot, :, :, :L], rtol=1e-3, atol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_without_mtp_cannot_draft(family, tiny_checkpoint, load_ours):
    model = load_ours(tiny_checkpoint(family, "text"))
    assert model.has_draft_head is False
    with pytest.raises(GenerationError, match="no draft head"):
        generate(model, PROMPTS[0], max_new_tokens=8, sampling=GREEDY, speculative_tokens=2)
    with pytest.raises(GenerationError, match="no MTP head"):
        model.draft(model.new_cache(16), 1, 2)


@pytest.fixture(scope="module")
def cli_checkpoints(tmp_path_factory, qwen_tokenizer_files):
    """Tiny qwen3_5 checkpoints with the real Qwen vocabulary size, with and without MTP, plus tokenizer files."""
    import shutil

    out = {}
    for mtp in (True, False):
        folder = tmp_path_factory.mktemp(f"cli-mtp-{mtp}")
        tiny.write_tiny("qwen3_5", "multimodal", folder, mtp=mtp, vocab_size=151936)
        for f in qwen_tokenizer_files:
            shutil.copy(f, folder)
        out[mtp] = folder
    return out


def test_cli_mtp_greedy_equals_plain_greedy(cli_checkpoints):
    from typer.testing import CliRunner

    from lollm.cli import app

    runner = CliRunner()
    args = ["run", "-m", str(cli_checkpoints[True]), "-p", "Explain the delta rule.", "--temperature", "0", "-n", "64"]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, args + ["--mtp", "--draft-tokens", "3"])
    assert plain.exit_code == 0, plain.output
    assert spec.exit_code == 0, spec.output
    assert "MTP:" in spec.output and "drafted tokens accepted" in spec.output
    text = lambda r: r.stdout.split("\n[")[0] if "\n[" in r.stdout else r.stdout  # noqa: E731
    assert text(spec) == text(plain)


def test_cli_mtp_without_mtp_tensors_is_a_clear_error(cli_checkpoints):
    from typer.testing import CliRunner

    from lollm.cli import app

    from lollm.errors import LollmError

    result = CliRunner().invoke(app, ["run", "-m", str(cli_checkpoints[False]), "-p", "hi", "--mtp"])
    assert result.exit_code != 0
    # lollm's console script prints a LollmError's message in one line and exits with status 2
    assert isinstance(result.exception, LollmError), result.output
    assert "no draft-head tensors (mtp.*)" in str(result.exception)


def test_too_many_draft_tokens_is_a_clear_error(mtp_models):
    """A verify step of 1 + 16 tokens could not be rolled back (kv.MAX_ROLLBACK_TOKENS)."""
    with pytest.raises(GenerationError, match="at most 15 draft tokens"):
        generate(mtp_models["qwen3_5"], PROMPTS[0], max_new_tokens=8, sampling=GREEDY, speculative_tokens=16)
