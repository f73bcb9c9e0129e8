"""Gemma 4 images from GGUF: llama.cpp's text GGUF plus its mmproj file give the safetensors checkpoint's logits.

A text GGUF holds no key for transformers' ``use_bidirectional_attention`` (how an image's tokens
attend in the sliding layers), so lollm takes llama.cpp's rule by text width for the published
checkpoints (lollm_gemma/gemma4/config_gguf.py, ``IMAGE_ATTENTION_BY_WIDTH``). Two tiny random
``Gemma4ForConditionalGeneration`` checkpoints written by transformers, at the two published
widths of each rule, everything else tiny:

* "e2b": text width 1536, ``use_bidirectional_attention`` null: images attend causally; this one is the
  checkpoint a learner makes (:func:`lollm.testing.tiny_vision.write_tiny_vision_checkpoint`, "gemma4");
* "26b": text width 2816, ``use_bidirectional_attention: "vision"``: bidirectional inside each
  image (a dense decoder here: the 26B's MoE block is not implemented, the rule is what is tested).

Each is converted by llama.cpp's own ``convert_hf_to_gguf.py`` (lollm.testing.converter; never a
writer of ours): a text GGUF, and ``--mmproj``. A SentencePiece tokenizer trained on the corpus
plus Gemma 4's multimodal tokens at the config's ids, so the converter's tokenizer places images
as the checkpoint's does. Then, on prompts with 1 and 2 images of held-out sizes:

* the GGUF decoder's config reads the same rule as config.json;
* the logits from text GGUF + mmproj equal the safetensors checkpoint's at every position, lollm's
  and transformers' (same argmax, cosine >= 0.9999), and flipping the table's rule breaks that bound;
* ``lollm run MODEL.gguf --mmproj mmproj.gguf --image A`` gives the safetensors run's greedy tokens;
* an mmproj whose width is outside the table is refused naming the width, the table and the way out.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from _gemma_testing import assert_close_logits, lollm_run
from lollm.errors import ConfigError
from lollm.load.options import LoadOptions
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.testing.tiny_vision import GEMMA4_GGUF_WIDTH, write_tiny_vision_checkpoint
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, place_images

from test_converter_gguf_gemma import CORPUS
from test_gemma4_vision import SOFT_TOKENS, drawing, reference_processor, tiny_config
from test_gemma4_vision_cli import BOI, EOI, IMAGE, MULTIMODAL_TOKENS
from test_gemma4_vision_decoder import reference_logits

CPU = LoadOptions(device="cpu", dtype="float32")
#: variant -> (text width, use_bidirectional_attention): one published width of each rule.
VARIANTS = {"e2b": (GEMMA4_GGUF_WIDTH, None), "26b": (2816, "vision")}
#: (width, height, seed) of the drawn images, sizes the other Gemma 4 tests do not use.
IMAGE_SETS = {1: [(150, 260, 7)], 2: [(260, 90, 8), (121, 121, 9)]}


def write_source(folder: Path, width: int, rule: str | None) -> Path:
    """The tiny checkpoint (test_gemma4_vision's, one vision layer) at text width ``width``, with
    Gemma's SentencePiece tokenizer of 505 pieces plus the seven multimodal tokens at ids 505..511."""
    from tokenizers import AddedToken, Tokenizer

    from lollm.testing.converter import write_sentencepiece_tokenizer

    cfg = tiny_config(standardize=False)
    cfg["text_config"] = {**cfg["text_config"], "hidden_size": width, "intermediate_size": 64,
                          "use_bidirectional_attention": rule}
    cfg["vision_soft_tokens_per_image"] = SOFT_TOKENS  # as the reference processor's max_soft_tokens
    write_tiny_checkpoint(cfg, folder, init_std=SENSITIVE_INIT_STD)
    write_sentencepiece_tokenizer(folder, CORPUS, style="gemma", vocab_size=505, max_characters=120)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in MULTIMODAL_TOKENS])
    assert [tok.token_to_id(t) for t in ("<|image>", "<image|>", "<|image|>")] == [BOI, EOI, IMAGE]  # config.json's ids
    tok.save(str(folder / "tokenizer.json"))
    reference_processor().save_pretrained(folder)  # preprocessor_config.json: the mmproj converter reads it
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """variant -> (source folder, text GGUF, mmproj GGUF); the four conversions run side by side."""
    from lollm.testing.converter import convert

    out, jobs = {}, []
    for variant, (width, rule) in VARIANTS.items():
        made = tmp_path_factory.mktemp(f"gemma4-{variant}")
        folder = write_tiny_vision_checkpoint("gemma4", made) if variant == "e2b" else write_source(made, width, rule)
        gguf = tmp_path_factory.mktemp(f"gemma4-{variant}-gguf")
        # the mmproj carries no soft-token budget: lollm reads it from a preprocessor_config.json beside the file
        shutil.copy(folder / "preprocessor_config.json", gguf / "preprocessor_config.json")
        out[variant] = (folder, gguf / "model-f32.gguf", gguf / "mmproj-f32.gguf")
        jobs += [(folder, gguf / "model-f32.gguf", ()), (folder, gguf / "mmproj-f32.gguf", ("--mmproj",))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each conversion is a child process
        list(pool.map(lambda job: convert(job[0], job[1], "f32", job[2]), jobs))
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, files):
    """(variant, safetensors LoadedModel and tower, GGUF LoadedModel and tower from the mmproj)."""
    from lollm.load.pipeline import open_model

    folder, gguf, mmproj = files[request.param]
    source, converted = open_model(str(folder), CPU), open_model(str(gguf), CPU)
    return request.param, (source, open_vision(source)), (converted, open_vision(converted, str(mmproj)))


