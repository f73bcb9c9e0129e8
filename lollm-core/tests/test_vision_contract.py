"""Plugin contract 3, vision: the Family fields, the preprocessing math, the prompt expansion and the merge.

The math is held against what it must equal: a convolution for patchify, transformers'
own ``rescale``/``normalize`` for the numbers, hand-written expectations for the placement.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lollm.errors import ImageError, PluginError
from lollm.family import CONTRACT_VERSION, Capabilities, Family, validate_family
from lollm.vision.preprocess import normalize, patchify, pixel_hash, rescale, resize, to_tensor
from lollm.vision.prompt import (
    encode_images, expand_placeholders, image_token_mask, place_images, require_tower, scatter_images,
)
from lollm.vision.spec import ImageBatch, PlacedImage, VisionSpec

SPEC = VisionSpec(image_size=(4, 4), patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, merge=1,
                  image_token="<img>", image_token_id=9, placeholder="<image>", begin_text="<b>", end_text="<e>")


class ToyTower:
    """A VisionTower with 4 tokens per image: the mean of each 2x2 patch, as C=3 channels."""

    spec = SPEC

    def preprocess(self, image):
        return normalize(rescale(to_tensor(resize(image, 4, 4))), SPEC.image_mean, SPEC.image_std)

    def num_tokens(self, pixels):
        return 4

    def __call__(self, pixels):
        return patchify(pixels, 2).view(4, 3, 4).mean(-1)  # (4, 3)


def family(**kw) -> Family:
    return Family(name="f", contract=CONTRACT_VERSION, model_types=("f",), load="m:load", **kw)


def test_family_declares_vision_with_both_fields_or_neither():
    plain = validate_family(family(), plugin="p")
    assert plain.vision is None and plain.capabilities.vision is False
    seeing = validate_family(family(capabilities=Capabilities(vision=True), vision="m.vision:load_vision"), plugin="p")
    assert seeing.vision == "m.vision:load_vision" and seeing.capabilities.vision
    with pytest.raises(PluginError, match="capabilities.vision is True but vision is None"):
        validate_family(family(capabilities=Capabilities(vision=True)), plugin="p")
    with pytest.raises(PluginError, match="capabilities.vision is False"):
        validate_family(family(vision="m:v"), plugin="p")
    with pytest.raises(PluginError, match="vision must be 'module:function'"):
        validate_family(family(capabilities=Capabilities(vision=True), vision="no colon"), plugin="p")


def test_rescale_and_normalize_equal_transformers():
    from transformers.image_transforms import normalize as hf_normalize, rescale as hf_rescale

    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (3, 5, 7), generator=g, dtype=torch.uint8)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    expected = hf_normalize(hf_rescale(pixels.numpy(), 1 / 255), mean, std, input_data_format="channels_first")
    got = normalize(rescale(pixels), mean, std)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), expected.astype(np.float32))


def test_patchify_is_the_convolution_of_a_patch_embedding():
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(3, 6, 8, generator=g)
    conv = torch.nn.Conv2d(3, 5, kernel_size=2, stride=2, bias=False)
    expected = conv(pixels[None]).flatten(2).transpose(1, 2)[0]  # (12, 5) in reading order
    got = patchify(pixels, 2) @ conv.weight.reshape(5, -1).T
    assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match="do not cut into 4x4"):
        patchify(pixels, 4)


def test_pixel_hash_tells_images_apart_and_matches_itself():
    a = torch.zeros(3, 4, 4)
    assert pixel_hash(a) == pixel_hash(a.clone())
    b = a.clone()
    b[0, 0, 0] = 1e-7
    assert pixel_hash(a) != pixel_hash(b)
    assert pixel_hash(a) != pixel_hash(a.reshape(3, 2, 8))  # same bytes, another shape


def test_expand_place_and_scatter():
    image = Image.new("RGB", (9, 5), (10, 200, 30))
    encoded = encode_images(ToyTower(), [image, image])
    text = expand_placeholders("<image> and <image>?", SPEC, [4, 4])
    assert text == "<b>" + "<img>" * 4 + "<e> and <b>" + "<img>" * 4 + "<e>?"
    ids = [1, 2, 9, 9, 9, 9, 3, 4, 9, 9, 9, 9, 5]
    batch = place_images(ids, SPEC, encoded, max_context=20)
    assert batch.spans() == [(2, 6), (8, 12)]
    assert batch.images[0].pixel_hash == batch.images[1].pixel_hash
    x = torch.zeros(1, len(ids), 3)
    merged = scatter_images(x, batch, 0)
    assert torch.equal(merged[0, 2:6], encoded[0].embeds) and torch.equal(merged[0, 8:12], encoded[1].embeds)
    assert merged[0, [0, 1, 6, 7, 12]].abs().sum() == 0 and x.abs().sum() == 0  # x itself untouched
    assert image_token_mask(batch, 0, len(ids)).nonzero().flatten().tolist() == [2, 3, 4, 5, 8, 9, 10, 11]
    # a later forward (a chunk starting at 7) sees the second image at its own offset
    assert torch.equal(scatter_images(torch.zeros(1, 6, 3), batch, 7)[0, 1:5], encoded[1].embeds)


def test_placement_refusals():
    encoded = encode_images(ToyTower(), [Image.new("RGB", (3, 3))])
    with pytest.raises(ImageError, match="holds 3 image tokens.*need 4"):
        place_images([9, 9, 9, 1], SPEC, encoded, max_context=20)
    with pytest.raises(ImageError, match="not consecutive"):
        place_images([9, 9, 1, 9, 9], SPEC, encoded, max_context=20)
    with pytest.raises(ImageError, match="context holds 4"):
        place_images([1, 9, 9, 9, 9], SPEC, encoded, max_context=4)
    with pytest.raises(ImageError, match="model text-only has no vision tower"):
        require_tower(None, "text-only")
    with pytest.raises(ImageError, match="1 image placeholder"):
        expand_placeholders("<image>", SPEC, [4, 4])
    assert expand_placeholders("hi", SPEC, [1]) == "<b><img><e> hi"  # no placeholder: images go first


def test_a_forward_must_hold_whole_images():
    batch = ImageBatch([PlacedImage(3, torch.ones(4, 2), "h")])
    assert batch.within(0, 3) == [] and batch.within(7, 2) == []
    with pytest.raises(ValueError, match="cut by this forward"):
        batch.within(0, 5)
