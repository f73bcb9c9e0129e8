"""``lollm run --image`` on a tiny Gemma 4 with a vision tower: the tokens equal transformers' greedy generation.

The tiny checkpoint of test_gemma4_vision_decoder.py (E2B's layout), with a tokenizer whose
last seven ids are Gemma 4's multimodal tokens at the config's ids (``<|image>`` 507,
``<image|>`` 509, ``<|image|>`` 510, ...), so the prompt goes the whole way: placeholder, chat
template, expansion, tokenizer, tower, merge, the decoder's prefill and cached decode steps.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from lollm.testing.tiny import write_tiny_tokenizer

from test_gemma4_vision import SOFT_TOKENS, reference_processor
from test_gemma4_vision_decoder import write_variant

#: Gemma 4's multimodal tokens (tokenizer_config.json of gemma-4-E2B-it), at the tiny config's ids 505..511.
MULTIMODAL_TOKENS = ["<|audio|>", "<|audio>", "<|image>", "<audio|>", "<image|>", "<|image|>", "<|video|>"]
BOI, EOI, IMAGE = 507, 509, 510


def with_image_tokens(folder):
    """The tiny tokenizer (505 ids) plus Gemma 4's multimodal tokens as the special ids 505..511, in ``folder``."""
    from tokenizers import AddedToken, Tokenizer

    write_tiny_tokenizer(folder, vocab_size=505)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in MULTIMODAL_TOKENS])
    assert [tok.token_to_id(t) for t in ("<|image>", "<image|>", "<|image|>")] == [BOI, EOI, IMAGE]
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return with_image_tokens(write_variant(tmp_path_factory.mktemp("gemma4-vision-cli"), "e2b"))


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("pictures") / "boat.png"
    img = Image.new("RGB", (70, 40), (20, 90, 200))
    ImageDraw.Draw(img).polygon([(10, 30), (60, 30), (50, 38), (20, 38)], fill=(120, 60, 20))
    img.save(path)
    return path


def lollm(*args: str):
    from lollm.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_run_with_an_image_equals_transformers_greedy(folder, picture):
    from transformers import Gemma4ForConditionalGeneration

    done = lollm("run", str(folder), "--image", str(picture), "-p", "what is this?", "-n", "6",
                 "--temperature", "0", "--json", "--device", "cpu", "--dtype", "float32")
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ids = out["prompt_ids"]
    n = ids.count(IMAGE)
    assert 0 < n <= SOFT_TOKENS and ids[ids.index(IMAGE) - 1] == BOI and ids[ids.index(IMAGE) + n] == EOI

    model = Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    pixels = reference_processor()(images=[Image.open(picture).convert("RGB")], return_tensors="pt")
    assert int(pixels["num_soft_tokens_per_image"][0]) == n
    with torch.inference_mode():
        ref = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                             image_position_ids=pixels["image_position_ids"],
                             mm_token_type_ids=(torch.tensor([ids]) == IMAGE).long(), max_new_tokens=6,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out["ids"] == ref[0, len(ids):].tolist()
