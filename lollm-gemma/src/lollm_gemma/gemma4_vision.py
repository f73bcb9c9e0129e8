"""The gemma4 vision tower: from an image's patches to soft tokens in the decoder's width.

::

    patches (N, 3·p·p) in [0, 1]        positions (N, 2): each patch's (x, y) on the patch grid
        │ × 2 − 1  (pixels to [−1, 1]; Gemma 4's processor does no mean/std)
        │ input_proj: Linear 3·p·p -> C
        + position_embedding_table[0][x] + position_embedding_table[1][y]   (learned, per axis)
        ▼
    x (N, C) ──────────────────────────────┐
        │ input_layernorm                  │  ×L   (bidirectional: every patch sees every patch)
        │ self_attn: q/k RMSNorm, v norm,  │
        │   2D RoPE (half the head by x,   │
        │   half by y), scale 1            │
        │ post_attention_layernorm         │
        + ◄────────────────────────────────┘
        ├──────────────────────────────────┐
        │ pre_feedforward_layernorm        │
        │ mlp (GeGLU, tanh GELU)           │
        │ post_feedforward_layernorm       │
        + ◄────────────────────────────────┘
        ▼
    pool: the mean of each k×k block of patches (k = pooling_kernel_size, 3), × sqrt(C)
        ▼
    (N / k², C) ── standardize (larger models: (x − std_bias) × std_scale)
        │ embed_vision: RMSNorm without weight, Linear C -> C_text
        ▼
    soft tokens (N / k², C_text): one per image placeholder token in the prompt

E2B: p = 16, C = 768, L = 16, k = 3, C_text = 1536. An image is resized (aspect ratio
kept) to at most 280·9 = 2520 patches of 16×16 pixels, both sides a multiple of 48
pixels; it becomes at most 280 soft tokens (gemma4_vision_preprocess.py).

Every linear of the tower may be a *clipped* linear (``use_clipped_linears``): its
input and output clamped to ranges stored in the checkpoint (``input_min`` ...;
±inf when unused).

Module names mirror transformers' ``Gemma4Model`` under ``model.`` (``vision_tower.
patch_embedder.input_proj``, ``vision_tower.encoder.layers.N.self_attn.q_proj.linear``,
``embed_vision.embedding_projection`` ...), so the name map from a Hugging Face
checkpoint strips ``model.`` and nothing else (gemma4_vision_weights.py).

Shapes: N patches of one image, C hidden_size, H heads, K key/value heads, D head_dim,
F intermediate_size, p patch_size, k pooling_kernel_size. One image per forward: a
batch of images is a loop (no padding, so no padding mask either).

Reference: transformers 5.25 ``models/gemma4/modeling_gemma4.py`` (Gemma4VisionModel,
Gemma4MultimodalEmbedder), which the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .gemma4.blocks import RMSNorm, rotate_half


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionConfig:
    """The tower's shape, from config.json's ``vision_config`` (plus the decoder width and token ids).

    text_hidden_size: the decoder's C_text, the projector's output width.
    soft_tokens_per_image: the most soft tokens an image may become (``vision_soft_tokens_per_image``, 280).
    image_token_id, boi_token_id, eoi_token_id: the placeholder repeated once per soft token, and the
    tokens around an image's run of placeholders.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rope_theta: float
    use_clipped_linears: bool
    standardize: bool
    text_hidden_size: int
    soft_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "config.json") -> "VisionConfig":
        """From a whole gemma4 config.json (``model_type`` "gemma4"); errors name the missing key.

        Raises ValueError when ``vision_config`` is absent (a text-only checkpoint) or a key
        is missing or unsupported (an activation other than tanh GELU, a RoPE type other
        than the axial default).
        """
        def need(d: dict, key: str, prefix: str) -> Any:
            if key not in d:
                raise ValueError(f"{where}: key {prefix}{key!r} is missing (needed by the gemma4 vision tower)")
            return d[key]

        vc = cfg.get("vision_config")
        if not isinstance(vc, dict):
            raise ValueError(f"{where}: no 'vision_config' object: this checkpoint has no vision tower")
        tc = need(cfg, "text_config", "")
        v = "vision_config."
        act = vc.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{where}: vision_config.hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        rope = vc.get("rope_parameters") or {}
        if rope.get("rope_type", "default") not in ("default", "axial"):
            raise ValueError(f"{where}: vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not "
                             "supported (the vision tower's RoPE is axial 2D)")
        heads = need(vc, "num_attention_heads", v)
        return cls(
            hidden_size=need(vc, "hidden_size", v), intermediate_size=need(vc, "intermediate_size", v),
            num_hidden_layers=need(vc, "num_hidden_layers", v), num_attention_heads=heads,
            num_key_value_heads=vc.get("num_key_value_heads", heads), head_dim=need(vc, "head_dim", v),
            rms_norm_eps=vc.get("rms_norm_eps", 1e-6), patch_size=need(vc, "patch_size", v),
            pooling_kernel_size=need(vc, "pooling_kernel_size", v),
            position_embedding_size=need(vc, "position_embedding_size", v),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            use_clipped_linears=bool(vc.get("use_clipped_linears", False)),
            standardize=bool(vc.get("standardize", False)),
            text_hidden_size=need(tc, "hidden_size", "text_config."),
            soft_tokens_per_image=cfg.get("vision_soft_tokens_per_image", vc.get("default_output_length", 280)),
            image_token_id=need(cfg, "image_token_id", ""), boi_token_id=need(cfg, "boi_token_id", ""),
            eoi_token_id=need(cfg, "eoi_token_id", ""),
        )


