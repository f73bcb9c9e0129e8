"""Images in a chat request (docs/vision.md, "lollm serve"): from content parts to the engine's ImageBatch.

A client sends images as content parts (OpenAI ``image_url`` with a ``data:`` URL, Anthropic
``image`` blocks with a base64 source: lollm.serve.messages turns those into the former).
:func:`lollm.serve.requests.read_messages` decodes and checks each one (every hostile image a
400 naming its part) and leaves an ``{"type": "image"}`` part where it stood. Then, here:

1. the chat template renders the messages; for each image part it writes the family's
   placeholder (Gemma 3's template: ``<start_of_image>``) as template text, so it becomes the
   placeholder's control token, while the client's own text is encoded with special tokens kept
   plain (``encode_chat(parse_special=False)``): a client that types ``<start_of_image>`` gets
   text, never an image slot;
2. in the rendered text (before it is tokenized, so the ids are those transformers' processor
   gives) each placeholder becomes ``begin_text + image_token * n + end_text``, n the image's
   tokens (:func:`lollm.vision.chat.encode_chat_with_images`); the client's text is hidden from
   this step (``encode_chat(rewrite=...)``);
3. the images go through the tower once (in the request's preparing thread, before the engine
   sees the request) and are placed: :func:`lollm.vision.prompt.place_images`.

Every refusal is an ApiError 400 naming the rule: a template that writes no placeholder for an
image, more image tokens than the server's context holds.
"""

from __future__ import annotations

import threading

from lollm.errors import ImageError
from lollm.serve.error_shapes import ApiError
from lollm.vision.chat import encode_chat_with_images
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, place_images
from lollm.vision.spec import ImageBatch, VisionTower


def reads_images(family: object, checkpoint: object, mmproj: str | None) -> bool:
    """Whether a served model may read images, known before its weights load (no tower is opened).

    family: its :class:`lollm.family.Family`; checkpoint: its :class:`lollm.load.loader.Checkpoint`; mmproj:
    the tower's own GGUF file given for a GGUF model (``lollm serve --mmproj``, or paired in a folder).
    True when the family declares vision (``Capabilities.vision``) and the tower has somewhere to come from:
    the mmproj file, or a safetensors checkpoint whose config.json has a ``vision_config`` (transformers'
    ``*ForConditionalGeneration``). The family's loader still decides on the first image: a request with
    an image to a model whose loader finds no tower is a 400 (:meth:`Towers.tower`). It sizes the body limit
    (lollm.serve.requests.body_limit) and /v1/models' ``vision`` flag (the chat page's image button).
    """
    if not family.capabilities.vision:
        return False
    if mmproj is not None:
        return True
    return checkpoint.fmt != "gguf" and "vision_config" in checkpoint.config


class Towers:
    """The served model's vision tower, opened on the first image request (a text request never pays for it).

    mmproj: a GGUF model's tower file (:func:`lollm.vision.load.open_vision`), None for a safetensors model.
    """

    def __init__(self, loaded: object, name: str, mmproj: str | None = None):
        self.loaded, self.name, self.mmproj = loaded, name, mmproj
        self._tower: VisionTower | None = None
        self._lock = threading.Lock()

    def tower(self) -> VisionTower:
        """The tower; ApiError 400 when the model has none (a text-only model, a checkpoint without one)."""
        with self._lock:
            if self._tower is None:
                self._tower = open_vision(self.loaded, self.mmproj)
            if self._tower is None:  # (a GGUF of a family with vision and no --mmproj: open_vision says what to do)
                raise ApiError(400, f"model {self.name!r} has no vision tower: it reads text only, and the request "
                                    "holds an image", param="messages")
            return self._tower


def image_prompt(messages: list[dict], images: list, tower: VisionTower, tokenizer, *, model: str, context: int,
                 **template_flags: object) -> tuple[list[int], ImageBatch]:
    """The chat prompt of ``messages`` (whose image parts are ``{"type": "image"}``) as ids, and its placed images.

    images:  the request's RGB ``PIL.Image`` s, in order; they go through the tower here, once.
    context: the positions one request may use (``lollm serve --ctx-size``): the prompt must leave one free.
    template_flags: the template variables (``enable_thinking``, ``tools``) as ``encode_chat`` takes them.
    Returns (ids, ImageBatch). ApiError 400 (param ``messages``) when the images make the prompt longer than the
    context. An ImageError (the template wrote another number of placeholders than there are images) and the
    template's error (LollmErrors) pass through, for the caller's 400.
    """
    spec = tower.spec
    encoded = encode_images(tower, images)
    counts = [e.embeds.shape[0] for e in encoded]
    ids = encode_chat_with_images(messages, counts, spec, tokenizer, model=model, parse_special=False, **template_flags)
    if len(ids) >= context:
        raise ApiError(400, f"{len(images)} image(s) take {sum(counts)} tokens; with the text the prompt is {len(ids)} "
                            f"tokens, but the server's context is {context} (lollm serve --ctx-size) and the answer needs "
                            "one more: send fewer or smaller images", param="messages", code="context_length_exceeded")
    try:
        return ids, place_images(ids, spec, encoded, max_context=context)
    except ImageError as error:
        raise ApiError(400, str(error), param="messages") from None
