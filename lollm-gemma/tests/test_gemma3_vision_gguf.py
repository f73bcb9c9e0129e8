"""Gemma 3's vision tower from llama.cpp's mmproj GGUF (``convert_hf_to_gguf.py --mmproj``), read by lollm's reader.

The tiny checkpoint of test_gemma3_vision.py, its tower renamed to the published spelling
(``vision_tower.vision_model.*``, the only one the converter maps) and a preprocessor_config.json
saying 16 tokens per image, converted by llama.cpp's own converter (never a writer of ours).
The tower from the mmproj file must hold the safetensors tower's tensors (the converter's +1 on
the projector's norm undone; its float16 projection rounded), and give the same logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _gemma_testing import assert_close_logits
from lollm.errors import LollmError
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, place_images

from test_gemma3_vision import IMAGES, TOKENS, prompt, tiny_gemma3_vision
from test_gemma3_vision_cli import with_image_tokens


def published_spelling(folder: Path) -> None:
    """``vision_tower.*`` (transformers 5's save_pretrained) -> ``vision_tower.vision_model.*`` (the hub files)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.testing.converter import convert

    folder = write_tiny_checkpoint(tiny_gemma3_vision(), tmp_path_factory.mktemp("gemma3-mmproj"),
                                   init_std=SENSITIVE_INIT_STD)
    with_image_tokens(folder)
    published_spelling(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({  # gemma-3-4b-it's, at the tiny sizes
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor", "image_seq_length": TOKENS,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": 64, "width": 64}, "do_normalize": True, "do_rescale": True, "do_resize": True}))
    mmproj = convert(folder, folder.parent / "mmproj.gguf", "f32", ("--mmproj",))
    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return loaded, mmproj


def mmproj_tower(loaded, mmproj: Path):
    """What open_vision does for a GGUF model given --mmproj, on the safetensors model's tokenizer."""
    from lollm.load.loader import load_gguf

    checkpoint = dataclasses.replace(load_gguf(mmproj), _tokenizer=loaded.tokenizer)
    return loaded.family.family.resolve("vision")(checkpoint, loaded.options)


def test_the_mmproj_tower_holds_the_safetensors_tensors(converted):
    loaded, mmproj = converted
    ours, theirs = open_vision(loaded), mmproj_tower(loaded, mmproj)
    eps = theirs.config.layer_norm_eps  # GGUF keeps it as a float32: 1e-6 comes back as 9.99999997e-07
    assert dataclasses.replace(theirs.config, layer_norm_eps=ours.config.layer_norm_eps) == ours.config
    assert eps == float(torch.tensor(ours.config.layer_norm_eps, dtype=torch.float32))
    for (name, a), (other, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert name == other
        if name.endswith("mm_input_projection_weight"):  # the converter forces float16 for it
            assert torch.equal(b, a.half().float()), name
        elif name.endswith("mm_soft_emb_norm.weight"):  # stored w + 1 (float32), undone by - 1 at load
            assert torch.equal(b, (a + 1.0) - 1.0), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_the_mmproj_tower_equal_the_safetensors_ones(converted, n_images):
    loaded, mmproj = converted
    model, ids = loaded.model, prompt(n_images)
    logits = []
    for tower in (open_vision(loaded), mmproj_tower(loaded, mmproj)):
        batch = place_images(ids, tower.spec, encode_images(tower, IMAGES[n_images]), max_context=model.max_context)
        with torch.inference_mode():
            logits.append(model(torch.tensor([ids]), images=batch)[0])
    assert_close_logits(logits[1], logits[0], ids)


def test_mmproj_with_a_safetensors_model_is_refused(converted):
    loaded, mmproj = converted
    with pytest.raises(LollmError, match="an mmproj file goes with a GGUF model"):
        open_vision(loaded, str(mmproj))
