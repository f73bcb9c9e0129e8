"""Qwen3.5's vision tower: a ViT that turns an image's patches into decoder-width embeddings.

Every Qwen3.5 checkpoint (qwen3_5 and qwen3_5_moe alike: the two share this tower
unchanged) is natively multimodal. The tower reads what the preprocessing
(:mod:`lollm_qwen3_5.vision_preprocess`) makes of an image:

* ``pixel_values`` (N, C*T*P*P): one row per patch of P x P pixels (P = 16), C = 3
  colour channels, T = 2 *temporal* patches (a still image is its own frame twice);
* ``grid_thw``: per image (t, h, w), its grid of patches (t = 1 for an image).

The rows come in **merge-block order**: the 2 x 2 patches that the merger will fuse
into one token are adjacent rows (block row, block column, row in block, column in
block). Everything that has a position here (the learned position table, 2D RoPE)
is laid out in that same order.

The forward, step by step (D = hidden_size, 768 in Qwen3.5-0.8B; m = spatial merge, 2):

1. patch embedding: a Conv3d with kernel = stride = (T, P, P) over one patch is a
   matrix product, so it is a Linear (C*T*P*P -> D) here; its weight is the conv's
   reshaped.
2. learned position embedding: a square table of ``num_position_embeddings``
   (48 x 48 = 2304) vectors, resized bilinearly (align_corners) to the image's
   (h, w) grid, reordered into merge-block order, added to every frame.
3. 2D RoPE: each head's D_h channels turn by the patch's row (first quarter of the
   frequencies' channels) and column (second quarter); the angles are repeated
   for the two halves as in the ``rotate_half`` convention.
4. the blocks: pre-LayerNorm ViT blocks (fused qkv with bias, non-causal attention
   within one frame only, GELU-tanh MLP).
5. the merger: LayerNorm, then every m*m = 4 adjacent rows concatenated
   (4D wide) and projected through Linear -> GELU -> Linear to the decoder width.

Qwen3-VL adds "deepstack" mergers that feed middle layers to the decoder; Qwen3.5's
configs list none (``deepstack_visual_indexes: []``), and a config listing some is
refused rather than half-supported.

Weights come from the full checkpoint's ``model.visual.*`` safetensors
(:func:`state_from_checkpoint`) or from llama.cpp's ``mmproj`` GGUF
(:func:`state_from_mmproj`, whose numbers :meth:`VisionConfig.from_mmproj` reads).

References: transformers' ``models/qwen3_5/modeling_qwen3_5.py`` (Qwen3_5VisionModel)
and ``vision_utils.py``; llama.cpp's ``conversion/qwen3vl.py`` for the mmproj names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lollm.errors import ConfigError, WeightsError
from lollm.load.checks import MAX_HEADS, MAX_LAYERS, MAX_WIDTH, ConfigReader

#: config.json's ``hidden_act`` -> torch's GELU ``approximate`` argument
GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
#: LayerNorm epsilon of every norm in the tower (fixed in transformers' module, not in the config)
LAYER_NORM_EPS = 1e-6
#: the 2D RoPE base: transformers' default for the tower; neither config.json nor the mmproj carries it
VISION_ROPE_THETA = 10000.0
#: largest patch side / merge / temporal patch we accept from a config (the real ones are 16, 2, 2)
MAX_PATCH = 1024


@dataclass(frozen=True)
class VisionConfig:
    """The numbers of Qwen3.5's vision tower (config.json's ``vision_config``; defaults are Qwen3.5-0.8B's)."""

    depth: int  # ViT blocks (12)
    hidden_size: int  # D (768)
    num_heads: int  # attention heads (12); head_dim = D / num_heads
    intermediate_size: int  # MLP width (3072)
    patch_size: int  # P, pixels per patch side (16)
    temporal_patch_size: int  # T, frames per patch (2)
    spatial_merge_size: int  # m, patches per merged token side (2)
    in_channels: int  # C (3)
    out_hidden_size: int  # the decoder's hidden size (1024)
    num_position_embeddings: int  # learned position table, a square: side**2 (2304 = 48**2)
    gelu_approximate: str  # "tanh" (gelu_pytorch_tanh) or "none"
    rope_theta: float = VISION_ROPE_THETA

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one pixel_values row: C * T * P * P (3 * 2 * 16 * 16 = 1536)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table (48)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def merged_size(self) -> int:
        """Width of one merged row: D * m * m (3072)."""
        return self.hidden_size * self.spatial_merge_size**2

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], where: str = "config.json") -> VisionConfig:
        """Read the ``vision_config`` section of a multimodal Qwen3.5 config.json (the whole dict ``raw``).

        ConfigError naming ``where``, the key and the value: no ``vision_config`` (a text-only
        checkpoint), a missing or out-of-range key, an activation other than GELU, deepstack layers,
        a width that the heads do not divide, a position table that is not a square.
        """
        top = ConfigReader(raw, where)
        read = top.section("vision_config")
        if read is None:
            raise top.fail("has no vision_config: this checkpoint carries no vision tower (a text-only layout)")
        act = read.string("hidden_act", choices=sorted(GELU_APPROXIMATE))
        deepstack = read.value("deepstack_visual_indexes", [])
        read.check(deepstack == [], f"deepstack_visual_indexes is {deepstack!r}: Qwen3.5's tower has none "
                   "(Qwen3-VL's deepstack mergers are not implemented)")
        config = cls(
            depth=read.positive_int("depth", at_most=MAX_LAYERS),
            hidden_size=read.positive_int("hidden_size", at_most=MAX_WIDTH),
            num_heads=read.positive_int("num_heads", at_most=MAX_HEADS),
            intermediate_size=read.positive_int("intermediate_size", at_most=MAX_WIDTH),
            patch_size=read.positive_int("patch_size", at_most=MAX_PATCH),
            temporal_patch_size=read.positive_int("temporal_patch_size", at_most=MAX_PATCH),
            spatial_merge_size=read.positive_int("spatial_merge_size", at_most=MAX_PATCH),
            in_channels=read.positive_int("in_channels", at_most=4),
            out_hidden_size=read.positive_int("out_hidden_size", at_most=MAX_WIDTH),
            num_position_embeddings=read.positive_int("num_position_embeddings", at_most=MAX_WIDTH),
            gelu_approximate=GELU_APPROXIMATE[act],
        )
        config.check(read.fail)
        return config

    @classmethod
    def from_mmproj(cls, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str) -> VisionConfig:
        """The same numbers from a llama.cpp mmproj GGUF (``clip.*`` metadata plus two tensor shapes).

        metadata: the file's key/values; shapes: tensor name -> torch shape; where: the file (for errors).
        The mmproj stores the position table as a square image size (``clip.vision.image_size`` =
        side * P) and the temporal patch as two conv weights (``v.patch_embd.weight`` and ``.weight.1``).
        ConfigError naming the file and key when one is missing or the projector is not Qwen3-VL's merger.
        """
        def need(key: str) -> Any:
            if key not in metadata:
                raise ConfigError(f"{where}: missing metadata key {key!r} (not a Qwen3.5 mmproj file?)")
            return metadata[key]

        projector = need("clip.projector_type")
        if projector != "qwen3vl_merger":
            raise ConfigError(f"{where}: clip.projector_type is {projector!r}, expected 'qwen3vl_merger'")
        if any(need("clip.vision.is_deepstack_layers")):
            raise ConfigError(f"{where}: clip.vision.is_deepstack_layers lists deepstack layers; Qwen3.5 has none")
        if "v.patch_embd.weight" not in shapes:
            raise ConfigError(f"{where}: no tensor 'v.patch_embd.weight'")
        patch = int(need("clip.vision.patch_size"))
        side = int(need("clip.vision.image_size")) // patch
        config = cls(
            depth=int(need("clip.vision.block_count")),
            hidden_size=int(need("clip.vision.embedding_length")),
            num_heads=int(need("clip.vision.attention.head_count")),
            intermediate_size=int(need("clip.vision.feed_forward_length")),
            patch_size=patch,
            temporal_patch_size=2 if "v.patch_embd.weight.1" in shapes else 1,
            spatial_merge_size=int(need("clip.vision.spatial_merge_size")),
            in_channels=shapes["v.patch_embd.weight"][1],
            out_hidden_size=int(need("clip.vision.projection_dim")),
            num_position_embeddings=side * side,
            gelu_approximate="tanh" if need("clip.use_gelu") else "none",
        )
        config.check(lambda message: ConfigError(f"{where} {message}"))
        return config

    def check(self, fail: Callable[[str], Exception]) -> None:
        """Consistency rules between the numbers; ``fail(message)`` makes the error to raise."""
        if self.hidden_size % self.num_heads:
            raise fail(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise fail(f"head_dim {self.head_dim} (hidden_size / num_heads) is not a multiple of 4 (2D RoPE)")
        if self.grid_side**2 != self.num_position_embeddings:
            raise fail(f"num_position_embeddings {self.num_position_embeddings} is not a square (the position grid)")


# ---------------------------------------------------------------------------------------------
# Positions: the learned table resized to the grid, and the (row, column) of every patch
# ---------------------------------------------------------------------------------------------

def merge_block_order(h: int, w: int, m: int) -> torch.Tensor:
    """Raster indices (row * w + col) of an (h, w) patch grid, listed in merge-block order.

    Returns a LongTensor (h*w,): block row, block column, row in block, column in block.
    E.g. h = w = 4, m = 2: [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15].
    """
    raster = torch.arange(h * w).reshape(h // m, m, w // m, m)  # (block row, in-row, block col, in-col)
    return raster.permute(0, 2, 1, 3).reshape(-1)


def patch_rows_cols(grid_thw: Sequence[Sequence[int]], m: int) -> torch.Tensor:
    """(row, column) of every patch row of pixel_values, for the 2D RoPE: LongTensor (N, 2).

    grid_thw: per image (t, h, w); each frame repeats the same (row, column) list.
    """
    out = []
    for t, h, w in grid_thw:
        order = merge_block_order(h, w, m)
        rows_cols = torch.stack([order // w, order % w], dim=-1)  # (h*w, 2)
        out.append(rows_cols.repeat(t, 1))
    return torch.cat(out)


def learned_positions(table: torch.Tensor, grid_thw: Sequence[Sequence[int]], m: int) -> torch.Tensor:
    """The learned position table resized to each image's grid: (N, D), rows in pixel_values' order.

    table: (side*side, D), a square grid of vectors. Each image's (h, w) grid gets the table
    resized bilinearly with align_corners=True (the table's corners land on the grid's corner
    patches), reordered into merge-block order and repeated for each of its t frames.
    """
    side = math.isqrt(table.shape[0])
    square = table.reshape(side, side, -1).permute(2, 0, 1)[None]  # (1, D, side, side)
    out = []
    for t, h, w in grid_thw:
        resized = F.interpolate(square.float(), size=(h, w), mode="bilinear", align_corners=True)  # (1, D, h, w)
        raster = resized[0].flatten(1).T  # (h*w, D)
        out.append(raster[merge_block_order(h, w, m)].repeat(t, 1).to(table.dtype))
    return torch.cat(out)


def vision_rope(rows_cols: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 2D RoPE, each (N, head_dim), float32.

    rows_cols: (N, 2) from :func:`patch_rows_cols`. head_dim / 4 frequencies
    inv_freq[i] = theta ** (-4i / head_dim); the angles of a patch are
    [row * inv_freq, col * inv_freq] (head_dim / 2), repeated twice for the two halves
    that ``rotate_half`` pairs.
    """
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(quarter, dtype=torch.float32) * 2 / (head_dim // 2)))
    angles = rows_cols.float()[..., None] * inv_freq  # (N, 2, head_dim/4)
    angles = angles.flatten(1)  # (N, head_dim/2): rows' angles, then columns'
    angles = torch.cat([angles, angles], dim=-1)  # (N, head_dim)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last axis (halves of the head)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


# ---------------------------------------------------------------------------------------------
# The modules
# ---------------------------------------------------------------------------------------------

class VisionAttention(nn.Module):
    """Non-causal multi-head attention over the patches of one frame at a time, with 2D RoPE."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)  # fused q, k, v (with bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x: (N, D); cos/sin: (N, head_dim); lengths: patches per frame (they sum to N). Returns (N, D)."""
        N, D = x.shape
        q, k, v = self.qkv(x).reshape(N, 3, self.num_heads, -1).unbind(1)  # each (N, H, head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (N, 1, head_dim): the same angles for every head
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):  # one frame: (n, H, hd)
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(-1, D))  # (n, D)
        return self.proj(torch.cat(outs))


class VisionMLP(nn.Module):
    """Linear -> GELU -> Linear, both with bias."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)): a pre-LayerNorm ViT block."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm each patch, fuse m*m adjacent patches into one row, project to the decoder width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged_size = config.merged_size
        self.norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(config.merged_size, config.merged_size)
        self.linear_fc2 = nn.Linear(config.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, D) in merge-block order -> (N / m², out_hidden_size)."""
        x = self.norm(x).reshape(-1, self.merged_size)  # (N/4, 4D): the 4 patches of a block side by side
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact GELU here (not the blocks' tanh form)


class VisionTower(nn.Module):
    """Qwen3.5's ViT: pixel_values (N, C*T*P*P) + grid_thw -> one (tokens, out_hidden_size) tensor per image.

    Parameter names are those of the checkpoint's ``model.visual.*`` (see :func:`state_from_checkpoint`),
    except ``patch_embed.weight``, the conv kernel flattened to a Linear's (D, C*T*P*P).
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(config.num_position_embeddings, config.hidden_size))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """pixel_values: (N, C*T*P*P) in merge-block order; grid_thw: per image (t, h, w), N = sum t*h*w.

        Returns per image a tensor (t*h*w / m², out_hidden_size): the embeddings that replace that
        image's placeholder tokens, in order. ValueError naming the argument on a size mismatch.
        """
        c = self.config
        grid = [tuple(int(n) for n in thw) for thw in grid_thw]
        check_grid(pixel_values, grid, c)
        # 1. patch embedding: (N, C*T*P*P) -> (N, D)
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        # 2. learned positions, resized to each grid: (N, D)
        x = x + learned_positions(self.pos_embed, grid, c.spatial_merge_size)
        # 3. 2D RoPE angles of every patch: cos, sin (N, head_dim)
        cos, sin = vision_rope(patch_rows_cols(grid, c.spatial_merge_size), c.head_dim, c.rope_theta)
        # 4. the blocks; attention stays within one frame of one image
        lengths = [h * w for t, h, w in grid for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)  # (N, D)
        # 5. merge m*m patches and project: (N / m², out_hidden_size), split per image
        merged = self.merger(x)
        return list(merged.split([t * h * w // c.spatial_merge_size**2 for t, h, w in grid]))


def check_grid(pixel_values: torch.Tensor, grid: list[tuple[int, int, int]], c: VisionConfig) -> None:
    """ValueError naming the argument unless pixel_values (N, C*T*P*P) matches grid_thw's patches."""
    if pixel_values.ndim != 2 or pixel_values.shape[1] != c.patch_dim:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}: expected (patches, {c.patch_dim})")
    for t, h, w in grid:
        if min(t, h, w) < 1 or h % c.spatial_merge_size or w % c.spatial_merge_size:
            raise ValueError(f"grid_thw entry {(t, h, w)}: t, h, w must be positive and h, w multiples of "
                             f"spatial_merge_size {c.spatial_merge_size}")
    total = sum(t * h * w for t, h, w in grid)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thw {grid} gives {total} patches but pixel_values has {pixel_values.shape[0]} rows")


# ---------------------------------------------------------------------------------------------
# Weights: the checkpoint's model.visual.* names, or llama.cpp's mmproj names
# ---------------------------------------------------------------------------------------------

#: prefix of the tower's tensors in a Qwen3_5(Moe)ForConditionalGeneration checkpoint
CHECKPOINT_PREFIX = "model.visual."


def state_from_checkpoint(read: Callable[[str], torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tower's state dict from a safetensors checkpoint: ``model.visual.X`` -> ``X``.

    read: name -> tensor; names: every tensor name of the checkpoint. The Conv3d kernel
    ``patch_embed.proj.weight`` (D, C, T, P, P) becomes ``patch_embed.weight`` (D, C*T*P*P);
    ``pos_embed.weight`` becomes ``pos_embed``. Load with :func:`load_tower`, which names a
    missing or misshapen tensor.
    """
    state = {}
    for name in names:
        if not name.startswith(CHECKPOINT_PREFIX):
            continue
        ours = name[len(CHECKPOINT_PREFIX):]
        tensor = read(name)
        if ours == "patch_embed.proj.weight":
            ours, tensor = "patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
        elif ours == "patch_embed.proj.bias":
            ours = "patch_embed.bias"
        elif ours == "pos_embed.weight":
            ours = "pos_embed"
        state[ours] = tensor
    return state


#: llama.cpp mmproj name -> ours, per block ({i}) and for the whole tower
MMPROJ_BLOCK_NAMES = {
    "ln1": "norm1", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
    "ln2": "norm2", "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2",
}
MMPROJ_NAMES = {
    "v.patch_embd.bias": "patch_embed.bias", "v.position_embd.weight": "pos_embed",
    "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
    "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
    "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias",
}


def state_from_mmproj(read: Callable[[str], torch.Tensor], names: Sequence[str], where: str) -> dict[str, torch.Tensor]:
    """The tower's state dict from a llama.cpp mmproj GGUF (names as its converter writes them).

    read: name -> dequantized tensor in torch's axis order; names: the file's tensor names.
    The converter split the Conv3d kernel along time into ``v.patch_embd.weight`` (frame 0)
    and ``v.patch_embd.weight.1`` (frame 1), each (D, C, P, P); they are stacked back to
    (D, C, 2, P, P) and flattened. WeightsError naming ``where`` and the tensor for a name
    this tower does not know (a file of another projector).
    """
    state = {}
    for name in names:
        if name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            continue
        if name in MMPROJ_NAMES:
            state[MMPROJ_NAMES[name]] = read(name)
            continue
        parts = name.split(".")  # v.blk.{i}.{what}.{weight|bias}
        if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[3] in MMPROJ_BLOCK_NAMES:
            state[f"blocks.{parts[2]}.{MMPROJ_BLOCK_NAMES[parts[3]]}.{parts[4]}"] = read(name)
            continue
        raise WeightsError(f"{where}: tensor {name!r} is not one of Qwen3.5's vision tower")
    frames = [read(n) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1") if n in names]
    if frames:
        kernel = torch.stack(frames, dim=2)  # (D, C, T, P, P), as the checkpoint's Conv3d
        state["patch_embed.weight"] = kernel.reshape(kernel.shape[0], -1)
    return state


def load_tower(tower: VisionTower, state: Mapping[str, torch.Tensor], where: str) -> VisionTower:
    """Copy ``state`` into ``tower``; WeightsError naming ``where`` and the tensor if one is missing,
    unexpected or of the wrong shape. Returns the tower (in eval mode)."""
    expected = tower.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise WeightsError(f"{where}: vision tower tensors missing {missing[:5]} unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise WeightsError(f"{where}: vision tensor {name!r} has shape {tuple(tensor.shape)}, "
                               f"expected {tuple(expected[name].shape)} from the config")
    tower.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return tower.eval()
