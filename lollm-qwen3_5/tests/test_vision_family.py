"""Qwen3.5's tower through core's contract 3 (lollm.vision): load_vision, encode_images, placeholders.

Needs core's ``lollm.vision`` (the viscore branch). Checked on the tiny livened checkpoints of
test_vision_tower: the embeddings core's ``encode_images`` gets from ``load_vision`` equal
transformers' ``get_image_features`` for images of held-out sizes, the grids are the merged
token grids M-RoPE needs, and the mmproj tower gives the same embeddings.
"""

from __future__ import annotations

import json

import pytest
import torch

import qwen3_5_tiny as tiny
from lollm.load.loader import load_checkpoint
from lollm.load.options import LoadOptions
from lollm.vision.prompt import encode_images, expand_placeholders, place_images
from lollm_qwen3_5.vision_family import load_vision, tower_from_mmproj
from lollm_qwen3_5.qwen3_5.mrope import mrope_positions
from lollm_qwen3_5.vision_preprocess import ProcessorConfig
from test_vision_preprocess import SMALL_BUDGET, drawing
from test_vision_tower import FAMILIES, MIN_COSINE, TWO_IMAGES, checkpoint, inputs  # noqa: F401 (fixture)

CPU = LoadOptions(device="cpu", dtype="float32")


def images():
    return [drawing(w, h, seed=10 + i) for i, (w, h) in enumerate(TWO_IMAGES)]


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_images_equals_transformers(family, checkpoint):
    folder = checkpoint(family)
    tower = load_vision(load_checkpoint(folder), CPU)
    encoded = encode_images(tower, images())
    reference = tiny.reference_class(family, "multimodal").from_pretrained(str(folder), dtype=torch.float32).eval()
    pixel_values, grids = inputs(TWO_IMAGES)
    with torch.no_grad():
        theirs = reference.model.get_image_features(pixel_values, torch.tensor(grids)).pooler_output
    for e, want, (t, h, w) in zip(encoded, theirs, grids):
        assert e.grid == (t, h // 2, w // 2) and e.embeds.shape == want.shape
        cos = torch.nn.functional.cosine_similarity(e.embeds.double(), want.double(), dim=-1)
        assert cos.min() >= MIN_COSINE
    assert tower.spec.image_token_id == json.loads((folder / "config.json").read_text())["image_token_id"]


def test_placeholders_expand_and_place_as_qwen_writes_them(checkpoint):
    folder = checkpoint("qwen3_5")
    tower = load_vision(load_checkpoint(folder), CPU)
    encoded = encode_images(tower, images())
    counts = [e.embeds.shape[0] for e in encoded]
    text = expand_placeholders("a <|vision_start|><|image_pad|><|vision_end|> b "
                               "<|vision_start|><|image_pad|><|vision_end|>", tower.spec, counts)
    assert text.count("<|image_pad|>") == sum(counts) and text.count("<|vision_start|>") == 2
    img = tower.spec.image_token_id
    ids = [1, 2] + [img] * counts[0] + [3, 4] + [img] * counts[1] + [5]
    batch = place_images(ids, tower.spec, encoded, max_context=1000)
    assert batch.spans() == [(2, 2 + counts[0]), (4 + counts[0], 4 + sum(counts))]
    positions, _ = mrope_positions(ids, img, [im.grid for im in batch.images], merge_size=1)
    assert positions.shape == (3, len(ids))


def test_a_text_only_checkpoint_has_no_tower(tiny_checkpoint):
    assert load_vision(load_checkpoint(tiny_checkpoint("qwen3_5", "text")), CPU) is None


def test_mmproj_tower_encodes_as_the_safetensors_one(checkpoint, tmp_path):
    from lollm.testing.converter import convert

    folder = checkpoint("qwen3_5")
    mmproj = convert(folder, tmp_path / "mmproj.gguf", "f32", ("--mmproj",))
    config = json.loads((folder / "config.json").read_text())
    a = encode_images(load_vision(load_checkpoint(folder), CPU), images())
    budget = ProcessorConfig.from_file_dict(SMALL_BUDGET)  # the budget of the checkpoint's preprocessor_config.json
    b = encode_images(tower_from_mmproj(mmproj, config, CPU, budget), images())
    for x, y in zip(a, b):
        assert x.pixel_hash == y.pixel_hash and torch.allclose(x.embeds, y.embeds, atol=1e-5)
