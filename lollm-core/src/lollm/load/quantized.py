"""Quantized weights that stay quantized: linear layers and embeddings over packed integers.

A GGUF file stores most matrices as blocks of small integers with a few
scales (lollm.gguf.quants draws every layout). The float path dequantizes each
block to float32 at load: simple and exact, but a 4-bit matrix then takes 8
times its file size, and every decode step reads all those bytes. This module
keeps the integers instead, in one of these layers:

* :class:`Q4_0Linear`, :class:`Q5_0Linear`, :class:`Q4_KLinear`, :class:`Q6_KLinear`,
  :class:`Q8_0Linear` (:mod:`lollm.load.packed_kquants`) -- the file's own bits (4.5, 5.5,
  4.625, 6.5625 and 8.5 bits a weight), rearranged at load into panels of 16 output channels,
  multiplied by lollm's native kernel with int8 activations (docs/native-kernel.md,
  sections 10 to 15). Nothing is rounded: whatever the file holds is what runs, and
  a row's output is the same bits alone or in any batch. Made where the native
  kernel is built and K is whole blocks (256 for the K-quants, 32 for the others).
* :class:`Q5Linear` -- a Q5_0 matrix in its 5-bit codes, channel by channel, on the native
  kernel: where the CPU's AMX tiles run, which multiply its many-row calls.
* :class:`Int4Linear` -- 4-bit codes in groups of 32 (or 64, 128, 256) with a
  scale and a zero per group: ``w = (q - 8) * s + z``. Q4_0, Q4_1 and Q4_K are
  exactly such groups (their codes are kept bit for bit; the scale and zero are
  rounded to bfloat16, the kernel's dtype). Kernel:
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``. Q4_1 always; Q4_0 and Q4_K
  where the native kernel is not built.
* :class:`Int8Linear` -- 8-bit codes with a scale per group of each row:
  ``w = q * s``. A tied output head over a Q8_0 embedding keeps the file's codes
  and float16 scales in groups of 32 where the native kernel is built (exact), shared
  with the :class:`Int8Embedding`. Q5_1, Q5_K (and Q6_K, Q5_0,
  Q8_0 where the native kernel is not built) have one scale per 16 or 32
  weights, which torch's int8 kernel cannot take, so their weights are
  *requantized* row by row to int8 (error at most half a step of the row's
  scale, measured in docs/quantized-execution.md). Kernel: lollm's native
  ``block_int8_linear``, or ``torch.ops.aten._weight_int8pack_mm``.
* :class:`BlockEmbedding` -- an embedding that keeps a GGUF tensor's blocks as
  they are in the file and dequantizes only the rows it looks up (exact: the
  same kernels as the float path). :class:`Int8Embedding` looks rows up in
  int8 codes, and can share them with an :class:`Int8Linear` (tied embeddings).

torch's two kernels take their activations in bfloat16 (they are slow with
float32 ones): those layers round their input to bfloat16, multiply, and give
the output back in the input's dtype, so the rest of the model (norms,
attention, the residual stream) stays float32. lollm's own kernel (:mod:`lollm.native`,
docs/native-kernel.md) takes float32 and rounds it to int8 in blocks of 32, as
llama.cpp multiplies, through integer dot-product instructions.

Nothing here ever holds a float copy of a whole matrix: packing works through
a matrix a slice of rows at a time.

The loader uses these through :func:`lollm.load.weights.load_weights`; a family's
weights.py only says which of its tensors may stay packed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from lollm import native
from lollm.errors import LollmError
from lollm.gguf.quants import GGML_TYPES_BY_NAME, affine4, dequantize
from lollm.load.packed_embedding import BlockEmbedding, Int8Embedding, Q8_0PanelEmbedding
from lollm.load.packed_kquants import PANEL_LAYERS, PanelLinear, Q4_0Linear, Q4_KLinear, Q6_KLinear, Q8_0Linear  # noqa: F401
from lollm.load.packed_linear import Int4Linear, Int8Linear, Q5Linear, row_slices
# Moved to lollm.load.packed_linear; still importable from here until lollm-core 0.3 (docs/plugins.md, 10).
from lollm.load.packed_linear import exact_scale, native_gemm_rows  # noqa: F401

#: GGUF types kept as 4-bit groups of 32 (exact codes).
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: GGUF types kept as int8 with one scale per output channel (requantized).
INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
#: GGUF types that are plain floats: they stay float (in the model's dtype).
FLOAT_TYPES = ("F32", "F16", "BF16")

#: Group sizes torch's int4 CPU kernel accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: Group size of the output head's int8 codes (see :func:`linear_from_gguf`'s ``grouped``).
HEAD_GROUP_SIZE = 32


@dataclass(frozen=True)
class Quantization:
    """How a load treats the tensors a family allows to stay packed.

    mode:
      ``"float"``  every tensor is dequantized (GGUF) or converted to the model's
                   dtype: the reference path, and the parity gate's standard;
      ``"gguf"``   GGUF tensors keep their blocks: Q4_0/Q4_K/Q6_K/Q8_0/Q5_0 in the file's bits
                   where lollm's native kernel is built (a tied Q8_0 head in its own int8 groups),
                   Q4_1 (and Q4_0/Q4_K elsewhere) as int4 groups, the other types as int8
                   (:func:`linear_from_gguf`), embeddings as the file's blocks;
                   float and other types are dequantized (the load summary says which);
      ``"int8"``   float weights (safetensors, or F32/F16/BF16 GGUF tensors) are
                   quantized at load to int8 with one scale per output channel;
      ``"int4"``   ... to int4 in groups of ``group_size`` with a scale and a zero.
    group_size: 32, 64, 128 or 256 (``"int4"`` only).
    """

    mode: str = "float"
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.mode not in ("float", "gguf", "int8", "int4"):
            raise LollmError(f"unknown quantization mode {self.mode!r} (float, gguf, int8, int4)")
        if self.group_size not in INT4_GROUP_SIZES:
            raise LollmError(f"int4 group size {self.group_size}: use one of {', '.join(map(str, INT4_GROUP_SIZES))}")

    @property
    def packs(self) -> bool:
        """Whether any tensor may stay (or become) packed."""
        return self.mode != "float"


# ---------------------------------------------------------------------------
# Quantizing float rows (safetensors at load; GGUF 5- to 8-bit types after dequantizing a slice)
# ---------------------------------------------------------------------------


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(n, K)`` float -> codes ``(n, K)`` int8 and scales ``(n,)`` float32.

    ``s = max|w_row| / 127``, ``q = round(w / s)``, so ``|q * s - w| <= s / 2``.
    A row of zeros gets scale 0 and codes 0. (gpt-fast's weight-only int8.)
    """
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups: ``(n, K)`` float -> codes ``(n, K)`` uint8 (0..15), scale and offset ``(n, K / g)``.

    Per group of ``g`` consecutive weights of a row: ``scale = (max - min) / 15``,
    ``offset = min``, ``q = round((w - min) / scale)``; ``w ~ q * scale + offset``
    with an error of at most ``scale / 2``. (gpt-fast's int4 groups.)
    """
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    scale = (hi - lo) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo


# ---------------------------------------------------------------------------
# Building packed modules from checkpoint tensors (used by lollm.load.weights.load_weights)
# ---------------------------------------------------------------------------


def int8_from_float_rows(n_rows: int, n_cols: int, read_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Requantize a matrix to int8 per row, a slice of rows at a time: ``read_rows(start, stop)`` gives float rows.

    Returns :class:`Int8Linear`'s ``codes (1, n_rows, n_cols)`` and ``scale (1, n_rows)``.
    """
    q = torch.empty(1, n_rows, n_cols, dtype=torch.int8)
    scale = torch.empty(1, n_rows, dtype=torch.float32)
    for start, stop in row_slices(n_rows, n_cols):
        q[0, start:stop], scale[0, start:stop] = quantize_int8_rows(read_rows(start, stop))
    return q, scale


def int8_groups_from_gguf(read_rows, ggml_type: str, shape: tuple[int, int], group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes in groups of 32 from a GGUF matrix: ``codes (K/32, N, 32)`` int8, ``scale (K/32, N)``.

    ``read_rows(start, stop)`` gives the bytes of rows ``start .. stop``. Q8_0
    (``w = q * d``) and Q5_0 (``w = (q - 16) * d``) give their own codes and
    scales: exact, the scales in float16 as the file has them. Other types are
    dequantized a slice of rows at a time and requantized per group of 32
    (``s = max|w| / 127``, float32).
    """
    n, k = shape
    g = group_size if k % group_size == 0 else 32
    own_blocks = ggml_type in ("Q8_0", "Q5_0") and g == 32  # the file's codes and float16 scales
    codes = torch.empty(k // g, n, g, dtype=torch.int8)
    scale = torch.empty(k // g, n, dtype=torch.float16 if own_blocks else torch.float32)
    for start, stop in row_slices(n, k):
        raw = read_rows(start, stop)
        if own_blocks:
            blocks = raw.reshape(stop - start, k // 32, -1)  # (r, G, bytes per 32-weight block)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # (r, G) float16, the file's d
            if ggml_type == "Q8_0":
                q = blocks[..., 2:34].view(np.int8)
            else:  # the dequantized weight is exactly (q - 16) * d: divide d back out
                w = dequantize(raw, "Q5_0").reshape(stop - start, k // 32, 32)
                d32 = d.astype(np.float32)
                q = np.rint(w / np.where(d32 == 0, 1, d32)[..., None]).astype(np.int8)
            codes[:, start:stop] = torch.from_numpy(np.ascontiguousarray(q)).transpose(0, 1)
            scale[:, start:stop] = torch.from_numpy(d).T
        else:
            w = torch.from_numpy(dequantize(raw, ggml_type)).view(-1, g)
            q8, s8 = quantize_int8_rows(w)
            codes[:, start:stop] = q8.view(stop - start, k // g, g).transpose(0, 1)
            scale[:, start:stop] = s8.view(stop - start, k // g).T
    return codes, scale


def linear_from_gguf(raw, ggml_type: str, shape: tuple[int, int], bias: nn.Parameter | None,
                     *, grouped: bool = False, tied: bool = False) -> nn.Module | None:
    """A packed linear layer from a GGUF matrix's bytes, or None when its type stays float.

    raw: the tensor's bytes (1-D uint8), or a function ``(start_row, stop_row) ->``
    the bytes of those rows, so that a big matrix is read a slice at a time;
    shape: ``(out_features, in_features)``. Where lollm's native kernel is built:

    * Q4_0, Q4_K, Q6_K, Q8_0 -> :class:`Q4_0Linear`, :class:`Q4_KLinear`, :class:`Q6_KLinear`,
      :class:`Q8_0Linear`, the file's own bits (K a multiple of 32 for Q4_0 and Q8_0, 256 for
      the K-quants); a Q6_K matrix with ``grouped`` (the output head) stays an :class:`Int8Linear`
      in groups of 32;
    * a Q8_0 matrix with ``tied`` (a head whose codes the embedding will share: the caller builds
      it with :func:`shared_embedding`) -> :class:`Q8_0Linear` as any Q8_0 matrix, its lookup a
      :class:`Q8_0PanelEmbedding`; where the CPU's AMX tiles run, an :class:`Int8Linear` in groups
      of 32 (the file's codes and float16 scales, the tiles' layout), its lookup an :class:`Int8Embedding`;
    * Q5_0 -> :class:`Q5_0Linear`, the file's bits in panels (not for ``grouped``); where the CPU's
      AMX tiles run (:func:`lollm.native.tile_min_rows`), :class:`Q5Linear` instead (K a multiple of
      64), whose tiles multiply many rows at once; both give the same bits.

    Elsewhere, and for the other types: Q4_0/Q4_1/Q4_K -> :class:`Int4Linear` with
    the file's codes (groups of 32); Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 -> :class:`Int8Linear`,
    requantized per row, or with ``grouped`` in groups of 32 (exact for Q8_0 and
    Q5_0; used for the output head). A 4-bit matrix whose row count the int4 kernel
    cannot tile (not a multiple of 16) becomes int8 too. Returns None for every other type.
    """
    n, k = shape
    t = GGML_TYPES_BY_NAME[ggml_type]
    row_bytes = k // t.block_size * t.type_size
    if callable(raw):
        read_rows = raw
    else:
        blocks = raw.reshape(n, row_bytes)  # one row of blocks per output channel
        def read_rows(start: int, stop: int) -> np.ndarray:
            return blocks[start:stop].reshape(-1)

    panels = PANEL_LAYERS.get(ggml_type)
    tiles = native.tile_min_rows() > 0  # where AMX tiles run, their layouts take the many-row calls (above)
    kept_int8 = grouped and ggml_type in ("Q6_K", "Q5_0") or tied and ggml_type == "Q8_0" and tiles  # heads that stay Int8Linear
    tiled_q5 = ggml_type == "Q5_0" and tiles  # Q5Linear (below)
    if panels is not None and k % panels.K_MULTIPLE == 0 and not kept_int8 and not tiled_q5 and _native():
        return panels.from_blocks(read_rows, shape, bias)
    if ggml_type in INT4_TYPES and n % 16 == 0:
        layer = Int4Linear(k, n, 32, bias)
        for start, stop in row_slices(n, k):
            q, s, o = (torch.from_numpy(a) for a in affine4(read_rows(start, stop), ggml_type))
            layer.fill_rows(start, q.view(stop - start, k), s.view(stop - start, -1), o.view(stop - start, -1))
        return layer
    if ggml_type == "Q5_0" and not grouped and k % 64 == 0 and _native_q5():
        return Q5Linear.from_blocks(read_rows, shape, bias)
    if ggml_type in INT8_TYPES and (grouped or ggml_type == "Q8_0" and _native()):
        return Int8Linear(*int8_groups_from_gguf(read_rows, ggml_type, shape, HEAD_GROUP_SIZE), bias)
    if ggml_type in INT8_TYPES or ggml_type in INT4_TYPES:
        def rows(start: int, stop: int) -> torch.Tensor:
            return torch.from_numpy(dequantize(read_rows(start, stop), ggml_type)).view(stop - start, k)

        return Int8Linear(*int8_from_float_rows(n, k, rows), bias)
    return None


def _native() -> bool:
    """Whether lollm's native kernel is built and on (its first call builds it)."""
    return native.block_int8_op() is not None


def _native_q5() -> bool:
    return native.block_q5_op() is not None


def linear_from_float(weight: torch.Tensor, quantization: Quantization, bias: nn.Parameter | None) -> nn.Module:
    """A packed linear layer from a float matrix ``(out_features, in_features)``, as ``quantization`` says (int8 or int4).

    int4 falls back to int8 for a matrix the int4 kernel cannot tile (rows not a
    multiple of 16, or columns not a multiple of the group size).
    """
    n, k = weight.shape
    if quantization.mode == "int4" and n % 16 == 0 and k % quantization.group_size == 0:
        layer = Int4Linear(k, n, quantization.group_size, bias)
        for start, stop in row_slices(n, k):
            layer.fill_rows(start, *quantize_int4_groups(weight[start:stop], quantization.group_size))
        return layer
    return Int8Linear(*int8_from_float_rows(n, k, lambda a, b: weight[a:b]), bias)


def shared_embedding(head: nn.Module, num_embeddings: int, dtype: torch.dtype) -> nn.Module:
    """The embedding that looks its rows up in a tied ``head``'s own buffers (one copy serves both).

    head: a :class:`Q8_0Linear` (-> :class:`Q8_0PanelEmbedding`) or an :class:`Int8Linear`
    (-> :class:`Int8Embedding`); rows come back in ``dtype``. Raises TypeError for another layer.
    """
    if isinstance(head, Q8_0Linear):
        return Q8_0PanelEmbedding(head.codes, head.d, num_embeddings, dtype)
    if isinstance(head, Int8Linear):
        return Int8Embedding(head.codes, head.scale, dtype)
    raise TypeError(f"no embedding shares the buffers of a {type(head).__name__}")


def describe(module: nn.Module) -> str:
    """How a packed module stores its matrix, for the load summary (``"int4 groups of 32"`` …)."""
    if isinstance(module, Int4Linear):
        return f"int4 groups of {module.group_size}"
    if isinstance(module, PanelLinear):
        return f"{module.GGML_TYPE} blocks (the file's bits, panels of 16 channels)"
    if isinstance(module, Q5Linear):
        return "Q5_0 blocks (5-bit codes)"
    if isinstance(module, Int8Linear):
        return "int8 per channel" if module.codes.shape[0] == 1 else f"int8 groups of {module.group_size}"
    if isinstance(module, BlockEmbedding):
        return "file blocks, rows dequantized on lookup"
    if isinstance(module, Q8_0PanelEmbedding):
        return "Q8_0 blocks (the file's bits, panels of 16 channels)"
    if isinstance(module, Int8Embedding):
        return "int8 rows" if module.codes.shape[0] == 1 else f"int8 groups of {module.codes.shape[2]}"
    return "float"


@dataclass
class WeightsSummary:
    """What a load did with each tensor: ``counts[(stored type, kept as)]``, and the bytes the model holds.

    ``requested`` is the quantization mode asked for; ``packed`` counts the tensors
    kept packed. :meth:`line` is the one-line summary ``lollm run`` prints.
    """

    requested: str = "float"
    counts: Counter = field(default_factory=Counter)
    dequantized: list[str] = field(default_factory=list)  # GGUF tensors of a type with no packed form
    model_bytes: int = 0

    def add(self, stored: str, kept: str) -> None:
        self.counts[(stored, kept)] += 1

    @property
    def packed(self) -> int:
        return sum(n for (_, kept), n in self.counts.items() if not kept.startswith(("float", "bfloat16")))

    def line(self) -> str:
        """The summary; where int8 or file-block layers were kept, it also says whether lollm's native kernel runs them (lollm.native)."""
        parts = [f"{stored}→{kept} ×{n}" for (stored, kept), n in sorted(self.counts.items()) if n]
        text = f"weights ({self.requested}): " + ", ".join(parts) + f"; {self.model_bytes / 1e6:.0f} MB in memory"
        if any(kept.startswith(("int8", "Q")) for _, kept in self.counts):  # layers lollm's native kernel may run
            text += f"; {native.status()}"
        if self.dequantized:
            shown = ", ".join(self.dequantized[:3]) + (f" and {len(self.dequantized) - 3} more" if len(self.dequantized) > 3 else "")
            text += f"; dequantized (no packed form for their type): {shown}"
        return text


def model_bytes(model: nn.Module) -> int:
    """Bytes held by a model's parameters and buffers, each storage counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
