"""From images and a prompt to the decoder's input: encode, expand the placeholders, place, scatter.

The decoder reads one sequence of embeddings. An image enters it as ``n`` placeholder
tokens (all the same id) whose embeddings are replaced by the tower's ``n`` output rows::

    prompt text   "<start_of_image> What is this?"
        │ expand_placeholders: placeholder -> begin_text + image_token x n + end_text
    text          "\\n\\n<start_of_image><image_soft_token> x 256<end_of_image>\\n\\n What is this?"
        │ tokenize (the family's tokenizer)
    ids           [2, 108, 255999, 262144, 262144, ..., 262144, 256000, 108, 3689, ...]
        │ place_images: where each image's run of image_token_id starts
    ImageBatch    [PlacedImage(start=3, embeds=(256, C), pixel_hash=...)]
        │ model.forward(ids, images=...): embed ids, then scatter_images
    x             (1, T, C): rows 3..258 are the image's embeddings, the rest the text's

Every refusal here is an :class:`lollm.errors.ImageError`: a model without a tower,
a prompt whose placeholders do not match the images, more image tokens than the context holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lollm.errors import ImageError
from lollm.vision.preprocess import pixel_hash
from lollm.vision.spec import ImageBatch, PlacedImage, VisionSpec, VisionTower

#: What a request may not send, and why: the refusal names the kind (issue 39: video and audio out of scope).
UNSUPPORTED_MEDIA = {
    "video": "video input is not supported (images only): send frames as separate images",
    "audio": "audio input is not supported (images only)",
}


@dataclass
class EncodedImage:
    """One image through its tower: pixels (as preprocess gave them), their hash, the (n, C) embeddings."""

    pixels: torch.Tensor
    pixel_hash: str
    embeds: torch.Tensor
    grid: tuple[int, int, int] | None = None


def require_tower(tower: VisionTower | None, model: str) -> VisionTower:
    """``tower``, or ImageError naming ``model`` when it has none (a text-only model given an image).

    A GGUF of a family with vision but no ``--mmproj`` file is refused earlier, with its own message
    (:func:`lollm.vision.load.open_vision`)."""
    if tower is None:
        raise ImageError(f"model {model} has no vision tower: it reads text only, and an image was given "
                         "(use a checkpoint with a vision tower, e.g. a Gemma 3 4B or a Qwen3.5)")
    return tower


@torch.inference_mode()
def encode_images(tower: VisionTower, images: list) -> list[EncodedImage]:
    """Each RGB ``PIL.Image`` -> tower.preprocess -> its hash -> tower(pixels): (n, C) embeddings.

    Raises ValueError when the tower returns another number of rows than its ``num_tokens``
    says (a bug in the family's tower, caught here rather than as a misplaced merge).
    """
    encoded = []
    for image in images:
        pixels = tower.preprocess(image)
        embeds = tower(pixels)
        n = tower.num_tokens(pixels)
        if embeds.ndim != 2 or embeds.shape[0] != n:
            raise ValueError(f"the vision tower returned {tuple(embeds.shape)} for an image of {n} tokens; "
                             "it must return (num_tokens, hidden)")
        grid_of = getattr(tower, "grid", None)
        encoded.append(EncodedImage(pixels, pixel_hash(pixels), embeds, grid_of(pixels) if grid_of else None))
    return encoded


def expand_placeholders(text: str, spec: VisionSpec, counts: list[int]) -> str:
    """Replace the i-th ``spec.placeholder`` in ``text`` by ``begin_text + image_token * counts[i] + end_text``.

    A prompt without any placeholder gets one per image in front, each followed by a space
    (``lollm run --image a.png --prompt "What is this?"``), as transformers' processors do.
    Raises ImageError when the prompt holds placeholders but not one per image, or holds the image
    token itself outside a placeholder (Qwen's ``<|image_pad|>`` written alone: lollm writes it, n times).
    """
    stray = text.replace(spec.placeholder, "").count(spec.image_token) if spec.image_token != spec.placeholder else 0
    if stray:
        raise ImageError(f"the prompt holds the image token {spec.image_token!r} {stray} time(s) outside a placeholder: "
                         f"write the placeholder {spec.placeholder!r} (one per image, or none), not the image token "
                         f"{spec.image_token!r}, which lollm writes itself once per image position")
    found = text.count(spec.placeholder)
    if found == 0:
        text = " ".join([spec.placeholder] * len(counts) + [text]) if counts else text
    elif found != len(counts):
        raise ImageError(f"the prompt holds {found} image placeholder(s) {spec.placeholder!r} "
                         f"but {len(counts)} image(s) were given: write one placeholder per image, or none")
    pieces = text.split(spec.placeholder)
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        out.append(spec.begin_text + spec.image_token * count + spec.end_text + piece)
    return "".join(out)


def place_images(ids: list[int], spec: VisionSpec, encoded: list[EncodedImage], *, max_context: int) -> ImageBatch:
    """Find each image's run of ``spec.image_token_id`` in ``ids`` (in order) and place its embeddings there.

    ids: the tokenized, expanded prompt. Raises ImageError when the image tokens number
    differently from the images' tokens (a template that dropped or doubled a placeholder),
    when one image's tokens are not consecutive, or when the prompt is longer than
    ``max_context`` because of its images (more images than the context can hold).
    """
    need = sum(e.embeds.shape[0] for e in encoded)
    if len(ids) > max_context:
        raise ImageError(f"{len(encoded)} image(s) take {need} tokens; with the text the prompt is {len(ids)} "
                         f"tokens and the model's context holds {max_context}: send fewer or smaller images")
    where = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(where) != need:
        raise ImageError(f"the prompt holds {len(where)} image tokens (id {spec.image_token_id}) but its "
                         f"{len(encoded)} image(s) need {need}")
    placed, at = [], 0
    for e in encoded:
        n = e.embeds.shape[0]
        run = where[at:at + n]
        if run[-1] - run[0] != n - 1:
            raise ImageError(f"image {len(placed) + 1}'s {n} tokens are not consecutive in the prompt")
        placed.append(PlacedImage(run[0], e.embeds, e.pixel_hash, e.grid))
        at += n
    return ImageBatch(placed)


def scatter_images(x: torch.Tensor, images: ImageBatch | None, start: int) -> torch.Tensor:
    """The merge: rows of ``x`` at image positions replaced by the images' embeddings.

    x:      (1, T, C), the embedded tokens of positions ``start .. start+T-1`` (after any embedding
            scale: transformers scatters into the scaled embeddings, and so do we).
    images: the sequence's images; only those inside this forward's positions are used, and
            an image cut by its edges raises ValueError (:meth:`ImageBatch.within`).
    Returns a new (1, T, C) tensor (x itself when no image falls inside).
    """
    if images is None:
        return x
    inside = images.within(start, x.shape[1])
    if not inside:
        return x
    x = x.clone()
    for im in inside:
        x[0, im.start - start:im.end - start] = im.embeds.to(x.dtype)
    return x


def image_token_mask(images: ImageBatch | None, start: int, T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T,) bool: True at the positions ``start .. start+T-1`` that hold an image token."""
    mask = torch.zeros(T, dtype=torch.bool, device=device)
    for im in ([] if images is None else images.within(start, T)):
        mask[im.start - start:im.end - start] = True
    return mask