# ---------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------
class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output may be clamped to stored ranges.

        y = clamp(linear(clamp(x, input_min, input_max)), output_min, output_max)

    The four bounds are scalars in the checkpoint (±inf where a model does not clip).
    x: (..., in) -> (..., out)
    """

    def __init__(self, n_in: int, n_out: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name, value in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                self.register_buffer(name, torch.tensor(value * float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


class PatchEmbedder(nn.Module):
    """Pixels to vectors, plus a learned embedding of each patch's column and of its row.

    input_proj: 3·p·p -> C; position_embedding_table: (2, S, C): row 0 indexed by x, row 1 by y
    (S = position_embedding_size, the widest grid the table covers).
    """

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * c.patch_size**2, c.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.zeros(2, c.position_embedding_size, c.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches (N, 3·p·p) in [0, 1], positions (N, 2) int64 (x, y) -> (N, C)."""
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))  # pixels in [-1, 1]
        table = self.position_embedding_table
        return x + table[0][positions[:, 0]] + table[1][positions[:, 1]]


def axial_rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 2D RoPE angles: positions (N, 2) (x, y) -> two (N, D) tensors.

    The head splits in two halves of D/2 channels: the first turns with the patch's x, the
    second with its y. Each half is an ordinary rotate-half RoPE over D/4 frequencies
    ``theta ** (-j / (D/4))``, j = 0 .. D/4-1, so its cos row is [cos(pos·f), cos(pos·f)].
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half))
    angles = positions[..., None].float() * inv_freq  # (N, 2, D/4)
    ax, ay = angles[:, 0], angles[:, 1]
    angles = torch.cat([ax, ax, ay, ay], dim=-1)  # (N, D): x's angles twice, then y's twice
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the x half and the y half of every head, each in rotate-half layout.

    x: (N, heads, D); cos, sin: (N, D) -> (N, heads, D)
    """
    half = x.shape[-1] // 2
    out = []
    for part in range(2):  # 0: the channels turned by x, 1: those turned by y
        s = slice(part * half, (part + 1) * half)
        xs, c, si = x[..., s], cos[:, None, s], sin[:, None, s]
        out.append(xs * c + rotate_half(xs) * si)
    return torch.cat(out, dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention over the patches of one image, with QK-norm and a value norm.

    Queries and keys are RMS-normed per head (with weights), values too (without), so the
    scores need no 1/sqrt(D): the scale is 1.
    """

    def __init__(self, c: VisionConfig):
        super().__init__()
        H, K, D, C, clip = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.use_clipped_linears
        self.H, self.K, self.D = H, K, D
        self.q_proj = ClippableLinear(C, H * D, clip)
        self.k_proj = ClippableLinear(C, K * D, clip)
        self.v_proj = ClippableLinear(C, K * D, clip)
        self.o_proj = ClippableLinear(H * D, C, clip)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)
        self.v_norm = RMSNorm(D, c.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (N, C), cos/sin (N, D) -> (N, C)."""
        N = x.shape[0]
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(N, self.H, self.D)), cos, sin)  # (N, H, D)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(N, self.K, self.D)), cos, sin)  # (N, K, D)
        v = self.v_norm(self.v_proj(x).view(N, self.K, self.D))  # (N, K, D)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # heads first: (H or K, N, D)
        k = k.repeat_interleave(self.H // self.K, dim=0)  # each key/value head serves H/K query heads
        v = v.repeat_interleave(self.H // self.K, dim=0)
        scores = q @ k.transpose(1, 2)  # (H, N, N), scale 1; no mask: every patch sees every patch
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(0, 1).reshape(N, self.H * self.D)  # (N, H·D)
        return self.o_proj(out)


class VisionMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)); x (N, C) -> (N, C), through F = intermediate_size."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        C, Fw, clip = c.hidden_size, c.intermediate_size, c.use_clipped_linears
        self.gate_proj = ClippableLinear(C, Fw, clip)
        self.up_proj = ClippableLinear(C, Fw, clip)
        self.down_proj = ClippableLinear(Fw, C, clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VisionLayer(nn.Module):
    """Gemma's sandwich block: each sub-block normed before and after, then added.

        x = x + post_attention_layernorm(attention(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    """

    def __init__(self, c: VisionConfig):
        super().__init__()
        C, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = VisionAttention(c)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.pre_feedforward_layernorm = RMSNorm(C, eps)
        self.mlp = VisionMLP(c)
        self.post_feedforward_layernorm = RMSNorm(C, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def pool_patches(x: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The mean of each k×k block of patches, blocks in row-major order: (N, C) -> (N / k², C).

    Patch (x, y) goes to block (x // k, y // k), numbered ``x // k + (width / k) · (y // k)``
    where width is the grid's width in patches. The sum is taken in float32.
    Raises ValueError when the grid's sides are not multiples of k (the processor makes them so).
    """
    width, height = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
    if width % k or height % k or width * height != x.shape[0]:
        raise ValueError(f"a {width}x{height} patch grid ({x.shape[0]} patches) cannot be pooled in {k}x{k} blocks")
    block = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)  # (N,)
    out = torch.zeros(x.shape[0] // k**2, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, block, x.float()) / k**2


class VisionEncoder(nn.Module):
    """A container named ``encoder`` holding ``layers``, so names match the checkpoints."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.num_hidden_layers))


class VisionTower(nn.Module):
    """``vision_tower``: patch embedder, encoder; optional standardization buffers."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.patch_embedder = PatchEmbedder(c)
        self.encoder = VisionEncoder(c)
        if c.standardize:
            self.register_buffer("std_bias", torch.zeros(c.hidden_size))
            self.register_buffer("std_scale", torch.ones(c.hidden_size))


class VisionEmbedder(nn.Module):
    """``embed_vision``: into the decoder's width. RMSNorm without weight, then Linear C -> C_text."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, with_scale=False)
        self.embedding_projection = nn.Linear(c.hidden_size, c.text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


# ---------------------------------------------------------------------------
# The whole path
# ---------------------------------------------------------------------------
class Gemma4Vision(nn.Module):
    """Tower plus projector: one image's patches -> its soft tokens in the decoder's width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.embed_vision = VisionEmbedder(config)

    def soft_token_count(self, num_patches: int) -> int:
        """How many placeholder tokens an image of ``num_patches`` patches takes: N / k²."""
        return num_patches // self.config.pooling_kernel_size**2

    def placeholder_ids(self, soft_tokens: int) -> list[int]:
        """What one image occupies in the prompt: <boi>, the image token once per soft token, <eoi>.

        transformers' Gemma4Processor expands each image token of the text to this run; the
        soft tokens replace the image tokens, one for one, before the decoder.
        """
        c = self.config
        return [c.boi_token_id] + [c.image_token_id] * soft_tokens + [c.eoi_token_id]

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches (N, 3·p·p) in [0, 1] and positions (N, 2) int64 (x, y) -> soft tokens (N / k², C_text).

        The patches and positions are those of gemma4_vision_preprocess.preprocess (one image).
        Raises ValueError on mismatched shapes, a position outside the position table, or a grid
        the pooling cannot tile.
        """
        c = self.config
        if patches.ndim != 2 or patches.shape[1] != 3 * c.patch_size**2 or positions.shape != (patches.shape[0], 2):
            raise ValueError(f"patches must be (N, {3 * c.patch_size**2}) and positions (N, 2); got "
                             f"{tuple(patches.shape)} and {tuple(positions.shape)}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= c.position_embedding_size):
            raise ValueError(f"patch positions must lie in 0..{c.position_embedding_size - 1} (the position table's "
                             f"size, vision_config.position_embedding_size); got {int(positions.min())}.."
                             f"{int(positions.max())}")
        tower = self.vision_tower
        # 1. Patch embedding: pixels to [-1, 1], a linear per patch, plus the learned x and y embeddings.
        x = tower.patch_embedder(patches, positions)  # (N, C)
        # 2. The 2D RoPE angles of every patch, shared by all layers.
        cos, sin = axial_rope(positions, c.head_dim, c.rope_theta, x.dtype)  # (N, D) each
        # 3. The encoder layers, bidirectional over the image's patches.
        for layer in tower.encoder.layers:
            x = layer(x, cos, sin)  # (N, C)
        # 4. Pool each k×k block of patches into one vector, scaled by sqrt(C), in float32.
        x = pool_patches(x, positions, c.pooling_kernel_size) * c.hidden_size**0.5  # (N/k², C)
        # 5. Standardize (models with ``standardize``), back to the working dtype.
        if c.standardize:
            x = (x - tower.std_bias.float()) * tower.std_scale.float()
        x = x.to(self.embed_vision.embedding_projection.weight.dtype)
        # 6. Project into the decoder's width: these are the image's soft tokens.
        return self.embed_vision(x)  # (N/k², C_text)
