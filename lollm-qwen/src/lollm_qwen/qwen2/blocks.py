"""The small pieces of a qwen2 decoder layer: RMSNorm, RoPE, attention, SwiGLU MLP.

Shapes use these letters (batch is always 1 in lollm):

    T   tokens in this forward call (the prompt in a prefill, 1 in a decode step)
    S   positions the attention can see: the cached ones plus the T new ones
    C   hidden_size                      H   num_attention_heads (query heads)
    K   num_key_value_heads              D   head_dim
    F   intermediate_size

References: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021, "RoFormer"),
YaRN (Peng et al. 2023), GQA (Ainslie et al. 2023), SwiGLU (Shazeer 2020);
transformers' modeling_qwen2.py and modeling_rope_utils.py are the reference
the tests compare against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lollm.attention import attend

from .config import Qwen2Config, RopeConfig


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x**2) + eps) * weight``, over the last dim.

    Unlike LayerNorm it neither subtracts the mean nor adds a bias. The
    statistics are computed in float32 whatever the model dtype (as in
    transformers), then the result is cast back before the weight multiplies.

    x: (..., dim) -> (..., dim)
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# ---------------------------------------------------------------------------
# Rotary position embedding (RoPE)
# ---------------------------------------------------------------------------
def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """The rotation speed of each pair of channels, and the cos/sin scale.

    Plain RoPE turns channel pair ``i`` of a head by the angle ``position * inv_freq[i]``
    with ``inv_freq[i] = theta ** (-2i / D)``: fast rotations in the first
    channels, slow ones in the last. The scaled types change these speeds to
    stretch the context the model was trained on:

    * linear: every speed divided by ``factor`` (positions are "squeezed").
    * yarn:   the slow pairs (which never completed a turn during training) are
              divided by ``factor``, the fast ones are kept, a linear ramp blends
              the pairs in between; cos and sin are then scaled by an
              "attention factor" (about ``0.1 * ln(factor) + 1``).

    Computed in float32 on the CPU, exactly as transformers does, so both give
    the same angles.

    Returns (inv_freq (D/2,) float32, attention_scaling float).
    """
    dim = head_dim
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # (D/2,)
    wavelength = base**exponents  # (D/2,) theta ** (2i / D)
    if rope.rope_type == "default":
        return 1.0 / wavelength, 1.0
    if rope.rope_type == "linear":
        return 1.0 / wavelength / rope.factor, 1.0
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, dim, base, wavelength)
    raise ValueError(f"unknown rope_type {rope.rope_type!r}")  # config.py rejects it first


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int, base: float, wavelength: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN ("Yet another RoPE extensioN", Peng et al. 2023), as transformers computes it."""
    factor = rope.factor
    original_context = rope.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention_scaling = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_scaling = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention_scaling = mscale(factor)

    # Which channel pairs turn at least `beta_fast` times (keep: "extrapolate") and which
    # fewer than `beta_slow` times (divide by factor: "interpolate") over the original context.
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def pair_turning(turns: float) -> float:
        """The (fractional) channel index whose pair turns `turns` times over the original context."""
        return dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # 0 fast .. 1 slow
    keep = 1 - ramp  # weight of the original (extrapolated) speed
    original_speed = 1.0 / wavelength
    stretched_speed = 1.0 / (factor * wavelength)
    inv_freq = stretched_speed * (1 - keep) + original_speed * keep
    return inv_freq, attention_scaling


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotation angles for the given positions.

    ``inv_freq`` is a non-persistent buffer: it is not in the checkpoint, the
    model computes it (``weights.load`` calls :meth:`materialize` after
    building the model on the meta device).

    positions: (T,) int64 -> cos, sin: (T, D) in ``dtype``; the D/2 angles are
    repeated twice, ``[a0 .. a_{D/2-1}, a0 .. a_{D/2-1}]``, to match rotate_half.
    """

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.rope = config.rope
        self.head_dim = config.head_dim
        inv_freq, self.attention_scaling = rope_inverse_frequencies(self.rope, self.head_dim)
        # on the default device: "meta" (no data) while weights.load builds the model
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """(Re)compute ``inv_freq`` on the CPU in float32 and place it on ``device`` (it stays float32, whatever ``dtype``).

        :func:`lollm.load.build.build_model` calls it after building the model on the meta device.
        """
        inv_freq, self.attention_scaling = rope_inverse_frequencies(self.rope, self.head_dim)
        self.inv_freq = inv_freq.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * self.inv_freq[None, :]  # (T, D/2), float32
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: (..., D) -> (..., D).

    Channel ``i`` is paired with channel ``i + D/2`` (transformers' "rotate-half"
    layout, which the HF checkpoints are written for).
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair of every head by its angle.

    x: (1, heads, T, D); cos, sin: (T, D) -> (1, heads, T, D)
    """
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------
class Qwen2Attention(nn.Module):
    """Self-attention with GQA and RoPE; q/k/v projections have a bias, o_proj has none.

    x: (1, T, C) -> (1, T, C). The new keys/values are written to the cache (when
    there is one) and attention reads every cached position.
    """

    def __init__(self, config: Qwen2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        C, H, K, D = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=True)
        self.k_proj = nn.Linear(C, K * D, bias=True)
        self.v_proj = nn.Linear(C, K * D, bias=True)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x, cos, sin, start: int, cache) -> torch.Tensor:
        _, T, _ = x.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        # project and split into heads: (1, T, H*D) -> (1, T, H, D) -> (1, H, T, D)
        q = self.q_proj(x).view(1, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        v = self.v_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        # rotate q and k by their positions (v carries content, it is not rotated)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (1, K, S, D): cached + new
        # causal attention: the query at position p reads the keys of positions 0 .. p;
        # query head h reads K/V head h // (H/K) (GQA). lollm.attention runs it (--attn picks the kernel).
        out = attend(q, k, v, start=start, layer=self.layer_idx)  # (1, H, T, D)
        out = out.transpose(1, 2).reshape(1, T, H * D)  # heads side by side again
        return self.o_proj(out)  # (1, T, C)


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------
class Qwen2MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, no biases.

    x: (1, T, C) -> gate, up: (1, T, F) -> (1, T, C)
    """

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
