"""The qwen3_5 and qwen3_5_moe decoders read images: scatter + M-RoPE, against transformers end to end.

Tiny random ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
checkpoints written by transformers (the lively decoder of qwen3_5_tiny: untied head, init 0.1,
so that positions matter; the tower livened as in test_vision_tower), with the small pixel budget
of test_vision_preprocess. Images are drawings at sizes the tower tests do not use.

* logits at every position of prompts with 1 and 2 images equal transformers' multimodal
  forward on its own processor's output (``Qwen2VLImageProcessorPil``): same argmax, cosine >= 0.9999;
* a mutant that gives the image tokens 1-D positions fails that bound (the test can fail);
* a prefill through the cache in chunks, then decode steps without images, gives the logits
  of one forward over the whole sequence: the positions after the images stay shifted;
* greedy ``generate`` after the images equals transformers' ``generate`` token for token.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import qwen3_5_tiny as tiny
from lollm.load.options import LoadOptions
from lollm.vision.prompt import encode_images, place_images
from test_vision_mrope import prompt
from test_vision_preprocess import SMALL_BUDGET, drawing, reference_processor
from test_vision_tower import FAMILIES, MIN_COSINE, liven_vision_weights

#: (width, height) of each case's images: held out from the tower tests, none a multiple of 32 px. Their
#: merged grids (2 x 3, then 3 x 2 and 2 x 2) have both sides above 1, so the text after each image
#: is shifted (max(h', w') < h' * w'): a decode step that lost the shift would be seen.
SIZES = {1: [(85, 62)], 2: [(62, 85), (58, 70)]}


@pytest.fixture(scope="module")
def lively(tmp_path_factory, tiny_checkpoint):
    """``lively(family)`` -> (folder, our model, our tower, transformers' model), built once per family."""
    from lollm.load.pipeline import open_model
    from lollm.vision.load import open_vision

    made = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(f"vision-decoder-{family}")
            shutil.copytree(tiny_checkpoint(family, "multimodal", lively=True), folder, dirs_exist_ok=True)
            (folder / "preprocessor_config.json").write_text(json.dumps(SMALL_BUDGET), encoding="utf-8")
            liven_vision_weights(folder)
            loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
            reference = tiny.reference_class(family, "multimodal").from_pretrained(str(folder), dtype=torch.float32)
            made[family] = folder, loaded.model, open_vision(loaded), reference.eval()
        return made[family]

    return get


def case(raw: dict, n_images: int):
    """(ids, mm_token_type_ids, images, transformers' processor output) of a prompt with ``n_images``."""
    images = [drawing(w, h, seed=30 + i) for i, (w, h) in enumerate(SIZES[n_images])]
    processed = reference_processor(SMALL_BUDGET)(images, return_tensors="pt")
    ids, types = prompt(raw, processed["image_grid_thw"].tolist())
    return ids, types, images, processed


def ours_and_theirs(lively, family: str, n_images: int):
    """Our logits (T, V) and transformers' on the same prompt, plus what made them."""
    folder, model, tower, reference = lively(family)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    ids, types, images, processed = case(raw, n_images)
    batch = place_images(ids, tower.spec, encode_images(tower, images), max_context=model.max_context)
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                         image_grid_thw=processed["image_grid_thw"], mm_token_type_ids=torch.tensor([types])).logits[0]
        got = model(torch.tensor([ids]), images=batch)[0]
    return got, want, ids, batch, processed


def assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() >= MIN_COSINE, f"min cosine {cos.min():.6f} at position {int(cos.argmin())}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), "argmax differs"


