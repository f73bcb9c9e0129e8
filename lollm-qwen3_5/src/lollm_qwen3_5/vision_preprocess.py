"""Qwen3.5's image preprocessing: from an RGB picture to the tower's ``pixel_values`` and ``grid_thw``.

Qwen's ViT takes images at (almost) their own resolution, so each image becomes
its own number of tokens. The steps (numbers for Qwen3.5's processor: P = 16,
m = 2, T = 2, mean = std = 0.5):

1. **dynamic resolution** (:func:`smart_resize`): round height and width to
   multiples of P * m = 32 pixels (so the patch grid divides into 2 x 2 merge
   blocks), then, if the area falls outside [min_pixels, max_pixels], scale both
   sides by the same factor to bring it inside, keeping the aspect ratio as
   close as the rounding allows. A 500 x 375 photo becomes 512 x 384: a 32 x 24
   grid of patches, 768 patches, 192 tokens after the merge.
2. **resize** with Pillow's bicubic filter (on the 8-bit pixels), then scale
   to [0, 1] and normalize per channel: (x - mean) / std.
3. **patchify** (:func:`patchify`): cut the (C, H, W) image into P x P patches
   and list them in *merge-block order* (block row, block column, row in block,
   column in block), so the 4 patches the merger fuses are adjacent rows.
4. **temporal patches**: the tower's patches are T = 2 frames deep (for video);
   a still image is duplicated into both frames. A row is then (C, T, P, P)
   flattened: C*T*P*P = 1536 numbers.

The result equals transformers' ``Qwen2VLImageProcessorPil`` (the slow class that
Qwen3.5's processor uses; tests/test_vision_preprocess.py checks it tensor for
tensor) without numpy or torchvision: only Pillow for the resize and torch.

Decoding untrusted bytes (bombs, truncated files, modes) is core's job
(lollm.vision); this module takes an already decoded ``PIL.Image`` in RGB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from lollm.errors import ConfigError

#: smart_resize refuses an image more elongated than this (as transformers does)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ProcessorConfig:
    """The numbers of Qwen3.5's image processor (preprocessor_config.json).

    Defaults are those of the Qwen3.5 (and Qwen3-VL) hub checkpoints: 16-pixel patches,
    2 x 2 merge, 2 temporal patches, mean = std = 0.5, areas from 65,536 (256 x 256)
    to 16,777,216 (4096 x 4096) pixels.
    """

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65_536  # size.shortest_edge in the file (an area, despite the name)
    max_pixels: int = 16_777_216  # size.longest_edge (an area)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        """Both sides become multiples of this: patch_size * merge_size (32)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_file_dict(cls, raw: Mapping[str, Any], where: str = "preprocessor_config.json") -> ProcessorConfig:
        """Read a preprocessor_config.json dict; keys it lacks keep the defaults.

        ``size`` {"shortest_edge", "longest_edge"} (or the older ``min_pixels`` / ``max_pixels``)
        are areas in pixels. ConfigError naming ``where`` and the key for a value of the wrong
        type or range.
        """
        def integer(key: str, value: Any, low: int = 1) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 40:
                raise ConfigError(f"{where}: {key} is {value!r}: expected an integer of at least {low}")
            return value

        def triple(key: str, value: Any) -> tuple[float, float, float]:
            if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)):
                raise ConfigError(f"{where}: {key} is {value!r}: expected three numbers (one per RGB channel)")
            if key == "image_std" and min(value) <= 0:
                raise ConfigError(f"{where}: image_std is {value!r}: every entry must be above 0")
            return tuple(float(v) for v in value)

        d = cls()
        size = raw.get("size") or {}
        config = cls(
            patch_size=integer("patch_size", raw.get("patch_size", d.patch_size)),
            merge_size=integer("merge_size", raw.get("merge_size", d.merge_size)),
            temporal_patch_size=integer("temporal_patch_size", raw.get("temporal_patch_size", d.temporal_patch_size)),
            min_pixels=integer("size.shortest_edge", size.get("shortest_edge", raw.get("min_pixels", d.min_pixels))),
            max_pixels=integer("size.longest_edge", size.get("longest_edge", raw.get("max_pixels", d.max_pixels))),
            image_mean=triple("image_mean", raw.get("image_mean", list(d.image_mean))),
            image_std=triple("image_std", raw.get("image_std", list(d.image_std))),
        )
        if config.min_pixels > config.max_pixels:
            raise ConfigError(f"{where}: size.shortest_edge {config.min_pixels} is above size.longest_edge "
                              f"{config.max_pixels} (both are areas in pixels)")
        return config


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of ``factor``, area within [min_pixels, max_pixels].

    1. round each side to the nearest multiple of ``factor`` (Python's round: halves to even);
    2. if that area exceeds max_pixels, shrink: divide both sides by
       beta = sqrt(height * width / max_pixels) and round *down* to multiples (at least one factor);
    3. if it is below min_pixels, grow: multiply both sides by
       beta = sqrt(min_pixels / (height * width)) and round *up*.
    ValueError when a side is not positive or the aspect ratio is above :data:`MAX_ASPECT_RATIO`.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image of {width} x {height} pixels: both sides must be at least 1")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width} x {height} pixels: aspect ratio above {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(image: torch.Tensor, config: ProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(C, H, W) normalized image -> pixel_values (h*w, C*T*P*P) in merge-block order, and (1, h, w).

    H and W must be multiples of P * m. Each still image fills all T temporal slots with itself.
    """
    P, m, T = config.patch_size, config.merge_size, config.temporal_patch_size
    C, H, W = image.shape
    h, w = H // P, W // P  # the patch grid
    x = image.reshape(C, h // m, m, P, w // m, m, P)  # (C, block row, in-row, P, block col, in-col, P)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, in-row, in-col, C, P, P)
    x = x[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, T, -1, -1)  # (..., C, T, P, P): the frame, T times
    return x.reshape(h * w, C * T * P * P), (1, h, w)


def preprocess(image, config: ProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One RGB ``PIL.Image`` -> (pixel_values (h*w, C*T*P*P) float32, grid (1, h, w)).

    The image goes through :func:`smart_resize`, Pillow's bicubic resize, /255, (x - mean) / std,
    then :func:`patchify`. ValueError when the image is not RGB (decode and convert it first).
    """
    from PIL import Image

    if image.mode != "RGB":
        raise ValueError(f"image mode is {image.mode!r}: Qwen3.5's preprocessing takes RGB images")
    height, width = smart_resize(image.height, image.width, config.factor, config.min_pixels, config.max_pixels)
    resized = image.resize((width, height), Image.Resampling.BICUBIC)  # 8-bit, as transformers resizes
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).reshape(height, width, 3)
    x = pixels.permute(2, 0, 1).float() / 255.0  # (C, H, W) in [0, 1]
    mean = torch.tensor(config.image_mean)[:, None, None]
    std = torch.tensor(config.image_std)[:, None, None]
    return patchify((x - mean) / std, config)


def preprocess_images(images, config: ProcessorConfig) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Several images -> pixel_values of all of them, concatenated (sum of h*w rows), and their grids."""
    rows, grids = [], []
    for image in images:
        pixel_values, grid = preprocess(image, config)
        rows.append(pixel_values)
        grids.append(grid)
    return torch.cat(rows), grids


def tokens_per_image(grid: tuple[int, int, int], merge_size: int) -> int:
    """How many placeholder tokens an image of grid (t, h, w) takes in the prompt: t*h*w / m²."""
    t, h, w = grid
    return t * h * w // merge_size**2
