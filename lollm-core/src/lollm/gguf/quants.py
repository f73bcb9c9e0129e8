"""ggml tensor types and their dequantization to float32, in numpy.

A GGUF file stores every tensor as a run of *blocks*. A block holds a fixed
number of weights (``block_size``) in a fixed number of bytes
(``type_size``): one weight in 4 bytes for ``F32``, 32 weights in 18 bytes
for ``Q4_0``, 256 weights in 144 bytes for ``Q4_K``. Inside a block, a few
bytes are *scales* (float16 numbers, or small integers that multiply a
float16 super-scale) and the rest are small integers packed several to a
byte. Dequantizing is: unpack the integers, unpack the scales, multiply.

How to read this module
-----------------------
* :data:`GGML_TYPES` is the table of every ggml type id that a GGUF file can
  name, with its block size and bytes per block (from ggml's own type table).
  Knowing the sizes of *every* type lets the reader validate the layout of a
  file even when we cannot dequantize some of its tensors.
* One function per supported type, ``dequantize_<type>(blocks, out)``. It
  receives ``blocks``, a ``(n_blocks, type_size)`` uint8 array (the raw
  bytes, one row per block), and writes ``n_blocks * block_size`` float32
  values into ``out`` (shape ``(n_blocks, block_size)``). Each one is
  vectorized over all the blocks it is given: there is no Python loop over
  blocks, only numpy operations on whole columns of bytes. Its docstring draws
  the block, says how the scales are packed, gives the formula, and names the
  function of llama.cpp's ``ggml/src/ggml-quants.c`` it follows.
* :func:`dequantize` is the entry point: raw bytes + type name -> float32.

Bit-exactness
-------------
Every kernel computes each weight with the same float32 operations in the
same order as ggml's reference C code (and gguf-py's ``gguf.quants``): for
example Q4_K computes ``(d * sc) * q - (dmin * m)`` in float32, never a fused
multiply-add and never ``d * (sc * q)``. Integers are exact in float32, so
the only roundings are the ones ggml makes; the tests check bit equality
against ``gguf.quants.dequantize`` on random blocks and on two real files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lollm.errors import GGUFError
from lollm.gguf.bits import QK_K, f16, nibbles, shaped
from lollm.gguf.kquants import (
    dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_k, dequantize_q6_k, k4_scales_mins,
)


# ---------------------------------------------------------------------------
# The table of ggml types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: its name, its numeric id in GGUF files, and its block geometry.

    ``block_size`` weights are stored in ``type_size`` bytes; plain float and
    integer types are "blocks" of one element.
    """

    name: str
    type_id: int
    block_size: int
    type_size: int

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    def nbytes(self, n_elements: int) -> int:
        """Bytes that ``n_elements`` weights take (n_elements must be a multiple of block_size)."""
        return n_elements // self.block_size * self.type_size


