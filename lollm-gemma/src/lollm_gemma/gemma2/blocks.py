"""The small pieces of a gemma2 decoder layer: RMSNorm, RoPE, masks, soft-capped attention, GeGLU MLP.

Shapes use these letters (batch is always 1 in lollm):

    T   tokens in this forward call (the prompt in a prefill, 1 in a decode step)
    S   key positions the attention reads: cached ones plus the T new ones
    C   hidden_size                      H   num_attention_heads (query heads)
    K   num_key_value_heads              D   head_dim
    F   intermediate_size                W   sliding_window

References: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021), GQA
(Ainslie et al. 2023), GeGLU (Shazeer 2020), logit soft-capping (Bello et al.
2016; the Gemma 2 technical report, 2024); transformers' modeling_gemma2.py is
the reference the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Gemma2Config, RopeConfig


# ---------------------------------------------------------------------------
# RMSNorm, Gemma style
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x**2) + eps) * (1 + weight)``, over the last dim.

    Two details differ from Llama/Qwen's RMSNorm:
      * the scale is ``1 + weight`` (the checkpoint stores the offset from 1, so a
        freshly initialised norm has weight 0);
      * the multiplication by the scale happens in float32, before the cast back
        to the model dtype (Llama casts first, then multiplies).

    x: (..., dim) -> (..., dim)
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)


# ---------------------------------------------------------------------------
# Rotary position embedding (RoPE)
# ---------------------------------------------------------------------------
def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The rotation speed of each pair of channels: (D/2,) float32.

    Plain RoPE turns channel pair ``i`` by the angle ``position * inv_freq[i]`` with
    ``inv_freq[i] = theta ** (-2i / D)``. Linear scaling divides every speed by ``factor``.
    Computed in float32 on the CPU, as transformers does, so both give the same angles.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # (D/2,)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type != "default":  # config.py rejects it first
        raise ValueError(f"unknown rope_type {rope.rope_type!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotation angles for the given positions (one RoPE for every layer).

    ``inv_freq`` is a non-persistent buffer: not in the checkpoint, computed by
    :meth:`materialize` after the model was built on the meta device.

    positions: (T,) int64 -> cos, sin: (T, D) in ``dtype``; the D/2 angles are
    repeated twice, ``[a0 .. a_{D/2-1}, a0 .. a_{D/2-1}]``, to match rotate_half.
    """

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """Compute ``inv_freq`` on the CPU in float32 and place it on ``device``."""
        self.inv_freq = rope_inverse_frequencies(self.rope, self.head_dim).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * self.inv_freq[None, :]  # (T, D/2), float32
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: (..., D) -> (..., D).

    Channel ``i`` is paired with channel ``i + D/2`` (the "rotate-half" layout of HF checkpoints).
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair of every head by its angle: (1, heads, T, D) -> (1, heads, T, D)."""
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------------------
# Masks: causal, and causal within a sliding window
# ---------------------------------------------------------------------------
def attention_mask(start: int, T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Who may see whom, for T new tokens at positions ``start .. start+T-1``.

    ``window`` is None for a global layer. A sliding-window layer's query at
    position p sees the keys at positions ``p-W+1 .. p``: W positions, itself
    included (transformers' convention: key j is visible when ``j > p - W``).

    The keys this mask's columns stand for are the ones the cache returns
    (kv.py): positions ``first .. start+T-1`` with ``first = 0`` for a global
    layer and ``first = max(0, start - (W-1))`` for a sliding one, in order.

    Returns ``None`` for T == 1 (decode: the cache returns exactly the keys the
    token may see), otherwise a boolean (T, S) mask, True where query row i
    may see key column j.
    """
    if T == 1:
        return None
    first = 0 if window is None else max(0, start - (window - 1))
    query_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
    key_pos = torch.arange(first, start + T, device=device)[None, :]  # (1, S)
    visible = key_pos <= query_pos  # causal: never the future
    if window is not None:
        visible = visible & (key_pos > query_pos - window)  # and not further back than the window
    return visible  # (T, S)


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------
def softcapped_attention(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v, with H query heads sharing K key/value heads.

    q: (1, H, T, D); k, v: (1, K, S, D); mask: None (T == 1) or bool (T, S) -> (1, H, T, D)

    The soft-cap squashes every score into (-cap, cap) smoothly: small scores
    pass almost unchanged, huge ones saturate. PyTorch's fused
    ``scaled_dot_product_attention`` has no hook between the scores and the
    softmax, so the scores are computed here explicitly.

    GQA without copies: the n_rep query heads that share one K/V head are
    stacked as n_rep*T query rows of that head, (1, H, T, D) -> (1, K, n_rep*T, D),
    so each K/V head is read once by a single matmul.
    """
    _, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    n_rep = H // K
    scores = torch.matmul(q.reshape(1, K, n_rep * T, D), k.transpose(2, 3)) * scale  # (1, K, n_rep*T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(1, K, n_rep, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # (T, S) broadcasts over K and n_rep
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # softmax in float32
    out = torch.matmul(probs.view(1, K, n_rep * T, S), v)  # (1, K, n_rep*T, D)
    return out.view(1, H, T, D)


class Gemma2Attention(nn.Module):
    """Self-attention with GQA, RoPE and an attention-logit soft-cap; no biases.

    Scores are scaled by ``query_pre_attn_scalar ** -0.5`` rather than
    ``head_dim ** -0.5`` (the same for 2B and 9B; 27B uses hidden/heads = 144).

    x: (1, T, C) -> (1, T, C). The new keys/values go into the cache (when there
    is one), which returns the keys this layer may read (kv.py).
    """

    def __init__(self, config: Gemma2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        C, H, K, D = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, K * D, bias=False)
        self.v_proj = nn.Linear(C, K * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        _, T, _ = x.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        # project and split into heads: (1, T, H*D) -> (1, T, H, D) -> (1, H, T, D)
        q = self.q_proj(x).view(1, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        v = self.v_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        # rotate q and k by their positions (v carries content, it is not rotated)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (1, K, S, D): the keys this layer may read
        out = softcapped_attention(q, k, v, mask, self.scale, self.softcap)  # (1, H, T, D)
        out = out.transpose(1, 2).reshape(1, T, H * D)  # heads side by side again
        return self.o_proj(out)  # (1, T, C)


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------
class Gemma2MLP(nn.Module):
    """GeGLU feed-forward: ``down(gelu_tanh(gate(x)) * up(x))``, no biases.

    Like Llama's SwiGLU, but the gate goes through GELU (tanh approximation)
    instead of SiLU.

    x: (1, T, C) -> gate, up: (1, T, F) -> (1, T, C)
    """

    def __init__(self, config: Gemma2Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
