"""Qwen3.5's side of plugin contract 3 (vision): ``load_vision`` and the tower object core drives.

Core (``lollm.vision``, docs/vision.md) decodes an image and calls, per image:

* ``tower.preprocess(image)`` -> pixels: here the resized, normalized (3, H, W) float32 image
  (H and W multiples of 32: :func:`lollm_qwen3_5.vision_preprocess.smart_resize`). The patches
  are cut later, inside ``__call__``, so that the pixels keep their shape and ``grid`` can
  read the grid off it;
* ``tower.num_tokens(pixels)`` -> (H/32) * (W/32): one token per 2x2 block of 16-pixel patches;
* ``tower.grid(pixels)`` -> (1, H/32, W/32), the merged token grid that M-RoPE needs
  (:func:`lollm_qwen3_5.vision_positions.mrope_positions` with ``merge_size=1``);
* ``tower(pixels)`` -> (n, C) embeddings in the decoder's width and dtype.

The prompt: Qwen3.5's chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for
an image; core replaces it by ``<|vision_start|>`` + n x ``<|image_pad|>`` + ``<|vision_end|>``.

Weights: the full ``Qwen3_5(Moe)ForConditionalGeneration`` safetensors (``model.visual.*``).
A GGUF decoder keeps its tower in llama.cpp's separate mmproj file; reading it is
:func:`lollm_qwen3_5.vision.state_from_mmproj` (tested), and :func:`tower_from_mmproj` builds
the tower from one, for when core passes an mmproj path to the loader.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.load.options import DTYPE_ALIASES

from .vision import VisionConfig, VisionTower, load_tower, state_from_checkpoint, state_from_mmproj
from .vision_preprocess import ProcessorConfig, patchify, preprocess

#: the placeholder tokens of Qwen3.5's tokenizer (tokenizer_config.json's added tokens)
IMAGE_TOKEN = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


class Qwen3_5Vision(nn.Module):
    """The tower as contract 3 sees it: preprocess / num_tokens / grid / __call__ (see the module docstring)."""

    def __init__(self, tower: VisionTower, processor: ProcessorConfig, spec, dtype: torch.dtype):
        super().__init__()
        self.tower = tower
        self.processor = processor
        self.spec = spec
        self.dtype = dtype

    def preprocess(self, image) -> torch.Tensor:
        """RGB PIL image -> (3, H, W) float32, resized by the dynamic rule and normalized."""
        pixel_values, (_, h, w) = preprocess(image, self.processor)
        P, T = self.processor.patch_size, self.processor.temporal_patch_size
        m = self.processor.merge_size
        # undo the patch cut (the tower re-cuts): rows (h/m, w/m, m, m, C, T, P, P) -> (C, H, W), frame 0
        x = pixel_values.reshape(h // m, w // m, m, m, 3, T, P, P)[:, :, :, :, :, 0]
        return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, h * P, w * P).contiguous()

    def grid(self, pixels: torch.Tensor) -> tuple[int, int, int]:
        """(1, H/(P*m), W/(P*m)): the image's tokens as a grid, for M-RoPE."""
        f = self.processor.factor
        return 1, pixels.shape[1] // f, pixels.shape[2] // f

    def num_tokens(self, pixels: torch.Tensor) -> int:
        _, h, w = self.grid(pixels)
        return h * w

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(3, H, W) -> (num_tokens, decoder width) in the decoder's dtype."""
        pixel_values, grid = patchify(pixels.float(), self.processor)
        device = self.tower.patch_embed.weight.device
        with torch.no_grad():
            (embeds,) = self.tower(pixel_values.to(device), [grid])
        return embeds.to(self.dtype)


def vision_spec(config: dict, processor: ProcessorConfig):
    """The VisionSpec of a Qwen3.5 checkpoint (config.json's image_token_id; the processor's numbers)."""
    from lollm.vision.spec import VisionSpec

    return VisionSpec(
        image_size=None, patch_size=processor.patch_size, image_mean=processor.image_mean,
        image_std=processor.image_std, merge=processor.merge_size, image_token=IMAGE_TOKEN,
        image_token_id=int(config["image_token_id"]), placeholder=VISION_START + IMAGE_TOKEN + VISION_END,
        begin_text=VISION_START, end_text=VISION_END, resample="bicubic",
    )


def load_vision(checkpoint, options) -> Qwen3_5Vision | None:
    """``Family.vision`` of qwen3_5 / qwen3_5_moe: the tower of a multimodal safetensors checkpoint, or None.

    None for the text-only layout (no ``vision_config``) and for GGUF (the tower is in an mmproj file).
    preprocessor_config.json beside config.json is read when present (else Qwen3.5's published values).
    ConfigError / WeightsError name the key or tensor.
    """
    import json

    if checkpoint.fmt != "safetensors" or "vision_config" not in checkpoint.config:
        return None
    where = str(checkpoint.path / "config.json")
    config = VisionConfig.from_config(checkpoint.config, where)
    names = list(checkpoint.weights.names())
    tower = load_tower(VisionTower(config), state_from_checkpoint(checkpoint.weights.read, names), where)
    pre = checkpoint.path / "preprocessor_config.json"
    processor = (ProcessorConfig.from_file_dict(json.loads(pre.read_text(encoding="utf-8")), str(pre))
                 if pre.is_file() else ProcessorConfig())
    return _finish(tower, processor, checkpoint.config, options)


def tower_from_mmproj(path, config: dict, options, budget: ProcessorConfig | None = None) -> Qwen3_5Vision:
    """The tower from llama.cpp's mmproj GGUF at ``path``; ``config``: the decoder's (for image_token_id).

    Patch, merge, mean and std come from the file (``clip.vision.*``). The file does not carry the
    pixel budget: ``budget``'s min_pixels / max_pixels (e.g. a preprocessor_config.json), else
    Qwen3.5's published one.
    """
    from lollm.gguf.reader import GGUFTensorSource

    source = GGUFTensorSource(path)
    names = source.names()
    vision = VisionConfig.from_mmproj(source.metadata, {n: source.shape(n) for n in names}, str(path))
    tower = load_tower(VisionTower(vision), state_from_mmproj(source.read, names, str(path)), str(path))
    meta = source.metadata
    budget = budget or ProcessorConfig()
    processor = ProcessorConfig(
        min_pixels=budget.min_pixels, max_pixels=budget.max_pixels, patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        image_mean=tuple(meta["clip.vision.image_mean"]), image_std=tuple(meta["clip.vision.image_std"]),
    )
    return _finish(tower, processor, config, options)


def _finish(tower: VisionTower, processor: ProcessorConfig, config: dict, options) -> Qwen3_5Vision:
    """Place the tower on the options' device and dtype (resolved by core: "cpu" / "float32" ...).

    Unresolved ("auto"), it stays on the CPU in float32.
    """
    device = "cpu" if options.device == "auto" else options.device
    name = "float32" if options.dtype == "auto" else DTYPE_ALIASES.get(options.dtype, options.dtype)
    dtype = getattr(torch, name)
    return Qwen3_5Vision(tower.to(device=device, dtype=dtype), processor, vision_spec(config, processor), dtype).eval()
