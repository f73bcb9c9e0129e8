"""Quantized weights that stay quantized: linear layers and embeddings over packed integers.

A GGUF file stores most matrices as blocks of small integers with a few
scales (lollm.gguf.quants draws every layout). The float path dequantizes each
block to float32 at load: simple and exact, but a 4-bit matrix then takes 8
times its file size, and every decode step reads all those bytes. This module
keeps the integers instead and multiplies with torch's packed CPU kernels:

* :class:`Int4Linear` -- 4-bit codes in groups of 32 (or 64, 128, 256) with a
  scale and a zero per group: ``w = (q - 8) * s + z``. Q4_0, Q4_1 and Q4_K are
  exactly such groups (their codes are kept bit for bit; the scale and zero are
  rounded to bfloat16, the kernel's dtype). Kernel:
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``.
* :class:`Int8Linear` -- 8-bit codes with one scale per output channel (row):
  ``w = q * s``. Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 have one scale per 16 or 32
  weights, which torch's int8 kernel cannot take, so their weights are
  *requantized* row by row to int8 (error at most half a step of the row's
  scale, measured in docs/quantized-execution.md). Kernel:
  ``torch.ops.aten._weight_int8pack_mm``.
* :class:`BlockEmbedding` -- an embedding that keeps a GGUF tensor's blocks as
  they are in the file and dequantizes only the rows it looks up (exact: the
  same kernels as the float path). :class:`Int8Embedding` looks rows up in
  int8 codes, and can share them with an :class:`Int8Linear` (tied embeddings).

Both torch kernels take their activations in bfloat16 (they are slow with
float32 ones): each layer rounds its input to bfloat16, multiplies, and gives
its output back in the input's dtype, so the rest of the model (norms,
attention, the residual stream) stays float32. For a decode step,
:class:`Int8Linear` calls lollm's own kernel instead where it could be built
(:mod:`lollm.native`, docs/native-kernel.md): int8 activations in blocks of 32,
as llama.cpp multiplies, through integer dot-product instructions.

Nothing here ever holds a float copy of a whole matrix: packing works through
a matrix a slice of rows at a time.

The loader uses these through :func:`lollm.load.weights.load_weights`; a family's
weights.py only says which of its tensors may stay packed.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from lollm.errors import LollmError, WeightsError

#: GGUF types kept as 4-bit groups of 32 (exact codes).
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: GGUF types kept as int8 with one scale per output channel (requantized).
INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
#: GGUF types that are plain floats: they stay float (in the model's dtype).
FLOAT_TYPES = ("F32", "F16", "BF16")

#: The dtype the packed kernels compute in (activations, scales and outputs).
KERNEL_DTYPE = torch.bfloat16
#: Group sizes torch's int4 CPU kernel accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: Group size of the output head's int8 codes (see :func:`linear_from_gguf`'s ``grouped``).
HEAD_GROUP_SIZE = 32
#: Weights handled per slice when packing, so temporaries stay a few MB.
_SLICE_WEIGHTS = 1 << 20
#: Rows (tokens) from which :class:`Int8Linear` stops calling torch's int8 kernel and runs one
#: bfloat16 matrix multiplication over weights it dequantizes on the fly (see :func:`gemm_rows`).
#: Per-channel layers (one int8 matrix) and grouped ones (the output head: one kernel call per
#: group of 32 columns) cross over at different points; measured by benchmarks/bench_int8_rows.py.
GEMM_MIN_ROWS = 20
GEMM_MIN_ROWS_GROUPED = 10
#: The same crossing where lollm's native kernel multiplies with AMX tiles (docs/native-kernel.md,
#: section 9): the tiles beat dequantize-then-multiply up to about 200 rows, and the two are even
#: at 256 (benchmarks/bench_tiles.py), so every prefill chunk of 128 tokens stays on the tiles.
GEMM_MIN_ROWS_TILES = 256
#: Weights dequantized at a time on that path (2 MB of bfloat16): 1,170 output channels of a matrix
#: with 896 inputs, 215 of one with 4,864. A fixed 1,024 channels made the widest slices 10 MB.
_GEMM_SLICE_WEIGHTS = 1 << 20


def gemm_slices(out_features: int, in_features: int) -> list[tuple[int, int]]:
    """The output-channel slices ``(n0, n1)`` the many-rows path dequantizes one at a time."""
    step = max(1, _GEMM_SLICE_WEIGHTS // in_features)
    return [(n0, min(n0 + step, out_features)) for n0 in range(0, out_features, step)]


def native_bf16_matmul() -> bool:
    """True when this CPU multiplies bfloat16 matrices in hardware (AVX-512 BF16 or AMX tiles).

    Without it a bfloat16 matmul is emulated and the dequantize-then-multiply path of
    :class:`Int8Linear` would not pay off, so it stays on the int8 kernel at every row count.
    """
    cpu = torch.cpu
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


_NATIVE_BF16 = native_bf16_matmul()


@functools.cache
def native_gemm_rows() -> int:
    """From how many rows a layer on lollm's native kernel (:class:`Int8Linear` where ``native``,
    :class:`Q5Linear`) dequantizes to bfloat16 and multiplies once, on a CPU with native bfloat16
    matmul: :data:`GEMM_MIN_ROWS_TILES` where the kernel multiplies with AMX tiles
    (:func:`lollm.native.tile_min_rows`), else :data:`GEMM_MIN_ROWS`. Decided once per process."""
    from lollm import native
    return GEMM_MIN_ROWS_TILES if native.tile_min_rows() else GEMM_MIN_ROWS


@dataclass(frozen=True)
class Quantization:
    """How a load treats the tensors a family allows to stay packed.

    mode:
      ``"float"``  every tensor is dequantized (GGUF) or converted to the model's
                   dtype: the reference path, and the parity gate's standard;
      ``"gguf"``   GGUF tensors keep their blocks: Q4_0/Q4_1/Q4_K as int4 groups,
                   Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as int8, embeddings as the file's blocks;
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


