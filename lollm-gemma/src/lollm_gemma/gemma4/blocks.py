"""The small pieces of a gemma4 decoder layer: RMSNorm, RoPE (incl. proportional), masks,
attention with shared KV, GeGLU MLP.

Shapes use these letters (batch is always 1 in lollm):

    T   tokens in this forward call (the prompt in a prefill, 1 in a decode step)
    S   key positions the attention reads: cached ones plus the T new ones
    C   hidden_size                      H   num_attention_heads (query heads)
    K   key/value heads of this layer    D   head dim of this layer (256 sliding, 512 global on E2B)
    F   MLP width of this layer          W   sliding_window
    L   num_hidden_layers                P   hidden_size_per_layer_input (PLE width)

References: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021), GQA
(Ainslie et al. 2023), GeGLU (Shazeer 2020), the Gemma 3n / Gemma 4 model
cards (per-layer embeddings, KV sharing); transformers' modeling_gemma4.py is
the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lollm.attention import attend, key_positions
from lollm.batch import Batch
from lollm.trace.attention import AttentionRecord, active_recording

from .config import Gemma4Config, RopeConfig


# ---------------------------------------------------------------------------
# RMSNorm, Gemma 4 style
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm: ``x / sqrt(mean(x**2) + eps) * weight``, over the last dim, in float32.

    Changed since Gemma 3: the scale is ``weight`` itself again (Gemma 2 and 3
    stored ``weight`` as an offset and multiplied by ``1 + weight``), and
    ``with_scale=False`` gives a norm with no weight at all (the value norm).
    ``mean ** -0.5`` is written as a power rather than ``rsqrt``, as the reference
    does (the two may differ in the last bit).

    x: (..., dim) -> (..., dim)
    """

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x = x * self.weight.float()
        return x.to(dtype)


