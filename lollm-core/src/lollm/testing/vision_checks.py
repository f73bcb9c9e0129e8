"""The conformance kit's vision check (plugin contract 3, docs/vision.md): a family's tower against transformers.

A family whose ``Family`` declares vision (``Capabilities.vision``) must show, on a tiny random
``*ForConditionalGeneration`` checkpoint written by transformers with spread weights
(``SENSITIVE_INIT_STD``: at transformers' default std of 0.02 the position table and the patch
order hardly move the features, so a tower that transposes its patches or drops its positions
would pass), for prompts with 1 and then 2 drawn images of different sizes and aspect ratios:

* ``test_vision_tower_features_equal_the_reference``: the tower's (n, C) features for each image,
  fed the reference processor's pixels, equal transformers' ``get_image_features`` (its
  ``pooler_output``: the projector's output), cosine >= ``vision_min_cosine`` at every token;
* ``test_vision_logits_equal_the_reference``: the whole image path (our preprocessing, tower,
  placement and merge, the decoder's image mask) gives transformers' logits at every position of
  the prompt: the same argmax, cosine >= ``vision_min_cosine``.

The mutants these checks must fail (:mod:`lollm.testing.mutation`): ``patch_order_transposed``,
``position_embedding_dropped``, ``merge_one_token_off``.

What the check needs of a family is a :class:`VisionSetup`: the tiny config.json, the transformers
image processor and reference class. The first-party ones are in :data:`FIRST_PARTY_VISION`; a
plugin author overrides the fixture ``vision_setup``, or states ``vision_waiver`` (why not yet;
the tests then skip, saying it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lollm.load.loader import load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.testing.tiny import SENSITIVE_INIT_STD, kit_config, write_tiny_checkpoint

#: The kit's vision tests (the mutation suite runs them on the vision mutants).
VISION_TESTS = ("test_vision_tower_features_equal_the_reference", "test_vision_logits_equal_the_reference")
#: (width, height, seed) of the drawn images: prompts with 1 and with 2 images, no two of one size or shape.
IMAGE_SIZES = {1: [(50, 30, 1)], 2: [(23, 71, 2), (90, 90, 3)]}


@dataclass(frozen=True)
class VisionSetup:
    """What the vision check needs of a family.

    config:          () -> the tiny ``*ForConditionalGeneration`` config.json (a dict), written by
                     transformers' class ``reference_class`` (tiny tower, decoder and image tokens).
    processor:       () -> transformers' image processor for it (a slow PIL class: no torchvision);
                     called as ``processor(images=[...], return_tensors="pt")``.
    reference_class: the transformers class name, e.g. ``"Gemma3ForConditionalGeneration"``.
    """

    config: Callable[[], dict]
    processor: Callable[[], Any]
    reference_class: str


def _gemma3_config() -> dict:
    """gemma-3-4b-it shrunk: the kit's decoder (window 6, shorter than an image), a 2-layer SigLIP on
    64 x 64 images in 8-pixel patches (an 8 x 8 grid), pooled 2 x 2 into 16 tokens per image."""
    from lollm.cli.hub_configs import hub_config

    raw = hub_config("google__gemma-3-4b-it")
    text = kit_config(raw)
    vocab = int(text["vocab_size"])
    vision = {**raw["vision_config"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 64, "patch_size": 8}
    return {**raw, "text_config": {**text, "model_type": raw["text_config"]["model_type"]}, "vision_config": vision,
            "mm_tokens_per_image": 16, "boi_token_index": vocab - 3, "eoi_token_index": vocab - 2,
            "image_token_index": vocab - 1}


def _gemma3_processor():
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 64, "width": 64})


#: family name -> its setup, for the first-party families whose kit runs the check.
FIRST_PARTY_VISION = {"gemma3": VisionSetup(_gemma3_config, _gemma3_processor, "Gemma3ForConditionalGeneration")}


def drawing(width: int, height: int, seed: int):
    """An RGB ``PIL.Image`` of ``width`` x ``height``: a coloured ground, an ellipse and a line placed by ``seed``."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    r = lambda n: int(torch.randint(0, n, (1,), generator=g))  # noqa: E731
    img = Image.new("RGB", (width, height), (r(256), r(256), r(256)))
    draw = ImageDraw.Draw(img)
    draw.ellipse((r(width // 2), r(height // 2), width - r(width // 3), height - r(height // 3)),
                 fill=(r(256), r(256), r(256)))
    draw.line((0, r(height), width, r(height)), fill=(r(256), r(256), r(256)), width=3)
    return img


def vision_prompt(config: dict, image_token_id: int, counts: list[int]) -> list[int]:
    """Token ids: text, then per image ``counts[i]`` image tokens and more text. The text ids are drawn
    (seed 7) below the vocabulary, never a special id of ``config`` (a key ending ``_token_id`` or ``_token_index``)."""
    text = config.get("text_config", config)
    special = {v for c in (config, text) for k, v in c.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)}
    g = torch.Generator().manual_seed(7)
    pool = [i for i in torch.randint(3, int(text["vocab_size"]), (64,), generator=g).tolist() if i not in special]
    ids, at = pool[:4], 4
    for n in counts:
        ids += [image_token_id] * n + pool[at:at + 3]
        at += 3
    return ids


def _cosines(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(N,) float64 cosine of each row of two (N, K) tensors."""
    return torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)


def _reference_kwargs(reference, processed: dict, ids: torch.Tensor, image_token_id: int) -> dict:
    """The processor's outputs (and ``token_type_ids``: 1 at image tokens) that the reference's forward takes."""
    accepted = inspect.signature(reference.forward).parameters
    kwargs = {k: v for k, v in processed.items() if k in accepted}
    if "token_type_ids" in accepted:
        kwargs["token_type_ids"] = (ids == image_token_id).long()
    return kwargs


class VisionChecks:
    """The kit's vision check; :class:`lollm.testing.conformance.FamilyConformance` inherits it.

    vision_min_cosine: per token (features) and per position (logits), ours against transformers.
    vision_waiver:     why this family's tower is not checked yet (the tests skip, saying it); None: checked.
    """

    vision_min_cosine: float = 0.9999
    vision_waiver: str | None = None

    @pytest.fixture
    def vision_setup(self, installed, family_name) -> VisionSetup:
        """The family's :class:`VisionSetup` (:data:`FIRST_PARTY_VISION`); override it for your family."""
        if not installed.family.capabilities.vision:
            pytest.skip(f"family {family_name!r} declares no vision (Capabilities.vision is False)")
        if self.vision_waiver:
            pytest.skip(f"vision_waiver: {self.vision_waiver}")
        if family_name not in FIRST_PARTY_VISION:
            pytest.fail(f"family {family_name!r} declares vision: override the fixture `vision_setup` with a "
                        "lollm.testing.vision_checks.VisionSetup (tiny config, processor, transformers class), "
                        "or state `vision_waiver` saying why not", pytrace=False)
        return FIRST_PARTY_VISION[family_name]

    @pytest.fixture
    def vision_run(self, installed, vision_setup, tmp_path):
        """(our decoder, our tower, transformers' model, the config) on the tiny vision checkpoint, float32 CPU."""
        import transformers

        folder = write_tiny_checkpoint(vision_setup.config(), Path(tmp_path) / "vision", init_std=SENSITIVE_INIT_STD)
        checkpoint = load_checkpoint(folder)
        options = LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="float", quantization=Quantization("float"))
        model = installed.family.resolve("load")(checkpoint, options)
        tower = installed.family.resolve("vision")(checkpoint, options)
        assert tower is not None, f"the family's vision loader found no tower in {folder} (a full *ForConditionalGeneration checkpoint)"
        reference = getattr(transformers, vision_setup.reference_class).from_pretrained(str(folder), dtype=torch.float32).eval()
        return model, tower, reference, checkpoint.config

    def test_vision_tower_features_equal_the_reference(self, vision_setup, vision_run):
        """Each image's features, from the reference processor's pixels: ours == ``get_image_features``."""
        _, tower, reference, _ = vision_run
        processor = vision_setup.processor()
        for n_images, sizes in IMAGE_SIZES.items():
            for width, height, seed in sizes:
                processed = processor(images=[drawing(width, height, seed)], return_tensors="pt")
                with torch.inference_mode():
                    out = reference.get_image_features(**{k: v for k, v in processed.items() if k != "num_crops"})
                    expected = (out if isinstance(out, torch.Tensor) else out.pooler_output).reshape(-1, out_width(out))
                    got = tower(processed["pixel_values"][0])
                assert got.shape == expected.shape, f"image {width}x{height}: tower features {tuple(got.shape)}, transformers {tuple(expected.shape)}"
                cos = _cosines(got, expected)
                worst = int(cos.argmin())
                assert cos[worst] >= self.vision_min_cosine, (
                    f"vision features of a {width}x{height} image: cosine {float(cos[worst]):.6f} at token {worst} "
                    f"(< {self.vision_min_cosine}; max |Δ| {float((got - expected).abs().max()):.3g})")

    def test_vision_logits_equal_the_reference(self, vision_setup, vision_run):
        """Prompts with 1 and 2 images, our whole image path: the same argmax and cosine at every position."""
        from lollm.vision.prompt import encode_images, place_images

        model, tower, reference, config = vision_run
        processor = vision_setup.processor()
        for n_images, sizes in IMAGE_SIZES.items():
            images = [drawing(w, h, s) for w, h, s in sizes]
            encoded = encode_images(tower, images)
            ids = vision_prompt(config, tower.spec.image_token_id, [e.embeds.shape[0] for e in encoded])
            batch = place_images(ids, tower.spec, encoded, max_context=int(model.max_context))
            x = torch.tensor([ids])
            processed = processor(images=images, return_tensors="pt")
            with torch.inference_mode():
                ref = reference(input_ids=x, use_cache=False, **_reference_kwargs(reference, processed, x, tower.spec.image_token_id)).logits[0]
                got = model(x, images=batch)[0]
            wrong = (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
            cos = _cosines(got, ref)
            worst = int(cos.argmin())
            assert not wrong and cos[worst] >= self.vision_min_cosine, (
                f"vision parity failed with {n_images} image(s): argmax differs at positions {wrong}; worst cosine "
                f"{float(cos[worst]):.6f} at position {worst} (< {self.vision_min_cosine}?), image tokens at "
                f"{[(im.start, im.end) for im in batch.images]}")


def out_width(out) -> int:
    """The feature width C of ``get_image_features``' output (a tensor, or an output whose ``pooler_output`` it is)."""
    return (out if isinstance(out, torch.Tensor) else out.pooler_output).shape[-1]