def exact_scale(scale: torch.Tensor) -> torch.Tensor:
    """Int8 scales in the smallest dtype that holds them exactly: float16 where every value is a
    float16, else float32. The rule of :class:`Int8Linear` and :class:`Int8Embedding`.

    scale: a float tensor of any shape. float16 is returned as it is (a Q8_0 or Q5_0 file's block
    scales d, which :func:`int8_groups_from_gguf` keeps so). Other float dtypes are taken to float32
    (what they were held in before float16 scales), then to float16 only where no value changes:
    ``scale.half().float() == scale`` everywhere (checked a slice at a time, so no float32 copy of
    the whole tensor is made). Requantized scales (``max|w| / 127``) are almost never all exact in
    float16 and stay float32 (the same tensor, where it was float32 already); a NaN never compares
    equal, and a value beyond float16's range (65504) or below its smallest step (2**-24) would
    change, so those stay float32 too. Returns the kept tensor. Raises WeightsError for a dtype that
    is not floating point (int codes passed where scales go).
    """
    if not scale.is_floating_point():
        raise WeightsError(f"int8 scales must be floating point (float16 or float32), not {scale.dtype}")
    if scale.dtype == torch.float16:
        return scale
    scale = scale.float()
    flat = scale.reshape(-1)
    for start in range(0, flat.numel(), _SLICE_WEIGHTS):
        piece = flat[start:start + _SLICE_WEIGHTS]
        if not torch.equal(piece.half().float(), piece):
            return scale
    return scale.half()


