"""Qwen3.5 reads images from GGUF: llama.cpp's text GGUF plus its mmproj file give transformers' logits.

The checkpoints and text GGUF files of test_gguf_qwen3_5 (converted once per run and shared with
it), plus the mmproj file the same converter writes with ``--mmproj``. The decoder from the text
GGUF takes its M-RoPE sections from ``rope.dimension_sections``; the tower comes from the mmproj
(:func:`lollm_qwen3_5.vision_family.tower_from_mmproj`; the image token's id from config.json, as
these tiny checkpoints number it beyond the Qwen2.5 tokenizer's own vision tokens). The logits of
a prompt with 2 images equal transformers' multimodal forward on the source checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch

from lollm.load.options import LoadOptions
from lollm.vision.prompt import encode_images, place_images
from lollm_qwen3_5.vision_family import tower_from_mmproj
from lollm_qwen3_5.vision_preprocess import ProcessorConfig
from test_gguf_qwen3_5 import FAMILIES, _ours, _once, gguf_file, references, shared, sources  # noqa: F401 (fixtures)
from test_vision_mrope import prompt
from test_vision_preprocess import SMALL_BUDGET, drawing, reference_processor

CPU = LoadOptions(device="cpu", dtype="float32")


@pytest.mark.parametrize("family", FAMILIES)
def test_text_gguf_plus_mmproj_give_transformers_logits_with_images(family, sources, shared, gguf_file, references):
    from lollm.testing.converter import convert

    folder = sources[family]

    def write_mmproj(out):
        """The converter reads mean/std from preprocessor_config.json: the source's files linked beside one."""
        beside = shared / f"{family}-src-with-preprocessor"
        beside.mkdir(exist_ok=True)
        for path in folder.iterdir():
            if not (beside / path.name).exists():
                (beside / path.name).symlink_to(path)
        (beside / "preprocessor_config.json").write_text(json.dumps(SMALL_BUDGET), encoding="utf-8")
        convert(beside, out, "f32", ("--mmproj",))

    mmproj = _once(shared / f"{family}-mmproj-f32.gguf", write_mmproj)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tower = tower_from_mmproj(mmproj, raw, CPU, ProcessorConfig.from_file_dict(SMALL_BUDGET))
    model = _ours(gguf_file(family, "f32"))
    assert model.config.mrope_section == tuple(raw["text_config"]["rope_parameters"]["mrope_section"])

    images = [drawing(w, h, seed=50 + i) for i, (w, h) in enumerate([(62, 85), (85, 62)])]
    processed = reference_processor(SMALL_BUDGET)(images, return_tensors="pt")
    ids, types = prompt(raw, processed["image_grid_thw"].tolist())
    batch = place_images(ids, tower.spec, encode_images(tower, images), max_context=model.max_context)
    with torch.inference_mode():
        want = references(family)(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                                  image_grid_thw=processed["image_grid_thw"],
                                  mm_token_type_ids=torch.tensor([types])).logits[0]
        got = model(torch.tensor([ids]), images=batch)[0]
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() >= 0.9999, f"min cosine {cos.min():.6f}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
