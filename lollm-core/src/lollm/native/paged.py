"""An engine step's attention on the CPU, each query computed alone (``attention.cpp``).

:func:`lollm.attention.attend` hands an engine step (a :class:`lollm.batch.Batch`) to
:func:`paged_attention` when it runs on a CPU with the ``sdpa`` backend and the native
library is built. The kernel reads every sequence's keys and values in place through its
block table, and computes each (query, head) by one fixed sequence of float32 operations
that depends on nothing but that query and the keys it sees: a request's attention rows are
the same bits alone, beside any other requests, and in prompt chunks of any size
(docs/batch-invariance.md, "Batch invariance in attention"; the arithmetic is at the top of ``attention.cpp``).

This module only lays the step out as the kernel wants it: the block tables as one
``(B, max_blocks)`` int64 tensor padded with -1, each sequence's start and query count.
Every layer of a step gets the same :class:`~lollm.batch.Batch`, so the tensors are built
once per step and kept with a weak reference to it.
"""

from __future__ import annotations

import weakref

import torch

from lollm.batch import Batch
from lollm.native import paged_attention_op

# The last step's tensors: (a weak reference to its Batch, {True: window tables', False: block tables'}).
_last: tuple[weakref.ref, dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None = None


def step_layout(batch: Batch, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables (B, max_blocks), starts (B,), counts (B,)), int64, for a layer with this ``window``.

    The tables are those the layer reads (:meth:`Batch.tables_for`): a sliding-window layer's
    may hold -1 for blocks released before its window, and every row is padded with -1.
    """
    global _last
    if _last is None or _last[0]() is not batch:
        _last = (weakref.ref(batch), {})
    tables = batch.tables_for(window)
    kept, key = _last[1], tables is not batch.block_tables
    if key not in kept:
        width = max(len(table) for table in tables)
        padded = torch.tensor([table + [-1] * (width - len(table)) for table in tables], dtype=torch.long)
        kept[key] = (padded, torch.tensor(batch.starts, dtype=torch.long), torch.tensor(batch.counts, dtype=torch.long))
    return kept[key]


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch, *,
                    window: int | None, softcap: float | None, scale: float | None) -> torch.Tensor:
    """Attention of an engine step's N queries over their own sequences' keys, each query alone.

    q (1, H, N, D), the step's tokens end to end as :class:`Batch` lays them out; k_pool, v_pool
    (blocks, block_size, K, D), a layer's whole pool (float32, bfloat16 or float16). window,
    softcap, scale as in :func:`lollm.attention.attend` (scale None: ``1/sqrt(D)``).
    Returns (1, H, N, D) in q's dtype: computed in float32, rounded once at the end.
    RuntimeError (from the kernel, naming the tensor) for tables that do not fit the pool.
    """
    op = paged_attention_op()
    if op is None:
        raise RuntimeError("paged_attention: the native library is not built here (lollm.native.status() says why)")
    tables, starts, counts = step_layout(batch, window)
    D = q.shape[3]
    rows = q[0].transpose(0, 1).to(torch.float32).contiguous()  # (N, H, D)
    out = op(rows, k_pool, v_pool, tables, starts, counts, window, softcap, D**-0.5 if scale is None else scale)
    return out.transpose(0, 1).unsqueeze(0).to(q.dtype)  # (1, H, N, D)
