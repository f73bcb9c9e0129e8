"""What transformers' ``*ForConditionalGeneration.forward`` reads for a prompt's images, built from our pixels.

The parity gate (``lollm parity --image``) and the kit's vision check run the reference on
*our* preprocessed pixels, so a difference in the logits is the tower's or the decoder's, never
the image processor's (each family's tests prove its preprocessing equal to transformers' image
processor, tensor for tensor). Each family's reference lays images out in its own way::

    Gemma 3 (a fixed size)      pixel_values (B, 3, 896, 896): one image per row     [the default]
    Gemma 4 (aspect kept)       pixel_values (B, max_patches, p*p*3), zero-padded,
                                image_position_ids (B, max_patches, 2), padding (-1, -1)
    Qwen3.5 (dynamic size)      pixel_values (sum of h*w patches, 3*T*P*P), all images' patches
                                concatenated, image_grid_thw (B, 3)

so a tower with a layout other than the default says it with ``reference_inputs``
(:class:`lollm.vision.spec.VisionTower`). The token types (which ids are image tokens)
depend on the ids, not the pixels: :func:`token_type_inputs`.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from lollm.vision.spec import VisionTower

#: The keyword arguments of a reference's forward that mark the image tokens (1) among the ids (0):
#: Gemma 3 reads ``token_type_ids`` (its bidirectional image mask); Gemma 4 and Qwen3.5 read
#: ``mm_token_type_ids`` (Gemma 4's "vision" mask rule, Qwen3.5's M-RoPE positions).
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")


def reference_inputs(tower: VisionTower, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image keyword arguments of transformers' forward for ``pixels`` (one tensor per image, in prompt order).

    pixels: each image as ``tower.preprocess`` gave it. Returns ``tower.reference_inputs(pixels)``
    when the tower has that method, else the default of a fixed-size tower:
    ``{"pixel_values": torch.stack(pixels)}``, (n_images, 3, H, W) float32.
    Raises ValueError when there is no image, or when a tower without the method gave pixels
    of different shapes (it must then say its own layout).
    """
    if not pixels:
        raise ValueError("reference_inputs: no image given")
    own = getattr(tower, "reference_inputs", None)
    if own is not None:
        return own(list(pixels))
    shapes = {tuple(p.shape) for p in pixels}
    if len(shapes) != 1:
        raise ValueError(f"the images' pixels have different shapes {sorted(shapes)}: a tower with a dynamic "
                         "resolution must give reference_inputs(pixels) (lollm.vision.spec.VisionTower)")
    return {"pixel_values": torch.stack(pixels)}


def token_type_inputs(forward: Callable, ids: torch.Tensor, image_token_id: int) -> dict[str, torch.Tensor]:
    """``{key: (ids == image_token_id) as int64}`` for each of :data:`TOKEN_TYPE_KEYS` that ``forward`` takes.

    forward: the reference model's ``forward`` (its signature is read); ids: (B, T) int64.
    """
    accepted = inspect.signature(forward).parameters
    marks = (ids == image_token_id).long()
    return {key: marks for key in TOKEN_TYPE_KEYS if key in accepted}
