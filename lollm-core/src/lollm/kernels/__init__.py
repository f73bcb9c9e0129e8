"""Triton kernels behind ``--attn triton`` (``pip install 'lollm-core[triton]'``).

Two kernels, one file each, written to be read next to docs/flash-attention.md:

* :mod:`lollm.kernels.flash_prefill`: FlashAttention-2 forward, for many
  queries (a prompt, a chunk after a cache);
* :mod:`lollm.kernels.flash_decode`: split-K "flash decoding", for a few
  queries (a decode step, a speculative verify) against a long cache, and
  for keys in ring-buffer order;
* :mod:`lollm.kernels.paged_attention`: the same split-K kernel over an engine
  step's paged KV pool, every sequence's few queries in one launch, keys read
  in place through the block tables.

:func:`flash_attention` picks one of the first two per call, and
:func:`flash_attention_paged` runs the third over an engine step;
:mod:`lollm.attention` calls them (its ``triton`` backend), after checking
that Triton can run here.

Importing this package imports Triton. Triton decides when a kernel is
*defined* (at import) whether it runs compiled on a GPU or in its CPU
interpreter (``TRITON_INTERPRET=1``, slow, for tests): set the variable
before the first ``--attn triton`` call of a process.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from lollm.batch import Batch
from lollm.errors import AttentionBackendError
from lollm.kernels.flash_decode import flash_decode, flash_decode_split_kernel
from lollm.kernels.flash_prefill import PREFILL_TILES, flash_prefill
from lollm.kernels.paged_attention import PAGED_MAX_QUERIES, PagedLayout, paged_attention, paged_attention_batch

#: Up to this many queries a call takes the split-K decode kernel: decode steps
#: (T = 1) and speculative verify steps (T = 1 + drafts). More: the prefill kernel.
DECODE_MAX_QUERIES = 16

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = max(PREFILL_TILES)


def interpreted() -> bool:
    """True when the kernels were defined for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(flash_decode_split_kernel, InterpretedFunction)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, ring: bool = False,
                    window: int | None = None, softcap: float | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """The ``triton`` backend's attention: q (1, H, T, D), k, v (1, K, S, D) -> (1, H, T, D) in q's dtype.

    Arguments as in :func:`lollm.attention.attend` (which has checked the shapes).
    Ring-ordered keys and calls of at most :data:`DECODE_MAX_QUERIES` queries take
    :func:`flash_decode`, the others :func:`flash_prefill`.

    Raises AttentionBackendError for what the kernels do not cover: a dtype other
    than float32, float16, bfloat16 (or q, k, v of different dtypes), a head wider
    than 512, tensors on another device than CUDA when the kernels are compiled
    (not interpreted).
    """
    _check_covered(q, k, v)
    if q.device.type == "cuda":
        with torch.cuda.device(q.device):  # Triton launches on the current device: make it the tensors' one
            return _launch(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)
    return _launch(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)


def flash_attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch, *,
                          window: int | None = None, softcap: float | None = None,
                          scale: float | None = None) -> tuple[torch.Tensor, list[bool]]:
    """The ``triton`` backend's paged attention over an engine step (:mod:`lollm.batch`).

    q (1, H, N, D), the batch's queries end to end; k_pool, v_pool (blocks, block_size, K, D).
    Returns (out (1, H, N, D), covered (B,) bools): :func:`paged_attention_batch` fills the rows
    of every sequence with at most :data:`PAGED_MAX_QUERIES` new tokens; the caller computes the
    others. Raises AttentionBackendError as :func:`flash_attention` does.
    """
    _check_covered(q, k_pool, v_pool)
    if q.device.type == "cuda":
        with torch.cuda.device(q.device):
            return paged_attention_batch(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)
    return paged_attention_batch(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)


def _check_covered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """AttentionBackendError for what the kernels do not cover (see :func:`flash_attention`)."""
    D = q.shape[-1]
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionBackendError(
            f"the triton attention kernels take float32, float16 or bfloat16 q, k, v of one dtype, "
            f"got {q.dtype}, {k.dtype}, {v.dtype}: use --attn sdpa"
        )
    if D > MAX_HEAD_DIM:
        raise AttentionBackendError(f"the triton attention kernels cover heads up to {MAX_HEAD_DIM} wide, this one is {D}: use --attn sdpa")
    if q.device.type != "cuda" and not interpreted():
        raise AttentionBackendError(
            f"the triton attention kernels were compiled for CUDA, but this model runs on {q.device}: "
            "run it with --device cuda, or set TRITON_INTERPRET=1 before lollm starts (Triton's CPU interpreter, slow)"
        )


def _launch(q, k, v, *, start, ring, window, softcap, scale) -> torch.Tensor:
    if ring or q.shape[2] <= DECODE_MAX_QUERIES:
        return flash_decode(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)
    return flash_prefill(q, k, v, start=start, window=window, softcap=softcap, scale=scale)
