"""Loading a model's vision tower beside its decoder, and turning a prompt with images into the decoder's input.

:func:`open_vision` calls the family's ``Family.vision`` loader on the checkpoint the decoder
came from; :func:`prepare_prompt` runs the whole front half of docs/vision.md for one prompt:
encode each image, expand the placeholders, tokenize, place the images.
"""

from __future__ import annotations

from dataclasses import dataclass

from lollm.vision.prompt import encode_images, expand_placeholders, place_images, require_tower
from lollm.vision.spec import ImageBatch, VisionTower


def open_vision(loaded) -> VisionTower | None:
    """The vision tower of a :class:`lollm.load.pipeline.LoadedModel`, or None when it has none.

    None when the family declares no vision (``Capabilities.vision`` False) or its loader finds
    no tower in this checkpoint (a text-only checkpoint). Raises the family's LollmError
    (ConfigError, WeightsError) for a broken tower, PluginError for a failing plugin.
    """
    family = loaded.family.family
    if not family.capabilities.vision:
        return None
    return family.resolve("vision")(loaded.checkpoint, loaded.options)


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
