"""Split-K attention ("flash decoding") in Triton: a few queries against a long cache.

In a decode step T = 1 (or a handful: the speculative verify of ``--mtp`` runs
1 + drafts queries). The prefill kernel's plan, one program per tile of queries
per head, would start only H programs, each walking the whole cache alone:
most of a GPU would idle while the cache streams through a few SMs. So the
work is split along the *keys* instead:

1. :func:`flash_decode_split_kernel`: program (g, r, s) takes the query rows
   of block r of K/V head g and the s-th slice of the keys, and runs the same
   online softmax as the prefill kernel over that slice only. It writes the
   slice's unnormalised accumulator and its running max m and sum l.
2. :func:`flash_decode_combine_kernel`: one program per (query head, query)
   merges the slices: with M the largest of their maxima,
   ``out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``,
   the same rescaling the online softmax does between two tiles.

GQA: the H/K query heads that share K/V head g are folded into query *rows* of
g (row ``rep * T + t`` is query t of head ``g * H/K + rep``), so each key and
value tile is loaded once for the whole group; no repeated K/V.

Keys are read exactly as the family's cache returns them: in position order,
or as the slots of a ring buffer (``ring=True``, a sliding-window cache in a
one-token step), whose positions follow the seam's rule
(:func:`lollm.attention.key_positions`): slot j holds ``last - ((last - j) mod S)``
with ``last = start + T - 1``. Attention is a sum over keys, so their order
does not matter as long as each one is masked by its true position.

Sources: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
inference" (PyTorch blog); FlashAttention-2 (Dao 2023) for the tile loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lollm.kernels.flash_prefill import dot_precision, head_block, tiles_for


@triton.jit
def flash_decode_split_kernel(
    Q, K, V,  # q (1, H, T, D), k and v (1, K, S, D)
    Acc, M, L,  # partial results: acc (H, T, SPLITS, D), m and l (H, T, SPLITS), all fp32
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    T, S, D,  # queries, keys, head width
    start,  # position of query 0
    n_rep,  # query heads per K/V head
    keys_per_split,  # keys each split covers (a multiple of BLOCK_N)
    n_splits,
    window, softcap, scale,
    RING: tl.constexpr,  # keys are ring-buffer slots (True) or in position order (False)
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (see dot_precision), Triton's default otherwise
    BLOCK_R: tl.constexpr,  # query rows (heads of the group x queries) per program
    BLOCK_N: tl.constexpr,  # keys per step of the loop
    BLOCK_D: tl.constexpr,  # head width rounded up to a power of two (>= 16)
):
    # This program: K/V head `kv_head`, query rows [BLOCK_R * pid_r, +BLOCK_R) of its group,
    # keys [keys_per_split * split, +keys_per_split).
    kv_head = tl.program_id(0)
    pid_r = tl.program_id(1)
    split = tl.program_id(2)

    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # row = rep * T + t
    row_ok = rows < n_rep * T
    head = kv_head * n_rep + rows // T  # (BLOCK_R,) the query head of each row
    t = rows % T  # (BLOCK_R,) the query of each row
    q_pos = start + t
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D

    # 1. Load the group's query rows.
    q = tl.load(Q + head[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_R, BLOCK_D)

    # 2. Running statistics over this split's keys.
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    last = start + T - 1  # the newest query's position: the keys end there
    n_lo = split * keys_per_split
    n_hi = tl.minimum(S, n_lo + keys_per_split)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_hi
        # 3. A tile of keys (transposed) and values, as the cache holds them.
        k = tl.load(k_base + cols[None, :] * stride_ks + dims[:, None] * stride_kd,
                    mask=dim_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(v_base + cols[:, None] * stride_vs + dims[None, :] * stride_vd,
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)

        # 4. The position of each key column.
        if RING:
            k_pos = last - (last - cols) % S  # last - cols >= 0: a ring never has more slots than positions
        else:
            k_pos = last - S + 1 + cols

        # 5. Scores, soft-cap, mask (causal for T > 1, and the window).
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # (BLOCK_R, BLOCK_N) fp32
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # cap * tanh(s / cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & col_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # 6. Online softmax, as in the prefill kernel.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 7. Store this split's unnormalised result; the combine kernel divides.
    part = (head * T + t) * n_splits + split  # (BLOCK_R,) index into (H, T, SPLITS)
    tl.store(Acc + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(M + part, m_i, mask=row_ok)
    tl.store(L + part, l_i, mask=row_ok)


@triton.jit
def flash_decode_combine_kernel(
    Acc, M, L, Out,  # partials as above; out (1, H, T, D)
    stride_oh, stride_ot, stride_od,
    T, D, n_splits,
    BLOCK_SPLITS: tl.constexpr,  # n_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    # This program: one query row (query head `head`, query `t`), all splits.
    row = tl.program_id(0)  # = head * T + t
    head = row // T
    t = row % T
    splits = tl.arange(0, BLOCK_SPLITS)
    split_ok = splits < n_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D

    m = tl.load(M + row * n_splits + splits, mask=split_ok, other=float("-inf"))  # (BLOCK_SPLITS,)
    l = tl.load(L + row * n_splits + splits, mask=split_ok, other=0.0)
    acc = tl.load(Acc + (row * n_splits + splits)[:, None] * D + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_SPLITS, BLOCK_D)

    # Bring every split to the common max M; a split that saw no visible key has m = -inf, weight 0.
    m_all = tl.max(m, axis=0)
    weight = tl.exp(m - m_all)  # (BLOCK_SPLITS,)
    total = tl.sum(weight * l, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / total  # (BLOCK_D,)
    tl.store(Out + head * stride_oh + t * stride_ot + dims * stride_od, out.to(Out.dtype.element_ty), mask=dim_ok)


#: Query rows per program: tl.dot's smallest tile. A decode step has H/K rows per K/V head
#: (7 for Qwen2.5, 4 for Gemma 3 270M); a verify step T times as many, in several row blocks.
BLOCK_R = 16

# Keys per step by head width: (BLOCK_N, num_warps, num_stages); checked like the prefill tiles.
DECODE_TILES = {
    64: (64, 4, 2),
    128: (64, 4, 2),
    256: (32, 8, 1),
    512: (16, 8, 1),
}

#: Aim for about this many split programs in all: enough to give every SM of a
#: large GPU (132 on an H100/H200) one or two ...
TARGET_PROGRAMS = 256
#: ... but never more than this many slices per query row, so that the combine kernel
#: holds all of a row's partial results (MAX_SPLITS x D fp32) in registers.
MAX_SPLITS = 32


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, ring: bool = False,
                 window: int | None = None, softcap: float | None = None, scale: float | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """Attention of a few queries over a long cache, split along the keys, then combined.

    q: (1, H, T, D) at positions ``start .. start+T-1``; k, v: (1, K, S, D) as the cache
    returns them (``ring``: ring-buffer slots; else position order ending at ``start+T-1``);
    H a multiple of K; D <= 512; fp32, fp16 or bf16. window, softcap, scale as in
    :func:`lollm.attention.attend`. ``splits``: how many slices of the keys (None: enough
    for about :data:`TARGET_PROGRAMS` programs, at most :data:`MAX_SPLITS`; never more
    than there are tiles of keys). Correct for any T; meant for small T.
    Returns (1, H, T, D) in q's dtype.
    """
    _, H, T, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    n_rep = H // n_kv
    scale = D**-0.5 if scale is None else scale
    BLOCK_N, num_warps, num_stages = tiles_for(DECODE_TILES, D)
    row_blocks = triton.cdiv(n_rep * T, BLOCK_R)
    if splits is None:
        splits = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // (n_kv * row_blocks)))
    keys_per_split = triton.cdiv(triton.cdiv(S, min(splits, triton.cdiv(S, BLOCK_N))), BLOCK_N) * BLOCK_N
    n_splits = triton.cdiv(S, keys_per_split)

    acc = torch.empty(H, T, n_splits, D, device=q.device, dtype=torch.float32)
    m = torch.empty(H, T, n_splits, device=q.device, dtype=torch.float32)
    l = torch.empty(H, T, n_splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    BLOCK_D = head_block(D)

    # the launch grid of the first kernel: one program per (K/V head, block of query rows, slice of keys)
    grid = (n_kv, row_blocks, n_splits)
    flash_decode_split_kernel[grid](
        q, k, v, acc, m, l,
        q.stride(1), q.stride(2), q.stride(3),
        k.stride(1), k.stride(2), k.stride(3),
        v.stride(1), v.stride(2), v.stride(3),
        T, S, D, start, n_rep, keys_per_split, n_splits,
        window or 0, float(softcap or 0.0), float(scale),
        RING=ring, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages,
    )
    # the launch grid of the second: one program per (query head, query)
    flash_decode_combine_kernel[(H * T,)](
        acc, m, l, out,
        out.stride(1), out.stride(2), out.stride(3),
        T, D, n_splits,
        BLOCK_SPLITS=triton.next_power_of_2(n_splits), BLOCK_D=BLOCK_D,
    )
    return out
