"""The gemma4 vision tower through plugin contract 3 (lollm.vision): load_vision, VisionTower, placement.

The same tiny checkpoint as test_gemma4_vision.py. Core's own pieces do the work here:
``encode_images`` (preprocess, hash, tower) and ``expand_placeholders`` on the text form.
The soft tokens equal transformers' ``get_image_features``. (The placement and the decoder's
own ``images=``, logits against transformers': test_gemma4_vision_decoder.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_gemma4_vision import drawing, reference_features, write_checkpoint

from lollm.vision.prompt import encode_images, expand_placeholders
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


def test_no_tower_for_gguf_or_text_only(loaded):
    _, model, _ = loaded
    assert load_vision(dataclasses.replace(model.checkpoint, fmt="gguf"), model.options) is None
    text_only = {k: v for k, v in model.checkpoint.config.items() if k != "vision_config"}
    assert load_vision(dataclasses.replace(model.checkpoint, config=text_only), model.options) is None


def test_an_mmproj_gguf_without_the_text_width_is_refused_naming_the_key(loaded):
    """The text width decides how a GGUF decoder's images attend (test_gemma4_vision_gguf.py): an mmproj
    that does not say it is refused before any encoding."""
    from lollm.errors import ConfigError

    _, model, _ = loaded
    mmproj = dataclasses.replace(model.checkpoint, fmt="gguf", config={"general.architecture": "clip"})
    with pytest.raises(ConfigError, match="'clip.vision.projection_dim' \\(the text width\\) is None"):
        load_vision(mmproj, model.options)
