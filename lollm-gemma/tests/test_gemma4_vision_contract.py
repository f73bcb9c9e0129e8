"""The gemma4 vision tower through plugin contract 3 (lollm.vision): load_vision, VisionTower, placement.

The same tiny checkpoint as test_gemma4_vision.py. Core's own pieces do the work here:
``encode_images`` (preprocess, hash, tower), ``expand_placeholders`` on the text form,
``place_images`` on the ids and ``scatter_images`` into the decoder's embeddings (through a
forward hook: the gemma4 decoder takes no ``images=`` yet). The soft tokens equal
transformers' ``get_image_features``; the logits on a prompt with two images equal
transformers' at every position.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _gemma_testing import assert_close_logits
from test_gemma4_vision import drawing, reference_features, write_checkpoint

from lollm.vision.prompt import encode_images, expand_placeholders, place_images, scatter_images
from lollm.vision.spec import ImageBatch
from lollm_gemma.gemma4_vision_contract import BOI, EOI, IMAGE_TOKEN, load_vision

COSINE_MIN = 0.9999


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(folder, lollm's LoadedModel of the decoder, our VisionTower), soft-token budget 70 as the tests' processor."""
    import json

    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    folder = write_checkpoint(tmp_path_factory.mktemp("gemma4-vision-contract"), standardize=False)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    cfg["vision_soft_tokens_per_image"] = 70  # as the reference processor's max_soft_tokens
    (folder / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    model = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return folder, model, load_vision(model.checkpoint, model.options)


def test_tower_through_the_contract_equals_transformers(loaded):
    folder, _, tower = loaded
    images = [drawing(200, 120, 1), drawing(333, 517, 2)]
    encoded = encode_images(tower, images)
    for e, ref in zip(encoded, reference_features(folder, images)):
        assert e.pixels.shape[0] == 3 and e.embeds.shape == ref.shape
        cos = float(torch.nn.functional.cosine_similarity(e.embeds.double(), ref.double(), dim=-1).min())
        assert cos >= COSINE_MIN, f"cosine {cos:.6f}"
    again = encode_images(tower, [drawing(200, 120, 1)])[0]
    assert again.pixel_hash == encoded[0].pixel_hash != encoded[1].pixel_hash


def test_spec_and_prompt_expansion(loaded):
    _, _, tower = loaded
    spec = tower.spec
    assert (spec.image_size, spec.patch_size, spec.merge, spec.resample) == (None, 16, 3, "bicubic")
    assert spec.image_token_id == 510
    text = expand_placeholders(f"a {IMAGE_TOKEN} b", spec, [4])
    assert text == f"a {BOI}{IMAGE_TOKEN * 4}{EOI} b"


def test_logits_through_core_placement_equal_transformers(loaded):
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    folder, model, tower = loaded
    ours, cfg = model.model, tower.vision.config
    images = [drawing(200, 120, 1), drawing(333, 517, 2)]
    encoded = encode_images(tower, images)
    text = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = [2] + text[:6]
    for i, e in enumerate(encoded):  # the expanded prompt, as the tokenizer would give it
        ids += tower.vision.placeholder_ids(e.embeds.shape[0]) + text[6 + 5 * i: 11 + 5 * i]
    batch = place_images(ids, tower.spec, encoded, max_context=ours.max_context)

    with torch.inference_mode():
        reference = Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
        pixels = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=images, return_tensors="pt")
        ref = reference(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                        image_position_ids=pixels["image_position_ids"], use_cache=False).logits[0]

    pad = 0  # text_config.pad_token_id: the per-layer table reads <pad> at the image slots
    text_ids = torch.tensor([pad if t == cfg.image_token_id else t for t in ids])[None]
    # the hook runs before forward's x sqrt(C), which the soft tokens must not get: divide by it first
    unscaled = ImageBatch([dataclasses.replace(im, embeds=im.embeds / ours.embed_scale) for im in batch.images])
    hook = ours.model.embed_tokens.register_forward_hook(lambda module, args, out: scatter_images(out, unscaled, 0))
    try:
        with torch.inference_mode():
            got = ours(text_ids)[0]
    finally:
        hook.remove()
    assert_close_logits(got, ref, ids)


def test_no_tower_for_gguf_or_text_only(loaded):
    _, model, _ = loaded
    assert load_vision(dataclasses.replace(model.checkpoint, fmt="gguf"), model.options) is None
    text_only = {k: v for k, v in model.checkpoint.config.items() if k != "vision_config"}
    assert load_vision(dataclasses.replace(model.checkpoint, config=text_only), model.options) is None
