"""Qwen3.5's side of plugin contract 3 (vision): ``load_vision`` and the tower object core drives.

Core (``lollm.vision``, docs/vision.md) decodes an image and calls, per image:

* ``tower.preprocess(image)`` -> pixels: here the resized, normalized (3, H, W) float32 image
  (H and W multiples of 32: :func:`lollm_qwen3_5.vision_preprocess.smart_resize`). The patches
  are cut later, inside ``__call__``, so that the pixels keep their shape and ``grid`` can
  read the grid off it;
* ``tower.num_tokens(pixels)`` -> (H/32) * (W/32): one token per 2x2 block of 16-pixel patches;
* ``tower.grid(pixels)`` -> (1, H/32, W/32), the merged token grid that M-RoPE needs
  (:func:`lollm_qwen3_5.qwen3_5.mrope.mrope_positions` with ``merge_size=1``);
* ``tower(pixels)`` -> (n, C) embeddings in the decoder's width and dtype;
* ``tower.reference_inputs(pixels)`` -> the patches of all images concatenated and their grids, as
  transformers' processor gives them (for ``lollm parity --image``'s reference).

The prompt: Qwen3.5's chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for
an image; core replaces it by ``<|vision_start|>`` + n x ``<|image_pad|>`` + ``<|vision_end|>``.

Weights: the full ``Qwen3_5(Moe)ForConditionalGeneration`` safetensors (``model.visual.*``).
A GGUF decoder keeps its tower in llama.cpp's separate mmproj file (``lollm run X.gguf --mmproj
mmproj.gguf``): core opens it as a checkpoint of its own (``general.architecture`` "clip") with
the text model's tokenizer, and :func:`load_vision` builds the tower from it
(:func:`lollm_qwen3_5.vision.state_from_mmproj` reads the tensors).
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

    def reference_inputs(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' forward inputs for these images (each (3, H, W) from ``preprocess``), as
        ``Qwen2VLImageProcessorPil`` lays them out: every image's patches, concatenated.

        Returns ``pixel_values`` (sum of h*w, C*T*P*P) float32 in merge-block order and
        ``image_grid_thw`` (B, 3) int64, each image's (1, h, w) grid of patches (before the merge).
        """
        cut = [patchify(image.float(), self.processor) for image in pixels]
        return {"pixel_values": torch.cat([values for values, _ in cut]),
                "image_grid_thw": torch.tensor([grid for _, grid in cut], dtype=torch.int64)}


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

    * a multimodal safetensors checkpoint: the tower beside the decoder (``model.visual.*``);
    * an mmproj GGUF (``general.architecture`` "clip", given with ``--mmproj``): the tower alone, the
      image token's id from the text model's tokenizer, which core hands over with it;
    * None for the text-only layout (no ``vision_config``) and a text GGUF (give its mmproj file).

    preprocessor_config.json beside config.json (or beside the mmproj file) is read when present,
    else Qwen3.5's published values. ConfigError / WeightsError name the key or tensor.
    """
    if checkpoint.fmt == "gguf" and checkpoint.config.get("general.architecture") == "clip":
        return _mmproj_checkpoint_tower(checkpoint, options)
    if checkpoint.fmt != "safetensors" or "vision_config" not in checkpoint.config:
        return None
    where = str(checkpoint.path / "config.json")
    config = VisionConfig.from_config(checkpoint.config, where)
    names = list(checkpoint.weights.names())
    tower = load_tower(VisionTower(config), state_from_checkpoint(checkpoint.weights.read, names), where)
    return _finish(tower, _processor_beside(checkpoint.path) or ProcessorConfig(), checkpoint.config, options)


def _processor_beside(folder) -> ProcessorConfig | None:
    """The ProcessorConfig of ``folder``/preprocessor_config.json, or None when there is none."""
    import json

    pre = folder / "preprocessor_config.json"
    if not pre.is_file():
        return None
    return ProcessorConfig.from_file_dict(json.loads(pre.read_text(encoding="utf-8")), str(pre))


def _mmproj_checkpoint_tower(checkpoint, options) -> Qwen3_5Vision:
    """The tower of an mmproj GGUF that core opened as a checkpoint (``--mmproj``; its ``path`` is the file's folder)."""
    from lollm.errors import ConfigError

    image_token_id = checkpoint.tokenizer.token_to_id(IMAGE_TOKEN)
    if image_token_id is None:
        raise ConfigError(f"qwen3_5 mmproj {checkpoint.spec}: the text model's tokenizer has no {IMAGE_TOKEN!r}, "
                          "so the image tokens cannot be placed (is this the mmproj file of this model?)")
    return _tower_from_source(checkpoint.weights, checkpoint.spec, {"image_token_id": image_token_id}, options,
                              _processor_beside(checkpoint.path))


def tower_from_mmproj(path, config: dict, options, budget: ProcessorConfig | None = None) -> Qwen3_5Vision:
    """The tower from llama.cpp's mmproj GGUF at ``path``; ``config``: the decoder's (for image_token_id).

    Patch, merge, mean and std come from the file (``clip.vision.*``). The file does not carry the
    pixel budget: ``budget``'s min_pixels / max_pixels (e.g. a preprocessor_config.json), else
    Qwen3.5's published one.
    """
    from lollm.gguf.reader import GGUFTensorSource

    return _tower_from_source(GGUFTensorSource(path), str(path), config, options, budget)


def _tower_from_source(source, where: str, config: dict, options, budget: ProcessorConfig | None) -> Qwen3_5Vision:
    """:func:`tower_from_mmproj` on an open ``GGUFTensorSource``; ``where`` names the file in errors."""
    names = source.names()
    vision = VisionConfig.from_mmproj(source.metadata, {n: source.shape(n) for n in names}, where)
    tower = load_tower(VisionTower(vision), state_from_mmproj(source.read, names, where), where)
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
