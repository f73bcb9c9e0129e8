"""The gemma4 vision tower (lollm_gemma/gemma4_vision*.py) against transformers, and from llama.cpp's mmproj.

* Preprocessing: our patches and positions equal transformers' ``Gemma4ImageProcessorPil``
  (the slow class: no torchvision here) exactly, on images drawn here at several sizes and
  aspect ratios (upscaled, downscaled, very thin, already at the target size).
* The tower plus projector: a tiny random ``Gemma4ForConditionalGeneration`` written by
  transformers from E2B's hub config (2 vision layers, weights of std 0.3, finite clip bounds
  on every clipped linear so the clamps act), and a variant with the larger models'
  ``standardize``. Our soft tokens for 1 and 2 images (two sizes in one padded batch on
  transformers' side) equal ``get_image_features``: same shape, cosine >= 0.9999 per token.
  Three mutants of our tower (x and y swapped, no position table, clamps off) fail that bound,
  so the bound can fail.
* The decoder's logits on a prompt with two images, the soft tokens put in by a local hook
  on the embedding (the tower's soft tokens alone, apart from the decoder's own ``images=``
  path, which test_gemma4_vision_decoder.py proves), equal transformers' at every position.
* llama.cpp's converter (``--mmproj``) writes the tower's GGUF (of the standardized variant:
  every kind of tensor); lollm's GGUF reader reads it and gives the same soft tokens as the
  safetensors, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _gemma_testing import assert_close_logits, tiny_gemma4_multimodal

from PIL import Image, ImageDraw

from lollm_gemma.gemma4_vision import VisionConfig
from lollm_gemma.gemma4_vision_preprocess import ProcessorConfig, preprocess, target_size
from lollm_gemma.gemma4_vision_weights import from_mmproj, from_safetensors

COSINE_MIN = 0.9999
#: Soft-token budget of the tests' processor: 70 (630 patches at most) keeps the tiny tower fast.
SOFT_TOKENS = 70
#: (width, height) of the drawn images: the two of the parity tests, then thin and odd ones.
SIZES = [(200, 120), (333, 517), (640, 90), (47, 700), (480, 336), (1000, 1000), (96, 96)]


def drawing(width: int, height: int, seed: int) -> Image.Image:
    """An RGB image: noise (so every pixel matters), a red ellipse and a blue bar (so shapes do)."""
    g = np.random.default_rng(seed)
    image = Image.fromarray(g.integers(0, 256, (height, width, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 5, width * 3 // 4, height * 2 // 3), fill=(250, 30, 20))
    draw.rectangle((0, height // 2, width // 3, height // 2 + max(2, height // 10)), fill=(10, 40, 230))
    return image


def reference_processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=SOFT_TOKENS)


def tiny_config(standardize: bool) -> dict:
    """E2B's hub config, tiny: 2 vision layers, no audio tower (not read here)."""
    cfg = tiny_gemma4_multimodal()
    cfg["vision_config"] = {**cfg["vision_config"], "num_hidden_layers": 2, "standardize": standardize}
    cfg["audio_config"] = None
    return cfg


