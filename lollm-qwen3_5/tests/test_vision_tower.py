"""Qwen3.5's vision tower equals transformers', from safetensors and from llama.cpp's mmproj GGUF.

Tiny random ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``
checkpoints (qwen3_5_tiny: 1 block, D = 32, 2 heads, a 4 x 4 learned position table) written
by transformers, plus the Qwen3.5 preprocessor_config.json (llama.cpp's converter reads its
mean/std). Images drawn by the tests at sizes whose grids differ from the position table (so
the bilinear resize is exercised) go through our preprocessing; the tower's features for 1 and
2 images must equal ``get_image_features`` (cosine >= 0.9999 per token row, same shapes).

mmproj: ``convert_hf_to_gguf.py --mmproj`` (the pinned llama.cpp sdist, via
lollm.testing.converter.convert) writes the tower; lollm's GGUF reader reads it; the tower
built from its metadata and tensors gives the features of the safetensors tower.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

import qwen3_5_tiny as tiny
from lollm.errors import ConfigError, WeightsError
from lollm_qwen3_5.vision import (
    VisionConfig, VisionTower, load_tower, merge_block_order, state_from_checkpoint, state_from_mmproj,
)
from lollm_qwen3_5.vision_preprocess import ProcessorConfig, preprocess_images
from test_vision_preprocess import SMALL_BUDGET, drawing

MIN_COSINE = 0.9999
FAMILIES = ["qwen3_5", "qwen3_5_moe"]
#: (width, height) of the images of each case: held-out sizes, none a multiple of 32 px
ONE_IMAGE = [(90, 40)]
TWO_IMAGES = [(40, 130), (100, 60)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint):
    """``checkpoint(family)`` -> folder: the tiny multimodal checkpoint plus Qwen3.5's preprocessor_config.json."""
    made = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(f"vision-{family}")
            shutil.copytree(tiny_checkpoint(family, "multimodal"), folder, dirs_exist_ok=True)
            (folder / "preprocessor_config.json").write_text(json.dumps(SMALL_BUDGET), encoding="utf-8")
            liven_vision_weights(folder)
            made[family] = folder
        return made[family]

    return get


