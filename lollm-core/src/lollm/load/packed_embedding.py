"""The packed embeddings: :class:`BlockEmbedding` (a GGUF tensor's blocks), :class:`Int8Embedding` and
:class:`Q8_0PanelEmbedding` (the lookups that share a tied head's int8 codes).
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.gguf.quants import dequantize
from lollm.load.packed_linear import exact_scale

# ---------------------------------------------------------------------------
# The embeddings
# ---------------------------------------------------------------------------


class _PackedEmbedding(nn.Module):
    """What the packed embeddings share: the output dtype, and a ``weight`` stand-in for code that reads its device/dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype

    @property
    def weight(self) -> torch.Tensor:
        """An empty tensor of the dtype this embedding returns, on its device.

        Model code sizes caches from ``embed_tokens.weight.device`` and ``.dtype``;
        this keeps that working. The rows themselves live in the packed buffers.
        """
        return torch.empty(0, dtype=self.dtype, device=next(self.buffers()).device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"


class BlockEmbedding(_PackedEmbedding):
    """``nn.Embedding`` over a GGUF tensor's blocks, kept as the file stores them; looked-up rows are dequantized.

    Buffer ``blocks``: ``(num_embeddings, bytes_per_row)`` uint8, each row the
    blocks of one token's vector. forward: ids ``(...)`` int64 -> ``(..., dim)``
    in ``dtype``, equal to the float path's rows bit for bit (same dequantizer).
    """

    def __init__(self, blocks: torch.Tensor, ggml_type: str, embedding_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__(blocks.shape[0], embedding_dim, dtype)
        self.ggml_type = ggml_type
        self.register_buffer("blocks", blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1).cpu()]  # (T, bytes_per_row) uint8
        flat = dequantize(rows.numpy().reshape(-1), self.ggml_type, what="embedding rows")
        out = torch.from_numpy(flat).view(*ids.shape, self.embedding_dim)
        return out.to(device=ids.device, dtype=self.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ggml_type={self.ggml_type}"


class Int8Embedding(_PackedEmbedding):
    """``nn.Embedding`` over int8 codes with a scale per group: ``row[v][k] = q[g, v, k % group_size] * s[g, v]``.

    Holds an :class:`Int8Linear`'s ``codes (groups, num_embeddings, group_size)`` int8 and
    ``scale (groups, num_embeddings)``, float16 where that loses nothing, else float32, as that
    layer does (:func:`exact_scale`); built from that layer it shares its tensors (tied
    embeddings: one copy serves the lookup and the output head). ``forward(ids)`` gives
    ``ids.shape + (embedding_dim,)`` rows in ``dtype``, computed in float32 whatever the scales' dtype.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__(codes.shape[1], codes.shape[0] * codes.shape[2], dtype)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", exact_scale(scale))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.codes[:, flat].float() * self.scale[:, flat].float().unsqueeze(-1)  # (G, T, group_size) float32
        return rows.transpose(0, 1).reshape(*ids.shape, self.embedding_dim).to(self.dtype)


class Q8_0PanelEmbedding(_PackedEmbedding):
    """``nn.Embedding`` over a :class:`~lollm.load.packed_kquants.Q8_0Linear`'s panels: a tied Q8_0 head and its lookup share one copy.

    A tied head (Gemma, small Qwen and Llama models) multiplies by the same matrix the
    embedding reads rows of. Kept as Q8_0 panels (docs/native-kernel.md, section 14), the head
    runs in the native kernel's panel loops; this looks the embedding's rows up in those same
    buffers. Token v is channel ``c = v % 16`` of panel ``v // 16``; in block b its code for input
    ``32b + 4u + j`` is byte ``64u + 4c + j``.

    Buffers (the layer's own tensors): ``codes (P, K / 32, 512)`` int8 and ``d (P, K / 32, 16)``
    float16, the file's scales. ``forward(ids)``: ids ``(...)`` int64 -> ``ids.shape + (K,)`` in
    ``dtype``, each value ``q * d`` computed in float32: the file's dequantized row, bit for bit.
    """

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, num_embeddings: int, dtype: torch.dtype = torch.float32):
        super().__init__(num_embeddings, codes.shape[1] * 32, dtype)
        self.register_buffer("codes", codes)
        self.register_buffer("d", d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        panel, c = flat // 16, flat % 16
        blocks = self.codes.shape[1]
        q = self.codes.view(-1, blocks, 8, 16, 4)[panel, :, :, c, :]  # (T, blocks, chunk u, j): channel c of each panel
        d = self.d[panel, :, c]  # (T, blocks)
        rows = q.reshape(-1, blocks, 32).float() * d.float().unsqueeze(-1)  # (T, blocks, 32) float32
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)
