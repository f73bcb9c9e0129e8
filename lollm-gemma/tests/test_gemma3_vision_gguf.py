"""Gemma 3 images from GGUF: llama.cpp's text GGUF and mmproj file (``convert_hf_to_gguf.py``), read by lollm's reader.

The tiny checkpoint a learner makes (:func:`lollm.testing.tiny_vision.write_tiny_vision_checkpoint`: the
kit's gemma3 config, a SentencePiece tokenizer with the image tokens at the config's ids, the tower under
the published names ``vision_tower.vision_model.*``, a preprocessor_config.json saying 16 tokens per
image), converted by llama.cpp's own converter (never a writer of ours), text GGUF and ``--mmproj``.
The tower from the mmproj file must hold the safetensors tower's tensors (the converter's +1 on
the projector's norm undone; its float16 projection rounded), and give the same logits; the text
GGUF with it gives the safetensors checkpoint's logits and ``lollm run`` tokens.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from _gemma_testing import assert_close_logits, lollm_run
from lollm.errors import LollmError
from lollm.load.options import LoadOptions
from lollm.testing.tiny_vision import drawing, write_tiny_vision_checkpoint
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, place_images

from test_gemma3_vision import IMAGE, IMAGES, prompt

CPU = LoadOptions(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the safetensors folder, its text GGUF, its mmproj GGUF); the two conversions run side by side."""
    from lollm.testing.converter import convert

    folder = write_tiny_vision_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3-vision"))
    out = tmp_path_factory.mktemp("gemma3-vision-gguf")
    jobs = [(out / "model-f32.gguf", ()), (out / "mmproj-f32.gguf", ("--mmproj",))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each conversion is a child process
        list(pool.map(lambda job: convert(folder, job[0], "f32", job[1]), jobs))
    return folder, jobs[0][0], jobs[1][0]


@pytest.fixture(scope="module")
def converted(files):
    from lollm.load.pipeline import open_model

    folder, _, mmproj = files
    return open_model(str(folder), CPU), mmproj


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


def test_text_gguf_plus_mmproj_give_the_safetensors_logits(files, converted):
    """The whole GGUF path (text GGUF decoder and tokenizer, mmproj tower) on a prompt with 2 images, as ``lollm run``
    makes it: the safetensors checkpoint's ids and logits at every position."""
    from lollm.load.pipeline import open_model
    from lollm.vision.load import prepare_prompt

    _, gguf, mmproj = files
    source = converted[0]
    gguf_model = open_model(str(gguf), CPU)
    got = []
    for loaded, tower in ((source, open_vision(source)), (gguf_model, open_vision(gguf_model, str(mmproj)))):
        text = f"one {tower.spec.placeholder} and two {tower.spec.placeholder} the end"
        ready = prepare_prompt(text, IMAGES[2], tower, loaded.tokenizer, model="tiny",
                               max_context=loaded.model.max_context, add_special_tokens=True)
        with torch.inference_mode():
            got.append((ready.ids, loaded.model(torch.tensor([ready.ids]), images=ready.images)[0]))
    (ids, want), (gguf_ids, logits) = got
    assert gguf_ids == ids and ids.count(IMAGE) == 2 * 16
    assert_close_logits(logits, want, ids)


def test_lollm_run_with_mmproj_gives_the_safetensors_greedy_tokens(files, tmp_path):
    folder, gguf, mmproj = files
    picture = tmp_path / "picture.png"
    drawing(90, 140, 11).save(picture)
    want = lollm_run(str(folder), picture)
    got = lollm_run(str(gguf), picture, "--mmproj", str(mmproj))
    assert got["prompt_ids"] == want["prompt_ids"] and want["prompt_ids"].count(IMAGE) == 16
    assert (got["ids"], got["text"]) == (want["ids"], want["text"])
