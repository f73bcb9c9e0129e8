"""The conformance kit's vision check (plugin contract 3, docs/vision.md): a family's tower against transformers.

A family whose ``Family`` declares vision (``Capabilities.vision``) must show, on a tiny random
``*ForConditionalGeneration`` checkpoint written by transformers with spread weights
(``SENSITIVE_INIT_STD``: at transformers' default std of 0.02 the position table and the patch
order hardly move the features, so a tower that transposes its patches or drops its positions
would pass), for prompts with 1 and then 2 drawn images of different sizes and aspect ratios:

* ``test_vision_tower_features_equal_the_reference``: the tower's (n, C) features for each image
  (``tower(tower.preprocess(image))``: a fixed-size or a dynamic-resolution tower alike) equal
  transformers' ``get_image_features`` on its processor's output (the ``pooler_output``: the
  projector's output), cosine >= ``vision_min_cosine`` at every token;
* ``test_vision_logits_equal_the_reference``: the whole image path (our preprocessing, tower,
  placement and merge, the decoder's own image rule: Gemma's mask, Qwen3.5's M-RoPE) gives
  transformers' logits at every position of the prompt: the same argmax, cosine >= ``vision_min_cosine``.

The mutants these checks must fail, on each first-party vision family (:mod:`lollm.testing.vision_mutants`,
run by :func:`lollm.testing.mutation.check_vision_mutant`): ``patch_order_transposed``,
``position_embedding_dropped``, ``merge_one_token_off``.

What the check needs of a family is a :class:`VisionSetup`: the tiny config.json, the transformers
image processor and reference class. The first-party ones are in :data:`FIRST_PARTY_VISION`; a
plugin author overrides the fixture ``vision_setup``, or states ``vision_waiver`` (why not yet;
the tests then skip, saying it).
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

from lollm.load.loader import load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
# the setups live in a module without pytest (a learner's tiny vision checkpoint is made from them); re-exported here
from lollm.testing.tiny_vision import FIRST_PARTY_VISION, GEMMA4_SOFT_TOKENS, VisionSetup, drawing  # noqa: F401

#: The kit's vision tests (the mutation suite runs them on the vision mutants).
VISION_TESTS = ("test_vision_tower_features_equal_the_reference", "test_vision_logits_equal_the_reference")
#: (width, height, seed) of the drawn images: prompts with 1 and with 2 images, no two of one size or shape.
IMAGE_SIZES = {1: [(50, 30, 1)], 2: [(23, 71, 2), (90, 90, 3)]}


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
    """What the reference's forward takes of the processor's outputs (``pixel_values``; Gemma 4's
    ``image_position_ids``; Qwen3.5's ``image_grid_thw``), plus the token types some read: 1 at image tokens
    (Gemma 3's ``token_type_ids``, the ``mm_token_type_ids`` of Gemma 4's mask and Qwen3.5's M-RoPE positions)."""
    from lollm.vision.reference import token_type_inputs

    accepted = inspect.signature(reference.forward).parameters
    kwargs = {k: v for k, v in processed.items() if k in accepted}
    return {**kwargs, **token_type_inputs(reference.forward, ids, image_token_id)}


def reference_features(reference, processed: dict) -> torch.Tensor:
    """transformers' (n, C) features of the one image in ``processed`` (its processor's output).

    ``get_image_features`` gets the outputs its signature takes (Gemma 4 also reads ``image_position_ids``,
    Qwen3.5 ``image_grid_thw``); its ``pooler_output`` (the projector's output) is a tensor (Gemma 3) or
    one tensor per image (Gemma 4, Qwen3.5).
    """
    model = reference if hasattr(reference, "get_image_features") else reference.model
    accepted = inspect.signature(model.get_image_features).parameters
    out = model.get_image_features(**{k: v for k, v in processed.items() if k in accepted})
    out = out if isinstance(out, torch.Tensor) else out.pooler_output
    if isinstance(out, (list, tuple)):
        out = torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
    return out.reshape(-1, out.shape[-1])


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

        folder = write_tiny_checkpoint(vision_setup.config(), Path(tmp_path) / "vision", init_std=SENSITIVE_INIT_STD,
                                       model_class=vision_setup.reference_class)
        vision_setup.processor().save_pretrained(folder)  # preprocessor_config.json, as a published checkpoint has it
        reference = getattr(transformers, vision_setup.reference_class).from_pretrained(str(folder), dtype=torch.float32).eval()
        if vision_setup.relabel is not None:  # this family's own model types: a copy of the checkpoint, relabelled
            folder = Path(shutil.copytree(folder, Path(tmp_path) / "vision-relabelled"))
            config = vision_setup.relabel(json.loads((folder / "config.json").read_text(encoding="utf-8")))
            (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        checkpoint = load_checkpoint(folder)
        options = LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="float", quantization=Quantization("float"))
        model = installed.family.resolve("load")(checkpoint, options)
        tower = installed.family.resolve("vision")(checkpoint, options)
        assert tower is not None, f"the family's vision loader found no tower in {folder} (a full *ForConditionalGeneration checkpoint)"
        return model, tower, reference, checkpoint.config

    def test_vision_tower_features_equal_the_reference(self, vision_setup, vision_run):
        """Each image alone: our preprocessing and tower give transformers' ``get_image_features`` on its processor's output."""
        _, tower, reference, _ = vision_run
        processor = vision_setup.processor()
        for width, height, seed in [size for sizes in IMAGE_SIZES.values() for size in sizes]:
            image = drawing(width, height, seed)
            with torch.inference_mode():
                got = tower(tower.preprocess(image))
                expected = reference_features(reference, processor(images=[image], return_tensors="pt"))
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

