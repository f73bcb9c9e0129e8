"""The shared preprocessing math: an RGB image -> the float tensor a vision tower reads.

Every tower in lollm starts the same way, only the numbers differ (the family's
:class:`lollm.vision.spec.VisionSpec` holds them)::

    RGB image (W x H, 8-bit)
      │ 1. resize to the tower's size          PIL, bilinear or bicubic, as transformers' processors
      ▼
    (3, h, w) uint8                             2. to_tensor: channels first
      │ 3. rescale: x / 255                     -> [0, 1]
      │ 4. normalize: (x - mean) / std          per channel -> about [-1, 1]
      ▼
    pixels (3, h, w) float32
      │ 5. patchify (towers that read flat patches; SigLIP's conv does the same cut)
      ▼
    patches (h/p * w/p, 3 * p * p)

Step 1 runs in Pillow on purpose: transformers' image processors resize with Pillow
(``image_transforms.resize``), and an interpolation written in torch differs from it by a
rounding step on 8-bit pixels; lollm's preprocessing is tested tensor for tensor
against transformers'. Steps 2-5 are torch.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from PIL import Image

#: Resampling filters by the names processors' configs use (``resample``: 2 bilinear, 3 bicubic).
RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
            "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}


def resize(image: Image.Image, height: int, width: int, resample: str = "bilinear") -> Image.Image:
    """Step 1: ``image`` resized to ``width`` x ``height`` pixels with Pillow's ``resample`` filter.

    The aspect ratio is not kept: Gemma 3 squeezes every image to a square; a tower with a
    dynamic-resolution rule (Qwen3.5) computes ``height``/``width`` first. Raises ValueError
    for an unknown filter name (a bug in the family's spec).
    """
    if resample not in RESAMPLE:
        raise ValueError(f"unknown resample filter {resample!r} (known: {', '.join(RESAMPLE)})")
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample=RESAMPLE[resample])


def to_tensor(image: Image.Image) -> torch.Tensor:
    """Step 2: an RGB image -> (3, H, W) uint8, channels first."""
    if image.mode != "RGB":
        raise ValueError(f"to_tensor needs an RGB image, got mode {image.mode!r} (lollm.vision.image decodes to RGB)")
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()  # (H, W, 3) -> (3, H, W)


def rescale(pixels: torch.Tensor, factor: float = 1 / 255) -> torch.Tensor:
    """Step 3: uint8 (3, H, W) -> float32 ``pixels * factor``; the product in float64 then rounded, as transformers."""
    return (pixels.to(torch.float64) * factor).to(torch.float32)


def normalize(pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Step 4: ``(pixels - mean[c]) / std[c]`` per channel c: (3, H, W) float32 -> (3, H, W) float32."""
    m = torch.tensor(mean, dtype=pixels.dtype)[:, None, None]  # (3, 1, 1)
    s = torch.tensor(std, dtype=pixels.dtype)[:, None, None]
    return (pixels - m) / s


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """Step 5: (3, H, W) -> (H/p * W/p, 3 * p * p): the p x p patches in reading order (row by row).

    Each row is one patch flattened channel first, then its rows, then its columns: the order
    in which a ``Conv2d(3, C, kernel_size=p, stride=p)`` reads its weight, so
    ``patches @ conv.weight.reshape(C, -1).T`` equals the convolution. Raises ValueError
    when H or W is not a multiple of p.
    """
    channels, height, width = pixels.shape
    if height % patch or width % patch:
        raise ValueError(f"patchify: {height}x{width} pixels do not cut into {patch}x{patch} patches")
    grid = pixels.reshape(channels, height // patch, patch, width // patch, patch)  # (3, gh, p, gw, p)
    return grid.permute(1, 3, 0, 2, 4).reshape(-1, channels * patch * patch)  # (gh*gw, 3*p*p)


def pixel_hash(pixels: torch.Tensor) -> str:
    """A SHA-256 of the tensor's dtype, shape and bytes: the identity of one image for a cache key.

    Two prompts that hold the same image tokens (every image's placeholders are the same
    token id) must share cached positions only when their pixels are the same; the engine's
    prefix cache keys image blocks by this hash.
    """
    data = pixels.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