# ---------------------------------------------------------------------------
# The linear layers
# ---------------------------------------------------------------------------


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` codes 0..15 -> the int4 kernel's packed ``(N, K / 2)`` uint8 layout, 64 rows at a time.

    The kernel's layout is tiled (not simply two codes per byte in order); it
    is made by ``_convert_weight_to_int4pack_for_cpu``, which wants int32 codes.
    Converting 64 rows at a time gives the same bytes as the whole matrix at
    once (checked in the tests) with a small int32 temporary.
    """
    out = torch.empty(codes.shape[0], codes.shape[1] // 2, dtype=torch.uint8)
    for start in range(0, codes.shape[0], 64):
        rows = codes[start : start + 64].to(torch.int32)
        out[start : start + 64] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(rows, 1)
    return out


class Int4Linear(nn.Module):
    """``nn.Linear`` over 4-bit weights in groups: ``w[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n]``, ``g = k // group_size``.

    Buffers:
      packed:          ``(out_features, in_features / 2)`` uint8, the kernel's tiled layout.
      scale_and_zero:  ``(in_features / group_size, out_features, 2)`` bfloat16: ``[..., 0]`` is s, ``[..., 1]`` z.
    bias: float parameter ``(out_features,)`` or None, added in the input's dtype.

    forward: ``x (..., in_features)`` any float dtype -> ``(..., out_features)`` in the
    same dtype, computed by ``_weight_int4pack_mm_for_cpu`` with bfloat16 activations.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: nn.Parameter | None = None):
        super().__init__()
        if out_features % 16 or in_features % group_size:
            raise WeightsError(
                f"int4 layout needs out_features divisible by 16 and in_features by the group size {group_size}; "
                f"got ({out_features}, {in_features})"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scale_and_zero", torch.empty(in_features // group_size, out_features, 2, dtype=KERNEL_DTYPE))
        self.bias = bias

    def fill_rows(self, start: int, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        """Pack rows ``start ..`` from codes ``(r, K)`` uint8 0..15 and per-group ``scale``, ``offset`` ``(r, K / group_size)``.

        The rows hold ``w = q * scale + offset``. The kernel counts codes from -8,
        so its zero is ``offset + 8 * scale`` (computed in float32, then rounded to
        bfloat16 with the scale). ``start`` must be a multiple of 64 (the kernel's tile).
        """
        stop = start + codes.shape[0]
        self.packed[start:stop] = _pack_int4(codes)
        zero = offset.float() + 8.0 * scale.float()
        self.scale_and_zero[:, start:stop] = torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).to(KERNEL_DTYPE)

    @classmethod
    def from_affine(cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                    bias: nn.Parameter | None = None) -> Int4Linear:
        """From codes ``(N, K)`` uint8 0..15 and per-group ``scale``, ``offset`` ``(N, K / group_size)``: ``w = q * scale + offset``."""
        n, k = codes.shape
        layer = cls(k, n, group_size, bias)
        layer.fill_rows(0, codes, scale, offset)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scale_and_zero)  # (M, N)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, bias={self.bias is not None}"


class Int8Linear(nn.Module):
    """``nn.Linear`` over int8 codes with a scale per group of each row: ``w[n, k] = q[n, k] * s[g, n]``, ``g = k // group_size``.

    One group spanning the whole row (``group_size == in_features``) is the
    usual *per-channel* int8: one kernel call. Smaller groups keep a format's
    own scales (Q8_0, Q5_0: exact codes and scales) at the price of one kernel
    call per group, summed in float32.

    Buffers:
      codes:         ``(groups, out_features, group_size)`` int8.
      scale:         ``(groups, out_features)``, the exact scales (an :class:`Int8Embedding` reads these):
                     float16 where that loses nothing, else float32 (:func:`exact_scale`). So a Q8_0 or
                     Q5_0 head in groups of 32 keeps the file's float16 d (half the bytes of float32),
                     a Q8_0 matrix requantized per channel usually too (a row's ``max|w| / 127`` is its
                     largest d where that block holds a code ±127, as llama.cpp's quantizer writes), and
                     other requantized layers their float32 scales.
    kernel_scale: the scales in bfloat16, torch's kernel's dtype; None where the native kernel
                  takes the few-row steps (``native``).
    bias: float parameter ``(out_features,)`` or None.
    native: whether lollm's native kernel takes the few-row steps, decided when the layer is made.

    forward: ``x (..., in_features)`` -> ``(..., out_features)`` in x's dtype, computed in one
    of three ways, by the number of rows M (tokens):

    * few rows (a decode step, a speculative verify, an engine step of up to 19 sequences;
      with AMX tiles up to 255 rows, prompt chunks included), where lollm's native kernel is
      built (:mod:`lollm.native`, docs/native-kernel.md): x
      becomes int8 in blocks of 32 with one scale each (llama.cpp's Q8_0 activations), each
      block meets 32 codes in integer dot-product instructions, and the sums are scaled in
      float32 by the exact scales ``scale`` (read as float32 in either dtype: float16 scales give
      the same outputs, bit for bit, as the same values in float32). A row's output does not depend on the rows
      beside it (from 8 rows the tiles add the float32 sums in another order than the
      vector loops below 8: the last bits differ between the two).
    * few rows where it is not built: ``_weight_int8pack_mm`` with bfloat16 activations.
      That kernel reads the int8 codes once *per row*, so its time grows with M: 16 rows
      cost about 7 times one row.
    * many rows (a prefill, or an engine step of many sequences; at least
      :func:`native_gemm_rows`, or :data:`GEMM_MIN_ROWS_GROUPED` for grouped layers, on a CPU
      with native bfloat16 matmul): the codes are dequantized to bfloat16,
      ``w = q * s``, a slice of output channels at a time, and one matrix multiplication
      reads each slice once for all M rows. The dequantization costs about as much as the
      kernel's 16 to 32 rows, and then barely grows with M.

    All three compute ``x · (q * s)`` from the same codes; they differ in where they round
    (x to int8 per block in the first; x, the scales and ``q * s`` or the per-group outputs
    to bfloat16 in the others): a few parts in a thousand of a logit
    (docs/quantized-execution.md, "Many rows"; docs/native-kernel.md).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None = None):
        super().__init__()
        groups, self.out_features, self.group_size = codes.shape
        self.in_features = groups * self.group_size
        self.register_buffer("codes", codes)
        self.register_buffer("scale", exact_scale(scale))
        self.bias = bias
        from lollm import native
        # Decided (and built, on a first run) while the model loads, not at its first token.
        self.native = self.group_size % 32 == 0 and native.block_int8_op() is not None
        # torch's kernel reads bfloat16 scales: kept beside the float32 ones only where it runs the
        # few-row steps (for the head that copy is 8.5 MB; the many-rows path converts a slice at a time).
        self.register_buffer("kernel_scale", None if self.native else scale.to(KERNEL_DTYPE))

    def gemm_rows(self) -> int | None:
        """From how many rows forward dequantizes and multiplies once (None: never, on this CPU).

        Where lollm's native kernel runs the fewer rows, both layouts switch at :func:`native_gemm_rows`
        (:data:`GEMM_MIN_ROWS`, or :data:`GEMM_MIN_ROWS_TILES` with AMX tiles; the kernel beats torch's
        grouped calls, which switch at :data:`GEMM_MIN_ROWS_GROUPED`)."""
        if not _NATIVE_BF16:
            return None
        if self.native:
            return native_gemm_rows()
        return GEMM_MIN_ROWS if self.codes.shape[0] == 1 else GEMM_MIN_ROWS_GROUPED

    def uses_native(self) -> bool:
        """Whether the rows below :meth:`gemm_rows` go through lollm's native kernel (:mod:`lollm.native`):
        it was built and on when this layer was made (``self.native``: groups of a multiple of 32), and
        the codes are contiguous CPU tensors."""
        return self.native and self.codes.is_cpu and self.codes.is_contiguous() and self.scale.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        many = self.gemm_rows()
        if many is not None and rows.shape[0] >= many:
            y = self._dequantized_matmul(rows.to(KERNEL_DTYPE))  # (M, N)
        elif self.uses_native():  # int8 activations in blocks of 32, integer dot products (lollm.native)
            y = torch.ops.lollm_native.block_int8_linear(rows.float().contiguous(), self.codes, self.scale)
        elif self.codes.shape[0] == 1:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(KERNEL_DTYPE), self.codes[0], self._bf16_scale()[0])  # (M, N)
        else:
            pieces = rows.to(KERNEL_DTYPE).view(rows.shape[0], -1, self.group_size)  # (M, G, group_size)
            y = torch.zeros(rows.shape[0], self.out_features, dtype=torch.float32)
            scale = self._bf16_scale()
            for g in range(self.codes.shape[0]):
                y += torch.ops.aten._weight_int8pack_mm(pieces[:, g].contiguous(), self.codes[g], scale[g])
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _bf16_scale(self) -> torch.Tensor:
        """The scales in bfloat16 for torch's kernel: the kept copy, or made now (a layer that has
        the native kernel but sits where it cannot run, such as a GPU)."""
        return self.kernel_scale if self.kernel_scale is not None else self.scale.to(KERNEL_DTYPE)

    def _dequantized_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """flat (M, K) bfloat16 -> (M, N) float32: ``flat @ (q * s).T``, dequantizing 2 MB of weights at a time (:func:`gemm_slices`).

        The codes become bfloat16 exactly (|q| <= 127 fits its 8 significant bits). One group
        (per channel): multiply by the codes, then scale each output channel. Groups: scale
        each group's codes first (``w = q * s``, rounded to bfloat16), then multiply once.
        """
        y = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32, device=flat.device)
        for n0, n1 in gemm_slices(self.out_features, self.in_features):
            q = self.codes[:, n0:n1].to(KERNEL_DTYPE)  # (G, n, group_size)
            s = self.scale[:, n0:n1].to(KERNEL_DTYPE)  # (G, n)
            if self.codes.shape[0] == 1:
                y[:, n0:n1] = (flat @ q[0].T) * s[0]
            else:  # (G, n, group_size) -> the slice's weights laid out (n, K)
                w = (q * s[:, :, None]).transpose(0, 1).reshape(n1 - n0, self.in_features)
                y[:, n0:n1] = flat @ w.T
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class Q5Linear(nn.Module):
    """``nn.Linear`` over a Q5_0 matrix kept in its own 5-bit codes: ``w[n, k] = (u[n, k] - 16) * d[n, k // 32]``.

    A Q5_0 file stores 5.5 bits a weight (a 5-bit code u in 0..31 and a float16
    scale d per block of 32). :class:`Int8Linear` would hold 8; this layer holds the
    file's bits, rearranged so that two blocks unpack with a few instructions
    (docs/native-kernel.md, "Q5_0 in its own bits"), and uses lollm's native kernel
    (:func:`lollm.native.block_q5_op`). It is made only where that kernel is built:
    elsewhere a Q5_0 matrix becomes an :class:`Int8Linear`.

    Buffers (channel n's blocks in pairs 2p, 2p + 1; K a multiple of 64):
      nibbles: ``(out_features, in_features / 2)`` uint8; byte j of pair p = the low
               4 bits of u of block 2p's weight j, | those of block 2p + 1's << 4.
      high:    ``(out_features, in_features / 8)`` uint8; 8 bytes a pair, a little-endian
               64-bit word: bit j = the 5th bit of block 2p's u[j], bit 32 + j block 2p + 1's.
      scale:   ``(out_features, in_features / 32)`` float16, the file's d.
    bias: float parameter ``(out_features,)`` or None.

    forward: ``x (..., in_features)`` -> ``(..., out_features)`` in x's dtype. Below
    :func:`native_gemm_rows` rows (20, or 256 with AMX tiles, on a CPU with native bfloat16
    matmul; every row count elsewhere) the native kernel computes it, each row alone, as for :class:`Int8Linear`;
    from there the weights are dequantized to bfloat16 a slice of channels at a time and
    multiplied once.
    """

    def __init__(self, nibbles: torch.Tensor, high: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None = None):
        super().__init__()
        self.out_features, half = nibbles.shape
        self.in_features = 2 * half
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("high", high)
        self.register_buffer("scale", scale)
        self.bias = bias

    @classmethod
    def from_blocks(cls, read_rows, shape: tuple[int, int], bias: nn.Parameter | None = None) -> "Q5Linear":
        """From a GGUF Q5_0 matrix: ``read_rows(start, stop)`` gives the file's bytes of rows ``start .. stop``
        (22 bytes a block: d float16, qh 4 bytes, qs 16 bytes; ``lollm.gguf.quants.dequantize_q5_0``)."""
        n, k = shape
        pairs = k // 64
        nibbles = torch.empty(n, k // 2, dtype=torch.uint8)
        high = torch.empty(n, k // 8, dtype=torch.uint8)
        scale = torch.empty(n, k // 32, dtype=torch.float16)
        for start, stop in _row_slices(n, k):
            blocks = torch.from_numpy(read_rows(start, stop).reshape(stop - start, pairs, 2, 22))
            scale[start:stop] = blocks[..., 0:2].contiguous().view(torch.float16).reshape(stop - start, -1)
            high[start:stop] = blocks[..., 2:6].reshape(stop - start, -1)  # the two qh words, back to back
            qs = blocks[..., 6:22]  # (r, pairs, 2, 16): byte j = low 4 bits of u[j] | of u[j + 16] << 4
            low = torch.cat([qs & 15, qs >> 4], dim=-1)  # (r, pairs, 2, 32): the low 4 bits of u[0 .. 31]
            nibbles[start:stop] = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(stop - start, -1)
        return cls(nibbles, high, scale, bias)

    def dequantize(self, n0: int = 0, n1: int | None = None) -> torch.Tensor:
        """Channels ``n0 .. n1`` as float32 ``(n1 - n0, in_features)``: ``(u - 16) * d``."""
        nib, high = self.nibbles[n0:n1], self.high[n0:n1]
        rows = nib.shape[0]
        pairs = nib.view(rows, -1, 32)  # (r, K / 64, 32): byte j = block 2p's low bits | block 2p + 1's << 4
        low = torch.stack([pairs & 15, pairs >> 4], dim=2)  # (r, K / 64, 2 blocks, 32)
        bits = (high.view(rows, -1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1  # (r, K / 8, 8): bit i of byte j
        u = low | (bits.view(rows, -1, 2, 32) << 4)  # the 64-bit word's bit 32 * b + j is block b's weight j
        return ((u.float() - 16) * self.scale[n0:n1].float().view(rows, -1, 2, 1)).view(rows, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if _NATIVE_BF16 and rows.shape[0] >= native_gemm_rows():
            y = self._dequantized_matmul(rows.to(KERNEL_DTYPE))  # (M, N)
        else:  # int8 activations in blocks of 32, integer dot products (lollm.native)
            y = torch.ops.lollm_native.block_q5_linear(rows.float().contiguous(), self.nibbles, self.high, self.scale)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _dequantized_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """flat (M, K) bfloat16 -> (M, N) float32: the weights dequantized to bfloat16 2 MB at a time
        (``(u - 16) * d`` rounded once, by the native ``block_q5_dequantize``), each slice multiplied once."""
        y = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        for n0, n1 in gemm_slices(self.out_features, self.in_features):
            w = torch.ops.lollm_native.block_q5_dequantize(self.nibbles[n0:n1], self.high[n0:n1], self.scale[n0:n1])
            y[:, n0:n1] = flat @ w.T  # w: (n1 - n0, K) bfloat16
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
        from lollm.gguf.quants import dequantize

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


# ---------------------------------------------------------------------------
# Building packed modules from checkpoint tensors (used by lollm.load.weights.load_weights)
# ---------------------------------------------------------------------------


def _row_slices(n_rows: int, row_len: int):
    step = max(64, (_SLICE_WEIGHTS // max(row_len, 1)) // 64 * 64)  # a multiple of 64 rows (the int4 tile)
    for start in range(0, n_rows, step):
        yield start, min(n_rows, start + step)


def int8_from_float_rows(n_rows: int, n_cols: int, read_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Requantize a matrix to int8 per row, a slice of rows at a time: ``read_rows(start, stop)`` gives float rows.

    Returns :class:`Int8Linear`'s ``codes (1, n_rows, n_cols)`` and ``scale (1, n_rows)``.
    """
    q = torch.empty(1, n_rows, n_cols, dtype=torch.int8)
    scale = torch.empty(1, n_rows, dtype=torch.float32)
    for start, stop in _row_slices(n_rows, n_cols):
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
    from lollm.gguf.quants import dequantize

    n, k = shape
    g = group_size if k % group_size == 0 else 32
    own_blocks = ggml_type in ("Q8_0", "Q5_0") and g == 32  # the file's codes and float16 scales
    codes = torch.empty(k // g, n, g, dtype=torch.int8)
    scale = torch.empty(k // g, n, dtype=torch.float16 if own_blocks else torch.float32)
    for start, stop in _row_slices(n, k):
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
                     *, grouped: bool = False) -> nn.Module | None:
    """A packed linear layer from a GGUF matrix's bytes, or None when its type stays float.

    raw: the tensor's bytes (1-D uint8), or a function ``(start_row, stop_row) ->``
    the bytes of those rows, so that a big matrix is read a slice at a time;
    shape: ``(out_features, in_features)``.
    Q4_0/Q4_1/Q4_K -> :class:`Int4Linear` with the file's codes (groups of 32);
    Q5_0 -> :class:`Q5Linear`, the file's 5-bit codes, where lollm's native kernel is
    built (and K is a multiple of 64; not for ``grouped``);
    Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 -> :class:`Int8Linear`, requantized per row, or with
    ``grouped`` in groups of 32 (exact for Q8_0 and Q5_0; used for the output
    head). A 4-bit matrix whose row count the int4 kernel cannot tile (not a
    multiple of 16) becomes int8 too. Returns None for every other type.
    """
    from lollm.gguf.quants import GGML_TYPES_BY_NAME, affine4, dequantize

    n, k = shape
    t = GGML_TYPES_BY_NAME[ggml_type]
    row_bytes = k // t.block_size * t.type_size
    if callable(raw):
        read_rows = raw
    else:
        blocks = raw.reshape(n, row_bytes)  # one row of blocks per output channel
        def read_rows(start: int, stop: int) -> np.ndarray:
            return blocks[start:stop].reshape(-1)

    if ggml_type in INT4_TYPES and n % 16 == 0:
        layer = Int4Linear(k, n, 32, bias)
        for start, stop in _row_slices(n, k):
            q, s, o = (torch.from_numpy(a) for a in affine4(read_rows(start, stop), ggml_type))
            layer.fill_rows(start, q.view(stop - start, k), s.view(stop - start, -1), o.view(stop - start, -1))
        return layer
    if ggml_type == "Q5_0" and not grouped and k % 64 == 0 and _native_q5():
        return Q5Linear.from_blocks(read_rows, shape, bias)
    if ggml_type in INT8_TYPES and grouped:
        return Int8Linear(*int8_groups_from_gguf(read_rows, ggml_type, shape, HEAD_GROUP_SIZE), bias)
    if ggml_type in INT8_TYPES or ggml_type in INT4_TYPES:
        def rows(start: int, stop: int) -> torch.Tensor:
            return torch.from_numpy(dequantize(read_rows(start, stop), ggml_type)).view(stop - start, k)

        return Int8Linear(*int8_from_float_rows(n, k, rows), bias)
    return None


def _native_q5() -> bool:
    from lollm import native
    return native.block_q5_op() is not None


def linear_from_float(weight: torch.Tensor, quantization: Quantization, bias: nn.Parameter | None) -> nn.Module:
    """A packed linear layer from a float matrix ``(out_features, in_features)``, as ``quantization`` says (int8 or int4).

    int4 falls back to int8 for a matrix the int4 kernel cannot tile (rows not a
    multiple of 16, or columns not a multiple of the group size).
    """
    n, k = weight.shape
    if quantization.mode == "int4" and n % 16 == 0 and k % quantization.group_size == 0:
        layer = Int4Linear(k, n, quantization.group_size, bias)
        for start, stop in _row_slices(n, k):
            layer.fill_rows(start, *quantize_int4_groups(weight[start:stop], quantization.group_size))
        return layer
    return Int8Linear(*int8_from_float_rows(n, k, lambda a, b: weight[a:b]), bias)


def describe(module: nn.Module) -> str:
    """How a packed module stores its matrix, for the load summary (``"int4 groups of 32"`` …)."""
    if isinstance(module, Int4Linear):
        return f"int4 groups of {module.group_size}"
    if isinstance(module, Q5Linear):
        return "Q5_0 blocks (5-bit codes)"
    if isinstance(module, Int8Linear):
        return "int8 per channel" if module.codes.shape[0] == 1 else f"int8 groups of {module.group_size}"
    if isinstance(module, BlockEmbedding):
        return "file blocks, rows dequantized on lookup"
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
        """The summary; where int8 layers were kept, it also says whether lollm's native kernel runs them (lollm.native)."""
        parts = [f"{stored}→{kept} ×{n}" for (stored, kept), n in sorted(self.counts.items()) if n]
        text = f"weights ({self.requested}): " + ", ".join(parts) + f"; {self.model_bytes / 1e6:.0f} MB in memory"
        if any(kept.startswith("int8") for _, kept in self.counts):
            from lollm import native
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
