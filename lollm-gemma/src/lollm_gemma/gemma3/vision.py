"""Gemma 3's eyes: a SigLIP vision tower and the average-pool projector (plugin contract 3: vision).

Gemma 3 4B, 12B and 27B read images; 270M and 1B do not. Every image becomes 256 tokens::

    RGB image, any size
        │ 1. resize to 896 x 896 (bilinear; the aspect ratio is not kept), /255, (x - 0.5) / 0.5
        ▼
    pixels (3, 896, 896)
        │ 2. patch_embedding: a 14x14 convolution with stride 14 = one linear map per patch
        ▼
    (P, D)  P = 64 x 64 = 4096 patches, D = 1152    + 3. position_embedding (one learned vector per patch)
        │ 4. 27 SigLIP encoder layers: LayerNorm, attention (every patch sees every patch), LayerNorm, MLP
        │ 5. post_layernorm
        ▼
    (P, D) as a 64 x 64 grid
        │ 6. avg-pool 4x4 -> 16 x 16 grid: the 256 image tokens
        │ 7. RMSNorm (Gemma's, 1 + w), then a linear map D -> C (C = the decoder's width, 2560 in 4B)
        ▼
    (256, C): the embeddings that replace the 256 ``<image_soft_token>`` of the prompt

In the tiny test checkpoint the same steps run on 64 x 64 images with 8-pixel patches:
an 8 x 8 grid pooled 2 x 2 into 16 tokens (``mm_tokens_per_image``).

The decoder (modeling_gemma3.py) puts these rows in place of the placeholders and, during
prefill, lets the 256 tokens of one image attend to each other in both directions (text stays causal).

Module names mirror transformers' ``Gemma3ForConditionalGeneration`` (``vision_tower.*``,
``multi_modal_projector.*``); :data:`VISION_PREFIXES` maps the three spellings files use.
References: SigLIP (Zhai et al. 2023), ViT (Dosovitskiy et al. 2020), the Gemma 3 technical report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lollm.errors import ConfigError
from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import MAX_HEADS, MAX_LAYERS, MAX_WIDTH, ConfigReader, tensor_table
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.vision.preprocess import normalize, rescale, resize, to_tensor
from lollm.vision.spec import VisionSpec

from .blocks import RMSNorm
from .config import Gemma3Config

#: Gemma 3's image tokens as its tokenizer spells them (tokenizer_config.json of gemma-3-4b-it).
IMAGE_TOKEN, BOI, EOI = "<image_soft_token>", "<start_of_image>", "<end_of_image>"

#: SigLIP's vision_config defaults (transformers' SiglipVisionConfig), applied under the checkpoint's keys.
VISION_DEFAULTS = {"layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", "num_channels": 3,
                   "vision_use_head": False}


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The numbers of the tower and projector, from config.json's ``vision_config`` and top-level keys.

    hidden_size D, intermediate_size, num_hidden_layers, num_attention_heads: the SigLIP encoder.
    image_size S, patch_size p: S/p patches per side. tokens_per_image n (``mm_tokens_per_image``):
    a perfect square; the pool's kernel is (S/p) / sqrt(n). text_hidden_size C: the decoder's width.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    tokens_per_image: int
    image_token_id: int
    text_hidden_size: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """The average pool's kernel and stride: patches per side / tokens per side (4 in Gemma 3)."""
        return self.patches_per_side // math.isqrt(self.tokens_per_image)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Gemma3VisionConfig":
        """Read a ``gemma3`` config.json; ConfigError naming the key for anything we do not implement."""
        top = ConfigReader(raw, "config.json")
        vision = ConfigReader(top.value("vision_config"), "config.json 'vision_config'", VISION_DEFAULTS)
        vision.check(vision.string("hidden_act") == "gelu_pytorch_tanh",
                     "'hidden_act' must be 'gelu_pytorch_tanh' (the only activation SigLIP's Gemma 3 tower uses)")
        vision.check(vision.boolean("vision_use_head") is False, "'vision_use_head' must be false (Gemma 3 has no head)")
        vision.check(vision.positive_int("num_channels", at_most=3) == 3, "'num_channels' must be 3 (RGB)")
        config = cls(
            hidden_size=vision.positive_int("hidden_size", at_most=MAX_WIDTH),
            intermediate_size=vision.positive_int("intermediate_size", at_most=MAX_WIDTH * 8),
            num_hidden_layers=vision.positive_int("num_hidden_layers", at_most=MAX_LAYERS),
            num_attention_heads=vision.positive_int("num_attention_heads", at_most=MAX_HEADS),
            image_size=vision.positive_int("image_size", at_most=8192),
            patch_size=vision.positive_int("patch_size", at_most=1024),
            layer_norm_eps=vision.number("layer_norm_eps", above=0.0, at_most=1.0),
            tokens_per_image=top.positive_int("mm_tokens_per_image", 256, at_most=65536),
            image_token_id=top.integer("image_token_index", 262144, at_most=10_000_000),
            text_hidden_size=Gemma3Config.from_hf(raw).hidden_size,
        )
        config.check()
        return config

    def check(self) -> None:
        """The rules between the numbers: patches tile the image, tokens tile the patch grid."""
        side = math.isqrt(self.tokens_per_image)
        where = "config.json"
        if self.image_size % self.patch_size:
            raise ConfigError(f"{where}: vision_config image_size {self.image_size} is not a multiple of "
                              f"patch_size {self.patch_size}")
        if side * side != self.tokens_per_image or self.patches_per_side % side:
            raise ConfigError(f"{where}: mm_tokens_per_image {self.tokens_per_image} must be a square whose side "
                              f"divides the {self.patches_per_side} patches per side")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{where}: vision_config hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}")


