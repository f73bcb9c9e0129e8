"""M-RoPE for prompts with images: positions and rotary angles equal transformers'.

References: ``Qwen3_5Model.get_rope_index`` (the (3, T) positions and the offset of the
positions after the prompt) and ``Qwen3_5TextRotaryEmbedding`` (cos/sin for (3, T)
positions with the interleaved mrope_section), on the tiny config (rotary dim 8) and on the
real Qwen3.5-0.8B and 35B-A3B text configs (rotary dim 64, every section in use).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

import qwen3_5_tiny as tiny
from lollm_qwen3_5.qwen3_5.blocks import rope_inverse_frequencies
from lollm_qwen3_5.qwen3_5.mrope import (
    mrope_axis_of_frequency, mrope_cos_sin, mrope_positions, mrope_positions_window,
)

#: patch grids (t, h, w): square, wide, tall, and one merged token
GRIDS = [(1, 4, 4), (1, 4, 10), (1, 12, 2), (1, 2, 2)]


def prompt(raw: dict, grids) -> tuple[list[int], list[int]]:
    """Text, then for each image <vision_start> image_token * n <vision_end> and more text.

    Returns (input_ids, mm_token_type_ids) as transformers' processor makes them (1 for image tokens).
    """
    ids = [1, 2, 3]
    for k, (t, h, w) in enumerate(grids):
        ids += [raw["vision_start_token_id"]] + [raw["image_token_id"]] * (t * h * w // 4) + [raw["vision_end_token_id"]]
        ids += list(range(10, 10 + k + 2))
    return ids, [int(i == raw["image_token_id"]) for i in ids]


@pytest.fixture(scope="module")
def reference_model():
    raw = tiny.tiny_config("qwen3_5", "multimodal")
    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    with torch.device("meta"):  # get_rope_index reads only the config: no weights needed
        model = transformers.Qwen3_5Model(config)
    return raw, model


@pytest.mark.parametrize("grids", [GRIDS[:1], GRIDS[1:3], GRIDS], ids=["1-image", "2-images", "4-images"])
def test_positions_equal_get_rope_index(reference_model, grids):
    raw, model = reference_model
    ids, types = prompt(raw, grids)
    want, want_delta = model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]), image_grid_thw=torch.tensor(grids))
    got, delta = mrope_positions(ids, raw["image_token_id"], grids, merge_size=2)
    assert got.shape == (3, len(ids))
    assert torch.equal(got, want[:, 0]), "positions differ"
    assert delta == int(want_delta)


@pytest.mark.parametrize("hub", [None, "Qwen__Qwen3.5-0.8B", "Qwen__Qwen3.5-35B-A3B"])
def test_angles_equal_transformers_rotary(reference_model, hub):
    raw, _ = reference_model
    family = "qwen3_5_moe" if hub and "A3B" in hub else "qwen3_5"
    text = tiny.tiny_config(family, "multimodal")["text_config"] if hub is None else tiny.hub_config(family, hub)["text_config"]
    config = transformers.CONFIG_MAPPING[text["model_type"]].from_dict(text)
    rope = text["rope_parameters"]
    assert rope["mrope_interleaved"] is True  # the rule mrope_axis_of_frequency implements
    positions, _ = mrope_positions(*prompt(raw, GRIDS)[:1], raw["image_token_id"], GRIDS, merge_size=2)
    x = torch.zeros(1, dtype=torch.float32)
    want_cos, want_sin = Qwen3_5TextRotaryEmbedding(config)(x, positions[:, None, :])
    rotary_dim = int(text["head_dim"] * rope["partial_rotary_factor"])
    inv_freq = rope_inverse_frequencies(rope["rope_theta"], rotary_dim)
    cos, sin = mrope_cos_sin(positions, inv_freq, rope["mrope_section"])
    assert cos.shape == (positions.shape[1], rotary_dim)
    assert torch.allclose(cos, want_cos[0], atol=1e-6) and torch.allclose(sin, want_sin[0], atol=1e-6)


def test_text_only_positions_reduce_to_1d_rope():
    ids = list(range(20))
    positions, delta = mrope_positions(ids, image_token_id=999, grids=[], merge_size=2)
    assert delta == 0 and torch.equal(positions, torch.arange(20).expand(3, -1))
    inv_freq = rope_inverse_frequencies(1e7, 64)
    cos, sin = mrope_cos_sin(positions, inv_freq, [11, 11, 10])
    angles = torch.arange(20).float()[:, None] * inv_freq
    assert torch.allclose(cos, torch.cat([angles, angles], -1).cos()) and torch.allclose(sin, torch.cat([angles, angles], -1).sin())


def test_interleaved_sections_of_qwen3_5():
    """[11, 11, 10] over 32 frequencies: T H W T H W ... (11 H, 10 W, the rest T)."""
    axis = mrope_axis_of_frequency(32, [11, 11, 10])
    assert axis[:6].tolist() == [0, 1, 2, 0, 1, 2]
    assert (axis == 1).sum() == 11 and (axis == 2).sum() == 10 and (axis == 0).sum() == 11


def test_placeholders_that_disagree_with_the_grids_are_refused():
    img = 7
    with pytest.raises(ValueError, match="needs 4 image tokens"):
        mrope_positions([1, img, img, img, 2], img, [(1, 4, 4)], merge_size=2)
    with pytest.raises(ValueError, match="2 image grids given but the prompt holds 1"):
        mrope_positions([1, img, 2], img, [(1, 2, 2), (1, 2, 2)], merge_size=2)
    with pytest.raises(ValueError, match="beyond the 1 image grid"):
        mrope_positions([img, 1, img], img, [(1, 2, 2)], merge_size=2)


@pytest.mark.parametrize("window", [(0, None), (0, 5), (3, 30), (20, 7), (41, 1), (60, 40)])
def test_window_positions_from_spans_equal_the_whole_prompts(reference_model, window):
    """A chunk (or one decode step) gets the positions of the whole prompt's computation, from spans only."""
    raw, _ = reference_model
    ids, _ = prompt(raw, GRIDS)
    whole, delta = mrope_positions(ids, raw["image_token_id"], GRIDS, merge_size=2)
    starts = [i for i, x in enumerate(ids) if x == raw["image_token_id"] and ids[i - 1] != x]
    images = [(s, (t, h // 2, w // 2)) for s, (t, h, w) in zip(starts, GRIDS)]
    start, T = window
    T = len(ids) - start if T is None else T
    got, got_delta = mrope_positions_window(images, start, T)
    assert got_delta == delta
    want = torch.cat([whole, torch.arange(len(ids), max(len(ids), start + T)).expand(3, -1) + delta], dim=1)[:, start:start + T]
    assert torch.equal(got, want)
