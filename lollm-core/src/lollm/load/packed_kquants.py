"""Linear layers over Q4_0, Q5_0, Q4_K, Q6_K and Q8_0 matrices, multiplied from the file's own bits.

A Q4_K_M file, the GGUF people download most, is mostly Q4_K and Q6_K tensors. These
layers keep such a matrix in the bits the file has (4.5, 5.5, 4.625, 6.5625 and 8.5 bits a weight),
rearranged once at load so that lollm's native kernel reads 16 output channels at a time
(``block_kquants.cpp``; docs/native-kernel.md, sections 10 to 14, draw each layout with a
worked block; section 15 Q5_0). Nothing is rounded on the way: :meth:`PanelLinear.dequantize` gives back
what :func:`lollm.gguf.quants.dequantize` gives for the file's bytes, bit for bit.

Each forward rounds x to int8 per block of 32 (as every packed layer of lollm does), sums
each block's products as integers, and scales and adds the block sums in one fixed
float32 order: a row's output is the same bits alone or in a batch of any size, and on
every instruction set the kernel was built for.

The panel layout (P = ceil(N / 16) panels; channels past N are zeros):

* ``nibbles (P, K / 32, 256)`` uint8: panel p, block b: 4 chunks of 64 bytes; in chunk h,
  byte ``4c + j`` holds channel ``16p + c``'s 4-bit code for input ``32b + 8h + j`` (low
  bits) and for input ``32b + 8h + 4 + j`` (high bits);
* ``codes (P, K / 32, 512)`` int8 (Q8_0): panel p, block b: 8 chunks of 64 bytes; in chunk v,
  byte ``4c + j`` holds channel ``16p + c``'s code for input ``32b + 4v + j``, as the file has it;
* ``fifth (P, K / 32, 64)`` uint8 (Q5_0): the codes' fifth bits; for inputs ``4v .. 4v + 3`` of
  block b, 8 bytes (one little-endian 64-bit word), whose bit ``4c + j`` belongs to channel ``16p + c``,
  input ``32b + 4v + j``;
* ``high (P, K / 32, 128)`` uint8 (Q6_K): the codes' top 2 bits; in chunk h (0, 1), bits
  ``2s, 2s + 1`` of byte ``4c + j`` belong to input ``32b + 16h + 4s + j``;
* scales ``(P, count, 16)``: one per channel and block (or sub-block, super-block), the
  16 channels of a panel side by side.

These layers are made only where the native kernel is built (:mod:`lollm.load.quantized`
decides); elsewhere a Q4_0 or Q4_K matrix becomes an Int4Linear and a Q5_0, Q6_K or Q8_0 one an Int8Linear.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lollm import native
from lollm.errors import WeightsError
from lollm.gguf.bits import crumbs, nibbles, single_bits
from lollm.gguf.kquants import k4_scales_mins
from lollm.load.packed_linear import row_slices

#: Output channels in a panel (the 16 lanes of the kernel's vectors).
PANEL = 16
#: Weights in a K-quant super-block.
SUPER = 256


# ---------------------------------------------------------------------------
# The panel layout: per-channel arrays -> panels, and back (for dequantize)
# ---------------------------------------------------------------------------


def pad_channels(t: torch.Tensor) -> torch.Tensor:
    """``(n, ...)`` -> ``(16 * ceil(n / 16), ...)``: zeros added for the channels past n."""
    extra = -t.shape[0] % PANEL
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def panel_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``(n, K)`` uint8 0..15 -> ``(P, K / 32, 256)`` uint8, the nibbles of the panel layout."""
    codes = pad_channels(codes)
    n, k = codes.shape
    c = codes.view(n // PANEL, PANEL, k // 32, 4, 2, 4)  # (panel, channel c, block b, chunk h, half, j): input 32b + 8h + 4 half + j
    c = c.permute(0, 2, 3, 1, 5, 4)  # (panel, b, h, c, j, half)
    return (c[..., 0] | (c[..., 1] << 4)).reshape(n // PANEL, k // 32, 256)


def panel_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``(n, K)`` int8 -> ``(P, K / 32, 512)`` int8, Q8_0's codes in the panel layout (no packing: a byte a code)."""
    codes = pad_channels(codes)
    n, k = codes.shape
    c = codes.view(n // PANEL, PANEL, k // 32, 8, 4)  # (panel, channel c, block b, chunk v, j): input 32b + 4v + j
    return c.permute(0, 2, 3, 1, 4).reshape(n // PANEL, k // 32, 512)  # (panel, b, v, c, j)


def bytes_of(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`panel_bytes`: ``(P, K / 32, 512)`` -> codes ``(16 P, K)`` int8."""
    p, blocks, _ = panels.shape
    return panels.view(p, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, blocks * 32)


def panel_crumbs(top: torch.Tensor) -> torch.Tensor:
    """Top bits ``(n, K)`` uint8 0..3 -> ``(P, K / 32, 128)`` uint8, Q6_K's ``high`` in the panel layout."""
    top = pad_channels(top)
    n, k = top.shape
    c = top.view(n // PANEL, PANEL, k // 32, 2, 4, 4)  # (panel, c, b, chunk h, s, j): input 32b + 16h + 4s + j
    c = c.permute(0, 2, 3, 1, 5, 4)  # (panel, b, h, c, j, s)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).reshape(n // PANEL, k // 32, 128)


def panel_fifth(bits: torch.Tensor) -> torch.Tensor:
    """Fifth bits ``(n, K)`` uint8 0..1 -> ``(P, K / 32, 64)`` uint8, Q5_0's ``fifth`` in the panel layout."""
    bits = pad_channels(bits)
    n, k = bits.shape
    c = bits.view(n // PANEL, PANEL, k // 32, 8, 4)  # (panel, channel c, block b, v, j): input 32b + 4v + j
    c = c.permute(0, 2, 3, 1, 4).reshape(n // PANEL, k // 32, 8, 8, 8)  # (panel, b, v, byte t, bit i): 4c + j = 8t + i
    packed = torch.zeros(c.shape[:-1], dtype=torch.uint8)
    for i in range(8):
        packed |= c[..., i] << i
    return packed.reshape(n // PANEL, k // 32, 64)


def fifth_of(fifth: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`panel_fifth`: ``(P, K / 32, 64)`` -> fifth bits ``(16 P, K)`` uint8 0..1."""
    p, blocks, _ = fifth.shape
    v = fifth.view(p, blocks, 8, 8)  # (panel, b, v, byte t)
    bits = torch.stack([(v >> i) & 1 for i in range(8)], dim=-1)  # (panel, b, v, t, i)
    return bits.view(p, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, blocks * 32)


def panel_channels(values: torch.Tensor) -> torch.Tensor:
    """Per-channel values ``(n, count)`` -> ``(P, count, 16)``: a panel's 16 channels side by side."""
    values = pad_channels(values)
    return values.view(-1, PANEL, values.shape[1]).transpose(1, 2).contiguous()


def codes_of(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`panel_nibbles`: ``(P, K / 32, 256)`` -> codes ``(16 P, K)`` uint8."""
    p, blocks, _ = panels.shape
    v = panels.view(p, blocks, 4, PANEL, 4)  # (panel, b, h, c, j)
    c = torch.stack([v & 15, v >> 4], dim=-1)  # (panel, b, h, c, j, half)
    return c.permute(0, 3, 1, 2, 5, 4).reshape(p * PANEL, blocks * 32)


def top_bits_of(high: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`panel_crumbs`: ``(P, K / 32, 128)`` -> top bits ``(16 P, K)`` uint8 0..3."""
    p, blocks, _ = high.shape
    v = high.view(p, blocks, 2, PANEL, 4)  # (panel, b, h, c, j)
    c = torch.stack([(v >> (2 * s)) & 3 for s in range(4)], dim=-1)  # (panel, b, h, c, j, s)
    return c.permute(0, 3, 1, 2, 5, 4).reshape(p * PANEL, blocks * 32)


def channels_of(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`panel_channels`: ``(P, count, 16)`` -> ``(16 P, count)``."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])


# ---------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------


class PanelLinear(nn.Module):
    """What the four layers share: buffers in the panel layout, one native operator, a bias.

    Subclasses name the operator (``OP``, in the build :func:`lollm.native.ops` gives), its weight tensors in
    the order it takes them (``PARTS``: name, dtype, and the shape of one panel's share for K
    inputs), the multiple K must be of (``K_MULTIPLE``), and how the file's bytes of a slice of
    rows become those tensors (:meth:`_panels`).

    forward: ``x (..., in_features)`` any float dtype -> ``(..., out_features)`` in x's dtype;
    the kernel computes in float32 (x rounded to int8 per block of 32 first), at every row count.
    """

    OP = ""
    GGML_TYPE = ""
    K_MULTIPLE = SUPER
    PARTS: tuple[tuple[str, torch.dtype, object], ...] = ()

    def __init__(self, in_features: int, out_features: int, parts: dict[str, torch.Tensor], bias: nn.Parameter | None = None):
        super().__init__()
        if native.block_int8_op() is None:  # loads the library (its first call builds it), or says why not
            raise WeightsError(f"{type(self).__name__} runs on lollm's native kernel only: {native.status()}")
        self.in_features, self.out_features = in_features, out_features
        panels = -(-out_features // PANEL)
        for name, dtype, share in self.PARTS:
            want = (panels, *share(in_features))
            got = parts[name]
            if got.dtype != dtype or tuple(got.shape) != want:
                raise WeightsError(f"{type(self).__name__}: {name} must be {dtype} {want} for ({out_features}, {in_features}), "
                                   f"got {got.dtype} {tuple(got.shape)}")
            self.register_buffer(name, got.contiguous())
        self.bias = bias

    @classmethod
    def from_blocks(cls, read_rows, shape: tuple[int, int], bias: nn.Parameter | None = None) -> "PanelLinear":
        """From a GGUF matrix of type ``GGML_TYPE``: ``read_rows(start, stop)`` gives the file's bytes of rows
        ``start .. stop`` (1-D uint8), read a slice at a time (row_slices: multiples of 64 rows, so every
        slice but the last starts and ends on a panel). WeightsError for K not a multiple of ``K_MULTIPLE``."""
        n, k = shape
        if k <= 0 or k % cls.K_MULTIPLE:
            raise WeightsError(f"{cls.GGML_TYPE} matrix ({n}, {k}): its {k} columns are not whole blocks of {cls.K_MULTIPLE}")
        panels = -(-n // PANEL)
        parts = {name: torch.zeros(panels, *share(k), dtype=dtype) for name, dtype, share in cls.PARTS}
        for start, stop in row_slices(n, k):
            rows = stop - start
            for name, value in cls._panels(np.asarray(read_rows(start, stop)).reshape(rows, -1), k).items():
                parts[name][start // PANEL : start // PANEL + value.shape[0]] = value
        return cls(k, n, parts, bias)

    @staticmethod
    def _panels(raw: np.ndarray, k: int) -> dict[str, torch.Tensor]:
        """The file's bytes of some rows ``(rows, bytes a row)`` -> each of ``PARTS`` for those rows, in panels."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``(out_features, in_features)``, computed as the file's dequantizer does (bit for bit)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        op = getattr(native.ops(), self.OP)
        y = op(rows.float().contiguous(), *(getattr(self, name) for name, _, _ in self.PARTS), self.out_features)  # (M, N) float32
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _blocks(k: int) -> tuple[int, int]:
    return (k // 32, 256)


def _per_block(k: int) -> tuple[int, int]:
    return (k // 32, PANEL)


def _per_super(k: int) -> tuple[int, int]:
    return (k // SUPER, PANEL)


class Q4_0Linear(PanelLinear):
    """A Q4_0 matrix: ``w[n, k] = (q - 8) * d``, q a 4-bit code (0..15), d float16 per block of 32 (4.5 bits a weight).

    Buffers: ``nibbles (P, K / 32, 256)`` uint8 (the panel layout), ``d (P, K / 32, 16)`` float16, the file's d.
    Kernel: ``block_q4_0_linear`` (isum = sum((q - 8) * xq), ws = d).
    """

    OP, GGML_TYPE, K_MULTIPLE = "block_q4_0_linear", "Q4_0", 32
    PARTS = (("nibbles", torch.uint8, _blocks), ("d", torch.float16, _per_block))

    @staticmethod
    def _panels(raw: np.ndarray, k: int) -> dict[str, torch.Tensor]:
        rows = raw.shape[0]
        blocks = raw.reshape(rows * k // 32, 18)  # d (2 bytes), qs (16): byte j = weight j | weight j + 16 << 4
        d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).view(rows, k // 32)
        q = torch.from_numpy(nibbles(blocks[:, 2:18])).reshape(rows, k)
        return {"nibbles": panel_nibbles(q), "d": panel_channels(d)}

    def dequantize(self) -> torch.Tensor:
        q = codes_of(self.nibbles)[: self.out_features].float().view(self.out_features, -1, 32)
        d = channels_of(self.d)[: self.out_features].float()
        return ((q - 8) * d[..., None]).view(self.out_features, self.in_features)


class Q5_0Linear(PanelLinear):
    """A Q5_0 matrix: ``w[n, k] = (q - 16) * d``, q a 5-bit code (0..31), d float16 per block of 32 (5.5 bits a weight).

    Buffers: ``nibbles (P, K / 32, 256)`` uint8, q's low 4 bits; ``fifth (P, K / 32, 64)`` uint8, its fifth
    bit; ``d (P, K / 32, 16)`` float16, the file's d. Kernel: ``block_q5_0_linear`` (isum = sum((q - 16) * xq),
    ws = d). The same numbers in the same order as :class:`Q5Linear` (so the same bits), but a lone row needs
    no sums across a vector's lanes: decode reads it faster.
    """

    OP, GGML_TYPE, K_MULTIPLE = "block_q5_0_linear", "Q5_0", 32
    PARTS = (("nibbles", torch.uint8, _blocks), ("fifth", torch.uint8, lambda k: (k // 32, 64)), ("d", torch.float16, _per_block))

    @staticmethod
    def _panels(raw: np.ndarray, k: int) -> dict[str, torch.Tensor]:
        rows = raw.shape[0]
        blocks = raw.reshape(rows * k // 32, 22)  # d (2 bytes), qh (4: bit j = weight j's fifth bit), qs (16, as Q4_0)
        d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).view(rows, k // 32)
        high = single_bits(blocks[:, 2:6])  # (., bit b, byte l): weight 8l + b
        high = high.transpose(0, 2, 1).reshape(rows, k)
        low = torch.from_numpy(nibbles(blocks[:, 6:22])).reshape(rows, k)
        return {"nibbles": panel_nibbles(low), "fifth": panel_fifth(torch.from_numpy(np.ascontiguousarray(high))),
                "d": panel_channels(d)}

    def dequantize(self) -> torch.Tensor:
        n = self.out_features
        q = (codes_of(self.nibbles)[:n] | (fifth_of(self.fifth)[:n] << 4)).float().view(n, -1, 32)
        d = channels_of(self.d)[:n].float()
        return ((q - 16) * d[..., None]).view(n, self.in_features)


class Q4_KLinear(PanelLinear):
    """A Q4_K matrix: ``w = (d * sc_j) * q - (dmin * m_j)``, q 4-bit, sc_j and m_j 6-bit per block of 32,
    d and dmin float16 per super-block of 256 (4.625 bits a weight here; the file's 4.5 packs the 6-bit values).

    Buffers: ``nibbles (P, K / 32, 256)`` uint8; ``sc``, ``m (P, K / 32, 16)`` uint8 (0..63);
    ``d``, ``dmin (P, K / 256, 16)`` float16. Kernel: ``block_q4_k_linear``: per block
    isum = sum(q * xq) with ws = d * sc_j, then the block's offset sum(xq) with wo = -(dmin * m_j),
    both products exact in float32.
    """

    OP, GGML_TYPE = "block_q4_k_linear", "Q4_K"
    PARTS = (("nibbles", torch.uint8, _blocks), ("sc", torch.uint8, _per_block), ("m", torch.uint8, _per_block),
             ("d", torch.float16, _per_super), ("dmin", torch.float16, _per_super))

    @staticmethod
    def _panels(raw: np.ndarray, k: int) -> dict[str, torch.Tensor]:
        rows, supers = raw.shape[0], k // SUPER
        blocks = raw.reshape(rows * supers, 144)  # d, dmin (2 bytes each), 12 bytes of 6-bit sc and m, qs (128)
        d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).view(rows, supers)
        dmin = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).view(rows, supers)
        sc, m = (torch.from_numpy(a).view(rows, k // 32) for a in k4_scales_mins(blocks[:, 4:16]))
        q = torch.from_numpy(nibbles(blocks[:, 16:144].reshape(-1, 4, 32))).reshape(rows, k)  # group g: blocks 2g, 2g + 1
        return {"nibbles": panel_nibbles(q), "sc": panel_channels(sc), "m": panel_channels(m),
                "d": panel_channels(d), "dmin": panel_channels(dmin)}

    def dequantize(self) -> torch.Tensor:
        n = self.out_features
        q = codes_of(self.nibbles)[:n].float().view(n, -1, 32)
        scale = channels_of(self.d)[:n].float().repeat_interleave(8, dim=1) * channels_of(self.sc)[:n].float()  # (n, K / 32)
        minimum = channels_of(self.dmin)[:n].float().repeat_interleave(8, dim=1) * channels_of(self.m)[:n].float()
        return (q * scale[..., None] - minimum[..., None]).view(n, self.in_features)


class Q6_KLinear(PanelLinear):
    """A Q6_K matrix: ``w = (d * sc_j) * (q - 32)``, q 6-bit (0..63), sc_j int8 per sub-block of 16, d float16
    per super-block of 256 (6.5625 bits a weight, as in the file).

    Buffers: ``nibbles (P, K / 32, 256)`` uint8, q's low 4 bits; ``high (P, K / 32, 128)`` uint8, its top 2;
    ``sc (P, K / 16, 16)`` int8; ``d (P, K / 256, 16)`` float16. Kernel: ``block_q6_k_linear``: per block
    of 32, isum = sc_lo * sum((q - 32) * xq over the first 16) + sc_hi * (over the last 16), ws = d.
    """

    OP, GGML_TYPE = "block_q6_k_linear", "Q6_K"
    PARTS = (("nibbles", torch.uint8, _blocks), ("high", torch.uint8, lambda k: (k // 32, 128)),
             ("sc", torch.int8, lambda k: (k // 16, PANEL)), ("d", torch.float16, _per_super))

    @staticmethod
    def _panels(raw: np.ndarray, k: int) -> dict[str, torch.Tensor]:
        rows, supers = raw.shape[0], k // SUPER
        blocks = raw.reshape(rows * supers, 210)  # ql (128), qh (64), scales (16 int8), d (2)
        low = nibbles(blocks[:, 0:128].reshape(-1, 2, 64))  # (., half h, nibble, 64): weight 128h + 64 nibble + l
        top = crumbs(blocks[:, 128:192].reshape(-1, 2, 32))  # (., half h, s, 32): weight 128h + 32s + l
        sc = torch.from_numpy(blocks[:, 192:208].copy().view(np.int8)).view(rows, k // 16)
        d = torch.from_numpy(blocks[:, 208:210].copy().view(np.float16)).view(rows, supers)
        return {"nibbles": panel_nibbles(torch.from_numpy(low).reshape(rows, k)),
                "high": panel_crumbs(torch.from_numpy(top).reshape(rows, k)),
                "sc": panel_channels(sc), "d": panel_channels(d)}

    def dequantize(self) -> torch.Tensor:
        n = self.out_features
        q = (codes_of(self.nibbles)[:n] | (top_bits_of(self.high)[:n] << 4)).float().view(n, -1, 16)
        scale = channels_of(self.d)[:n].float().repeat_interleave(16, dim=1) * channels_of(self.sc)[:n].float()  # (n, K / 16)
        return (scale[..., None] * (q - 32)).view(n, self.in_features)


class Q8_0Linear(PanelLinear):
    """A Q8_0 matrix: ``w[n, k] = q * d``, q an int8 code, d float16 per block of 32 (8.5 bits a weight, as in the file).

    Buffers: ``codes (P, K / 32, 512)`` int8 (the panel layout), ``d (P, K / 32, 16)`` float16, the file's d.
    Kernel: ``block_q8_0_linear`` (isum = sum(q * xq), ws = d). Unlike an :class:`Int8Linear` in groups of 32
    (the same numbers), a lone row needs no sums across a vector's lanes: decode reads it faster.
    """

    OP, GGML_TYPE, K_MULTIPLE = "block_q8_0_linear", "Q8_0", 32
    PARTS = (("codes", torch.int8, lambda k: (k // 32, 512)), ("d", torch.float16, _per_block))

    @staticmethod
    def _panels(raw: np.ndarray, k: int) -> dict[str, torch.Tensor]:
        rows = raw.shape[0]
        blocks = raw.reshape(rows * k // 32, 34)  # d (2 bytes), qs (32 int8): weight j = qs[j] * d
        d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).view(rows, k // 32)
        q = torch.from_numpy(blocks[:, 2:34].copy().view(np.int8)).reshape(rows, k)
        return {"codes": panel_bytes(q), "d": panel_channels(d)}

    def dequantize(self) -> torch.Tensor:
        q = bytes_of(self.codes)[: self.out_features].float().view(self.out_features, -1, 32)
        d = channels_of(self.d)[: self.out_features].float()
        return (q * d[..., None]).view(self.out_features, self.in_features)


#: The layer for each GGUF type these panels hold.
PANEL_LAYERS: dict[str, type[PanelLinear]] = {"Q4_0": Q4_0Linear, "Q5_0": Q5_0Linear, "Q4_K": Q4_KLinear,
                                               "Q6_K": Q6_KLinear, "Q8_0": Q8_0Linear}