def liven_vision_weights(folder, seed: int = 0) -> None:
    """Redraw the tower's weights so that positions matter: std 1 position table, sharp attention.

    With transformers' init (std 0.02) every attention is near uniform and the position table
    a whisper beside the patch embedding, so a transposed patch order, a dropped position
    table or swapped RoPE axes all pass a cosine of 0.9999 (measured). Here a matrix gets
    std gain / sqrt(fan_in) (gain 4 for qkv), biases and norms std 0.1 around their init.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if not name.startswith("model.visual."):
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("pos_embed.weight"):
            tensors[name] = noise
        elif t.ndim >= 2:
            gain = 4.0 if ".qkv." in name else 1.0
            tensors[name] = noise * gain / t[0].numel() ** 0.5
        else:
            tensors[name] = t + 0.1 * noise
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def tower_from_safetensors(folder) -> VisionTower:
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        state = state_from_checkpoint(f.get_tensor, list(f.keys()))
    return load_tower(VisionTower(VisionConfig.from_config(raw)), state, str(folder))


def tower_from_mmproj(path) -> VisionTower:
    from lollm.gguf.reader import GGUFTensorSource

    source = GGUFTensorSource(path)
    names = source.names()
    config = VisionConfig.from_mmproj(source.metadata, {n: source.shape(n) for n in names}, str(path))
    return load_tower(VisionTower(config), state_from_mmproj(source.read, names, str(path)), str(path))


def inputs(sizes):
    images = [drawing(w, h, seed=10 + i) for i, (w, h) in enumerate(sizes)]
    return preprocess_images(images, ProcessorConfig.from_file_dict(SMALL_BUDGET))


def assert_close(ours: list[torch.Tensor], theirs, what: str) -> None:
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, f"{what}: image {k} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
        assert cos.min() >= MIN_COSINE, f"{what}: image {k} min cosine {cos.min():.6f}"


@pytest.mark.parametrize("sizes", [ONE_IMAGE, TWO_IMAGES], ids=["1-image", "2-images"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tower_equals_transformers_image_features(family, sizes, checkpoint):
    folder = checkpoint(family)
    reference = tiny.reference_class(family, "multimodal").from_pretrained(str(folder), dtype=torch.float32).eval()
    pixel_values, grids = inputs(sizes)
    with torch.no_grad():
        theirs = reference.model.get_image_features(pixel_values, torch.tensor(grids)).pooler_output
        ours = tower_from_safetensors(folder)(pixel_values, grids)
    assert [g[1] * g[2] // 4 for g in grids] == [o.shape[0] for o in ours]
    assert ours[0].shape[1] == reference.config.text_config.hidden_size
    assert_close(ours, theirs, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_mmproj_from_llama_cpp_gives_the_safetensors_features(family, checkpoint, tmp_path):
    from lollm.testing.converter import convert

    folder = checkpoint(family)
    mmproj = convert(folder, tmp_path / "mmproj-f32.gguf", "f32", ("--mmproj",))
    pixel_values, grids = inputs(TWO_IMAGES)
    with torch.no_grad():
        want = tower_from_safetensors(folder)(pixel_values, grids)
        got = tower_from_mmproj(mmproj)(pixel_values, grids)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert tower_from_mmproj(mmproj).config == VisionConfig.from_config(raw)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5), f"max |diff| {(a - b).abs().max():.3g}"


def test_merge_block_order():
    """The order of the module docstring: 2x2 blocks of a 4x4 grid, row by row."""
    assert merge_block_order(4, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]


def test_config_errors_name_the_key(checkpoint):
    raw = json.loads((checkpoint("qwen3_5") / "config.json").read_text(encoding="utf-8"))
    text_only = {k: v for k, v in raw.items() if k != "vision_config"}
    with pytest.raises(ConfigError, match="no vision_config"):
        VisionConfig.from_config(text_only)
    for key, value, message in [("depth", None, "depth"), ("hidden_act", "relu", "hidden_act"),
                                ("deepstack_visual_indexes", [3], "deepstack"), ("num_heads", 3, "num_heads"),
                                ("num_position_embeddings", 15, "not a square")]:
        bad = json.loads(json.dumps(raw))
        if value is None:
            del bad["vision_config"][key]
        else:
            bad["vision_config"][key] = value
        with pytest.raises(ConfigError, match=message):
            VisionConfig.from_config(bad)


def test_weight_errors_name_the_tensor(checkpoint):
    folder = checkpoint("qwen3_5")
    tower = VisionTower(VisionConfig.from_config(json.loads((folder / "config.json").read_text(encoding="utf-8"))))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        state = state_from_checkpoint(f.get_tensor, list(f.keys()))
    with pytest.raises(WeightsError, match="missing .*merger.norm.bias"):
        load_tower(tower, {k: v for k, v in state.items() if k != "merger.norm.bias"}, "x")
    with pytest.raises(WeightsError, match="'pos_embed' has shape"):
        load_tower(tower, {**state, "pos_embed": state["pos_embed"][:9]}, "x")
    with pytest.raises(WeightsError, match="'v.blk.0.attn_q.weight' is not one of"):
        state_from_mmproj(lambda n: torch.zeros(1), ["v.blk.0.attn_q.weight"], "f.gguf")
    with pytest.raises(ValueError, match="gives 16 patches but pixel_values has 15"):
        tower(torch.zeros(15, tower.config.patch_dim), [(1, 4, 4)])


@pytest.mark.parametrize("family", FAMILIES)
def test_our_embeddings_and_positions_give_transformers_logits(family, checkpoint):
    """Our tower's features scattered at the image tokens + our M-RoPE positions, fed to transformers'
    decoder (inputs_embeds, position_ids), give the logits of transformers' own multimodal forward
    (pixel_values, image_grid_thw) at every position: the pieces compose as the decoder needs them."""
    from lollm_qwen3_5.qwen3_5.mrope import mrope_positions
    from test_vision_mrope import prompt

    folder = checkpoint(family)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    reference = tiny.reference_class(family, "multimodal").from_pretrained(str(folder), dtype=torch.float32).eval()
    pixel_values, grids = inputs(TWO_IMAGES)
    ids, types = prompt(raw, grids)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        want = reference(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=torch.tensor(grids),
                         mm_token_type_ids=torch.tensor([types])).logits[0]
        embeds = reference.get_input_embeddings()(input_ids)  # (1, T, C)
        image_rows = input_ids[0] == raw["image_token_id"]
        embeds[0, image_rows] = torch.cat(tower_from_safetensors(folder)(pixel_values, grids))
        positions, _ = mrope_positions(ids, raw["image_token_id"], grids, merge_size=2)
        got = reference(inputs_embeds=embeds, position_ids=positions[:, None, :]).logits[0]
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() >= MIN_COSINE, f"min cosine {cos.min():.6f}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
