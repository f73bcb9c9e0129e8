"""The gemma4 vision tower as plugin contract 3 (lollm.vision) drives it: ``load_vision`` and a VisionTower.

The tower itself is gemma4_vision.py; this file only adapts it:

* ``preprocess(image)``: step 1-2 of gemma4_vision_preprocess (resize keeping the aspect ratio
  within the soft-token budget, ÷ 255) -> pixels (3, H, W) float32 in [0, 1]. The pixels, not
  the patches, are what core hashes for the prefix cache and what ``num_tokens`` reads.
* ``num_tokens(pixels)``: (H/p)·(W/p) / k², the image's soft tokens (at most 280 on E2B).
* ``tower(pixels)``: steps 3-4 of the preprocessing (patches in (row, column, channel) order,
  (x, y) positions), then the tower and projector -> (n, C_text).
* ``reference_inputs(pixels)``: the same patches and positions, padded as transformers' processor
  pads them, for the parity gate's reference (``lollm parity --image``).

The prompt: a chat template writes ``<|image|>`` per image; core turns each into
``<|image>`` + ``<|image|>`` × n + ``<image|>``, as transformers' Gemma4Processor does.

What the decoder does with the ImageBatch: gemma4/modeling_gemma4.py, ``Gemma4ForCausalLM.embed``
(``<pad>`` at the image slots, scale by sqrt(C), ``scatter_images``, the per-layer inputs from
the scattered embeddings) and gemma4/blocks.py, ``image_visible`` (26B/31B: the sliding layers
bidirectional inside each image).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lollm.errors import ConfigError
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.vision.preprocess import rescale, to_tensor
from lollm.vision.spec import VisionSpec

from .gemma4_vision import Gemma4Vision, VisionConfig
from .gemma4_vision_preprocess import ProcessorConfig, patchify, resize
from .gemma4.config_gguf import require_image_rule
from .gemma4_vision_weights import HF_PREFIXES, budget_beside, build, mmproj_config, mmproj_state

#: Gemma 4's image tokens as its tokenizer spells them (tokenizer_config.json of gemma-4-E2B-it):
#: the placeholder repeated per soft token (also what the chat template writes per image),
#: and the tokens around one image's run.
IMAGE_TOKEN, BOI, EOI = "<|image|>", "<|image>", "<image|>"


class Gemma4VisionTower(nn.Module):
    """A :class:`Gemma4Vision` behind the :class:`lollm.vision.spec.VisionTower` protocol."""

    def __init__(self, vision: Gemma4Vision):
        super().__init__()
        c = vision.config
        self.vision = vision
        self.processor = ProcessorConfig(patch_size=c.patch_size, max_soft_tokens=c.soft_tokens_per_image,
                                         pooling_kernel_size=c.pooling_kernel_size)
        self.spec = VisionSpec(
            image_size=None, patch_size=c.patch_size, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0),
            merge=c.pooling_kernel_size, image_token=IMAGE_TOKEN, image_token_id=c.image_token_id,
            placeholder=IMAGE_TOKEN, begin_text=BOI, end_text=EOI, resample="bicubic",
        )

    def preprocess(self, image: Any) -> torch.Tensor:
        """An RGB PIL image -> (3, H, W) float32 in [0, 1], H and W multiples of k·p within the budget."""
        return rescale(to_tensor(resize(image, self.processor)))

    def num_tokens(self, pixels: torch.Tensor) -> int:
        """(H/p)·(W/p) patches, one soft token per k×k block of them."""
        p = self.processor.patch_size
        return (pixels.shape[1] // p) * (pixels.shape[2] // p) // self.processor.pooling_kernel_size**2

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (3, H, W) -> soft tokens (num_tokens(pixels), C_text) in the tower's dtype and device."""
        weight = self.vision.embed_vision.embedding_projection.weight
        patches, positions = patchify(pixels.permute(1, 2, 0), self.processor.patch_size)  # (N, p·p·3), (N, 2)
        return self.vision(patches.to(weight.device, weight.dtype), positions.to(weight.device))

    def reference_inputs(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' forward inputs for these images (each (3, H, W) from ``preprocess``), as
        ``Gemma4ImageProcessorPil`` lays them out: every image's patches padded to the budget.

        Returns ``pixel_values`` (B, max_patches, p·p·3) float32, zeros after an image's patches, and
        ``image_position_ids`` (B, max_patches, 2) int64, its patches' (x, y), (-1, -1) after them.
        """
        p, budget = self.processor.patch_size, self.processor.max_patches
        values = torch.zeros(len(pixels), budget, p * p * 3)
        positions = torch.full((len(pixels), budget, 2), -1, dtype=torch.int64)
        for i, image in enumerate(pixels):
            patches, where = patchify(image.float().permute(1, 2, 0), p)  # (N, p·p·3), (N, 2)
            values[i, :patches.shape[0]] = patches
            positions[i, :patches.shape[0]] = where
        return {"pixel_values": values, "image_position_ids": positions}


def load_vision(checkpoint: Checkpoint, options: LoadOptions) -> Gemma4VisionTower | None:
    """The ``vision`` of the gemma4 Family (contract 3: vision): the tower of this checkpoint, or None.

    * a ``gemma4`` safetensors checkpoint: the tower beside the decoder (``model.vision_tower.*``,
      ``model.embed_vision.*``);
    * an mmproj GGUF (``general.architecture`` "clip", from ``convert_hf_to_gguf.py --mmproj``, given
      with ``--mmproj``): the tower alone (gemma4_vision_weights.mmproj_state). Core hands it over
      with the text model's tokenizer, which knows the image tokens' ids; the soft-token budget
      comes from a preprocessor_config.json beside the file, else the published 280. The text GGUF
      does not say how its images attend, so the mmproj's ``clip.vision.projection_dim`` (the text
      width) must be a published checkpoint's (gemma4/config_gguf.py, IMAGE_ATTENTION_BY_WIDTH,
      the same table the GGUF decoder's config reads): another width is refused before any image
      is encoded, naming the width and the table;
    * None for a ``gemma4_text`` checkpoint, one without ``vision_config``, and a text GGUF file.

    Raises ConfigError for the mmproj's width, its missing image tokens or a broken mmproj
    (naming the file and key or tensor); ValueError naming the missing config key or the missing,
    unexpected or misshapen tensors of a safetensors checkpoint.
    """
    cfg = checkpoint.config
    if checkpoint.fmt == "gguf" and cfg.get("general.architecture") == "clip":
        return Gemma4VisionTower(_mmproj_vision(checkpoint, options)).eval()
    if checkpoint.fmt != "safetensors" or cfg.get("model_type") != "gemma4" or not cfg.get("vision_config"):
        return None
    config = VisionConfig.from_dict(cfg, where=str(checkpoint.path / "config.json"))
    weights = checkpoint.weights
    state = {name.removeprefix("model."): weights.read(name) for name in weights.names() if name.startswith(HF_PREFIXES)}
    vision = build(config, state, source=str(checkpoint.path), dtype=options.torch_dtype, device=options.torch_device)
    return Gemma4VisionTower(vision).eval()


def _mmproj_vision(checkpoint: Checkpoint, options: LoadOptions) -> Gemma4Vision:
    """The tower of an mmproj GGUF that core opened as a checkpoint (its ``path``: the file's folder).

    1. the mask rule of the text width (``clip.vision.projection_dim``), or ConfigError;
    2. the image tokens' ids from the text model's tokenizer, or ConfigError;
    3. config (metadata, shapes, the budget beside the file) and tensors -> the module.
    """
    source, where = checkpoint.weights, f"mmproj {checkpoint.spec}"
    width = checkpoint.config.get("clip.vision.projection_dim")
    if not isinstance(width, int) or isinstance(width, bool):
        raise ConfigError(f"gemma4: {where}: 'clip.vision.projection_dim' (the text width) is {width!r}, not a number")
    require_image_rule(width, where)  # 1.
    ids = {text: checkpoint.tokenizer.token_to_id(text) for text in (IMAGE_TOKEN, BOI, EOI)}  # 2.
    if None in ids.values():
        missing = [text for text, i in ids.items() if i is None]
        raise ConfigError(f"gemma4: {where}: the text model's tokenizer has no {missing[0]!r}, so images cannot be placed")
    try:  # 3.
        config = mmproj_config(source, image_token_id=ids[IMAGE_TOKEN], boi_token_id=ids[BOI], eoi_token_id=ids[EOI],
                               soft_tokens_per_image=budget_beside(checkpoint.path))
        return build(config, mmproj_state(source), source=where, dtype=options.torch_dtype, device=options.torch_device)
    except ValueError as e:
        raise ConfigError(f"gemma4: {e}") from None