@pytest.mark.parametrize("n_images", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_with_images(lively, family, n_images):
    got, want, ids, batch, processed = ours_and_theirs(lively, family, n_images)
    grids = processed["image_grid_thw"].tolist()
    assert [im.grid for im in batch.images] == [(t, h // 2, w // 2) for t, h, w in grids]
    assert_close_logits(got, want)


def test_one_dimensional_positions_for_the_image_fail_the_bound(lively, monkeypatch):
    """The mutant: image tokens at 1-D positions (M-RoPE dropped). The logits must leave the bound,
    so the test above can fail on the positions, not only on the scatter."""
    import lollm_qwen3_5.qwen3_5.mrope as vp

    def one_d(images, start, T):
        return torch.arange(start, start + T).expand(3, -1), 0

    monkeypatch.setattr(vp, "mrope_positions_window", one_d)
    got, want, *_ = ours_and_theirs(lively, "qwen3_5", 2)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() < MIN_COSINE, "1-D positions for the images still match transformers: the test cannot see M-RoPE"


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_decode_keeps_the_shifted_positions(lively, family):
    """Prefill in forwards of 3 tokens or whole images (never cutting one), then 3 decode steps with
    images=None: each step's logits equal one forward over the whole sequence, whose text after the
    images sits at index + delta (delta < 0 here)."""
    _, model, tower, _ = lively(family)
    got, _, ids, batch, _ = ours_and_theirs(lively, family, 2)
    more = [int(t) for t in got.argmax(-1)[-3:]]
    with torch.inference_mode():
        whole = model(torch.tensor([ids + more]), images=batch)[0]
        cache, at, steps = model.new_cache(len(ids) + 8), 0, []
        while at < len(ids):
            end = max([min(at + 3, len(ids))] + [b for a, b in batch.spans() if a < min(at + 3, len(ids)) < b])
            model(torch.tensor([ids[at:end]]), cache, images=batch)
            at = end
        for token in more:
            steps.append(model(torch.tensor([[token]]), cache)[0, -1])
    assert cache.image_spans and cache.length == len(ids) + len(more)
    assert torch.allclose(torch.stack(steps), whole[len(ids):], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_after_images_equals_transformers(lively, family):
    """A continuation of 6 tokens, greedy, through lollm's generate loop (chunked prefill, then decode
    steps that get no images): the tokens of transformers' generate."""
    import lollm.generate.prefill as prefill
    from lollm.generate.loop import generate
    from lollm.sampling_params import SamplingParams

    folder, model, tower, reference = lively(family)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    ids, types, images, processed = case(raw, 2)
    batch = place_images(ids, tower.spec, encode_images(tower, images), max_context=model.max_context)
    with torch.inference_mode():
        ref = reference.generate(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                                 image_grid_thw=processed["image_grid_thw"], mm_token_type_ids=torch.tensor([types]),
                                 max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    old = prefill.PREFILL_CHUNK_TOKENS
    prefill.PREFILL_CHUNK_TOKENS = 4
    try:
        ours = generate(model, ids, max_new_tokens=6, sampling=SamplingParams(temperature=0.0), images=batch).new_ids
    finally:
        prefill.PREFILL_CHUNK_TOKENS = old
    assert ours == ref[0, len(ids):].tolist()
    assert len(set(ours)) > 1, "a constant continuation would not show the positions"


def test_a_text_only_sequence_keeps_the_1d_path(lively):
    """No images: the cache keeps no spans and the logits are those of the text path (bit for bit)."""
    _, model, _, _ = lively("qwen3_5")
    ids = list(range(5, 40))
    with torch.inference_mode():
        plain = model(torch.tensor([ids]))
        cache = model.new_cache(64)
        cached = model(torch.tensor([ids]), cache, images=None)
    assert cache.image_spans == [] and torch.equal(plain, cached)


def test_an_image_cut_by_a_forward_is_refused(lively):
    _, model, _, _ = lively("qwen3_5")
    _, _, ids, batch, _ = ours_and_theirs(lively, "qwen3_5", 1)
    first = batch.images[0].start
    with torch.inference_mode(), pytest.raises(ValueError, match="cut by this forward"):
        model(torch.tensor([ids[:first + 1]]), model.new_cache(64), images=batch)


def test_both_families_register_their_vision_tower():
    from lollm.family import validate_family
    from lollm_qwen3_5.plugin import families

    for family in families():
        family = validate_family(family, plugin="qwen3_5")
        assert family.capabilities.vision and family.vision == "lollm_qwen3_5.vision_family:load_vision"
        assert family.resolve("vision").__name__ == "load_vision"


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_section_is_read_and_a_bad_one_names_the_key(family):
    """config.json's rope_parameters.mrope_section reaches the config; absent, transformers' default; else refused."""
    import importlib

    from lollm.errors import ConfigError

    module = importlib.import_module(f"lollm_qwen3_5.{family}.config")
    parse = getattr(module, "Qwen3_5Config" if family == "qwen3_5" else "Qwen3_5MoeConfig").from_hf
    raw = tiny.tiny_config(family, "multimodal")
    rope = raw["text_config"]["rope_parameters"]
    assert parse(raw).mrope_section == tuple(rope["mrope_section"])
    rope["mrope_section"] = [8, 12, 12]
    assert parse(raw).mrope_section == (8, 12, 12)
    del rope["mrope_section"]
    assert parse(raw).mrope_section == (11, 11, 10)  # Qwen3_5TextRotaryEmbedding's default
    for bad in ([11, 11], [11, "11", 10], 32):
        rope["mrope_section"] = bad
        with pytest.raises(ConfigError, match="'mrope_section'"):
            parse(raw)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_speculative_decoding_after_an_image_equals_greedy(family, tiny_checkpoint, load_ours, monkeypatch):
    """``--mtp`` with an image: the tokens equal plain greedy decoding's, with the random head's drafts
    (all rejected: one-token verify steps) and with drafts that are right but every third token, so
    that verify forwards of several tokens (images=None) and their rollbacks must give the positions of
    one-token steps (whose shift test_chunked_prefill_then_decode_keeps_the_shifted_positions proves).
    The real head runs in both (its catch-up reads the M-RoPE angles of the image)."""
    from lollm.generate.loop import generate
    from lollm.load.loader import load_checkpoint
    from lollm.sampling_params import SamplingParams
    from lollm_qwen3_5.vision_family import load_vision

    folder = tiny_checkpoint(family, "multimodal", mtp=True, lively=True)
    model, tower = load_ours(folder), load_vision(load_checkpoint(folder), LoadOptions(device="cpu", dtype="float32"))
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    encoded = encode_images(tower, [drawing(300, 200, seed=40)])  # Qwen3.5's own budget: at least 256 x 256 px
    ids, _ = prompt(raw, [(t, 2 * h, 2 * w) for t, h, w in (e.grid for e in encoded)])
    batch = place_images(ids, tower.spec, encoded, max_context=model.max_context)
    greedy = SamplingParams(temperature=0.0)
    plain = generate(model, ids, max_new_tokens=24, sampling=greedy, images=batch)
    spec = generate(model, ids, max_new_tokens=24, sampling=greedy, images=batch, speculative_tokens=3)
    assert spec.new_ids == plain.new_ids and len(set(plain.new_ids)) > 4 and spec.drafted > 0
    truth, real_draft = ids + plain.new_ids, model.draft

    def mostly_right(cache, pending, num_tokens):
        real_draft(cache, pending, num_tokens)
        start = cache.length + 1  # `pending` sits at cache.length; the drafts follow it
        return [t if (start + k) % 3 else (t + 1) % model.vocab_size
                for k, t in enumerate(truth[start:start + num_tokens])]

    monkeypatch.setattr(model, "draft", mostly_right)
    spec = generate(model, ids, max_new_tokens=24, sampling=greedy, images=batch, speculative_tokens=3)
    assert spec.new_ids == plain.new_ids and spec.accepted > 4
