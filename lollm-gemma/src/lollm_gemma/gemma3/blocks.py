"""The small pieces of a gemma3 decoder layer: RMSNorm, RoPE, masks, attention, GeGLU MLP.

Shapes use these letters (batch is always 1 in lollm):

    T   tokens in this forward call (the prompt in a prefill, 1 in a decode step)
    S   key positions the attention reads: cached ones plus the T new ones
    C   hidden_size                      H   num_attention_heads (query heads)
    K   num_key_value_heads              D   head_dim
    F   intermediate_size                W   sliding_window

References: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021), GQA
(Ainslie et al. 2023), GeGLU (Shazeer 2020, "GLU Variants Improve Transformer"),
the Gemma 3 technical report (2025); transformers' modeling_gemma3.py is the
reference the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lollm.attention import attend, key_positions
from lollm.batch import Batch
from lollm.trace.attention import AttentionRecord, active_recording

from .config import Gemma3Config, RopeConfig


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
# Rotary position embedding (RoPE): one per layer type
# ---------------------------------------------------------------------------
def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The rotation speed of each pair of channels: (D/2,) float32.

    Plain RoPE turns channel pair ``i`` by the angle ``position * inv_freq[i]`` with
    ``inv_freq[i] = theta ** (-2i / D)``. Linear scaling divides every speed by
    ``factor`` (Gemma 3 4B+ use factor 8 on their global layers to reach 128K tokens).
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
    """cos and sin of the rotation angles of one layer type, for the given positions.

    Gemma 3 has two of these: sliding-window layers use base 10 000 (short
    distances, fast rotations are enough), global layers base 1 000 000 (and
    linear scaling on the large models) so that far-apart positions stay distinct.

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

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute ``inv_freq`` on the CPU in float32 and place it on ``device`` (it stays float32, whatever ``dtype``).

        :func:`lollm.load.build.build_model` calls it after building the model on the meta device.
        """
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
# Attention
# ---------------------------------------------------------------------------
class Gemma3Attention(nn.Module):
    """Self-attention with GQA, QK-norm and RoPE; no biases.

    New in Gemma 3 (vs Gemma 2): q and k are RMS-normed per head (QK-norm)
    before RoPE, which replaces Gemma 2's attention-logit soft-cap as the way to
    keep attention scores in range. Scores are scaled by
    ``query_pre_attn_scalar ** -0.5`` (256 ** -0.5 = 1/16 = 1/sqrt(D) here).

    x: (1, T, C) -> (1, T, C). The new keys/values go into the cache (when there
    is one), which returns the keys this layer may read (kv.py).
    """

    def __init__(self, config: Gemma3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        C, H, K, D = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, K * D, bias=False)
        self.v_proj = nn.Linear(C, K * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, x, cos, sin, start: int, window: int | None, cache, blocks=None) -> torch.Tensor:
        _, T, _ = x.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        # project, split into heads, normalise each head: (1, T, H*D) -> (1, T, H, D) -> (1, H, T, D)
        q = self.q_norm(self.q_proj(x).view(1, T, H, D)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(1, T, K, D)).transpose(1, 2)  # (1, K, T, D)
        v = self.v_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        # rotate q and k by their positions (v carries content, it is not rotated)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (1, K, S, D): the keys this layer may read
        # attention: causal; a sliding layer reads only the last W positions (p - W < j <= p).
        # Query head h reads K/V head h // (H/K) (GQA). In a one-token step a sliding
        # layer's ring hands its slots in ring order (kv.py). In an engine step (start a
        # lollm.batch.Batch) k, v are the layer's paged pool, read in position order
        # through the block tables: attend ignores ring there.
        ring = window is not None and cache is not None and T == 1
        if blocks is not None and isinstance(start, Batch):  # an engine step holding images
            out = attend_images_in_step(q, k, v, start, window, blocks, self.scale, self.layer_idx)
            return self.o_proj(out.transpose(1, 2).reshape(1, T, H * D))
        if blocks is not None:  # images in this prefill: the mask of image_visible (vision.md)
            mask = image_visible(start, T, k.shape[2], window, blocks)  # (T, S)
            if active_recording() is not None:  # lollm trace: the weights written out, recorded
                out = record_masked(q, k, v, mask, self.scale, start, window, self.layer_idx)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=H != K)
            return self.o_proj(out.transpose(1, 2).reshape(1, T, H * D))
        out = attend(q, k, v, start=start, ring=ring, window=window, scale=self.scale,
                     layer=self.layer_idx)  # (1, H, T, D)
        out = out.transpose(1, 2).reshape(1, T, H * D)  # heads side by side again
        return self.o_proj(out)  # (1, T, C)


def image_visible(start: int, T: int, S: int, window: int | None, blocks: torch.Tensor) -> torch.Tensor:
    """Who may see whom in a prefill holding images: a bool (T, S) mask, True where query i reads key j.

    Text is causal, as everywhere; the tokens of one image also see each other in both
    directions (an image is not read left to right), as transformers' Gemma 3 does
    (``create_masks_for_vision_model``)::

        full layer:     causal  OR  same image
        sliding layer: (causal  OR  same image)  AND  key > query - W

    blocks: (T,) int64, the image number of each new token, -1 for text. Keys before ``start``
    (cached) are never inside an image of this forward: a forward holds whole images.
    """
    query_pos = torch.arange(start, start + T, device=blocks.device)[:, None]  # (T, 1)
    key_pos = key_positions(start, T, S, device=blocks.device)[None, :]  # (1, S)
    new = key_pos[0] - start  # index of each key among the new tokens (< 0: cached)
    key_block = torch.where(new >= 0, blocks[new.clamp(min=0)], -1)[None, :]  # (1, S)
    same_image = (blocks[:, None] == key_block) & (key_block >= 0)  # (T, S)
    mask = (key_pos <= query_pos) | same_image
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    return mask


def record_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, start: int,
                  window: int | None, layer: int) -> torch.Tensor:
    """Attention under ``mask`` (T, S) written out, its weights added to ``lollm trace``'s recording: (1, H, T, D).

    q (1, H, T, D); k, v (1, K, S, D), each K/V head read by H/K query heads (GQA).
    """
    H, K = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)  # (1, H, S, D)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (1, H, T, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    T, S = mask.shape
    active_recording().records.append(AttentionRecord(layer, probs, torch.arange(start, start + T, device=q.device),
                                                      key_positions(start, T, S, device=q.device), window))
    return (probs @ v.float()).to(q.dtype)


def attend_images_in_step(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch,
                          window: int | None, blocks: torch.Tensor, scale: float, layer: int) -> torch.Tensor:
    """Attention for an engine step in which some sequences bring images: (1, H, N, D).

    q (1, H, N, D); k_pool, v_pool: the layer's paged pool (blocks, block_size, K, D), as
    ``cache.update`` returns it in an engine step; blocks (N,): image number per token, -1 text.

    1. Every row first goes through the engine's paged attention (causal, the window): right for
       every sequence whose rows of this step hold no image.
    2. A sequence with image tokens among its rows gets them again, with the mask of
       :func:`image_visible`: its keys gathered from its blocks in position order (a sliding
       layer from the block its first query's window starts in, as lollm.attention does), then
       one SDPA call. Its rows of step 1 are thrown away: the price of keeping the paged path
       untouched, paid once per image (one prefill chunk), never in a decode step.
    """
    out = attend(q, k_pool, v_pool, start=batch, window=window, scale=scale, layer=layer)  # (1, H, N, D)
    K, D, size = k_pool.shape[2], k_pool.shape[3], batch.block_size
    for (lo, hi), first, table in zip(batch.segments(), batch.starts, batch.tables_for(window)):
        if not bool((blocks[lo:hi] >= 0).any()):
            continue
        skip = max(0, first - window + 1) // size if window is not None else 0
        S = first + (hi - lo) - skip * size  # the keys end at the newest query (key_positions' rule)
        ids = torch.tensor(table[skip:], dtype=torch.long, device=k_pool.device)
        k = k_pool.index_select(0, ids).reshape(-1, K, D)[:S].transpose(0, 1).unsqueeze(0)  # (1, K, S, D)
        v = v_pool.index_select(0, ids).reshape(-1, K, D)[:S].transpose(0, 1).unsqueeze(0)
        mask = image_visible(first, hi - lo, S, window, blocks[lo:hi])  # (T_b, S)
        out[:, :, lo:hi] = F.scaled_dot_product_attention(q[:, :, lo:hi], k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                                          scale=scale, enable_gqa=q.shape[1] != K)
    return out


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------
class Gemma3MLP(nn.Module):
    """GeGLU feed-forward: ``down(gelu_tanh(gate(x)) * up(x))``, no biases.

    Like Llama's SwiGLU, but the gate goes through GELU (tanh approximation)
    instead of SiLU.

    x: (1, T, C) -> gate, up: (1, T, F) -> (1, T, C)
    """

    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
