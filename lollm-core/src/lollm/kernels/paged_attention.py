"""Paged attention in Triton: the decode steps of a whole engine batch in one launch, keys read in place.

In an engine step (:mod:`lollm.batch`) the keys of every sequence live in one
pool per layer, ``(blocks, block_size, K, D)``, and a sequence owns a list of
blocks, its *block table*: position p of sequence b sits in block
``table[b][p // block_size]`` at offset ``p % block_size``. The blocks of one
sequence are scattered over the pool (whichever were free when it grew, or
shared with another sequence through the prefix cache).

The seam's loop (:func:`lollm.attention._attend_batch`) gathers each sequence's
blocks into a contiguous (1, K, S, D) copy and calls a kernel per sequence. On
a GPU that costs twice: every key is read and written once more by the copy
before the kernel reads it, and B small launches run one after the other. This
kernel reads the pool itself: to load a tile of key positions it first loads
their block ids from the table, then the keys at ``block * block_size + offset``.
One launch covers all sequences of the step.

It is :mod:`lollm.kernels.flash_decode` with two changes:

1. the grid has one more axis, the sequence: program (b, g·R + r, s) takes
   sequence b, K/V head g, block r of its query rows (the H/K heads of the
   group times its T_b queries, folded as in flash_decode), and slice s of its
   keys; each program reads its sequence's start, count and first query row
   from small int32 tensors;
2. a key tile's addresses go through the block table (step 3 below).

Then, as in flash_decode, :func:`flash_decode_combine_kernel` merges the slices.
Keys are always in position order here (a pool holds every position), so a
sliding window is only a mask, and the slices cover only the positions that
some query of the sequence may see.

Sources: Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention" (block tables, attention reading blocks in place);
Flash-Decoding (Dao, Haziza, Massa, Sizov 2023) for the split along the keys.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lollm.batch import Batch
from lollm.kernels.flash_decode import BLOCK_R, MAX_SPLITS, TARGET_PROGRAMS, flash_decode_combine_kernel
from lollm.kernels.flash_prefill import dot_precision, head_block, tiles_for


@triton.jit
def paged_attention_kernel(
    Q, K, V,  # q (1, H, N, D): the queries of B sequences end to end; k and v pools (blocks, block_size, K, D), one layout
    Tables, Starts, Counts, Rows,  # int32: block tables (B, max_blocks); cached length, new tokens, first row (B,)
    Acc, M, L,  # partial results: acc (H, N, SPLITS, D), m and l (H, N, SPLITS), all fp32
    stride_qh, stride_qt, stride_qd,
    stride_b, stride_s, stride_h, stride_d,  # of both pools: block, slot in a block, K/V head, channel
    stride_tb,  # a block table's row
    N, D, block_size, n_rep, n_splits,  # n_rep: query heads per K/V head
    row_blocks,  # blocks of BLOCK_R query rows per K/V head (for the longest sequence)
    window, softcap, scale,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (see dot_precision), Triton's default otherwise
    BLOCK_R: tl.constexpr,  # query rows (heads of the group x queries) per program
    BLOCK_N: tl.constexpr,  # key positions per step of the loop
    BLOCK_D: tl.constexpr,  # head width rounded up to a power of two (>= 16)
):
    # This program: sequence `seq`, K/V head `kv_head`, its query rows [BLOCK_R * pid_r, +BLOCK_R),
    # its keys' slice `split`.
    seq, split = tl.program_id(0), tl.program_id(2)
    kv_head, pid_r = tl.program_id(1) // row_blocks, tl.program_id(1) % row_blocks

    # 1. The sequence: its queries sit at positions start .. start+T-1, rows row0 .. row0+T-1 of the N.
    start = tl.load(Starts + seq)
    T = tl.load(Counts + seq)
    row0 = tl.load(Rows + seq)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # row = rep * T + t
    row_ok = rows < n_rep * T  # a shorter sequence leaves some of the row blocks empty
    head = kv_head * n_rep + rows // T  # (BLOCK_R,) the query head of each row
    t = rows % T  # (BLOCK_R,) the query of each row within the sequence
    q_pos = start + t
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q = tl.load(Q + head[:, None] * stride_qh + (row0 + t)[:, None] * stride_qt + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_R, BLOCK_D)

    # 2. The positions any of its queries may see, [lo, last], cut into n_splits slices; ours is [n_lo, n_hi).
    last = start + T - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, start - window + 1)  # the first query's window begins there
    keys_per_split = tl.cdiv(tl.cdiv(last + 1 - lo, n_splits), BLOCK_N) * BLOCK_N
    n_lo = lo + split * keys_per_split
    n_hi = tl.minimum(last + 1, n_lo + keys_per_split)
    n_hi = tl.where(pid_r * BLOCK_R < n_rep * T, n_hi, n_lo)  # an empty row block loads nothing

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions of this tile
        col_ok = k_pos < n_hi
        # 3. Paging: each position's block from the table, then its slot in the pool (int64: pools are large).
        block = tl.load(Tables + seq * stride_tb + k_pos // block_size, mask=col_ok, other=0).to(tl.int64)
        slot = block * stride_b + (k_pos % block_size) * stride_s + kv_head * stride_h  # (BLOCK_N,)
        k = tl.load(K + slot[None, :] + dims[:, None] * stride_d,
                    mask=dim_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(V + slot[:, None] + dims[None, :] * stride_d,
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)

        # 4. Scores, soft-cap, mask (causal inside the sequence's new tokens, and the window).
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # (BLOCK_R, BLOCK_N) fp32
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # cap * tanh(s / cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & col_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # 5. Online softmax, as in the prefill and decode kernels.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 6. Store this slice's unnormalised result under the query's row of the N; the combine divides.
    part = (head * N + row0 + t) * n_splits + split  # (BLOCK_R,) index into (H, N, SPLITS)
    tl.store(Acc + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(M + part, m_i, mask=row_ok)
    tl.store(L + part, l_i, mask=row_ok)


# Keys per step by head width: (BLOCK_N, num_warps, num_stages). The decode kernel's tiles, except
# at D = 128: the gathered addresses (one block id per key column) cost registers that the decode
# kernel's contiguous ones do not, and with 4 warps the kernel spilled (672 bytes per thread in
# bf16 on sm_90); with 8 warps and one stage it does not. Checked by compiling for sm_90 with
# the channel stride specialised to 1, as a launch on a contiguous pool does (benchmarks/
# compile_attention_kernels.py): no spill in bf16 at 64, 128 and 512, 24 bytes at 256; in fp32 at
# most 144 bytes. Not tuned on a GPU.
PAGED_TILES = {
    64: (64, 4, 2),
    128: (64, 8, 1),
    256: (32, 8, 1),
    512: (16, 8, 1),
}

#: The most new tokens a sequence may bring for the paged kernel to take it (decode and verify
#: steps; a longer prefill chunk is cheaper to gather once and run through flash_prefill).
PAGED_MAX_QUERIES = 16


@dataclass(frozen=True)
class PagedLayout:
    """Where B sequences' queries and keys are, as the paged kernel reads it (tensors on the device).

    tables:    (B, max_blocks) int32: row b is sequence b's block table, padded with 0
               (padding is never read: positions past a sequence's length are masked; nor
               are the -1 of a window table, before the window the loop starts at).
    starts:    (B,) int32: positions sequence b already holds before this step.
    counts:    (B,) int32: its new tokens (its queries), T_b >= 1.
    rows:      (B,) int32: the row of its first query in q's N (counts' running sum before b).
    max_count: the largest T_b, max_keys the largest ``starts[b] + counts[b]``, num_tokens
               the sum of the T_b (host ints: they size the grid and check q).
    """

    tables: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    rows: torch.Tensor
    max_count: int
    max_keys: int
    num_tokens: int

    @classmethod
    def build(cls, starts: list[int], counts: list[int], block_tables: list[list[int]],
              device: torch.device | str) -> PagedLayout:
        """From host lists (a :class:`~lollm.batch.Batch`'s fields); one host-to-device copy per tensor."""
        if not starts or len(starts) != len(counts) or len(counts) != len(block_tables) or min(counts) < 1:
            raise ValueError(f"paged attention: {len(starts)} starts, {counts} counts, {len(block_tables)} tables: "
                             "want one of each per sequence, every count >= 1")
        width = max(len(table) for table in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, table in enumerate(block_tables):
            tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
        rows = [sum(counts[:b]) for b in range(len(counts))]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device)  # noqa: E731
        return cls(tables.to(device), as_tensor(starts), as_tensor(counts), as_tensor(rows),
                   max(counts), max(s + c for s, c in zip(starts, counts)), sum(counts))


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layout: PagedLayout, *,
                    window: int | None = None, softcap: float | None = None, scale: float | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """Attention of B sequences' few new queries over their keys in a paged pool, one launch (+ the combine).

    q: (1, H, N, D), the sequences' queries end to end as ``layout`` places them (sequence b:
    rows ``rows[b] ..`` at positions ``starts[b] ..``, RoPE applied); k_pool, v_pool:
    (blocks, block_size, K, D), sequence b's position p in block ``tables[b, p // block_size]``
    (this step's keys already written); H a multiple of K; D <= 512; fp32, fp16 or bf16, all one
    dtype. window, softcap, scale as in :func:`lollm.attention.attend`. ``splits``: slices of each
    sequence's keys (None: enough for about :data:`TARGET_PROGRAMS` programs, at most
    :data:`MAX_SPLITS`, never more than the longest sequence has key tiles). Correct for any
    T_b; meant for T_b <= :data:`PAGED_MAX_QUERIES`. Returns (1, H, N, D) in q's dtype.
    ValueError when q's N is not the layout's, or the pools differ in shape or strides.
    """
    if q.shape[2] != layout.num_tokens or k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride():
        raise ValueError(f"paged attention: q {tuple(q.shape)} for {layout.num_tokens} queries, pools "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}: want N queries and two pools of one layout")
    _, H, N, D = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    n_rep = H // n_kv
    B = layout.starts.numel()
    scale = D**-0.5 if scale is None else scale
    BLOCK_N, num_warps, num_stages = tiles_for(PAGED_TILES, D)
    row_blocks = triton.cdiv(n_rep * layout.max_count, BLOCK_R)
    if splits is None:
        splits = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // (B * n_kv * row_blocks)))
    n_splits = max(1, min(splits, triton.cdiv(layout.max_keys, BLOCK_N)))

    acc = torch.empty(H, N, n_splits, D, device=q.device, dtype=torch.float32)
    m = torch.empty(H, N, n_splits, device=q.device, dtype=torch.float32)
    l = torch.empty(H, N, n_splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    BLOCK_D = head_block(D)

    # the launch grid: one program per (sequence, K/V head x block of its query rows, slice of its keys)
    grid = (B, n_kv * row_blocks, n_splits)
    paged_attention_kernel[grid](
        q, k_pool, v_pool, layout.tables, layout.starts, layout.counts, layout.rows, acc, m, l,
        q.stride(1), q.stride(2), q.stride(3),
        *k_pool.stride(), layout.tables.stride(0),
        N, D, block_size, n_rep, n_splits, row_blocks,
        window or 0, float(softcap or 0.0), float(scale),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages,
    )
    # the combine of flash_decode, with the N queries of the batch as its T: one program per (query head, query)
    flash_decode_combine_kernel[(H * N,)](
        acc, m, l, out,
        out.stride(1), out.stride(2), out.stride(3),
        N, D, n_splits,
        BLOCK_SPLITS=triton.next_power_of_2(n_splits), BLOCK_D=BLOCK_D,
    )
    return out


# An engine step calls attention once per layer with the same Batch: its layouts (one over the block
# tables, one over the window tables of sliding-window layers) are built once and kept here, with a
# weak reference to the Batch they belong to.
_last_layouts: tuple[weakref.ref, torch.device, dict[bool, tuple[list[int], torch.Tensor, PagedLayout]]] | None = None


def _layout_of(batch: Batch, device: torch.device, window: int | None) -> tuple[list[int], torch.Tensor, PagedLayout]:
    """The sequences of ``batch`` the paged kernel takes, the rows of their queries in the N, and their layout
    over the tables a layer with this ``window`` reads (:meth:`lollm.batch.Batch.tables_for`)."""
    global _last_layouts
    if _last_layouts is None or _last_layouts[0]() is not batch or _last_layouts[1] != device:
        _last_layouts = (weakref.ref(batch), device, {})
    tables = batch.tables_for(window)
    kept = _last_layouts[2]
    key = tables is not batch.block_tables
    if key not in kept:
        seqs = [b for b, count in enumerate(batch.counts) if count <= PAGED_MAX_QUERIES]
        segments = batch.segments()
        rows = torch.tensor([row for b in seqs for row in range(*segments[b])], dtype=torch.long).to(device)
        layout = None
        if seqs:
            layout = PagedLayout.build([batch.starts[b] for b in seqs], [batch.counts[b] for b in seqs],
                                       [tables[b] for b in seqs], device)
        kept[key] = (seqs, rows, layout)
    return kept[key]


def paged_attention_batch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch, *,
                          window: int | None = None, softcap: float | None = None,
                          scale: float | None = None) -> tuple[torch.Tensor, list[bool]]:
    """The paged kernel over the sequences of an engine step that bring at most :data:`PAGED_MAX_QUERIES` tokens.

    q (1, H, N, D) as the family passes it in an engine step; k_pool, v_pool (blocks, block_size,
    K, D). Returns (out (1, H, N, D) in q's dtype, covered (B,) bools): the rows of sequence b are
    filled when ``covered[b]``; the others (long prefill chunks) are left for the caller, unset.
    """
    seqs, rows, layout = _layout_of(batch, q.device, window)
    kw = dict(window=window, softcap=softcap, scale=scale)
    if len(seqs) == len(batch.counts):  # a pure decode step: every row
        return paged_attention(q, k_pool, v_pool, layout, **kw), [True] * len(seqs)
    out = q.new_empty(q.shape)  # (1, H, N, D)
    if seqs:
        out[:, :, rows] = paged_attention(q[:, :, rows], k_pool, v_pool, layout, **kw)
    return out, [b in seqs for b in range(len(batch.counts))]
