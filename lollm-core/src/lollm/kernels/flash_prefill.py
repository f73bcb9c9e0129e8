"""FlashAttention-2 forward in Triton: many queries (a prompt, a chunk) against the keys of one layer.

The arithmetic is the one of :func:`lollm.attention.attend`,

    out = softmax(mask(softcap(q k^T * scale))) v          q (1, H, T, D), k and v (1, K, S, D)

but the (T, S) matrix of scores is never written to memory. One program takes
a tile of BLOCK_M queries of one head, walks over the keys a tile of BLOCK_N
at a time, and keeps for each query row only three running things: the
largest score seen so far (m), the sum of exp(score - m) so far (l) and the
weighted sum of values so far (acc). When a new tile brings a larger maximum,
what was summed before is rescaled by exp(m_old - m_new). After the last tile,
out = acc / l. docs/flash-attention.md derives why this is exact.

Sources: Dao 2023, "FlashAttention-2" (Algorithm 1: the loop over key tiles
inside one program of query rows, the division by l only at the end); the
online softmax of Milakov & Gimelshein 2018; Triton's fused-attention tutorial
(06-fused-attention.py) for the form of a tile loop in Triton.

What this kernel adds to the textbook version, because lollm's families need it:

* causal with an offset: query i sits at position ``start + i`` and key
  column j at ``key_offset + j`` (the keys end at the newest query, see
  :func:`lollm.attention.key_positions`); keys after a query are hidden;
* a sliding window W: keys at or before ``p - W`` are hidden too, and key
  tiles that lie wholly outside every query's window are never loaded;
* a soft-cap (gemma2): ``cap * tanh(score / cap)`` inside the tile;
* GQA: program for query head h reads K/V head ``h // (H/K)`` in place;
* T and S that are not multiples of the tiles, head widths from 16 to 512
  that need not be powers of two (loads are masked).

Keys must be in position order (``ring=False``); ring-ordered keys only
occur in one-token steps, which :mod:`lollm.kernels.flash_decode` serves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def flash_prefill_kernel(
    Q, K, V, Out,  # pointers: q (1, H, T, D), k and v (1, K, S, D), out (1, H, T, D)
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_oh, stride_ot, stride_od,
    T, S, D,  # queries, keys, head width
    start,  # position of query row 0
    key_offset,  # position of key column 0 (= start + T - S)
    n_rep,  # query heads per K/V head (H / K)
    window,  # sliding window W (used only when HAS_WINDOW)
    softcap,  # the cap (used only when HAS_SOFTCAP)
    scale,  # the factor on q k^T
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (see dot_precision), Triton's default otherwise
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step of the loop
    BLOCK_D: tl.constexpr,  # head width rounded up to a power of two (>= 16)
):
    # This program: query rows [BLOCK_M * pid_m, +BLOCK_M) of query head `head`.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // n_rep  # GQA: the K/V head this query head shares

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query indices
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,) channels
    row_ok = rows < T
    dim_ok = dims < D
    q_pos = start + rows  # (BLOCK_M,) positions of the queries

    # 1. Load the query tile once; it stays in registers for the whole loop.
    q_ptrs = Q + head * stride_qh + rows[:, None] * stride_qt + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    # 2. The running statistics of every query row (fp32 whatever the input dtype).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # largest score so far
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum of exp(score - m_i) so far
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # sum of exp(score - m_i) * v so far

    # 3. Which key columns can any query of this tile see? Causal: none after the
    #    tile's last query. Window: none at or before (first query - W). Tiles
    #    outside [lo, hi) are skipped without being loaded.
    first_q = start + pid_m * BLOCK_M
    last_q = tl.minimum(first_q + BLOCK_M, start + T) - 1
    hi = tl.minimum(S, last_q - key_offset + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_q - window + 1 - key_offset)
        lo = (lo // BLOCK_N) * BLOCK_N  # start on a tile boundary

    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key columns
        col_ok = cols < S
        # 4. Load a tile of keys (transposed: (BLOCK_D, BLOCK_N)) and of values.
        k = tl.load(k_base + cols[None, :] * stride_ks + dims[:, None] * stride_kd,
                    mask=dim_ok[:, None] & col_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + dims[None, :] * stride_vd,
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)

        # 5. Scores of the tile, soft-capped, masked.
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # (BLOCK_M, BLOCK_N) fp32
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # cap * tanh(s / cap)
        k_pos = key_offset + cols
        visible = (k_pos[None, :] <= q_pos[:, None]) & col_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # 6. Online softmax: the new running max, and how much the old sums shrink.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no visible key yet
        alpha = tl.exp(m_i - m_safe)  # (BLOCK_M,) rescales what was summed under the old max
        p = tl.exp(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N), 0 on hidden keys
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # 7. Rescale the accumulator, add this tile's weighted values.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 8. Normalise once at the end and store in the input dtype.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only padding rows (row >= T) see no key
    out = acc / l_i[:, None]
    o_ptrs = Out + head * stride_oh + rows[:, None] * stride_ot + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


# Tiles per head width: (BLOCK_M, BLOCK_N, num_warps, num_stages). Wider heads take
# smaller tiles so that the query tile, the fp32 accumulator and a key and a value
# tile fit in one SM's registers and shared memory: at D = 512 a 16 x 512 fp32
# accumulator alone is 32 KB. Checked without a GPU by compiling for sm_80 and sm_90
# (benchmarks/compile_attention_kernels.py: in bf16 no spilled registers on sm_90 and at
# most 48 KB of shared memory; fp32 at most 112 KB); not tuned on a GPU (docs/flash-attention.md).
PREFILL_TILES = {
    64: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
    256: (32, 32, 8, 1),
    512: (16, 16, 8, 1),
}


def head_block(D: int) -> int:
    """The head width rounded up to a power of two, at least 16 (``tl.dot`` needs 16)."""
    return max(16, triton.next_power_of_2(D))


def dot_precision(dtype: torch.dtype) -> str:
    """How ``tl.dot`` multiplies: exactly in fp32 ("ieee") for fp32 inputs, Triton's default otherwise.

    Triton's default for fp32 operands is TF32 on NVIDIA tensor cores (10 bits of
    mantissa, like fp16), which would cost the fp32 path its 1e-4 agreement with the
    reference. fp16 and bf16 operands take the tensor cores either way, with an fp32
    accumulator.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def tiles_for(table: dict[int, tuple], D: int) -> tuple:
    """The entry of ``table`` for the narrowest listed width >= D."""
    for width in sorted(table):
        if D <= width:
            return table[width]
    raise ValueError(f"flash attention: head width {D} is wider than the widest tile ({max(table)})")


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, window: int | None = None,
                  softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of T queries over S keys in position order, FlashAttention-2 style.

    q: (1, H, T, D); k, v: (1, K, S, D), the keys at positions ``start+T-S .. start+T-1``
    (the seam's convention, ``ring=False``); H a multiple of K; D <= 512; fp32, fp16 or bf16
    (all three the same). window, softcap, scale as in :func:`lollm.attention.attend`.
    Returns (1, H, T, D) in q's dtype; scores, softmax and the accumulator are fp32.
    """
    _, H, T, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    BLOCK_M, BLOCK_N, num_warps, num_stages = tiles_for(PREFILL_TILES, D)
    # the launch grid: one program per (tile of BLOCK_M queries, query head)
    grid = (triton.cdiv(T, BLOCK_M), H)
    flash_prefill_kernel[grid](
        q, k, v, out,
        q.stride(1), q.stride(2), q.stride(3),
        k.stride(1), k.stride(2), k.stride(3),
        v.stride(1), v.stride(2), v.stride(3),
        out.stride(1), out.stride(2), out.stride(3),
        T, S, D, start, start + T - S, H // n_kv,
        window or 0, float(softcap or 0.0), float(scale),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=head_block(D),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
