"""The seam the image parity gate stands on: :mod:`lollm.vision.reference` (which inputs transformers' reference
reads for our pixels). The whole gate runs in each vision family's tests (test_*vision_entry*.py,
test_gemma3_vision_engine_entry_points.py), where a checkpoint with a tower exists."""

from __future__ import annotations

import pytest
import torch

from lollm.vision.reference import reference_inputs, token_type_inputs


class FixedTower:
    """A fixed-size tower: no reference_inputs of its own."""


class OwnLayout:
    def reference_inputs(self, pixels):
        return {"pixel_values": torch.cat([p.flatten(1) for p in pixels]), "image_grid_thw": torch.tensor([[1, 2, 2]])}


def test_the_default_stacks_the_pixels_of_a_fixed_size_tower():
    pixels = [torch.rand(3, 8, 8), torch.rand(3, 8, 8)]
    got = reference_inputs(FixedTower(), pixels)
    assert list(got) == ["pixel_values"] and torch.equal(got["pixel_values"], torch.stack(pixels))


def test_a_tower_with_its_own_layout_gives_it():
    pixels = [torch.rand(3, 4, 6)]
    got = reference_inputs(OwnLayout(), pixels)
    assert set(got) == {"pixel_values", "image_grid_thw"} and got["pixel_values"].shape == (3, 24)


def test_pixels_of_different_shapes_without_a_layout_are_refused_by_name():
    with pytest.raises(ValueError, match="dynamic resolution must give reference_inputs"):
        reference_inputs(FixedTower(), [torch.rand(3, 8, 8), torch.rand(3, 8, 16)])
    with pytest.raises(ValueError, match="no image"):
        reference_inputs(FixedTower(), [])


def test_token_types_only_under_the_names_the_forward_takes():
    ids = torch.tensor([[5, 9, 9, 6]])

    def gemma3_like(input_ids=None, pixel_values=None, token_type_ids=None, **kwargs):
        return None

    def qwen_like(input_ids=None, pixel_values=None, image_grid_thw=None, mm_token_type_ids=None, **kwargs):
        return None

    def neither(input_ids=None, pixel_values=None):
        return None

    assert list(token_type_inputs(gemma3_like, ids, 9)) == ["token_type_ids"]
    marks = token_type_inputs(qwen_like, ids, 9)
    assert list(marks) == ["mm_token_type_ids"] and marks["mm_token_type_ids"].tolist() == [[0, 1, 1, 0]]
    assert token_type_inputs(neither, ids, 9) == {}