def write_checkpoint(folder: Path, standardize: bool) -> Path:
    """The tiny checkpoint, then finite clip bounds (and, with standardize, a random std_bias/std_scale)."""
    from safetensors.torch import load_file, save_file

    from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint

    write_tiny_checkpoint(tiny_config(standardize), folder, init_std=SENSITIVE_INIT_STD)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(3)
    for name in tensors:
        if name.endswith(("input_min", "input_max")):
            tensors[name] = torch.tensor(1.5 if name.endswith("max") else -1.5)
        elif name.endswith(("output_min", "output_max")):
            tensors[name] = torch.tensor(3.0 if name.endswith("max") else -3.0)
        elif name.endswith("std_bias"):
            tensors[name] = torch.randn(tensors[name].shape, generator=g)
        elif name.endswith("std_scale"):
            tensors[name] = 0.5 + torch.rand(tensors[name].shape, generator=g)
    save_file(tensors, str(path), metadata={"format": "pt"})
    reference_processor().save_pretrained(folder)  # preprocessor_config.json: the converter reads it
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> folder: "e2b" (clipped linears) and "standardized" (the larger models' std_bias/std_scale)."""
    return {v: write_checkpoint(tmp_path_factory.mktemp(f"gemma4-vision-{v}"), v == "standardized")
            for v in ("e2b", "standardized")}


@torch.inference_mode()
def reference_features(folder: Path, images: list[Image.Image]) -> list[torch.Tensor]:
    """transformers' soft tokens of each image (one padded batch): a list of (n_i, C_text)."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    batch = reference_processor()(images=images, return_tensors="pt")
    out = model.model.get_image_features(batch["pixel_values"], batch["image_position_ids"])
    return list(out.pooler_output)


def worst_cosine(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, f"shapes differ: ours {tuple(ours.shape)}, transformers {tuple(ref.shape)}"
    return float(torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1).min())


# ---------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_preprocess_equals_transformers(size):
    width, height = size
    image = drawing(width, height, seed=width * 7 + height)
    ref = reference_processor()(images=[image], return_tensors="pt")
    patches, positions = preprocess(image, ProcessorConfig(max_soft_tokens=SOFT_TOKENS))
    n = patches.shape[0]
    assert n // 9 == int(ref["num_soft_tokens_per_image"][0]) <= SOFT_TOKENS
    assert torch.equal(patches, ref["pixel_values"][0, :n]), "patches differ"
    assert torch.equal(positions, ref["image_position_ids"][0, :n].long()), "positions differ"
    assert bool((ref["image_position_ids"][0, n:] == -1).all()), "transformers has more real patches than we do"


def test_preprocess_e2b_budget():
    """The E2B budget (280 soft tokens): a square photo becomes 768x768 pixels, 256 soft tokens."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    cfg = ProcessorConfig()
    assert target_size(1024, 1024, cfg) == (768, 768)
    for h, w in [(1024, 1024), (480, 640), (300, 4000), (4000, 300), (17, 33)]:
        assert target_size(h, w, cfg) == get_aspect_ratio_preserving_size(h, w, 16, 2520, 3), (h, w)


def test_preprocess_refusals():
    with pytest.raises(ValueError, match="0x0"):
        target_size(0, 0, ProcessorConfig())
    with pytest.raises(ValueError, match="max_soft_tokens"):
        ProcessorConfig(max_soft_tokens=100)


# ---------------------------------------------------------------------------
# The tower
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["e2b", "standardized"])
def test_tower_equals_transformers(checkpoints, variant):
    folder = checkpoints[variant]
    images = [drawing(200, 120, 1), drawing(333, 517, 2)]
    cfg = ProcessorConfig(max_soft_tokens=SOFT_TOKENS)
    ours = from_safetensors(folder)
    for count in (1, 2):
        refs = reference_features(folder, images[:count])
        for image, ref in zip(images[:count], refs):
            with torch.inference_mode():
                got = ours(*preprocess(image, cfg))  # (n, C_text)
            assert got.shape == (ours.soft_token_count(preprocess(image, cfg)[0].shape[0]), 64)
            cos = worst_cosine(got, ref)
            assert cos >= COSINE_MIN, f"{count} image(s): cosine {cos:.6f}"


def _swap_xy(model, patches, positions):
    return model(patches, positions.flip(-1).contiguous())


def _no_position_table(model, patches, positions):
    with torch.no_grad():
        model.vision_tower.patch_embedder.position_embedding_table.zero_()
    return model(patches, positions)


def _no_clamps(model, patches, positions):
    for module in model.modules():
        if hasattr(module, "clipped"):
            module.clipped = False
    return model(patches, positions)


@pytest.mark.parametrize("mutant", [_swap_xy, _no_position_table, _no_clamps], ids=lambda f: f.__name__[1:])
def test_tower_mutants_fail_the_bound(checkpoints, mutant):
    """Each mistake moves the soft tokens past the parity bound, so the bound can catch it."""
    folder = checkpoints["e2b"]
    image = drawing(333, 517, 2)  # not square: x and y differ
    ref = reference_features(folder, [image])[0]
    with torch.inference_mode():
        got = mutant(from_safetensors(folder), *preprocess(image, ProcessorConfig(max_soft_tokens=SOFT_TOKENS)))
    assert worst_cosine(got, ref) < COSINE_MIN