# ---------------------------------------------------------------------------
# The SigLIP encoder
# ---------------------------------------------------------------------------
class SiglipEmbeddings(nn.Module):
    """Steps 2-3: pixels (1, 3, S, S) -> patches (1, P, D), each plus its learned position vector."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        D, p = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(3, D, kernel_size=p, stride=p)  # one linear map per p x p patch
        self.position_embedding = nn.Embedding(config.patches_per_side**2, D)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)  # (1, D, S/p, S/p)
        x = x.flatten(2).transpose(1, 2)  # (1, P, D): patches in reading order, row by row
        return x + self.position_embedding.weight[None]  # patch i gets position vector i


class SiglipAttention(nn.Module):
    """Multi-head self-attention with biases, no mask: every patch attends to every patch. (1, P, D) -> (1, P, D)."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        D = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.v_proj, self.out_proj = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, P, D = x.shape
        H = self.num_heads
        q, k, v = (proj(x).view(1, P, H, D // H).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # (1, H, P, D/H), scale 1/sqrt(D/H)
        return self.out_proj(out.transpose(1, 2).reshape(1, P, D))


class SiglipMLP(nn.Module):
    """fc2(gelu_tanh(fc1(x))), with biases: (1, P, D) -> (1, P, F) -> (1, P, D)."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    """Step 4, one layer, pre-norm: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``. (1, P, D) -> (1, P, D)."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(D, eps=eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(D, eps=eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipVisionModel(nn.Module):
    """Steps 2-5 (named ``vision_tower`` in the model): pixels (1, 3, S, S) -> (1, P, D)."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    """Steps 6-7: (1, P, D) -> avg-pool the patch grid -> RMSNorm -> x @ W: (n, C)."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        self.side, self.pool = config.patches_per_side, config.pool
        # stored (D, C), applied as x @ W (no nn.Linear: the checkpoint keeps it in this orientation)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(config.hidden_size, config.text_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, P, D = x.shape
        grid = x.transpose(1, 2).reshape(1, D, self.side, self.side)  # (1, D, S/p, S/p): patches back on their grid
        pooled = F.avg_pool2d(grid, kernel_size=self.pool, stride=self.pool)  # (1, D, sqrt(n), sqrt(n))
        tokens = pooled.flatten(2).transpose(1, 2)  # (1, n, D), row by row
        return (self.mm_soft_emb_norm(tokens) @ self.mm_input_projection_weight)[0]  # (n, C)


class Gemma3VisionTower(nn.Module):
    """The tower and projector as one :class:`lollm.vision.spec.VisionTower`: image -> pixels -> (n, C)."""

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        self.config = config
        S = config.image_size
        self.spec = VisionSpec(
            image_size=(S, S), patch_size=config.patch_size, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
            merge=config.pool, image_token=IMAGE_TOKEN, image_token_id=config.image_token_id, placeholder=BOI,
            begin_text=f"\n\n{BOI}", end_text=f"{EOI}\n\n", resample="bilinear",
        )
        self.vision_tower = SiglipVisionModel(config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def preprocess(self, image: Any) -> torch.Tensor:
        """Step 1: an RGB PIL image -> (3, S, S) float32, as transformers' Gemma3ImageProcessor (no pan-and-scan)."""
        spec = self.spec
        image = resize(image, *spec.image_size, resample=spec.resample)
        return normalize(rescale(to_tensor(image)), spec.image_mean, spec.image_std)

    def num_tokens(self, pixels: torch.Tensor) -> int:
        """Every image is squeezed to S x S, so every image is ``mm_tokens_per_image`` tokens (256)."""
        return self.config.tokens_per_image

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (3, S, S) -> (n, C) in the tower's dtype (steps 2-7)."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        S = self.config.image_size
        if tuple(pixels.shape) != (3, S, S):
            raise ValueError(f"gemma3 vision tower: pixels must be (3, {S}, {S}), got {tuple(pixels.shape)}")
        x = pixels.to(weight.device, weight.dtype)[None]  # (1, 3, S, S)
        return self.multi_modal_projector(self.vision_tower(x))


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------
#: The tower's tensors, by their model names (``{i}``: the encoder layer).
TOWER_NAMES = (
    "embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias", "embeddings.position_embedding.weight",
    *(f"encoder.layers.{{i}}.{m}.{p}" for m in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj",
                                                 "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
      for p in ("weight", "bias")),
    "post_layernorm.weight", "post_layernorm.bias",
)
PROJECTOR_NAMES = ("mm_input_projection_weight", "mm_soft_emb_norm.weight")

#: File prefix -> model prefix: published files (``vision_tower.vision_model.``), transformers 5's
#: save_pretrained (``vision_tower.``), transformers 4.52-4.57's (``model.vision_tower.vision_model.``).
VISION_PREFIXES = {
    "vision_tower.vision_model.": "vision_tower.", "vision_tower.": "vision_tower.",
    "model.vision_tower.vision_model.": "vision_tower.", "model.vision_tower.": "vision_tower.",
}
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")

#: The decoder's tensors, which load() reads: skipped here.
DECODER_PREFIXES = ("language_model.", "model.language_model.", "lm_head.")


def vision_names() -> dict[str, str]:
    """file name template -> model name template, for every spelling of :data:`VISION_PREFIXES`."""
    table = {file + name: model + name for file, model in VISION_PREFIXES.items() for name in TOWER_NAMES}
    table.update({file + name: "multi_modal_projector." + name for file in PROJECTOR_PREFIXES for name in PROJECTOR_NAMES})
    return table


VISION_LAYOUT = WeightLayout(name_maps={
    "safetensors": NameMap("gemma3", "multimodal (model_type 'gemma3') safetensors, vision tower", vision_names(),
                           ignored_prefixes=DECODER_PREFIXES),
})


def load_vision(checkpoint: Checkpoint, options: LoadOptions) -> Gemma3VisionTower | None:
    """The ``vision`` of the gemma3 Family (contract 3: vision): the tower of a ``gemma3`` checkpoint, or None.

    None for a ``gemma3_text`` checkpoint (270M, 1B: no tower) and for a GGUF file (llama.cpp keeps
    the tower in a separate mmproj file, not read yet). Raises ConfigError (vision_config) and
    WeightsError (a tower tensor missing, unexpected or misshapen), naming the key or tensor.
    """
    if checkpoint.fmt != "safetensors" or checkpoint.config.get("model_type") != "gemma3":
        return None
    config = Gemma3VisionConfig.from_hf(checkpoint.config)
    table = tensor_table(checkpoint.weights, VISION_LAYOUT.name_map("safetensors", "gemma3"))
    layers = {name.split(".")[3] for name in table if name.startswith("vision_tower.encoder.layers.")}
    if len(layers) != config.num_hidden_layers:
        raise ConfigError(f"config.json 'vision_config' says num_hidden_layers {config.num_hidden_layers}, "
                          f"the checkpoint holds {len(layers)} vision encoder layers")
    return build_model(Gemma3VisionTower, config, checkpoint.weights, "safetensors", options, VISION_LAYOUT)
