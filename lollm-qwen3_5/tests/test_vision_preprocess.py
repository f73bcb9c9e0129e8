"""Qwen3.5's image preprocessing equals transformers' image processor, tensor for tensor.

The reference is ``Qwen2VLImageProcessorPil`` (the slow, Pillow/numpy class that transformers'
AutoImageProcessor maps qwen3_5 and qwen3_5_moe to; torchvision is not installed here), built
from the preprocessor_config.json numbers of the Qwen3.5 hub checkpoints. Images are drawn by
the test with Pillow, at sizes and aspect ratios that take every branch of the dynamic
resolution rule (round, shrink to max_pixels, grow to min_pixels).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from lollm.errors import ConfigError
from lollm_qwen3_5.vision_preprocess import (
    ProcessorConfig, preprocess, preprocess_images, smart_resize, tokens_per_image,
)

#: Qwen3.5's preprocessor_config.json (the hub files; also Qwen3-VL's)
QWEN3_5_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
#: a small pixel budget (32x32 .. 64x96 px) so that large images take the shrink branch
SMALL_BUDGET = {**QWEN3_5_PREPROCESSOR, "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 96}}
#: (width, height): landscape photo size, tall and thin, wide strip, square, tiny (grows), odd sides
SIZES = [(500, 375), (37, 301), (1000, 90), (64, 64), (20, 30), (257, 129)]


def drawing(width: int, height: int, seed: int) -> Image.Image:
    """An RGB picture with edges and colour gradients (a flat image would hide a channel or patch swap)."""
    g = torch.Generator().manual_seed(seed)
    base = tuple(int(v) for v in torch.randint(0, 256, (3,), generator=g))
    image = Image.new("RGB", (width, height), base)
    draw = ImageDraw.Draw(image)
    for k in range(6):
        x0, x1 = sorted(int(v) for v in torch.randint(0, width, (2,), generator=g))
        y0, y1 = sorted(int(v) for v in torch.randint(0, height, (2,), generator=g))
        colour = tuple(int(v) for v in torch.randint(0, 256, (3,), generator=g))
        (draw.ellipse if k % 2 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    draw.line((0, 0, width - 1, height - 1), fill=(0, 0, 255), width=2)
    return image


def reference_processor(raw: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**raw)


@pytest.mark.parametrize("raw", [QWEN3_5_PREPROCESSOR, SMALL_BUDGET], ids=["qwen3_5", "small-budget"])
def test_preprocessing_equals_transformers(raw):
    images = [drawing(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    theirs = reference_processor(raw)(images, return_tensors="pt")
    ours, grids = preprocess_images(images, ProcessorConfig.from_file_dict(raw))
    assert grids == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
    assert ours.shape == theirs["pixel_values"].shape
    assert torch.allclose(ours, theirs["pixel_values"].float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("width,height", SIZES + [(4000, 3000), (1, 150)])
def test_smart_resize_equals_transformers(width, height):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for raw in (QWEN3_5_PREPROCESSOR, SMALL_BUDGET):
        c = ProcessorConfig.from_file_dict(raw)
        want = reference(height, width, factor=32, min_pixels=c.min_pixels, max_pixels=c.max_pixels)
        assert smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels) == tuple(want)


def test_a_photo_becomes_the_documented_grid():
    """The module docstring's example: 500 x 375 -> 512 x 384 pixels, a 24 x 32 grid, 192 tokens."""
    pixel_values, grid = preprocess(drawing(500, 375, seed=0), ProcessorConfig())
    assert grid == (1, 24, 32) and pixel_values.shape == (768, 3 * 2 * 16 * 16)
    assert tokens_per_image(grid, 2) == 192


def test_the_temporal_slots_hold_the_same_frame_and_patches_are_in_merge_block_order():
    """Row 1 of pixel_values is the patch right of row 0 (same 2x2 block), row 2 the one below row 0."""
    image = drawing(64, 64, seed=3)
    c = ProcessorConfig.from_file_dict(SMALL_BUDGET)
    pixel_values, grid = preprocess(image, c)
    assert grid == (1, 4, 4)
    patches = pixel_values.reshape(16, 3, 2, 16, 16)
    assert torch.equal(patches[:, :, 0], patches[:, :, 1])
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(64, 64, 3)
    x = (x.float() / 255 - 0.5) / 0.5  # (H, W, C), normalized
    for row, (r, col) in {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 2)}.items():
        want = x[16 * r:16 * r + 16, 16 * col:16 * col + 16].permute(2, 0, 1)
        assert torch.allclose(patches[row, :, 0], want, atol=1e-6), f"row {row} is not patch {(r, col)}"


def test_bad_inputs_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 32, 1024, 1 << 24)
    with pytest.raises(ValueError, match="at least 1"):
        smart_resize(0, 10, 32, 1024, 1 << 24)
    with pytest.raises(ValueError, match="mode is 'L'"):
        preprocess(Image.new("L", (32, 32)), ProcessorConfig())
    with pytest.raises(ConfigError, match="image_std"):
        ProcessorConfig.from_file_dict({**QWEN3_5_PREPROCESSOR, "image_std": [0.5, 0, 0.5]})
    with pytest.raises(ConfigError, match="patch_size"):
        ProcessorConfig.from_file_dict({**QWEN3_5_PREPROCESSOR, "patch_size": "16"})
    with pytest.raises(ConfigError, match="shortest_edge .* above"):
        ProcessorConfig.from_file_dict({**QWEN3_5_PREPROCESSOR, "size": {"shortest_edge": 10**6, "longest_edge": 10}})
