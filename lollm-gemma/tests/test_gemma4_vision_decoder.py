"""The gemma4 decoder takes images itself (``forward(..., images=ImageBatch)``): logits equal transformers'.

The tiny checkpoint of test_gemma4_vision.py (E2B's layout: per-layer embeddings, KV-sharing
layers, a sliding window of 6), in two variants:

* "e2b": ``use_bidirectional_attention`` null, images attend causally like text;
* "vision": ``use_bidirectional_attention: "vision"`` (the 26B/31B rule): the sliding layers let
  an image's tokens see each other both ways, the global layers stay causal.

Everything goes through core's contract-3 pieces (``encode_images``, ``place_images``) and
lollm's own decoder, no hook. For prompts with 1 image (a size the tower tests do not use) and
2 images (two sizes and aspect ratios), our logits at every position equal transformers'
``Gemma4ForConditionalGeneration`` on the same pixels: same argmax, cosine >= 0.9999; also
through a cache, in two forwards, and with the last position alone (the KV-sharing layers' cut).
Mutants show the bound can fail: the wrong mask rule either way, and the per-layer table
reading the placeholder id instead of <pad>.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _gemma_testing import assert_close_logits
from test_gemma4_vision import SOFT_TOKENS, drawing, reference_processor, write_checkpoint

from lollm.vision.prompt import encode_images, place_images
from lollm.vision.spec import ImageBatch

IMAGE_SETS = {
    "1 image": [(300, 220, 3)],  # (width, height, seed); held out from the tower tests' two sizes
    "2 images": [(200, 120, 1), (333, 517, 2)],
}


def write_variant(folder, variant: str):
    """The tiny checkpoint with the tests' soft-token budget, and the 26B/31B mask rule for "vision"."""
    write_checkpoint(folder, standardize=False)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    cfg["vision_soft_tokens_per_image"] = SOFT_TOKENS  # as the reference processor's max_soft_tokens
    cfg["text_config"]["use_bidirectional_attention"] = "vision" if variant == "vision" else None
    (folder / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return folder


@pytest.fixture(scope="module", params=["e2b", "vision"])
def loaded(request, tmp_path_factory):
    """(variant, folder, our decoder, our VisionTower), fp32 on the CPU."""
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.vision.load import open_vision

    folder = write_variant(tmp_path_factory.mktemp(f"gemma4-decoder-{request.param}"), request.param)
    model = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return request.param, folder, model.model, open_vision(model)


def image_prompt(tower, images) -> tuple[list[int], ImageBatch]:
    """<bos>, text, then per image <boi> <|image|>×n <eoi> and more text: the ids and their ImageBatch."""
    encoded = encode_images(tower, images)
    text = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = [2] + text[:7]
    for i, e in enumerate(encoded):
        ids += tower.vision.placeholder_ids(e.embeds.shape[0]) + text[7 + 6 * i: 13 + 6 * i]
    return ids, place_images(ids, tower.spec, encoded, max_context=10_000)


@torch.inference_mode()
def reference_logits(folder, ids: list[int], images) -> torch.Tensor:
    """transformers' logits (T, V) for the prompt and its pixels (as its processor makes them)."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    pixels = reference_processor()(images=images, return_tensors="pt")
    image_token = model.config.image_token_id
    out = model(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                image_position_ids=pixels["image_position_ids"], use_cache=False,
                mm_token_type_ids=(torch.tensor([ids]) == image_token).long())  # read by the "vision" rule only
    return out.logits[0]


@pytest.fixture(scope="module")
def runs(loaded):
    """image set -> (ids, ImageBatch, transformers' logits (T, V))."""
    _, folder, _, tower = loaded
    out = {}
    for name, sizes in IMAGE_SETS.items():
        images = [drawing(w, h, seed) for w, h, seed in sizes]
        ids, batch = image_prompt(tower, images)
        out[name] = ids, batch, reference_logits(folder, ids, images)
    return out


@pytest.mark.parametrize("image_set", IMAGE_SETS)
def test_logits_with_images_equal_transformers(loaded, runs, image_set):
    _, _, model, _ = loaded
    ids, batch, ref = runs[image_set]
    with torch.inference_mode():
        got = model(torch.tensor([ids]), images=batch)[0]
    assert_close_logits(got, ref, ids)


def test_through_a_cache_in_two_forwards(loaded, runs):
    """Text first, then the images and the rest: the cached keys, the sliding ring, the image mask at start > 0;
    then the same prompt's last position alone (logits_to_keep=1: the KV-sharing layers carry one query)."""
    _, _, model, _ = loaded
    ids, batch, ref = runs["2 images"]
    cut = batch.images[0].start - 3  # inside the text before the first image
    with torch.inference_mode():
        cache = model.new_cache(len(ids))
        first = model(torch.tensor([ids[:cut]]), cache, images=batch)[0]
        second = model(torch.tensor([ids[cut:]]), cache, images=batch)[0]
        cache = model.new_cache(len(ids))
        last = model(torch.tensor([ids]), cache, images=batch, logits_to_keep=1)[0]
    assert_close_logits(torch.cat([first, second]), ref, ids)
    assert_close_logits(last, ref[-1:], ids[-1:])


def test_text_only_is_unchanged(loaded):
    """No images, or an empty ImageBatch: bit for bit the text forward."""
    _, _, model, _ = loaded
    ids = torch.randint(3, 500, (1, 30), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        plain = model(ids)
        assert torch.equal(model(ids, images=None), plain)
        assert torch.equal(model(ids, images=ImageBatch([])), plain)


def test_an_image_cut_by_the_forward_is_refused(loaded, runs):
    _, _, model, _ = loaded
    ids, batch, _ = runs["1 image"]
    inside = batch.images[0].start + 2
    with pytest.raises(ValueError, match="cut by this forward"):
        model(torch.tensor([ids[:inside]]), images=batch)


def test_a_config_without_the_mask_rule_refuses_images(loaded, runs):
    """As from a GGUF file (``images_bidirectional`` None): images are refused naming the key, text still runs."""
    _, _, model, _ = loaded
    ids, batch, _ = runs["1 image"]
    right = model.config
    model.config = dataclasses.replace(right, images_bidirectional=None)
    try:
        with pytest.raises(ValueError, match="use_bidirectional_attention"):
            model(torch.tensor([ids]), images=batch)
        with torch.inference_mode():
            model(torch.tensor([ids[:5]]))
    finally:
        model.config = right


def _other_mask_rule(model):
    model.config = dataclasses.replace(model.config, images_bidirectional=not model.config.images_bidirectional)


def _placeholder_in_the_per_layer_table(model):
    model.config = dataclasses.replace(model.config, pad_token_id=510)  # the image token's id: no <pad> swap


@pytest.mark.parametrize("mutant", [_other_mask_rule, _placeholder_in_the_per_layer_table],
                         ids=lambda f: f.__name__[1:])
def test_mutants_fail_the_bound(loaded, runs, mutant):
    """Each mistake moves the logits past the bound, so the parity tests can catch it."""
    _, _, model, _ = loaded
    ids, batch, ref = runs["2 images"]
    right = model.config
    mutant(model)
    try:
        with torch.inference_mode():
            got = model(torch.tensor([ids]), images=batch)[0]
    finally:
        model.config = right
    with pytest.raises(AssertionError, match="argmax differs|cosine"):
        assert_close_logits(got, ref, ids)


def test_the_config_reads_the_image_rules_from_the_hub_configs():
    """E2B: causal images (``use_bidirectional_attention`` null); 26B-A4B: "vision" (its MoE block aside);
    both embed <pad> (0) at image positions; a pad id outside the vocabulary is refused naming the key."""
    from _gemma_testing import hub_config

    from lollm.errors import ConfigError
    from lollm_gemma.gemma4.config import Gemma4Config

    e2b = Gemma4Config.from_hf(hub_config("google__gemma-4-E2B-it"))
    big = hub_config("google__gemma-4-26B-A4B")
    big["text_config"]["enable_moe_block"] = False  # not implemented; the image rule is what is read here
    assert (e2b.pad_token_id, e2b.images_bidirectional) == (0, False)
    assert (Gemma4Config.from_hf(big).pad_token_id, Gemma4Config.from_hf(big).images_bidirectional) == (0, True)
    big["text_config"]["pad_token_id"] = big["text_config"]["vocab_size"]
    with pytest.raises(ConfigError, match="pad_token_id"):
        Gemma4Config.from_hf(big)
