"""The packed linear layers: :class:`Int4Linear`, :class:`Int8Linear` and :class:`Q5Linear`.

Each keeps a matrix as small integers with scales and multiplies with a packed kernel;
:mod:`lollm.load.quantized` says which layer a tensor becomes and why.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm import native
from lollm.errors import WeightsError

#: The dtype the packed kernels compute in (activations, scales and outputs).
KERNEL_DTYPE = torch.bfloat16
#: Weights handled per slice when packing, so temporaries stay a few MB.
_SLICE_WEIGHTS = 1 << 20


def native_gemm_rows() -> None:
    """Kept for the import promise of docs/plugins.md (until lollm-core 0.3); always None.

    It gave the row count from which a packed layer dequantized its weights to bfloat16 and
    multiplied once. That path is gone: it rounded differently from the int8 kernel, so a
    row's output changed with the number of rows beside it, and the kernel's own multi-row
    loops are now faster (docs/native-kernel.md, section 4). No layer switches by row count.
    """
    return None


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


def row_slices(n_rows: int, row_len: int):
    step = max(64, (_SLICE_WEIGHTS // max(row_len, 1)) // 64 * 64)  # a multiple of 64 rows (the int4 tile)
    for start in range(0, n_rows, step):
        yield start, min(n_rows, start + step)


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
                  runs (``native``).
    bias: float parameter ``(out_features,)`` or None.
    native: whether lollm's native kernel runs this layer, decided when the layer is made.

    forward: ``x (..., in_features)`` -> ``(..., out_features)`` in x's dtype, computed the same
    way for every number of rows M (tokens), so that a row's output is a function of that row and
    the weights alone, bit for bit, whatever rows share the call (an engine step's other
    requests, a prefill chunk's other tokens):

    * where lollm's native kernel is built (:mod:`lollm.native`, docs/native-kernel.md): x
      becomes int8 in blocks of 32 with one scale each (llama.cpp's Q8_0 activations), each
      block meets 32 codes in integer dot-product instructions (exact int32 sums), and the sums
      are scaled and added in float32 in one fixed order by the exact scales ``scale`` (read as
      float32 in either dtype: float16 scales give the same outputs, bit for bit, as the same
      values in float32). Every route the kernel has (AMX tiles, AVX-512 VNNI, AVX2, portable
      C++; ``LOLLM_ISA``) gives the same bits, and its multi-row loops reuse each weight block
      across rows, so a prefill pays the weights once.
    * where it is not built: ``_weight_int8pack_mm`` with bfloat16 activations, at every row
      count. That kernel reads the int8 codes once *per row*, so its time grows with M (16 rows
      cost about 7 times one row).

    The two compute ``x · (q * s)`` from the same codes; they differ in where they round (x to
    int8 per block in the first; x and the scales to bfloat16 in the second): a few parts in a
    thousand of a logit (docs/quantized-execution.md).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None = None):
        super().__init__()
        groups, self.out_features, self.group_size = codes.shape
        self.in_features = groups * self.group_size
        self.register_buffer("codes", codes)
        self.register_buffer("scale", exact_scale(scale))
        self.bias = bias
        # Decided (and built, on a first run) while the model loads, not at its first token.
        self.native = self.group_size % 32 == 0 and native.block_int8_op() is not None
        # torch's kernel reads bfloat16 scales: kept beside the exact ones only where it runs
        # (for the head that copy is 8.5 MB).
        self.register_buffer("kernel_scale", None if self.native else scale.to(KERNEL_DTYPE))

    def uses_native(self) -> bool:
        """Whether forward goes through lollm's native kernel (:mod:`lollm.native`): it was built and
        on when this layer was made (``self.native``: groups of a multiple of 32), and the codes are
        contiguous CPU tensors."""
        return self.native and self.codes.is_cpu and self.codes.is_contiguous() and self.scale.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if self.uses_native():  # int8 activations in blocks of 32, integer dot products (lollm.native)
            y = native.ops().block_int8_linear(rows.float().contiguous(), self.codes, self.scale)
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

    forward: ``x (..., in_features)`` -> ``(..., out_features)`` in x's dtype: the native
    kernel at every row count, each row alone and bit for bit the same on every route, as for
    :class:`Int8Linear`. Raises WeightsError where the kernel is off or not built (the loader
    makes this layer only where it is built).
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
        for start, stop in row_slices(n, k):
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
        kernel = native.ops()
        if kernel is None:
            raise WeightsError(f"Q5Linear ({self.out_features}, {self.in_features}) needs lollm's native kernel: {native.status()}")
        # int8 activations in blocks of 32, integer dot products (lollm.native)
        y = kernel.block_q5_linear(rows.float().contiguous(), self.nibbles, self.high, self.scale)  # (M, N)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
