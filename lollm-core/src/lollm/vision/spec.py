"""Plugin contract 3, vision: what a family fills in (:class:`VisionSpec`, a :class:`VisionTower`)
and what reaches its decoder (:class:`ImageBatch`).

The split of the work (docs/vision.md draws it)::

    core  (lollm.vision)                       family (e.g. lollm_gemma.gemma3.vision)
    ─────────────────────────────────          ────────────────────────────────────────────
    decode bytes -> RGB image (image.py)
                                               tower.preprocess(image) -> pixels
                                                 (with core's resize/rescale/normalize/patchify)
                                               tower.num_tokens(pixels) -> n
    expand the prompt: one placeholder ->
      begin_text + n x image_token + end_text
    tokenize; find each image's span
                                               tower(pixels) -> (n, C) embeddings, C = decoder width
    ImageBatch: embeddings + spans + hashes
                                               model.forward(ids, cache, images=ImageBatch):
                                                 embed the ids, scatter_images(...), then the
                                                 family's own rule (Gemma 3: bidirectional
                                                 attention inside an image; Qwen3.5: M-RoPE)

A family declares the tower with ``Family.vision = "module:function"`` and
``Capabilities(vision=True)``; the function is called as ``load_vision(checkpoint, options)``
and returns a :class:`VisionTower`, or None when this checkpoint carries no tower
(a text-only checkpoint of a family that has vision ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class VisionSpec:
    """The numbers of one family's image processor and prompt format (one per loaded checkpoint).

    Fields:
      image_size:   (height, width) every image is resized to, e.g. (896, 896) for Gemma 3; None when the
                    family resizes by a dynamic-resolution rule of its own (Qwen3.5) in ``preprocess``.
      patch_size:   side of one square patch in pixels (Gemma 3: 14; Qwen3.5: 16).
      image_mean:   per-channel mean subtracted after rescaling to [0, 1], e.g. (0.5, 0.5, 0.5).
      image_std:    per-channel standard deviation divided by after that.
      merge:        how many patches per side become one token (Gemma 3: 4, its 4x4 average pool;
                    Qwen3.5: 2, its 2x2 spatial merge).
      resample:     Pillow filter of the resize: "bilinear" (Gemma 3) or "bicubic" (Qwen3.5).
      image_token:  the placeholder token's text, repeated once per image token (``<image_soft_token>``).
      image_token_id: its id; the decoder finds the image positions by it.
      placeholder:  what a chat template or a user's prompt writes for one image (``<start_of_image>``);
                    core replaces each by ``begin_text + image_token * n + end_text``.
      begin_text:   text before an image's tokens (Gemma 3: ``"\\n\\n<start_of_image>"``).
      end_text:     text after them (Gemma 3: ``"<end_of_image>\\n\\n"``).
    """

    image_size: tuple[int, int] | None
    patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    merge: int
    image_token: str
    image_token_id: int
    placeholder: str
    begin_text: str = ""
    end_text: str = ""
    resample: str = "bilinear"


class VisionTower(Protocol):
    """A family's vision tower and projector, as core drives it (usually an ``nn.Module``).

    spec:           the :class:`VisionSpec` of this checkpoint.
    preprocess(image):  an RGB ``PIL.Image`` (already decoded and checked by lollm.vision.image) ->
                    the pixels the tower reads, a float32 tensor (Gemma 3: (3, 896, 896)).
    num_tokens(pixels): how many image tokens these pixels become (Gemma 3: always 256).
    grid(pixels):   optional: the (t, h, w) grid of the image's tokens after the merge, for families
                    whose decoder positions need it (Qwen3.5's M-RoPE); None otherwise.
    __call__(pixels): the tower and projector -> (num_tokens(pixels), C) embeddings, C the decoder's
                    hidden size, in the decoder's dtype, ready to be scattered.
    reference_inputs(pixels): optional: ``pixels`` a list of tensors as ``preprocess`` gave them (one
                    per image, prompt order) -> ``dict[str, Tensor]``, the keyword arguments transformers'
                    ``*ForConditionalGeneration.forward`` takes for these images, laid out exactly as the
                    family's image processor lays them out (the parity gate and the kit feed the
                    reference our own pixels). Gemma 4: ``pixel_values`` (B, max_patches, p*p*3) zero-padded
                    and ``image_position_ids`` (B, max_patches, 2) int64, (-1, -1) at padding; Qwen3.5:
                    ``pixel_values`` (sum of h*w, 3*T*P*P) and ``image_grid_thw`` (B, 3) int64. Without it
                    (a fixed-size tower, Gemma 3): ``{"pixel_values": torch.stack(pixels)}``, (B, 3, H, W);
                    :func:`lollm.vision.reference.reference_inputs` applies that default.
    """

    spec: VisionSpec

    def preprocess(self, image: Any) -> torch.Tensor: ...

    def num_tokens(self, pixels: torch.Tensor) -> int: ...

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PlacedImage:
    """One image of a prompt, encoded and placed.

    start:      the sequence position of its first image token (positions count from 0 at the
                prompt's first token, as the cache's positions do).
    embeds:     (n, C) the tower's output; the image takes positions ``start .. start+n-1``.
    pixel_hash: :func:`lollm.vision.preprocess.pixel_hash` of its pixels (prefix-cache key).
    grid:       (t, h, w) of its tokens when the tower gives one (Qwen3.5), else None.
    """

    start: int
    embeds: torch.Tensor
    pixel_hash: str
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        """One past the image's last position."""
        return self.start + self.embeds.shape[0]


@dataclass
class ImageBatch:
    """The images of one sequence, in prompt order, as ``model.forward(..., images=...)`` receives them."""

    images: list[PlacedImage] = field(default_factory=list)

    def spans(self) -> list[tuple[int, int]]:
        """``[(start, end), ...]``: each image's positions, end exclusive."""
        return [(im.start, im.end) for im in self.images]

    def within(self, start: int, T: int) -> list[PlacedImage]:
        """The images whose positions meet ``start .. start+T-1``; raises ValueError for one cut by the edge.

        A forward must hold an image's positions all at once (Gemma 3 attends inside an image in both
        directions; a chunked prefill must not cut one): the caller sizes its chunks so.
        """
        inside = []
        for im in self.images:
            if im.end <= start or im.start >= start + T:
                continue
            if im.start < start or im.end > start + T:
                raise ValueError(f"image at positions {im.start}..{im.end - 1} is cut by this forward's "
                                 f"positions {start}..{start + T - 1}: a forward must hold a whole image")
            inside.append(im)
        return inside