def prompt(loaded, tower, images) -> tuple[list[int], object]:
    """<bos>, text, then per image its placeholder run and more text: ids and their ImageBatch, as lollm run makes them."""
    from lollm.vision.load import prepare_prompt

    text = " ".join(f"picture {i}: {tower.spec.placeholder} and after it," for i in range(len(images)))
    ready = prepare_prompt(f"Look. {text} the end", images, tower, loaded.tokenizer, model="tiny",
                           max_context=loaded.model.max_context, add_special_tokens=True)
    return ready.ids, ready.images


def test_the_gguf_config_reads_the_rule_of_config_json(models):
    variant, (source, _), (converted, _) = models
    want = VARIANTS[variant][1] == "vision"
    assert source.model.config.images_bidirectional is want
    assert converted.model.config.images_bidirectional is want
    assert converted.model.config.pad_token_id == source.model.config.pad_token_id == 0


@pytest.mark.parametrize("n_images", sorted(IMAGE_SETS))
def test_text_gguf_plus_mmproj_give_the_safetensors_logits(models, n_images):
    """Against lollm on the safetensors checkpoint, and against transformers on it (same pixels, processor's budget)."""
    _, (source, tower), (converted, mm_tower) = models
    images = [drawing(w, h, seed) for w, h, seed in IMAGE_SETS[n_images]]
    ids, batch = prompt(source, tower, images)
    mm_ids, mm_batch = prompt(converted, mm_tower, images)
    assert mm_ids == ids and ids.count(tower.spec.image_token_id) == sum(i.embeds.shape[0] for i in batch.images)
    with torch.inference_mode():
        want = source.model(torch.tensor([ids]), images=batch)[0]
        got = converted.model(torch.tensor([ids]), images=mm_batch)[0]
    assert_close_logits(got, want, ids)
    assert_close_logits(got, reference_logits(source.checkpoint.path, ids, images), ids)