# ---------------------------------------------------------------------------
# Rotary position embedding (RoPE): one per layer type
# ---------------------------------------------------------------------------
def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The rotation speed of each pair of channels: (D/2,) float32.

    * default:      ``inv_freq[i] = theta ** (-2i / D)`` for every pair i.
    * linear:       the same, divided by ``factor``.
    * proportional: only the first ``rotary_fraction`` of the pairs rotate, at the
      speeds they would have in a full-width RoPE of this head (exponent
      ``2i / D``, D the whole head); the other pairs get speed 0, i.e. angle 0:
      cos 1, sin 0, they pass through unrotated. On Gemma 4's global layers 64
      of 256 pairs rotate: those carry position, the rest carry pure content.
      (Divided by ``factor``, 1 unless set.)

    Computed in float32 on the CPU, as transformers does, so both give the same angles.
    """
    if rope.rope_type == "proportional":
        rotating = int(rope.rotary_fraction * head_dim // 2)  # pairs that rotate
        exponents = torch.arange(0, 2 * rotating, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = torch.cat((1.0 / (rope.theta**exponents), torch.zeros(head_dim // 2 - rotating)))
        return inv_freq / rope.factor
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # (D/2,)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "default":  # config.py rejects it first
        raise ValueError(f"unknown rope_type {rope.rope_type!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotation angles of one layer type, for the given positions.

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
class Gemma4Attention(nn.Module):
    """Self-attention with GQA, QK-norm, a value norm and RoPE; optionally on another layer's KV.

    * Every layer has q_proj, q_norm and o_proj. Its head width D depends on its
      type: sliding layers ``head_dim``, global ones ``global_head_dim``.
    * A layer that computes its own keys/values also has k_proj, k_norm and
      v_proj (none when ``attention_k_eq_v`` on a global layer: the values are
      then the un-normed keys), and a weightless value norm.
    * A KV-sharing layer (the last ``num_kv_shared_layers``) has none of those:
      it attends over the keys/values its source layer produced in this same
      forward (``shared_kv[layer_type]``), and writes nothing to the cache.

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: Gemma4Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads_for(self.layer_type)
        self.head_dim = config.head_dim_for(self.layer_type)
        source = config.kv_source(layer_idx)
        self.is_kv_shared = source != layer_idx
        # the layer whose keys/values the KV-sharing layers of this type read
        self.stores_kv = not self.is_kv_shared and any(
            config.kv_source(j) == layer_idx for j in range(config.first_kv_shared_layer, config.num_hidden_layers)
        )
        C, H, K, D, eps = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, config.rms_norm_eps
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.q_norm = RMSNorm(D, eps)
        if not self.is_kv_shared:
            self.k_proj = nn.Linear(C, K * D, bias=False)
            self.k_norm = RMSNorm(D, eps)
            values_are_keys = config.attention_k_eq_v and self.layer_type != "sliding_attention"
            self.v_proj = None if values_are_keys else nn.Linear(C, K * D, bias=False)
            self.v_norm = RMSNorm(D, eps, with_scale=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x, cos, sin, start: int, window: int | None, cache, shared_kv: dict,
                images: "ImageBlocks | None" = None) -> torch.Tensor:
        _, T, _ = x.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        # queries: project, split into heads, normalise each head, rotate
        q = self.q_norm(self.q_proj(x).view(1, T, H, D)).transpose(1, 2)  # (1, H, T, D)
        q = apply_rope(q, cos, sin)
        if self.is_kv_shared:
            # the source layer's keys/values, produced earlier in this forward: (1, K, S, D),
            # or in an engine step its pool (blocks, block_size, K, D), read with the same Batch
            k, v, ring = shared_kv[self.layer_type]
        else:
            k_raw = self.k_proj(x).view(1, T, K, D)
            v_raw = self.v_proj(x).view(1, T, K, D) if self.v_proj is not None else k_raw
            k = apply_rope(self.k_norm(k_raw).transpose(1, 2), cos, sin)  # (1, K, T, D)
            v = self.v_norm(v_raw).transpose(1, 2)  # (1, K, T, D)
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)  # (1, K, S, D): the keys this layer may read
            # in a one-token step a sliding layer's ring hands its slots in ring order (kv.py);
            # in an engine step (start a lollm.batch.Batch) k, v are the layer's paged pool
            # (blocks, block_size, K, D), read in position order: attend ignores ring there
            ring = window is not None and cache is not None and T == 1
            if self.stores_kv:
                shared_kv[self.layer_type] = (k, v, ring)
        if images is not None and window is not None and isinstance(start, Batch):  # the same, in an engine step
            out = attend_images_in_step(q, k, v, start, window, images.ids, self.layer_idx)  # (1, H, N, D)
            return self.o_proj(out.transpose(1, 2).reshape(1, T, H * D))
        if images is not None and window is not None:  # 26B/31B, images in this prefill: image_visible's mask
            mask = image_visible(start, T, k.shape[2], window, images, ring=ring)  # (T, S)
            if active_recording() is not None:  # lollm trace: the weights written out, recorded (two-way in an image)
                out = record_masked(q, k, v, mask, start, window, self.layer_idx, ring=ring)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=H != K)
            return self.o_proj(out.transpose(1, 2).reshape(1, T, H * D))
        # attention: causal, a sliding layer only the last W positions (p - W < j <= p); scale 1
        # (QK-norm already fixed the size of q and k). Query head h reads K/V head h // (H/K) (GQA).
        out = attend(q, k, v, start=start, ring=ring, window=window, scale=1.0, layer=self.layer_idx)  # (1, H, T, D)
        out = out.transpose(1, 2).reshape(1, T, H * D)  # heads side by side again
        return self.o_proj(out)  # (1, T, C)


@dataclass(frozen=True)
class ImageBlocks:
    """Which of this forward's positions belong to which image, for the sliding layers' mask.

    start:  the position of ``ids[0]`` (the forward's first token); in an engine step the
            step's lollm.batch.Batch (each sequence's rows then start at its own position).
    ids:    (T,) int64, for each of the forward's T tokens the number of its image, -1 for text
            (in an engine step numbered across the step: lollm.vision.step.image_numbers).
    """

    start: int | Batch
    ids: torch.Tensor

    def of(self, positions: torch.Tensor) -> torch.Tensor:
        """(n,) positions -> (n,) image number of each, -1 for text and for positions outside this forward."""
        index = positions - self.start
        inside = (index >= 0) & (index < self.ids.shape[0])
        return torch.where(inside, self.ids[index.clamp(0, self.ids.shape[0] - 1)], -1)


