"""``lollm run --image`` on a tiny Gemma 3 with a vision tower: the tokens equal transformers' greedy generation.

The tiny checkpoint of test_gemma3_vision.py, with a tokenizer whose last three ids are Gemma 3's
image tokens (``<start_of_image>`` 509, ``<end_of_image>`` 510, ``<image_soft_token>`` 511), so the
prompt goes the whole way: placeholder, chat template, expansion, tokenizer, tower, merge, generate.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from lollm.errors import ImageError
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint, write_tiny_tokenizer

from test_gemma3_vision import BOI, EOI, IMAGE, tiny_gemma3_vision


def with_image_tokens(folder):
    """The tiny tokenizer (509 ids) plus Gemma 3's image tokens as the special ids 509, 510, 511, in ``folder``."""
    from tokenizers import AddedToken, Tokenizer

    write_tiny_tokenizer(folder, vocab_size=509)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")])
    assert [tok.token_to_id(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")] == [BOI, EOI, IMAGE]
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return with_image_tokens(write_tiny_checkpoint(tiny_gemma3_vision(), tmp_path_factory.mktemp("gemma3-vision-cli"),
                                                   init_std=SENSITIVE_INIT_STD))


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
    from transformers import Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    done = lollm("run", str(folder), "--image", str(picture), "-p", "what is this?", "-n", "4",
                 "--temperature", "0", "--json", "--device", "cpu", "--dtype", "float32")
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ids = out["prompt_ids"]
    assert ids.count(IMAGE) == 16 and ids[ids.index(IMAGE) - 1] == BOI and ids[ids.index(IMAGE) + 16] == EOI

    model = Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    pixels = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})(images=[Image.open(picture)],
                                                                        return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels,
                             token_type_ids=(torch.tensor([ids]) == IMAGE).long(), max_new_tokens=4, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert out["ids"] == ref[0, len(ids):].tolist()


def test_a_hostile_image_fails_before_the_model_loads(folder, tmp_path):
    cut = tmp_path / "cut.png"
    img = Image.new("RGB", (64, 64))
    img.save(cut)
    cut.write_bytes(cut.read_bytes()[:60])
    with pytest.raises(ImageError, match="cut.png.*truncated"):  # the CLI prints it in one line, exit status 2
        lollm("run", str(folder), "--image", str(cut), "-p", "hi", "-n", "1")


def test_a_text_only_model_given_an_image_is_refused_naming_it(tmp_path, picture):
    from _gemma_testing import tiny_gemma3_1b

    folder = write_tiny_checkpoint(tiny_gemma3_1b(), tmp_path / "gemma3-1b")
    write_tiny_tokenizer(folder, vocab_size=512)
    with pytest.raises(ImageError, match="model .*gemma3-1b has no vision tower"):
        lollm("run", str(folder), "--image", str(picture), "-p", "hi", "-n", "1", "--device", "cpu")
