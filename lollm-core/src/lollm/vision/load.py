"""Loading a model's vision tower beside its decoder, and turning a prompt with images into the decoder's input.

:func:`open_vision` calls the family's ``Family.vision`` loader on the checkpoint the decoder
came from; :func:`prepare_prompt` runs the whole front half of docs/vision.md for one prompt:
encode each image, expand the placeholders, tokenize, place the images.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lollm.errors import ImageError, LollmError
from lollm.vision.prompt import encode_images, expand_placeholders, place_images, require_tower
from lollm.vision.spec import ImageBatch, VisionTower


def open_vision(loaded, mmproj: str | None = None) -> VisionTower | None:
    """The vision tower of a :class:`lollm.load.pipeline.LoadedModel`, or None when it has none.

    mmproj: an mmproj GGUF file (llama.cpp's ``convert_hf_to_gguf.py --mmproj``) holding the tower
    of a GGUF model, whose own file holds the decoder only. It is opened with lollm's GGUF reader
    and handed to the family's loader as a checkpoint of its own that shares the model's tokenizer
    (the image token's id is the text model's).

    None when the family declares no vision (``Capabilities.vision`` False) or its loader finds
    no tower in a safetensors checkpoint (a text-only one). Raises ImageError for a GGUF of a family
    with vision given no ``mmproj`` (it says a GGUF keeps its tower in an mmproj file: ``--mmproj FILE``),
    the family's LollmError (ConfigError, WeightsError) for a broken tower, GGUFError for a broken
    mmproj file, PluginError for a failing plugin.
    """
    family = loaded.family.family
    if not family.capabilities.vision:
        return None
    checkpoint = loaded.checkpoint
    if mmproj is not None:
        from lollm.load.loader import load_gguf

        if checkpoint.fmt != "gguf":
            raise LollmError(f"--mmproj {mmproj}: an mmproj file goes with a GGUF model; {checkpoint.spec} is "
                             f"{checkpoint.fmt}, whose own files hold the tower")
        checkpoint = dataclasses.replace(load_gguf(Path(mmproj)), _tokenizer=loaded.tokenizer)
    tower = family.resolve("vision")(checkpoint, loaded.options)
    if tower is None and mmproj is None and checkpoint.fmt == "gguf":
        raise ImageError(f"model {checkpoint.spec} is a GGUF, and a GGUF keeps no vision tower in its own file: "
                         f"the {family.name} tower is a separate mmproj file, given with --mmproj FILE "
                         "(LLM(..., mmproj=FILE) in Python). llama.cpp's convert_hf_to_gguf.py --mmproj writes one "
                         "from the safetensors checkpoint; a text-only checkpoint has none (docs/vision.md)")
    return tower


@dataclass
class PromptWithImages:
    """A prompt ready for ``model.forward(ids, images=images)``: its token ids and its placed images."""

    ids: list[int]
    images: ImageBatch


def prepare_prompt(text: str, images: list, tower: VisionTower | None, tokenizer, *, model: str,
                   max_context: int, add_special_tokens: bool) -> PromptWithImages:
    """``text`` (a rendered prompt: chat template applied) and RGB ``PIL.Image`` s -> ids and an ImageBatch.

    tokenizer: a :class:`lollm.tokenizer.Tokenizer` (its ``encode(text)`` must turn the family's
    ``image_token`` into the one id ``spec.image_token_id``). model: the model's name for errors.
    add_special_tokens: as ``tokenizer.encode`` (False for a rendered chat prompt, which holds its BOS).
    Raises ImageError for a model without a tower, placeholders that do not match the images,
    or a prompt longer than ``max_context``.
    """
    tower = require_tower(tower, model)
    encoded = encode_images(tower, images)
    expanded = expand_placeholders(text, tower.spec, [e.embeds.shape[0] for e in encoded])
    ids = tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
    return PromptWithImages(ids, place_images(ids, tower.spec, encoded, max_context=max_context))
