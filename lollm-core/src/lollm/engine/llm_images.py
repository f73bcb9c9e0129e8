"""Prompts with images for :class:`lollm.LLM` (docs/offline-batch.md, "Images"; docs/vision.md)::

    from lollm import LLM, ImagePrompt
    llm = LLM("path/to/gemma-3-4b-it")
    done = llm.generate([ImagePrompt("What is in this picture?", ["boat.png"]), "Name three rivers."])

An :class:`ImagePrompt` is a text prompt and its images; each image is a ``PIL.Image``, the path
of an image file, or an image file's bytes (PNG, JPEG, GIF, WebP, BMP). It goes the way
``lollm run --image`` goes, in the order :meth:`lollm.LLM.generate` runs these steps:

1. :func:`read_prompt_images`: every image of every prompt is read and checked before anything
   else runs (lollm.vision.image: a decompression bomb, a huge side, a truncated file, CMYK or
   16-bit, an animated GIF, 0x0 are each one ImageError naming ``prompts[i].images[j]``);
2. the model's vision tower opens once (an ImageError naming the model when it has none);
3. :func:`with_placeholders`: the family's placeholder (Gemma 3: ``<start_of_image>``) stays where
   the text holds it, or goes once per image before the text; then the chat template (or raw
   text) and :func:`lollm.vision.load.prepare_prompt`: the tower, the expansion, the tokens, the
   placed :class:`lollm.vision.spec.ImageBatch`, which the engine (or the loop) takes with the ids.

:func:`read_chat_images` reads the image parts of :meth:`lollm.LLM.chat`'s conversations the same
way (step 1); there the chat template writes each placeholder (lollm.vision.chat).

Only Pillow is imported here (``from lollm import ImagePrompt`` stays torch-free).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence, Union

from lollm.errors import GenerationError, ImageError

#: One image as a caller gives it: a PIL image, a file's path, or a file's encoded bytes.
ImageInput = Union["PIL.Image.Image", str, os.PathLike, bytes]  # noqa: F821 (PIL is imported when an image is read)


@dataclass(frozen=True)
class ImagePrompt:
    """A text prompt with images, for :meth:`lollm.LLM.generate`.

    text:   the prompt; write the family's placeholder (``<start_of_image>`` for Gemma 3) where an image
            goes, once per image, or none (then each image goes before the text, as ``lollm run --image``).
    images: the images in order, each a ``PIL.Image``, a path (str or ``os.PathLike``) or encoded bytes.
    """

    text: str
    images: Sequence[ImageInput] = field(default_factory=tuple)


def read_prompt_images(prompt: ImagePrompt, index: int) -> list:
    """Every image of ``prompt`` (the ``index``-th of the call) as a checked RGB ``PIL.Image``, in order.

    Raises GenerationError for an ImagePrompt of the wrong shape (text not a str, images not a list; an empty
    text with no image is the text prompt's error, "is empty"),
    ImageError naming ``prompts[index].images[j]`` (and the file, for a path) for an image of another
    type or one that lollm.vision.image refuses.
    """
    if not isinstance(prompt.text, str):
        raise GenerationError(f"prompts[{index}].text must be a str (it may be empty when images are given), "
                              f"got {prompt.text!r:.80}")
    if isinstance(prompt.images, (str, bytes)) or not isinstance(prompt.images, Sequence):
        raise GenerationError(f"prompts[{index}].images must be a list of images, got {type(prompt.images).__name__}")
    return [read_one(image, f"prompts[{index}].images[{j}]") for j, image in enumerate(prompt.images)]


def read_one(image: object, name: str):
    """One image as a checked RGB ``PIL.Image``: a path read with :func:`lollm.vision.image.read_image_file`, bytes
    with :func:`~lollm.vision.image.decode_image`, a PIL image checked as a decoded file's header is. ImageError
    naming ``name``."""
    from PIL import Image

    from lollm.vision.image import check_header, decode_image, read_image_file, to_rgb

    if isinstance(image, (str, os.PathLike)):
        try:
            return read_image_file(image)
        except ImageError as error:
            raise ImageError(f"{name}: {error}") from None
    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_image(bytes(image), name=name)
    if isinstance(image, Image.Image):
        check_header(image, name)  # size, frames, colour mode: the rules a file's header meets
        try:
            image.load()  # a lazily opened file decodes here: a truncated one fails
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"{name} is truncated or corrupt: {exc}") from None
        return to_rgb(image)
    raise ImageError(f"{name} is a {type(image).__name__}; an image is a PIL.Image, a file's path or its bytes")


def with_placeholders(text: str, count: int, placeholder: str) -> str:
    """``text`` as it holds the images: unchanged when it holds ``placeholder`` (the expansion then checks
    there is one per image), else ``count`` placeholders before it, each followed by a space."""
    if placeholder in text:
        return text
    return " ".join([placeholder] * count + [text])



def read_chat_images(conversation: list[dict], index: int) -> tuple[list[dict], list]:
    """A conversation of :meth:`lollm.LLM.chat` with each image part read: (the messages for the chat template,
    each image part made ``{"type": "image"}``, whose placeholder the template writes; the images, checked RGB
    ``PIL.Image`` s in order).

    An image part is ``{"type": "image", "image": X}`` (X a PIL image, a path or bytes, as in an
    :class:`ImagePrompt`) or OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
    (a ``data:`` URL only: nothing is fetched). Other parts stay as they are. Raises ImageError naming
    ``conversations[index][m].content[j]`` for a refused image or another URL.
    """
    from lollm.vision.image import decode_data_url, decode_image

    messages, images = [], []
    for m, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"conversations[{index}][{m}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                images.append(read_one(part.get("image"), where))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(decode_image(decode_data_url(url, name=where), name=where))
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    return messages, images
