"""Gemma 4's image preprocessing: an RGB image to the patches and positions its vision tower reads.

Steps (transformers' ``Gemma4ImageProcessor`` does the same; the tests compare tensor for tensor):

1. Resize, keeping the aspect ratio, to the largest size whose patch count fits the budget
   ``max_soft_tokens · k²`` (k = pooling_kernel_size) and whose sides are multiples of k·p
   (p = patch_size): 48 pixels on E2B, so that the patch grid tiles into k×k pooling blocks.
   Bicubic (Pillow's). An image already at that size is not resampled.
2. Pixels to [0, 1] (÷ 255). No mean/std: the tower maps them to [-1, 1] itself.
3. Cut into p×p patches, row-major over the grid; each patch flattened as
   (row in patch, column in patch, channel): (N, p·p·3), N = (H/p)·(W/p).
4. Each patch's position on the grid as (x, y) = (column, row): (N, 2).

The image becomes N / k² soft tokens: at most ``max_soft_tokens`` (280 on E2B; a square
image is resized to 768×768 pixels, 48×48 patches, 16×16 = 256 soft tokens: the budget
is a ceiling, not a target).
transformers pads every image's patches to the budget (positions -1); one image at a
time here, unpadded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: The soft-token budgets Gemma 4's processor accepts.
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class ProcessorConfig:
    """preprocessor_config.json's keys that matter: patch_size, max_soft_tokens, pooling_kernel_size."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, not {self.max_soft_tokens}")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


def target_size(height: int, width: int, cfg: ProcessorConfig) -> tuple[int, int]:
    """(height, width) after step 1, in pixels.

    Scale both sides by sqrt(budget_pixels / pixels), then round each down to a multiple
    of k·p. A very thin image whose short side rounds to 0 gets one k·p row (or column)
    and a long side of floor(aspect) · k·p, at most (max_patches / k²) · k·p.
    Raises ValueError for a 0-sized image or one both of whose sides round to 0.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"an image of {width}x{height} pixels has nothing to encode")
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    side = k * p
    budget = cfg.max_patches * p * p
    factor = math.sqrt(budget / (height * width))
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"an image of {width}x{height} pixels rounds to 0x0 (sides must be multiples of {side})")
    longest = (cfg.max_patches // k**2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    return h, w


def resize(image, cfg: ProcessorConfig):
    """Step 1 on a Pillow RGB image: the resized image (the same object when no resize is needed)."""
    from PIL import Image

    h, w = target_size(image.height, image.width, cfg)
    if (h, w) == (image.height, image.width):
        return image
    return image.resize((w, h), resample=Image.Resampling.BICUBIC)


def patchify(pixels: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-4: pixels (H, W, 3) -> patches (N, p·p·3) and positions (N, 2) int64 (x, y).

    Patch n is at grid row n // (W/p), column n % (W/p).
    """
    H, W, _ = pixels.shape
    p = patch_size
    gh, gw = H // p, W // p
    patches = pixels.reshape(gh, p, gw, p, 3).permute(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")  # (gh, gw) each
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1)  # (N, 2): (x, y)
    return patches, positions


def preprocess(image, cfg: ProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A Pillow image (converted to RGB) -> patches (N, p·p·3) float32 in [0, 1], positions (N, 2) int64.

    ``N / pooling_kernel_size²`` is the number of soft tokens the image becomes.
    """
    import numpy as np

    image = resize(image.convert("RGB"), cfg)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()) / 255  # (H, W, 3) in [0, 1]
    return patchify(pixels, cfg.patch_size)
