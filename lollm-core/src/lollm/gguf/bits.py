"""Unpacking the bits of ggml blocks: float16 scales, 4-, 2- and 1-bit fields, in numpy.

The small helpers every dequantizer of :mod:`lollm.gguf.quants` and :mod:`lollm.gguf.kquants` shares.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights in a K-quant (and IQ4_XS) super-block


# ---------------------------------------------------------------------------
# Small helpers shared by the kernels
# ---------------------------------------------------------------------------


def f16(two_bytes: np.ndarray) -> np.ndarray:
    """A ``(n, 2)`` column of little-endian float16 bytes -> ``(n, 1)`` float32 (exact)."""
    return two_bytes.view("<f2").astype(np.float32)


def shaped(out: np.ndarray, *shape: int) -> np.ndarray:
    """A view of ``out`` with a new shape; fails instead of silently copying (writes must land in ``out``)."""
    view = out.view()
    view.shape = shape
    return view


def nibbles(packed: np.ndarray) -> np.ndarray:
    """Split bytes into 4-bit halves: ``(..., k)`` uint8 -> ``(..., 2, k)``, low nibbles first, then high.

    This is the packing of every 4-bit format in ggml: byte ``j`` of a group
    of ``k`` bytes holds weight ``j`` in its low nibble and weight ``j + k``
    in its high nibble.
    """
    out = np.empty(packed.shape[:-1] + (2, packed.shape[-1]), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[..., 0, :])
    np.right_shift(packed, 4, out=out[..., 1, :])
    return out


#: The shifts that pick the four 2-bit fields of a byte (see :func:`crumbs`).
SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
_SHIFT_1BIT = np.arange(8, dtype=np.uint8).reshape(8, 1)  # eight 1-bit fields per byte


def crumbs(packed: np.ndarray) -> np.ndarray:
    """Split bytes into four 2-bit fields: ``(..., 32)`` uint8 -> ``(..., 4, 32)``.

    Field ``s`` of byte ``l`` (bits ``2s, 2s+1``) is weight ``32 * s + l`` of
    the 128 weights those 32 bytes hold (the K-quant layout of 2-bit values).
    """
    return (packed[..., None, :] >> SHIFT_2BIT) & np.uint8(3)


def single_bits(packed: np.ndarray) -> np.ndarray:
    """Split bytes into bits: ``(..., 32)`` uint8 -> ``(..., 8, 32)``; bit ``b`` of byte ``l`` is weight ``32 * b + l``."""
    return (packed[..., None, :] >> _SHIFT_1BIT) & np.uint8(1)