# (name, id, weights per block, bytes per block), as in ggml's type_traits table.
# Ids 4, 5 (Q4_2, Q4_3), 31-33 (Q4_0_4_4, Q4_0_4_8, Q4_0_8_8) and 36-38
# (IQ4_NL_4_4 …) belonged to types that ggml has removed; a file naming one of
# them is refused like any other unknown id.
_TYPE_ROWS = [
    ("F32", 0, 1, 4),
    ("F16", 1, 1, 2),
    ("Q4_0", 2, 32, 2 + 16),
    ("Q4_1", 3, 32, 2 + 2 + 16),
    ("Q5_0", 6, 32, 2 + 4 + 16),
    ("Q5_1", 7, 32, 2 + 2 + 4 + 16),
    ("Q8_0", 8, 32, 2 + 32),
    ("Q8_1", 9, 32, 4 + 4 + 32),
    ("Q2_K", 10, QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    ("Q3_K", 11, QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    ("Q4_K", 12, QK_K, 2 + 2 + 12 + QK_K // 2),
    ("Q5_K", 13, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    ("Q6_K", 14, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    ("Q8_K", 15, QK_K, 4 + QK_K + QK_K // 8),
    ("IQ2_XXS", 16, QK_K, 2 + QK_K // 4),
    ("IQ2_XS", 17, QK_K, 2 + QK_K // 4 + QK_K // 32),
    ("IQ3_XXS", 18, QK_K, 2 + QK_K // 4 + QK_K // 8),
    ("IQ1_S", 19, QK_K, 2 + QK_K // 8 + QK_K // 16),
    ("IQ4_NL", 20, 32, 2 + 16),
    ("IQ3_S", 21, QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    ("IQ2_S", 22, QK_K, 2 + QK_K // 4 + QK_K // 16),
    ("IQ4_XS", 23, QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    ("I8", 24, 1, 1),
    ("I16", 25, 1, 2),
    ("I32", 26, 1, 4),
    ("I64", 27, 1, 8),
    ("F64", 28, 1, 8),
    ("IQ1_M", 29, QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    ("BF16", 30, 1, 2),
    ("TQ1_0", 34, QK_K, 2 + 4 * 13),
    ("TQ2_0", 35, QK_K, 2 + QK_K // 4),
    ("MXFP4", 39, 32, 1 + 16),
    ("NVFP4", 40, 64, 4 + 32),
    ("Q1_0", 41, 128, 2 + 16),
]

#: Every ggml type a GGUF file may name, by numeric id.
GGML_TYPES: dict[int, GGMLType] = {row[1]: GGMLType(*row) for row in _TYPE_ROWS}
#: The same table by name (``"Q4_K"`` -> GGMLType).
GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}


def ggml_type(name: str) -> GGMLType:
    """The :class:`GGMLType` called ``name``; GGUFError for a name ggml does not have."""
    try:
        return GGML_TYPES_BY_NAME[name]
    except KeyError:
        raise GGUFError(f"unknown ggml type {name!r}; known: {', '.join(GGML_TYPES_BY_NAME)}") from None


# ---------------------------------------------------------------------------
# Plain floats
# ---------------------------------------------------------------------------


def dequantize_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    """F32: 4 bytes per weight, IEEE float32, little-endian. Copied as is."""
    out[:] = blocks.view("<f4")


def dequantize_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    """F16: 2 bytes per weight, IEEE float16, little-endian. Widened to float32 (exact)."""
    out[:] = blocks.view("<f2")


def dequantize_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    """BF16: 2 bytes per weight, the top half of a float32.

    Widening is a shift: put the 16 stored bits in the high half of a 32-bit
    word and read the word as float32 (ggml_bf16_to_fp32 in ggml-impl.h).
    """
    bits = blocks.view("<u2").astype(np.uint32) << np.uint32(16)
    out[:] = bits.view(np.float32)


# ---------------------------------------------------------------------------
# Legacy 32-weight formats
# ---------------------------------------------------------------------------


def dequantize_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_0: 32 weights in 18 bytes, 4.5 bits per weight; symmetric 4-bit.

    ::

        bytes 0-1    d       float16 scale
        bytes 2-17   qs[16]  32 unsigned 4-bit values; byte j holds
                             weight j (low nibble) and weight j+16 (high nibble)

        w = (q - 8) * d                  q in 0..15, so q - 8 in -8..7

    Follows dequantize_row_q4_0 in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    q = nibbles(blocks[:, 2:18]).reshape(n, 32)
    q -= np.uint8(8)  # wraps around in uint8; read as int8 it is q - 8
    np.multiply(q.view(np.int8), d, out=out)


def dequantize_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_1: 32 weights in 20 bytes, 5 bits per weight; 4-bit with an offset.

    ::

        bytes 0-1    d       float16 scale
        bytes 2-3    m       float16 minimum (offset)
        bytes 4-19   qs[16]  32 unsigned 4-bit values, packed as in Q4_0

        w = q * d + m                    q in 0..15

    Follows dequantize_row_q4_1 in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    m = f16(blocks[:, 2:4])
    q = nibbles(blocks[:, 4:20]).reshape(n, 32)
    np.multiply(q, d, out=out)
    np.add(out, m, out=out)


def dequantize_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_0: 32 weights in 22 bytes, 5.5 bits per weight; symmetric 5-bit.

    ::

        bytes 0-1    d       float16 scale
        bytes 2-5    qh      32 fifth bits, one per weight: bit j of these 4 bytes
                             (little-endian uint32) is the high bit of weight j
        bytes 6-21   qs[16]  the low 4 bits, packed as in Q4_0

        q = low4 | (high_bit << 4)       q in 0..31
        w = (q - 16) * d

    Follows dequantize_row_q5_0 in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # (n, 32): bit j -> weight j
    q = nibbles(blocks[:, 6:22]).reshape(n, 32)
    q |= high << np.uint8(4)
    q -= np.uint8(16)  # int8 view: q - 16
    np.multiply(q.view(np.int8), d, out=out)


def dequantize_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_1: 32 weights in 24 bytes, 6 bits per weight; 5-bit with an offset.

    ::

        bytes 0-1    d       float16 scale
        bytes 2-3    m       float16 minimum
        bytes 4-7    qh      the 32 fifth bits, as in Q5_0
        bytes 8-23   qs[16]  the low 4 bits, as in Q4_0

        w = q * d + m                    q in 0..31

    Follows dequantize_row_q5_1 in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    m = f16(blocks[:, 2:4])
    high = np.unpackbits(blocks[:, 4:8], axis=1, bitorder="little")
    q = nibbles(blocks[:, 8:24]).reshape(n, 32)
    q |= high << np.uint8(4)
    np.multiply(q, d, out=out)
    np.add(out, m, out=out)


def dequantize_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q8_0: 32 weights in 34 bytes, 8.5 bits per weight; symmetric 8-bit.

    ::

        bytes 0-1    d       float16 scale
        bytes 2-33   qs[32]  signed 8-bit values, one per weight

        w = q * d                        q in -128..127

    Follows dequantize_row_q8_0 in ggml-quants.c.
    """
    d = f16(blocks[:, 0:2])
    np.multiply(blocks[:, 2:34].view(np.int8), d, out=out)


# ---------------------------------------------------------------------------
# Non-linear 4-bit: IQ4_NL and IQ4_XS
# ---------------------------------------------------------------------------

#: The 16 levels of the non-linear 4-bit grid (kvalues_iq4nl in ggml-common.h):
#: denser near zero, where most weights are, than a uniform -8..7 grid.
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def dequantize_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    """IQ4_NL: 32 weights in 18 bytes, 4.5 bits per weight; a 4-bit index into a fixed non-linear grid.

    ::

        bytes 0-1    d       float16 scale
        bytes 2-17   qs[16]  32 4-bit indices, packed as in Q4_0

        w = d * KVALUES_IQ4NL[q]

    Follows dequantize_row_iq4_nl in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    levels = KVALUES_IQ4NL[nibbles(blocks[:, 2:18]).reshape(n, 32)]
    np.multiply(levels, d, out=out)


def dequantize_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """IQ4_XS: 256 weights in 136 bytes, 4.25 bits per weight; IQ4_NL's grid with 6-bit sub-block scales.

    ::

        bytes  0-1    d           float16 super-scale
        bytes  2-3    scales_h    little-endian uint16: bits 2b..2b+1 = high 2 bits of scale b
        bytes  4-7    scales_l[4] low 4 bits of the 8 scales: byte b // 2, nibble b % 2
        bytes  8-135  qs[128]     8 sub-blocks of 32 weights, 16 bytes each,
                                  packed inside a sub-block as in Q4_0

        ls = low4 | (high2 << 4)                     6 bits, offset by 32
        w  = (d * (ls[b] - 32)) * KVALUES_IQ4NL[q]   b = i // 32

    Follows dequantize_row_iq4_xs in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    scales_h = blocks[:, 2:4].view("<u2").astype(np.uint32)  # (n, 1)
    high = ((scales_h >> np.arange(0, 16, 2, dtype=np.uint32)) & np.uint32(3)).astype(np.uint8)  # (n, 8)
    low = nibbles(blocks[:, 4:8]).transpose(0, 2, 1).reshape(n, 8)  # scale b: byte b // 2, nibble b % 2
    ls = low | (high << np.uint8(4))
    ls -= np.uint8(32)
    scale = d * ls.view(np.int8)  # (n, 8) float32
    levels = KVALUES_IQ4NL[nibbles(blocks[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32)]
    y = shaped(out, n, 8, 32)
    np.multiply(levels, scale[:, :, None], out=y)


# ---------------------------------------------------------------------------
# 4-bit formats as affine groups (for the quantized linear, lollm.load.quantized)
# ---------------------------------------------------------------------------


def affine4_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 as ``w = q * scale + offset``: ``(n, 18)`` -> codes ``(n, 1, 32)`` uint8, scale and offset ``(n, 1)`` float32.

    ``(q - 8) * d`` is ``q * d + (-8 * d)``; both products are exact in float32
    (an 11-bit float16 mantissa times a 4-bit integer), so the sum equals
    :func:`dequantize_q4_0` exactly (as a value: ``q = 8`` gives +0.0 where
    ``(q - 8) * d`` gives -0.0 for a negative ``d``).
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    q = nibbles(blocks[:, 2:18]).reshape(n, 1, 32)
    return q, d, d * np.float32(-8)


def affine4_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 as ``w = q * scale + offset``: scale ``d``, offset ``m`` (the format's own form)."""
    n = blocks.shape[0]
    q = nibbles(blocks[:, 4:20]).reshape(n, 1, 32)
    return q, f16(blocks[:, 0:2]), f16(blocks[:, 2:4])


def affine4_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K as ``w = q * scale + offset`` per sub-block of 32: codes ``(n, 8, 32)``, scale, offset ``(n, 8)``.

    scale = ``d * sc[b]``, offset = ``-(dmin * m[b])``: the same float32
    operations as :func:`dequantize_q4_k`, so ``q * scale + offset`` equals it
    bit for bit (``x + (-y)`` is ``x - y`` in IEEE arithmetic).
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    dmin = f16(blocks[:, 2:4])
    sc, m = k4_scales_mins(blocks[:, 4:16])
    q = nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    return q, d * sc, -(dmin * m)


#: The 4-bit types that are exactly "4-bit codes in groups of 32 with a scale and an offset".
AFFINE4: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {
    "Q4_0": affine4_q4_0,
    "Q4_1": affine4_q4_1,
    "Q4_K": affine4_q4_k,
}


def affine4(raw: np.ndarray, type_name: str, *, what: str = "tensor") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The raw bytes of a Q4_0 / Q4_1 / Q4_K tensor as affine 4-bit groups of 32.

    Returns ``(codes, scale, offset)``: ``codes`` a flat uint8 array of the
    values 0..15, one per weight in file order; ``scale`` and ``offset`` flat
    float32 arrays, one per group of 32 consecutive weights; each weight is
    ``codes[i] * scale[i // 32] + offset[i // 32]``, equal to
    :func:`dequantize` (bit for bit but for the sign of Q4_0's zeros). GGUFError for another type or a partial block.
    """
    if type_name not in AFFINE4:
        raise GGUFError(f"{what}: {type_name} is not a 4-bit affine type ({', '.join(AFFINE4)})")
    t = GGML_TYPES_BY_NAME[type_name]
    if raw.size % t.type_size:
        raise GGUFError(f"{what}: {raw.size} bytes is not a whole number of {type_name} blocks of {t.type_size} bytes")
    q, scale, offset = AFFINE4[type_name](raw.reshape(-1, t.type_size))
    return q.reshape(-1), scale.reshape(-1), offset.reshape(-1)


# ---------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------

Kernel = Callable[[np.ndarray, np.ndarray], None]

#: The types we can dequantize, with their kernels.
DEQUANTIZERS: dict[str, Kernel] = {
    "F32": dequantize_f32,
    "F16": dequantize_f16,
    "BF16": dequantize_bf16,
    "Q4_0": dequantize_q4_0,
    "Q4_1": dequantize_q4_1,
    "Q5_0": dequantize_q5_0,
    "Q5_1": dequantize_q5_1,
    "Q8_0": dequantize_q8_0,
    "Q2_K": dequantize_q2_k,
    "Q3_K": dequantize_q3_k,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
    "IQ4_NL": dequantize_iq4_nl,
    "IQ4_XS": dequantize_iq4_xs,
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(DEQUANTIZERS)

#: Weights dequantized per step. The kernels are vectorized over every block
#: they are given; handing them a quarter of a million weights at a time keeps
#: their temporaries (a few bytes per weight) small and bounds the extra memory
#: to a few MB whatever the tensor size, instead of several times the output.
STEP_WEIGHTS = 1 << 18


def dequantize(raw: np.ndarray, type_name: str, *, what: str = "tensor") -> np.ndarray:
    """Dequantize the raw bytes of a tensor stored as ``type_name`` into a new flat float32 array.

    ``raw`` is a 1-D uint8 array (for instance :meth:`GGUFFile.raw`) whose
    length is a whole number of blocks. ``what`` names the tensor in error
    messages. Raises GGUFError for a type without a dequantizer here (naming
    the type and ``what``) or for a byte count that is not whole blocks.
    """
    kernel = DEQUANTIZERS.get(type_name)
    if kernel is None:
        known = "an unknown ggml type" if type_name not in GGML_TYPES_BY_NAME else "a ggml type"
        raise GGUFError(
            f"{what}: is stored as {type_name}, {known} that lollm cannot dequantize; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    t = GGML_TYPES_BY_NAME[type_name]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise TypeError(f"dequantize expects a 1-D uint8 array, got {raw.dtype} of shape {raw.shape}")
    if raw.size % t.type_size:
        raise GGUFError(f"{what}: {raw.size} bytes is not a whole number of {type_name} blocks of {t.type_size} bytes")
    n_blocks = raw.size // t.type_size
    blocks = raw.reshape(n_blocks, t.type_size)
    out = np.empty((n_blocks, t.block_size), dtype=np.float32)
    step = max(1, STEP_WEIGHTS // t.block_size)
    # inf or NaN scales (a corrupted or odd file) give inf/NaN weights, as in ggml; numpy need not warn
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n_blocks, step):  # a handful of big steps, not a loop over blocks
            kernel(blocks[start : start + step], out[start : start + step])
    return out.reshape(-1)