def test_config_errors_name_the_key(checkpoints):
    cfg = json.loads((checkpoints["e2b"] / "config.json").read_text(encoding="utf-8"))
    del cfg["vision_config"]["pooling_kernel_size"]
    with pytest.raises(ValueError, match=r"vision_config\.'?pooling_kernel_size"):
        VisionConfig.from_dict(cfg)
    with pytest.raises(ValueError, match="no 'vision_config'"):
        VisionConfig.from_dict({"text_config": cfg["text_config"]})
    good = VisionConfig.from_dict(json.loads((checkpoints["e2b"] / "config.json").read_text(encoding="utf-8")))
    with pytest.raises(ValueError, match=r"patches must be \(N, 768\)"):
        from_safetensors(checkpoints["e2b"])(torch.zeros(9, 10), torch.zeros(9, 2, dtype=torch.long))
    wide = torch.stack([torch.arange(66 * 3) % 66, torch.arange(66 * 3) // 66], dim=-1)  # a 66x3 grid: x up to 65
    with pytest.raises(ValueError, match=r"0\.\.63 .*position_embedding_size"):
        from_safetensors(checkpoints["e2b"])(torch.zeros(66 * 3, 768), wide)
    assert (good.soft_tokens_per_image, good.image_token_id) == (280, 510)


# ---------------------------------------------------------------------------
# The decoder's logits with the soft tokens in place
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_prompt_run(checkpoints):
    """A prompt with two images: (ids, our soft tokens per image, transformers' logits (T, V))."""
    from transformers import Gemma4ForConditionalGeneration

    folder = checkpoints["e2b"]
    images = [drawing(200, 120, 1), drawing(333, 517, 2)]
    vision = from_safetensors(folder)
    with torch.inference_mode():
        soft = [vision(*preprocess(image, ProcessorConfig(max_soft_tokens=SOFT_TOKENS))) for image in images]
    text = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = [2] + text[:8]  # <bos> text, then per image <boi> <image>×n <eoi> and more text
    for i, s in enumerate(soft):
        ids += vision.placeholder_ids(s.shape[0]) + text[8 + 6 * i: 14 + 6 * i]
    with torch.inference_mode():
        model = Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
        batch = reference_processor()(images=images, return_tensors="pt")
        ref = model(input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"],
                    image_position_ids=batch["image_position_ids"], use_cache=False).logits[0]
    return ids, soft, ref


def logits_with_images(folder: Path, ids: list[int], soft: list[torch.Tensor], shift: int = 0) -> torch.Tensor:
    """Our decoder's logits (T, V), each image's soft tokens put in place of its image tokens.

    The decoder takes token ids only, so a forward hook on its embedding table writes the soft
    tokens over the image slots' rows (divided by sqrt(C): the forward multiplies by it next),
    and the ids it sees have <pad> in those slots, as transformers' per-layer table reads them.
    ``shift`` moves the soft tokens that many slots later (a mutant: the merge one token off).
    """
    from _gemma_testing import load_ours

    ours = load_ours(folder)
    image_token = VisionConfig.from_dict(json.loads((folder / "config.json").read_text(encoding="utf-8"))).image_token_id
    pad = json.loads((folder / "config.json").read_text(encoding="utf-8"))["text_config"]["pad_token_id"]
    slots = torch.tensor(ids) == image_token
    text_ids = torch.where(slots, pad, torch.tensor(ids))

    def put_images(module, args, out):  # out: (1, T, C)
        out = out.clone()
        out[0, slots.roll(shift)] = torch.cat(soft).to(out.dtype) / ours.embed_scale
        return out

    hook = ours.model.embed_tokens.register_forward_hook(put_images)
    try:
        with torch.inference_mode():
            return ours(text_ids[None])[0]
    finally:
        hook.remove()


def test_logits_with_images_equal_transformers(checkpoints, image_prompt_run):
    ids, soft, ref = image_prompt_run
    assert_close_logits(logits_with_images(checkpoints["e2b"], ids, soft), ref, ids)


def test_logits_with_the_merge_one_token_off_fail(checkpoints, image_prompt_run):
    ids, soft, ref = image_prompt_run
    with pytest.raises(AssertionError, match="argmax differs"):
        assert_close_logits(logits_with_images(checkpoints["e2b"], ids, soft, shift=1), ref, ids)


# ---------------------------------------------------------------------------
# llama.cpp's mmproj GGUF
# ---------------------------------------------------------------------------
def test_mmproj_equals_safetensors(checkpoints, tmp_path):
    """One conversion (14 s, most of it the converter's imports), of the variant that holds every
    kind of tensor: clip bounds and the standardize pair."""
    from lollm.gguf.reader import GGUFTensorSource
    from lollm.testing.converter import convert

    folder = checkpoints["standardized"]
    path = convert(folder, tmp_path / "mmproj.gguf", "f32", ("--mmproj",))
    source = GGUFTensorSource(path)
    assert source.metadata["clip.vision.projector_type"] == "gemma4v"
    assert {"v.std_bias", "v.std_scale", "v.blk.1.attn_q.input_min"} <= set(source.names())
    st = from_safetensors(folder)
    cfg = st.config
    mm = from_mmproj(path, image_token_id=cfg.image_token_id, boi_token_id=cfg.boi_token_id,
                     eoi_token_id=cfg.eoi_token_id)
    assert mm.config.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(mm.config, rms_norm_eps=cfg.rms_norm_eps) == cfg
    for image in (drawing(200, 120, 1), drawing(333, 517, 2)):
        patches, positions = preprocess(image, ProcessorConfig(max_soft_tokens=SOFT_TOKENS))
        with torch.inference_mode():
            assert torch.equal(mm(patches, positions), st(patches, positions))


def test_mmproj_of_another_projector_is_refused(tmp_path):
    import gguf

    from lollm_gemma.gemma4_vision_weights import mmproj_config
    from lollm.gguf.reader import GGUFTensorSource

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.vision.projector_type", "gemma3")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 3, 2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma3', not 'gemma4v'"):
        mmproj_config(GGUFTensorSource(path), image_token_id=1, boi_token_id=2, eoi_token_id=3)
