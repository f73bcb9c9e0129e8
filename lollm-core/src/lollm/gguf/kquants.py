"""The K-quants' dequantizers (Q2_K .. Q6_K): 256-weight super-blocks, in numpy.

Each follows the conventions of :mod:`lollm.gguf.quants` (its docstring says how to read them):
``dequantize_<type>(blocks, out)``, bit-exact against ggml's reference C code.
"""

from __future__ import annotations

import numpy as np

from lollm.gguf.bits import SHIFT_2BIT, crumbs, f16, nibbles, shaped, single_bits

# ---------------------------------------------------------------------------
# K-quants: 256-weight super-blocks made of 16 or 8 sub-blocks
# ---------------------------------------------------------------------------


def dequantize_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q2_K: 256 weights in 84 bytes, 2.625 bits per weight; 16 sub-blocks of 16.

    ::

        bytes  0-15  scales[16]  one byte per sub-block of 16 weights:
                                 low nibble = scale sc, high nibble = min m (4 bits each)
        bytes 16-79  qs[64]      256 unsigned 2-bit values, in two halves of 32 bytes;
                                 bits 2s..2s+1 of byte l of half h = weight 128h + 32s + l
        bytes 80-81  d           float16 super-scale for the scales
        bytes 82-83  dmin        float16 super-scale for the mins

        for weight i, in sub-block b = i // 16:
        w = (d * sc[b]) * q - (dmin * m[b])          q in 0..3

    Follows dequantize_row_q2_K in ggml-quants.c.
    """
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d = f16(blocks[:, 80:82])
    dmin = f16(blocks[:, 82:84])
    scale = d * (sc & np.uint8(0x0F))  # (n, 16) float32
    minv = dmin * (sc >> np.uint8(4))
    q = crumbs(blocks[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16)
    y = shaped(out, n, 16, 16)
    np.multiply(q, scale[:, :, None], out=y)
    np.subtract(y, minv[:, :, None], out=y)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """The 16 signed 6-bit scales of a Q3_K block from its 12 packed bytes: ``(n, 12)`` -> ``(n, 16)`` int8.

    Scale j has its low 4 bits in byte j (j < 8, low nibble) or byte j - 8
    (j >= 8, high nibble), and its high 2 bits in byte 8 + j % 4 at bit
    position 2 * (j // 4). The 6-bit value is stored with an offset of 32.
    """
    n = s.shape[0]
    low = nibbles(s[:, 0:8]).reshape(n, 16)  # j < 8: low nibble of byte j; j >= 8: high nibble of byte j - 8
    high = ((s[:, None, 8:12] >> SHIFT_2BIT) & np.uint8(3)).reshape(n, 16)  # (j // 4, j % 4)
    six_bit = low | (high << np.uint8(4))
    six_bit -= np.uint8(32)
    return six_bit.view(np.int8)


def dequantize_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q3_K: 256 weights in 110 bytes, 3.4375 bits per weight; 16 sub-blocks of 16, no mins.

    ::

        bytes   0-31   hmask[32]   the third (high) bit of each weight:
                                   bit b of byte l = weight 32b + l
        bytes  32-95   qs[64]      the low 2 bits, laid out as Q2_K's qs
        bytes  96-107  scales[12]  16 scales of 6 bits (see _q3_k_scales), offset by 32
        bytes 108-109  d           float16 super-scale

        q = low2 - (0 if high bit set else 4)        q in -4..3
        w = (d * (sc[b] - 32)) * q                   b = i // 16

    The high bit is stored "inverted": a set bit means no -4.
    Follows dequantize_row_q3_K in ggml-quants.c.
    """
    n = blocks.shape[0]
    high = single_bits(blocks[:, 0:32]).reshape(n, 256)
    low = crumbs(blocks[:, 32:96].reshape(n, 2, 32)).reshape(n, 256)
    d = f16(blocks[:, 108:110])
    scale = d * _q3_k_scales(blocks[:, 96:108])  # (n, 16) float32
    high ^= np.uint8(1)
    low -= high << np.uint8(2)  # wraps in uint8; as int8 it is low - 4 * (1 - bit)
    y = shaped(out, n, 16, 16)
    np.multiply(low.view(np.int8).reshape(n, 16, 16), scale[:, :, None], out=y)


def k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 8 scales and 8 mins (6 bits each) of a Q4_K / Q5_K block: ``(n, 12)`` -> two ``(n, 8)`` uint8.

    ::

        byte  0..3   : bits 0-5 = scale[0..3]      bits 6-7 = high bits of scale[4..7]
        byte  4..7   : bits 0-5 = min[0..3]        bits 6-7 = high bits of min[4..7]
        byte  8..11  : bits 0-3 = low of scale[4..7], bits 4-7 = low of min[4..7]

    This is get_scale_min_k4 in ggml-quants.c, done for all 8 sub-blocks at once.
    """
    n = s.shape[0]
    first, second, third = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.empty((n, 8), dtype=np.uint8)
    mins = np.empty((n, 8), dtype=np.uint8)
    scales[:, 0:4] = first & np.uint8(63)
    mins[:, 0:4] = second & np.uint8(63)
    scales[:, 4:8] = (third & np.uint8(0x0F)) | ((first >> np.uint8(6)) << np.uint8(4))
    mins[:, 4:8] = (third >> np.uint8(4)) | ((second >> np.uint8(6)) << np.uint8(4))
    return scales, mins


def dequantize_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_K: 256 weights in 144 bytes, 4.5 bits per weight; 8 sub-blocks of 32.

    ::

        bytes  0-1    d           float16 super-scale for the 8 scales
        bytes  2-3    dmin        float16 super-scale for the 8 mins
        bytes  4-15   scales[12]  8 scales + 8 mins, 6 bits each (see k4_scales_mins)
        bytes 16-143  qs[128]     256 unsigned 4-bit values in 4 groups of 32 bytes;
                                  group g holds sub-block 2g in its low nibbles and
                                  sub-block 2g+1 in its high nibbles

        w = (d * sc[b]) * q - (dmin * m[b])          b = i // 32, q in 0..15

    Follows dequantize_row_q4_K in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    dmin = f16(blocks[:, 2:4])
    sc, m = k4_scales_mins(blocks[:, 4:16])
    scale = d * sc  # (n, 8) float32
    minv = dmin * m
    q = nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    y = shaped(out, n, 8, 32)
    np.multiply(q, scale[:, :, None], out=y)
    np.subtract(y, minv[:, :, None], out=y)


def dequantize_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_K: 256 weights in 176 bytes, 5.5 bits per weight; Q4_K plus a fifth bit.

    ::

        bytes  0-1    d           float16 super-scale for the scales
        bytes  2-3    dmin        float16 super-scale for the mins
        bytes  4-15   scales[12]  8 scales + 8 mins, 6 bits each, packed as in Q4_K
        bytes 16-47   qh[32]      the fifth bit: bit b of byte l = weight 32b + l
        bytes 48-175  qs[128]     the low 4 bits, laid out as Q4_K's qs

        q = low4 | (bit << 4)                        q in 0..31
        w = (d * sc[b]) * q - (dmin * m[b])          b = i // 32

    Follows dequantize_row_q5_K in ggml-quants.c.
    """
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    dmin = f16(blocks[:, 2:4])
    sc, m = k4_scales_mins(blocks[:, 4:16])
    scale = d * sc
    minv = dmin * m
    q = nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q |= single_bits(blocks[:, 16:48]) << np.uint8(4)
    y = shaped(out, n, 8, 32)
    np.multiply(q, scale[:, :, None], out=y)
    np.subtract(y, minv[:, :, None], out=y)


def dequantize_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q6_K: 256 weights in 210 bytes, 6.5625 bits per weight; 16 sub-blocks of 16.

    ::

        bytes   0-127  ql[128]     low 4 bits, two halves of 64 bytes; in half h,
                                   byte l (0..63) holds weight 128h + l (low nibble)
                                   and weight 128h + 64 + l (high nibble)
        bytes 128-191  qh[64]      high 2 bits, two halves of 32 bytes; in half h,
                                   bits 2s..2s+1 of byte l = weight 128h + 32s + l
        bytes 192-207  scales[16]  signed 8-bit scale per sub-block of 16
        bytes 208-209  d           float16 super-scale

        q = (low4 | (high2 << 4)) - 32               q in -32..31
        w = (d * sc[b]) * q                          b = i // 16

    Follows dequantize_row_q6_K in ggml-quants.c.
    """
    n = blocks.shape[0]
    low = nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = crumbs(blocks[:, 128:192].reshape(n, 2, 32))  # (n, 2, 4, 32)
    d = f16(blocks[:, 208:210])
    scale = d * blocks[:, 192:208].view(np.int8)  # (n, 16) float32
    low |= high << np.uint8(4)
    low -= np.uint8(32)  # int8 view: q - 32
    y = shaped(out, n, 16, 16)
    np.multiply(low.view(np.int8).reshape(n, 16, 16), scale[:, :, None], out=y)