def test_the_flipped_rule_fails_the_bound(models, monkeypatch):
    """The table's rule read the other way round: the GGUF decoder's logits leave the bound."""
    from lollm_gemma.gemma4 import config_gguf

    _, (source, tower), (converted, mm_tower) = models
    flipped = {w: (name, not both) for w, (name, both) in config_gguf.IMAGE_ATTENTION_BY_WIDTH.items()}
    monkeypatch.setattr(config_gguf, "IMAGE_ATTENTION_BY_WIDTH", flipped)
    images = [drawing(w, h, seed) for w, h, seed in IMAGE_SETS[2]]
    ids, batch = prompt(source, tower, images)
    model, right = converted.model, converted.model.config
    model.config = dataclasses.replace(right, images_bidirectional=config_gguf.images_bidirectional_for_width(right.hidden_size))
    try:
        with torch.inference_mode():
            want = source.model(torch.tensor([ids]), images=batch)[0]
            got = model(torch.tensor([ids]), images=prompt(converted, mm_tower, images)[1])[0]
    finally:
        model.config = right
    with pytest.raises(AssertionError, match="argmax differs|cosine"):
        assert_close_logits(got, want, ids)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lollm_run_with_mmproj_gives_the_safetensors_greedy_tokens(files, tmp_path, variant):
    folder, gguf, mmproj = files[variant]
    picture = tmp_path / "picture.png"
    drawing(90, 140, 11).save(picture)
    want = lollm_run(str(folder), picture)
    got = lollm_run(str(gguf), picture, "--mmproj", str(mmproj))
    image = json.loads((folder / "config.json").read_text(encoding="utf-8"))["image_token_id"]
    assert got["prompt_ids"] == want["prompt_ids"] and image in want["prompt_ids"]
    assert (got["ids"], got["text"]) == (want["ids"], want["text"])


def test_a_width_outside_the_table_is_refused(files, models):
    """Before any image is encoded (the mmproj says the text width), naming the width, the table and the way
    out; the GGUF decoder's config of such a width holds no rule, and its forward refuses images."""
    from lollm.gguf.reader import GGUFTensorSource
    from lollm.load.loader import load_gguf
    from lollm_gemma.gemma4.config import Gemma4Config
    from lollm_gemma.gemma4_vision_contract import load_vision

    variant, _, (converted, tower) = models
    _, gguf, mmproj = files[variant]
    checkpoint = dataclasses.replace(load_gguf(mmproj), _tokenizer=converted.tokenizer)
    odd = dataclasses.replace(checkpoint, config={**checkpoint.config, "clip.vision.projection_dim": 2048})
    with pytest.raises(ConfigError, match=r"text width 2048 are refused.*1536 \(gemma-4-E2B: causal\).*"
                                          r"IMAGE_ATTENTION_BY_WIDTH\)\. Use the safetensors checkpoint"):
        load_vision(odd, CPU)

    source = GGUFTensorSource(gguf)
    shapes = {name: source.shape(name) for name in source.names()}
    config = Gemma4Config.from_gguf({**source.metadata, "gemma4.embedding_length": 2048}, shapes,
                                    rope_freqs=source.read("rope_freqs.weight").tolist())
    assert config.images_bidirectional is None
    ids, batch = prompt(converted, tower, [drawing(64, 64, 1)])
    model, right = converted.model, converted.model.config
    model.config = dataclasses.replace(right, images_bidirectional=config.images_bidirectional)
    try:
        with pytest.raises(ValueError, match="IMAGE_ATTENTION_BY_WIDTH"):
            model(torch.tensor([ids]), images=batch)
    finally:
        model.config = right


def test_the_budget_beside_the_mmproj(tmp_path):
    """max_soft_tokens of a preprocessor_config.json beside the file, else the published 280; a budget the
    processor does not take is refused naming the file and key."""
    from lollm_gemma.gemma4_vision_weights import PUBLISHED_SOFT_TOKENS, budget_beside

    assert budget_beside(tmp_path) == PUBLISHED_SOFT_TOKENS == 280
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 140}), encoding="utf-8")
    assert budget_beside(tmp_path) == 140
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 100}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"preprocessor_config.json: 'max_soft_tokens': .*not 100"):
        budget_beside(tmp_path)