def image_visible(start: int, T: int, S: int, window: int, images: ImageBlocks, *, ring: bool = False) -> torch.Tensor:
    """A sliding layer's mask in a prefill holding images (26B, 31B): bool (T, S), True where query i reads key j.

    transformers' Gemma 4 (``create_masks_for_vision_model``): inside one image the tokens see
    each other both ways (an image is not read left to right), but only on the sliding layers;
    the global layers stay causal, and take the ordinary mask (attend)::

        sliding layer:  (key <= query  OR  same image)  AND  key > query - W

    The queries sit at ``start .. start+T-1`` (``start`` may be past ``images.start``: the
    KV-sharing layers may carry the last positions only); the keys at
    :func:`lollm.attention.key_positions`. Keys cached before this forward are text or whole
    earlier images, never part of an image of this forward (a prefill chunk holds whole images).
    """
    query = torch.arange(start, start + T, device=images.ids.device)  # (T,)
    key = key_positions(start, T, S, ring=ring, device=images.ids.device)  # (S,)
    query_image, key_image = images.of(query)[:, None], images.of(key)[None, :]  # (T, 1), (1, S)
    same_image = (query_image == key_image) & (key_image >= 0)  # (T, S)
    causal = key[None, :] <= query[:, None]  # (T, S)
    return (causal | same_image) & (key[None, :] > query[:, None] - window)


def record_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, start: int, window: int,
                  layer: int, *, ring: bool = False) -> torch.Tensor:
    """Attention under ``mask`` (T, S) written out (scale 1), its weights added to ``lollm trace``'s recording.

    q (1, H, T, D); k, v (1, K, S, D), each K/V head read by H/K query heads (GQA). Returns (1, H, T, D),
    what the SDPA call under the same mask gives, within float rounding.
    """
    H, K = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)  # (1, H, S, D)
    scores = q.float() @ k.float().transpose(-1, -2)  # (1, H, T, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    T, S = mask.shape
    active_recording().records.append(AttentionRecord(layer, probs, torch.arange(start, start + T, device=q.device),
                                                      key_positions(start, T, S, ring=ring, device=q.device), window))
    return (probs @ v.float()).to(q.dtype)


def attend_images_in_step(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch, window: int,
                          ids: torch.Tensor, layer: int) -> torch.Tensor:
    """A sliding layer's attention in an engine step where some sequence brings images (26B, 31B): (1, H, N, D).

    q (1, H, N, D); k_pool, v_pool: the layer's paged pool (blocks, block_size, K, D), its own
    (``cache.update`` in an engine step) or, on a KV-sharing layer, its source layer's; ids (N,):
    image number per token, numbered across the step, -1 text. Scale 1, as every gemma4 layer.

    1. Every row goes through the engine's paged attention (causal, the window): right for each
       sequence whose rows of this step hold no image token.
    2. A sequence with image tokens among its rows is done again under :func:`image_visible`'s
       mask: its keys gathered from its block table in position order (from the block its first
       query's window starts in, as lollm.attention does), then one SDPA call; its rows of step 1
       are thrown away. Paid once per image (the prefill chunk holding it), never in a decode step.
    """
    out = attend(q, k_pool, v_pool, start=batch, window=window, scale=1.0, layer=layer)  # (1, H, N, D)
    K, D, size = k_pool.shape[2], k_pool.shape[3], batch.block_size
    for (lo, hi), first, table in zip(batch.segments(), batch.starts, batch.tables_for(window)):
        if not bool((ids[lo:hi] >= 0).any()):
            continue
        skip = max(0, first - window + 1) // size  # blocks wholly before the first query's window
        S = first + (hi - lo) - skip * size  # keys skip*size .. first+T_b-1, the last S (key_positions' rule)
        rows = torch.tensor(table[skip:], dtype=torch.long, device=k_pool.device)
        k = k_pool.index_select(0, rows).reshape(-1, K, D)[:S].transpose(0, 1).unsqueeze(0)  # (1, K, S, D)
        v = v_pool.index_select(0, rows).reshape(-1, K, D)[:S].transpose(0, 1).unsqueeze(0)
        mask = image_visible(first, hi - lo, S, window, ImageBlocks(first, ids[lo:hi]))  # (T_b, S)
        out[:, :, lo:hi] = F.scaled_dot_product_attention(q[:, :, lo:hi], k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                                          scale=1.0, enable_gqa=q.shape[1] != K)
    return out


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------
class Gemma4MLP(nn.Module):
    """GeGLU feed-forward: ``down(gelu_tanh(gate(x)) * up(x))``, no biases.

    Its width F is ``intermediate_size``, doubled on the KV-sharing layers when
    ``use_double_wide_mlp`` (those layers skip the key/value work, and spend it here).

    x: (1, T, C) -> gate, up: (1, T, F) -> (1, T, C)
    """

    def __init__(self, config: Gemma4Config, layer_idx: int):
        super().__init__()
        width = config.intermediate_size_for(layer_idx)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
