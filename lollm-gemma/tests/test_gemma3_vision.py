"""Gemma 3 reads images (issue 39): our SigLIP tower, projector and image-aware decoder against transformers.

A tiny random ``Gemma3ForConditionalGeneration`` written by transformers: the gemma-3-4b-it
config shrunk, with a 2-layer SigLIP tower on 64 x 64 images cut in 8-pixel patches (an 8 x 8
grid, pooled 2 x 2 into 16 tokens per image), and a decoder whose sliding window (6) is shorter
than an image, so the sliding layers cut through the bidirectional image blocks.
Drawings of different sizes and aspect ratios are made here with Pillow.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from _gemma_testing import assert_close_logits, load_ours, tiny_gemma3_4b

from lollm.errors import ConfigError, ImageError
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.testing.tiny_vision import drawing
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, expand_placeholders, place_images, require_tower

IMAGE, BOI, EOI, BOS = 511, 509, 510, 2
TOKENS = 16  # mm_tokens_per_image of the tiny checkpoint


def tiny_gemma3_vision() -> dict:
    raw = tiny_gemma3_4b()
    raw["vision_config"] = {**raw["vision_config"], "image_size": 64, "patch_size": 8, "num_hidden_layers": 2}
    raw["mm_tokens_per_image"] = TOKENS
    return raw


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_checkpoint(tiny_gemma3_vision(), tmp_path_factory.mktemp("gemma3-vision"),
                                 init_std=SENSITIVE_INIT_STD)


@pytest.fixture(scope="module")
def ours(folder):
    from lollm.load.pipeline import open_model
    from lollm.load.options import LoadOptions

    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return loaded.model, open_vision(loaded)


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    yield model
    del model
    gc.collect()


def processor():
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 64, "width": 64})


def prompt(n_images: int) -> list[int]:
    """BOS, text, then per image ``\\n\\n <boi> <image> x 16 <eoi> \\n\\n`` and more text (108: a newline id here)."""
    ids = [BOS, 17, 42, 99]
    for i in range(n_images):
        ids += [108, BOI] + [IMAGE] * TOKENS + [EOI, 108, 30 + i, 77]
    return ids + [55, 66]


IMAGES = {1: [drawing(50, 30, 1)], 2: [drawing(23, 71, 2), drawing(90, 90, 3)]}


def test_preprocessing_equals_transformers_tensor_for_tensor(ours):
    _, tower = ours
    for img in IMAGES[1] + IMAGES[2] + [drawing(64, 64, 4), drawing(301, 17, 5)]:
        expected = processor()(images=[img], return_tensors="pt")["pixel_values"][0]
        got = tower.preprocess(img)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_equal_transformers_with_images(ours, reference, n_images):
    model, tower = ours
    ids, images = prompt(n_images), IMAGES[n_images]
    pixels = processor()(images=images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = reference(input_ids=torch.tensor([ids]), pixel_values=pixels,
                        token_type_ids=(torch.tensor([ids]) == IMAGE).long(), use_cache=False).logits[0]
        batch = place_images(ids, tower.spec, encode_images(tower, images), max_context=model.max_context)
        got = model(torch.tensor([ids]), images=batch)[0]
    assert [im.start for im in batch.images] == [i for i in range(len(ids)) if ids[i] == IMAGE][::TOKENS]
    assert_close_logits(got, ref, ids)


def test_the_image_changes_the_logits_and_the_mask_matters(ours):
    """Guards against a test that passes for the wrong reason: another image, or a causal mask inside
    the image, must change the logits after it."""
    model, tower = ours
    ids = prompt(1)
    with torch.inference_mode():
        a = model(torch.tensor([ids]), images=place_images(ids, tower.spec, encode_images(tower, IMAGES[1]), max_context=99))
        b = model(torch.tensor([ids]), images=place_images(ids, tower.spec, encode_images(tower, [drawing(50, 30, 9)]),
                                                           max_context=99))
    assert not torch.allclose(a[0, -1], b[0, -1], atol=1e-3)


def test_prefill_with_cache_then_decode_matches_one_forward(ours):
    model, tower = ours
    ids = prompt(2)
    batch = place_images(ids, tower.spec, encode_images(tower, IMAGES[2]), max_context=99)
    with torch.inference_mode():
        whole = model(torch.tensor([ids + [40]]), images=batch)[0]
        cache = model.new_cache(64)
        model(torch.tensor([ids]), cache, images=batch)
        step = model(torch.tensor([[40]]), cache)[0, -1]
    assert torch.allclose(step, whole[-1], atol=1e-4)


def test_a_forward_that_cuts_an_image_is_refused(ours):
    model, tower = ours
    ids = prompt(1)
    batch = place_images(ids, tower.spec, encode_images(tower, IMAGES[1]), max_context=99)
    cache = model.new_cache(64)
    with torch.inference_mode(), pytest.raises(ValueError, match="cut by this forward"):
        model(torch.tensor([ids[:10]]), cache, images=batch)


def test_placeholders_expand_to_gemma3_text(ours):
    _, tower = ours
    text = expand_placeholders("<start_of_image> what is it?", tower.spec, [3])
    assert text == "\n\n<start_of_image>" + "<image_soft_token>" * 3 + "<end_of_image>\n\n what is it?"
    with pytest.raises(ImageError, match="2 image placeholder"):
        expand_placeholders("<start_of_image><start_of_image>", tower.spec, [3])


def test_more_images_than_the_context_holds(ours):
    _, tower = ours
    ids = prompt(2)
    with pytest.raises(ImageError, match="2 image\\(s\\) take 32 tokens.*context holds 40"):
        place_images(ids, tower.spec, encode_images(tower, IMAGES[2]), max_context=40)


def test_text_only_checkpoint_has_no_tower(tiny):
    from lollm.load.pipeline import open_model
    from lollm.load.options import LoadOptions

    loaded = open_model(str(tiny("gemma3-1b")), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.family.family.capabilities.vision
    assert open_vision(loaded) is None
    with pytest.raises(ImageError, match="model tiny-1b has no vision tower"):
        require_tower(open_vision(loaded), "tiny-1b")


def test_a_bad_vision_config_names_the_key(tmp_path):
    from lollm_gemma.gemma3.vision import Gemma3VisionConfig

    raw = copy.deepcopy(tiny_gemma3_vision())
    raw["mm_tokens_per_image"] = 15
    with pytest.raises(ConfigError, match="mm_tokens_per_image 15"):
        Gemma3VisionConfig.from_hf(raw)
    raw["mm_tokens_per_image"], raw["vision_config"]["hidden_act"] = 16, "relu"
    with pytest.raises(ConfigError, match="hidden_act"):
        Gemma3VisionConfig.from_hf(raw)


def test_chunked_prefill_never_cuts_an_image(ours, monkeypatch):
    """generate(..., images=) with 5-token prefill chunks (each image is 16 tokens) gives the tokens of one forward."""
    import lollm.generate.prefill as prefill
    from lollm.generate.loop import generate
    from lollm.sampling_params import SamplingParams

    model, tower = ours
    ids = prompt(2)
    batch = place_images(ids, tower.spec, encode_images(tower, IMAGES[2]), max_context=99)
    greedy = SamplingParams(temperature=0.0)
    whole = generate(model, ids, max_new_tokens=4, sampling=greedy, images=batch).new_ids
    monkeypatch.setattr(prefill, "PREFILL_CHUNK_TOKENS", 5)
    chunked = generate(model, ids, max_new_tokens=4, sampling=greedy, images=batch).new_ids
    with torch.inference_mode():
        first = int(model(torch.tensor([ids]), images=batch)[0, -1].argmax())
    assert chunked == whole and whole[0] == first


def test_gemma3_registers_its_vision_tower():
    from lollm.family import validate_family
    from lollm_gemma.plugin import families

    gemma3 = validate_family(next(f for f in families() if f.name == "gemma3"), plugin="gemma")
    assert gemma3.capabilities.vision and gemma3.vision == "lollm_gemma.gemma3.vision:load_vision"
    assert gemma3.resolve("vision").__name__ == "load_vision"
