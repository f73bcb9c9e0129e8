"""The attention seam: the one function every family's attention layer calls.

A family projects its queries, keys and values, rotates them, stores the new
keys/values in its cache and gets back the keys this layer may read. What
happens next is the same arithmetic in every family,

    out = softmax(cap * tanh(q k^T * scale / cap)  +  mask) v          (the soft-cap only in gemma2)

and it is the part of a forward pass that fast kernels replace. So it lives
here, once, behind :func:`attend`, and a family's forward says in words what
attention does at that step while the kernel stays hidden::

    out = attend(q, k, v, start=start, window=W, layer=self.layer_idx)   # (1, H, T, D)

Shape letters (batch is always 1 in lollm):

    H   query heads               K   key/value heads (H is a multiple of K: GQA)
    T   new tokens (queries)      S   keys this layer reads (cached + new)
    D   head width

**Backends.** The same call runs on one of several implementations, picked by
name (:data:`BACKENDS`):

* ``sdpa`` (the default, and the reference): PyTorch's
  ``scaled_dot_product_attention``, called exactly as the families called it
  before this seam existed, so the parity figures against transformers are
  unchanged. SDPA has no hook between the scores and the softmax, so a
  soft-capped call (gemma2) takes the ``eager`` arithmetic. An engine step on a
  CPU takes lollm's native paged kernel instead, batch invariant (:func:`_attend_batch`).
* ``eager``: the scores and the softmax written out as matrix products; the
  readable reference, and the path that can hand out the probabilities.
* ``triton``: FlashAttention-2 (prefill) and split-K (decode) kernels written
  in Triton, :mod:`lollm.kernels` (``lollm-core[triton]``; a CUDA GPU, or
  Triton's CPU interpreter with ``TRITON_INTERPRET=1``); docs/flash-attention.md.

Pick one with ``--attn NAME`` on the command line, the environment variable
``LOLLM_ATTN``, or in Python with :func:`use_backend` (a context manager) or
:func:`set_backend`. The choice is held in a :mod:`contextvars` variable: no
family code and no load signature knows about it, and two models (or two
threads) can run with different backends in turn.

**Recording.** Inside ``with recording() as rec:`` every call computes the
probabilities explicitly (the eager arithmetic, whatever backend is picked)
and appends an :class:`AttentionRecord` to ``rec.records``; ``lollm trace``
shows them. When nothing records, nothing of this runs.

See docs/attention.md for the lesson; the masks follow transformers'
conventions (``masking_utils.py``: causal, and ``p - W < j <= p`` for a
sliding window of W), GQA follows Ainslie et al. 2023, the soft-cap the Gemma 2
report (Gemma Team 2024) and transformers' ``modeling_gemma2.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Lazy imports below: triton and lollm.kernels (which imports Triton), the optional extra lollm-core[triton].
from lollm.batch import Batch
from lollm.errors import AttentionBackendError
from lollm.native import paged_attention_op
from lollm.native.paged import paged_attention
from lollm.trace.attention import AttentionRecord, active_recording
# The recording lives in lollm.trace.attention; a family may still import these from here (docs/plugins.md, 10).
from lollm.trace.attention import AttentionRecording, recording  # noqa: F401

DEFAULT_BACKEND = "sdpa"
#: The pool dtypes of the CPU's batch-invariant paged kernel (lollm.native.paged), which sums in float32.
PAGED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENV_VAR = "LOLLM_ATTN"


# ---------------------------------------------------------------------------
# Where the keys sit: positions and masks
# ---------------------------------------------------------------------------
def key_positions(start: int, T: int, S: int, *, ring: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
    """The position of each of the S keys a layer reads: (S,) int64.

    The convention every family's cache follows: the keys always end at the
    newest query's own position ``start+T-1`` (the cache already holds this
    step's keys), and they are the last S positions up to it:

    * ``ring=False``: in position order, ``start+T-S .. start+T-1``
      (a full KV cache returns ``0 .. start+T-1``; a sliding-window cache in a
      prefill or chunk returns the last ``W-1`` cached positions and the new ones);
    * ``ring=True``: the S slots of a ring buffer in which position p sits in
      slot ``p % S`` (a sliding-window cache in a one-token decode step returns its
      filled slots as they lie): slot s holds ``last - ((last - s) mod S)``, with
      ``last = start+T-1``. Before the ring is full (``S == start+1``) that is
      simply position s.
    """
    last = start + T - 1
    slots = torch.arange(S, device=device)
    if ring:
        return last - torch.remainder(last - slots, S)
    return slots + (last - S + 1)


def visible(start: int, T: int, S: int, *, ring: bool = False, window: int | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
    """Who may see whom: a bool (T, S) mask, True where query row i may read key column j.

    Query i sits at position ``p = start + i``; key j at ``key_positions(...)[j]``.
    Causal: ``j_pos <= p``, never the future. With a sliding window of W,
    also ``j_pos > p - W``: W positions, the query's own included
    (transformers' convention).
    """
    query_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
    key_pos = key_positions(start, T, S, ring=ring, device=device)[None, :]  # (1, S)
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    return mask  # (T, S)


def sees_every_key(T: int, S: int, window: int | None) -> bool:
    """True when every query may read every key, so no mask is needed at all.

    The keys end at the newest query (see :func:`key_positions`), so causality
    hides nothing only for a single query (T == 1); the window hides nothing
    when the oldest key is still inside it (S <= W). A decode step on a full
    cache or on a sliding window's ring is such a case.
    """
    return T == 1 and (window is None or S <= window)


def plain_causal(T: int, S: int, *, ring: bool, window: int | None) -> bool:
    """True when the mask is the plain lower triangle, which SDPA's ``is_causal`` builds itself.

    That is the case when the keys are exactly the T new positions in order
    (S == T: no cache before them) and a window, if any, hides none of them
    (T <= W). ``is_causal`` aligns its triangle to the top-left corner, so with
    cached keys in front (S > T) it would be wrong and an explicit mask is needed.
    """
    return S == T and not ring and (window is None or T <= window)


# ---------------------------------------------------------------------------
# The backends
# ---------------------------------------------------------------------------
def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes a family passes: q (1, H, T, D), k and v (1, K, S, D), H a multiple of K, S >= T."""
    B, H, T, D = q.shape
    Bk, K, S, Dk = k.shape
    if B != 1 or Bk != 1 or Dk != D or k.shape != v.shape:
        raise ValueError(f"attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want (1, H, T, D) and (1, K, S, D)")
    if H % K:
        raise ValueError(f"attend: {H} query heads cannot share {K} key/value heads evenly")
    if S < T:
        raise ValueError(f"attend: {T} queries but only {S} keys: the keys must include the new positions")


def sdpa_attention(q, k, v, *, start: int, ring: bool = False, window: int | None = None,
                   softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """The ``sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention``.

    q (1, H, T, D), k, v (1, K, S, D) -> (1, H, T, D), in q's dtype. Arguments as in :func:`attend`.

    * T == 1 (a decode step): the n_rep = H/K query heads of a group all read
      the same key/value head, so they are folded into n_rep query *rows* of
      that head, (1, H, 1, D) -> (1, K, n_rep, D): one SDPA call per K/V head,
      no copy of the cache.
    * T > 1: SDPA's ``enable_gqa`` maps query head h to K/V head ``h // n_rep``
      (the CPU flash kernel reads the shared head in place; the result is bit for
      bit the one of repeating K/V first, as transformers does).
    * The mask: none when every query sees every key, ``is_causal`` when the
      keys are exactly the new positions, else the explicit (T, S) mask of :func:`visible`.
    * A soft-cap needs a step between the scores and the softmax that SDPA
      lacks: such a call runs :func:`eager_attention`.
    """
    if softcap is not None:
        return eager_attention(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)
    _, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    n_rep = H // K
    if sees_every_key(T, S, window):
        mask, causal = None, False
    elif plain_causal(T, S, ring=ring, window=window):
        mask, causal = None, True
    else:
        mask, causal = visible(start, T, S, ring=ring, window=window, device=q.device), False
    if T == 1:
        out = F.scaled_dot_product_attention(q.reshape(1, K, n_rep, D), k, v, attn_mask=mask, scale=scale)  # (1, K, n_rep, D)
        return out.reshape(1, H, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=n_rep > 1)


def eager_probs(q, k, v, *, start: int, ring: bool = False, window: int | None = None,
                softcap: float | None = None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention arithmetic written out; returns (out (1, H, T, D) in q's dtype, probs (1, H, T, S) float32).

    1. scores = q k^T * scale, with the n_rep query heads of a group stacked as
       n_rep*T rows of their K/V head: (1, K, n_rep*T, D) @ (1, K, D, S), one
       matmul per K/V head and no repeated K/V (GQA folding);
    2. soft-cap (gemma2): ``cap * tanh(scores / cap)``, every score squashed
       smoothly into (-cap, cap);
    3. mask: -inf where a key is hidden (the future, or outside the window);
    4. softmax over the keys, in float32 whatever the model dtype;
    5. out = probs @ v, back in the model dtype.

    This is how gemma2 computed its attention before the seam, so its outputs are unchanged.
    """
    _, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    n_rep = H // K
    scale = D**-0.5 if scale is None else scale
    scores = torch.matmul(q.reshape(1, K, n_rep * T, D), k.transpose(2, 3)) * scale  # (1, K, n_rep*T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(1, K, n_rep, T, S)
    if not sees_every_key(T, S, window):
        mask = visible(start, T, S, ring=ring, window=window, device=q.device)  # (T, S): broadcasts over K, n_rep
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)  # (1, K, n_rep, T, S) float32
    out = torch.matmul(probs.to(q.dtype).view(1, K, n_rep * T, S), v)  # (1, K, n_rep*T, D)
    return out.view(1, H, T, D), probs.view(1, H, T, S)


def eager_attention(q, k, v, **kwargs) -> torch.Tensor:
    """The ``eager`` backend: :func:`eager_probs` without keeping the probabilities. (1, H, T, D)."""
    return eager_probs(q, k, v, **kwargs)[0]


TRITON_EXTRA = "lollm-core[triton]"


def triton_check(device: torch.device | None = None) -> None:
    """The ``triton`` backend's check: can its kernels run on ``device`` (None: on this machine)?

    They need the Triton package (the optional extra ``lollm-core[triton]``), and
    either a CUDA device or Triton's CPU interpreter (``TRITON_INTERPRET=1``: every
    kernel runs in numpy, slowly; the tests use it). Raises AttentionBackendError
    saying which is missing, before Triton would fail looking for a GPU driver.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        raise AttentionBackendError(
            f"the 'triton' attention backend needs Triton: pip install '{TRITON_EXTRA}' "
            "(or use --attn sdpa, the default)"
        ) from None
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y"):  # as Triton reads it
        return
    if not torch.cuda.is_available():
        raise AttentionBackendError(
            f"the 'triton' attention backend runs on a CUDA GPU, and this torch {torch.__version__} sees none: "
            "use --attn sdpa, or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter (slow)"
        )
    if device is not None and device.type != "cuda":
        raise AttentionBackendError(
            f"the 'triton' attention backend runs on a CUDA GPU, not on {device}: pass --device cuda "
            "(or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter, slow)"
        )


_triton_ready = False


def triton_attention(q, k, v, *, start: int, ring: bool = False, window: int | None = None,
                     softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """The ``triton`` backend: the FlashAttention kernels of :mod:`lollm.kernels`.

    q (1, H, T, D), k, v (1, K, S, D) -> (1, H, T, D), in q's dtype; fp32, fp16 or
    bf16; D up to 512. A prefill or chunk runs the FlashAttention-2 kernel
    (:mod:`lollm.kernels.flash_prefill`), a decode or verify step of up to 16
    queries the split-K kernel (:mod:`lollm.kernels.flash_decode`). Scores,
    softmax and accumulation are fp32 inside the kernels. The first call checks
    :func:`triton_check` (a process that picked the backend through
    ``LOLLM_ATTN`` alone has not been checked yet); AttentionBackendError when
    the kernels cannot run here or do not cover the call.
    """
    global _triton_ready
    if not _triton_ready:
        triton_check(q.device)
        _triton_ready = True
    from lollm.kernels import flash_attention

    return flash_attention(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)


def triton_attention_paged(q, k_pool, v_pool, batch: Batch, *, window: int | None = None, softcap: float | None = None,
                           scale: float | None = None) -> tuple[torch.Tensor, list[bool]]:
    """The ``triton`` backend in an engine step: the paged kernel of :mod:`lollm.kernels.paged_attention`.

    q (1, H, N, D); k_pool, v_pool (blocks, block_size, K, D) -> (out (1, H, N, D), covered (B,) bools).
    One launch reads the keys of every sequence with at most 16 new tokens (decode and verify
    steps) through its block table, without gathering them; those rows of ``out`` are set.
    Longer prefill chunks are left to :func:`_attend_batch` (``covered[b]`` False). Checks as
    :func:`triton_attention`.
    """
    global _triton_ready
    if not _triton_ready:
        triton_check(q.device)
        _triton_ready = True
    from lollm.kernels import flash_attention_paged

    return flash_attention_paged(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)


@dataclass(frozen=True)
class Backend:
    """One implementation of :func:`attend`.

    name:         what ``--attn`` and ``LOLLM_ATTN`` call it.
    summary:      one line for help texts and docs.
    attend:       ``attend(q, k, v, *, start, ring, window, softcap, scale) -> out (1, H, T, D)``.
    check:        ``check(device or None)``: raises AttentionBackendError when the backend
                  cannot run here (a missing extra, no GPU); called before a model loads.
    attend_paged: optional, for engine steps (:func:`_attend_batch`): ``attend_paged(q, k_pool,
                  v_pool, batch, *, window, softcap, scale) -> (out (1, H, N, D), covered (B,) bools)``,
                  reading the keys straight from the pool through the block tables; it sets the
                  rows of the sequences it covers. None: every sequence takes ``attend`` on
                  gathered keys.
    """

    name: str
    summary: str
    attend: Callable[..., torch.Tensor]
    check: Callable[[torch.device | None], None] = lambda device: None
    attend_paged: Callable[..., tuple[torch.Tensor, list[bool]]] | None = None


BACKENDS: dict[str, Backend] = {
    "sdpa": Backend("sdpa", "PyTorch's scaled_dot_product_attention (the default and the reference)", sdpa_attention),
    "eager": Backend("eager", "scores and softmax written out (readable; the path that records probabilities)", eager_attention),
    "triton": Backend("triton", "FlashAttention-2 and split-K decode kernels in Triton (lollm-core[triton]; a CUDA GPU)",
                      triton_attention, triton_check, triton_attention_paged),
}


# ---------------------------------------------------------------------------
# Picking a backend
# ---------------------------------------------------------------------------
_selected: ContextVar[str | None] = ContextVar("lollm_attention_backend", default=None)


def _lookup(name: str, source: str) -> Backend:
    backend = BACKENDS.get(name)
    if backend is None:
        raise AttentionBackendError(f"{source}: unknown attention backend {name!r} (use one of: {', '.join(BACKENDS)})")
    return backend


def current_backend() -> str:
    """The name of the backend :func:`attend` uses now.

    In order: the one set by :func:`use_backend` / :func:`set_backend` in this
    context, else the environment variable ``LOLLM_ATTN``, else ``sdpa``.
    """
    return _selected.get() or os.environ.get(ENV_VAR) or DEFAULT_BACKEND


def _named(name: str | None) -> tuple[str, str]:
    """The backend's name (None: :func:`current_backend`'s) and where it came from, for errors."""
    if name is not None:
        return name, "--attn"
    if _selected.get():
        return _selected.get(), "attention backend"
    return os.environ.get(ENV_VAR) or DEFAULT_BACKEND, ENV_VAR


def _checked(name: str | None, device: torch.device | str | None = None) -> str:
    """The backend's name once :data:`BACKENDS` knows it and it can run here (on ``device``, when given)."""
    name, source = _named(name)
    _lookup(name, source).check(None if device is None else torch.device(device))
    return name


def check_backend_name(name: str | None = None) -> None:
    """Check a backend's name (None: :func:`current_backend`'s) and what it needs of this machine.

    The commands call it on their flags before a model is looked for, so that a typo or a missing
    GPU costs nothing; the backend is chosen later, once, by :func:`resolve_backend` with the device
    known. Raises AttentionBackendError naming the unknown value and the known ones, or what the
    backend lacks on this machine.
    """
    _checked(name)


def resolve_backend(name: str | None = None, device: torch.device | str | None = None) -> str:
    """Choose a backend (None: :func:`current_backend`) and check that it can run on ``device``; return its name.

    The decision a load makes once (:func:`lollm.load.pipeline.prepare`). Raises AttentionBackendError
    (a LollmError) naming the unknown value and the known ones, or saying what the backend lacks here.
    """
    return _checked(name, device)


def set_backend(name: str) -> None:
    """Use backend ``name`` from now on in this context (the whole program, for a plain script)."""
    _selected.set(_checked(name))


@contextmanager
def use_backend(name: str | None) -> Iterator[str]:
    """``with use_backend("eager"):`` runs the block with that backend, then restores the previous choice.

    ``None`` keeps the current choice (so callers can pass an optional setting through).
    Yields the backend's name. Raises AttentionBackendError for an unknown or unusable name.
    """
    if name is None:
        yield current_backend()
        return
    token = _selected.set(_checked(name))
    try:
        yield name
    finally:
        _selected.reset(token)


# ---------------------------------------------------------------------------
# The seam
# ---------------------------------------------------------------------------
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    start: int | Batch,
    ring: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    layer: Any = None,
) -> torch.Tensor:
    """softmax(mask(softcap(q k^T * scale))) v for T new queries against S keys, with GQA.

    q:       (1, H, T, D), the queries of positions ``start .. start+T-1``, RoPE applied.
    k, v:    (1, K, S, D), the keys/values this layer reads, as the family's cache
             returns them; they end at the newest query's position (see
             :func:`key_positions`). H must be a multiple of K: query head h reads
             K/V head ``h // (H/K)``; repeated K/V are never materialised. H and K
             are taken from the tensors, so a tensor-parallel rank passes its local heads.
    start:   position of the first query (the number of positions cached before this step).
             In an engine step (:mod:`lollm.batch`) a :class:`~lollm.batch.Batch` instead:
             q is (1, H, N, D), the N new tokens of B sequences end to end, and k, v are
             this layer's whole KV pool as :class:`lollm.engine.cache.PagedCache` returns
             it, (blocks, block_size, K, D); see :func:`_attend_batch`.
    ring:    True when k, v are the slots of a ring buffer (position p in slot
             ``p % S``), as a sliding-window cache returns them in a one-token step;
             False for keys in position order.
    window:  sliding window W: query p reads keys j with ``p - W < j <= p``; None: all ``j <= p``.
    softcap: logit soft-cap (gemma2's ``attn_logit_softcapping``): scores become
             ``cap * tanh(score / cap)`` before the mask and softmax; None: off.
    scale:   the factor on ``q k^T``; None: ``1/sqrt(D)``. (gemma: ``query_pre_attn_scalar ** -0.5``,
             gemma4: 1.0.)
    layer:   the caller's layer index, kept in the :class:`AttentionRecord` when recording.

    Returns (1, H, T, D) in q's dtype (the softmax runs in float32 in ``eager``;
    ``sdpa`` follows PyTorch's kernels). Raises AttentionBackendError when the
    picked backend is unknown or cannot run; ValueError for shapes that break the
    contract above (a bug in the calling family).
    """
    if isinstance(start, Batch):
        return _attend_batch(q, k, v, start, window=window, softcap=softcap, scale=scale, layer=layer)
    _check_heads(q, k, v)
    rec = active_recording()
    if rec is not None:
        T, S = q.shape[2], k.shape[2]
        out, probs = eager_probs(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)
        rec.records.append(AttentionRecord(
            layer, probs, torch.arange(start, start + T, device=q.device),
            key_positions(start, T, S, ring=ring, device=q.device), window,
        ))
        return out
    name = _selected.get()  # checked when it was set
    backend = BACKENDS[name] if name else _lookup(os.environ.get(ENV_VAR) or DEFAULT_BACKEND, ENV_VAR)
    return backend.attend(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)


def _attend_batch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch, *,
                  window: int | None, softcap: float | None, scale: float | None, layer: Any) -> torch.Tensor:
    """Attention for an engine step: each sequence's queries read its own keys from the paged pool.

    q (1, H, N, D); k_pool, v_pool (blocks, block_size, K, D) -> (1, H, N, D).

    The matmuls around attention were shared by the whole batch; attention itself is
    per sequence, because each sequence reads its own keys. For sequence b:

    0. a backend with a paged kernel (``Backend.attend_paged``: ``triton``) first runs it
       once over the whole batch: it reads each sequence's keys in place through its
       block table and sets the rows of the sequences it covers (decode and verify steps);
    1. every other sequence's queries are the rows ``lo:hi`` of the N;
    2. its keys are gathered from its blocks: ``pool.index_select(0, block_table)`` (n, block_size, K, D)
       laid end to end and cut at its length, ``starts[b] + counts[b]`` positions,
       in position order (so ``ring`` never applies here). A sliding-window layer reads
       its own pool through the batch's window tables (:meth:`Batch.tables_for`), from the
       block where its first query's window starts: the blocks before it may be released;
       the keys still end at the newest query, as :func:`key_positions` expects;
    3. the picked backend runs exactly the single-sequence call, with ``start=starts[b]``.

    **On a CPU with the ``sdpa`` backend** (the default), lollm's native library built and pools
    in float32, bfloat16 or float16 (float64 is the tests' reference), none of this runs: the whole step goes to :func:`lollm.native.paged.paged_attention`, which reads
    the pool in place and computes each query by one fixed float32 order, so a request's rows are
    the same bits alone, in any batch and in prompt chunks of any size (docs/batching.md,
    section 9). The steps above are the path without it (``LOLLM_NATIVE=0``, no compiler, a GPU),
    and they are **not batch invariant**: SDPA's sums follow its call's shape (how many queries,
    how many keys), which the other sequences of the step and the scheduler's token budget decide.
    There, with no soft-cap, the sequences that bring one query each skip the loop:
    :func:`_attend_decode_rows` runs them in one SDPA call, keys padded to the longest (on a CPU
    the loop's small calls cost more than its arithmetic; on a GPU the gather copies and the B
    launches are the cost, hence step 0; docs/flash-attention.md, "Paged attention").
    """
    if active_recording() is not None:
        raise AttentionBackendError("lollm trace records one sequence at a time: it cannot record an engine step")
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"attend: an engine step wants k, v pools (blocks, block_size, K, D), got {tuple(k_pool.shape)}")
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != batch.num_tokens or q.shape[3] != k_pool.shape[3] \
            or q.shape[1] % k_pool.shape[2]:
        raise ValueError(f"attend: an engine step of {batch.num_tokens} tokens wants q (1, H, N, D) with H a multiple "
                         f"of K, got q {tuple(q.shape)} and pools {tuple(k_pool.shape)}")
    name = _selected.get()
    backend = BACKENDS[name] if name else _lookup(os.environ.get(ENV_VAR) or DEFAULT_BACKEND, ENV_VAR)
    if backend.name == "sdpa" and q.device.type == "cpu" and k_pool.dtype in PAGED_DTYPES and paged_attention_op():
        return paged_attention(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)
    K, D = k_pool.shape[2], k_pool.shape[3]
    if backend.attend_paged is not None:
        out, covered = backend.attend_paged(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)
    else:
        out, covered = q.new_empty(q.shape), [False] * len(batch.counts)  # (1, H, N, D)
    decoding = [b for b, done in enumerate(covered) if not done and batch.counts[b] == 1]
    if backend.name == "sdpa" and softcap is None and len(decoding) > 1:
        _attend_decode_rows(q, k_pool, v_pool, batch, decoding, window=window, scale=scale, out=out)
        covered = [done or b in set(decoding) for b, done in enumerate(covered)]
    size = batch.block_size
    for (lo, hi), first, table, done in zip(batch.segments(), batch.starts, batch.tables_for(window), covered):
        if done:
            continue
        # a sliding-window layer reads from the block of its first query's window on (the blocks
        # before it may be released: -1 in a window table); the keys still end at its last query
        skip = max(0, first - window + 1) // size if window is not None else 0
        S = first + (hi - lo) - skip * size
        blocks = torch.tensor(table[skip:], dtype=torch.long, device=k_pool.device)
        # index_select gathers whole blocks, as pool[blocks] does, at a third of its cost on a CPU
        k = k_pool.index_select(0, blocks).reshape(-1, K, D)[:S].transpose(0, 1).unsqueeze(0)  # (1, K, S, D)
        v = v_pool.index_select(0, blocks).reshape(-1, K, D)[:S].transpose(0, 1).unsqueeze(0)
        q_b = q[:, :, lo:hi]  # (1, H, T_b, D)
        _check_heads(q_b, k, v)
        out[:, :, lo:hi] = backend.attend(q_b, k, v, start=first, ring=False, window=window, softcap=softcap, scale=scale)
    return out  # (1, H, N, D)


def _attend_decode_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: Batch, rows: list[int], *,
                        window: int | None, scale: float | None, out: torch.Tensor) -> None:
    """Sequences ``rows`` of an engine step, one query each, in one SDPA call; writes their rows of ``out``.

    q, out (1, H, N, D); k_pool, v_pool (blocks, block_size, K, D). For B sequences:

    1. each one's blocks from where its window starts (as in :func:`_attend_batch`), padded
       with block 0 to the longest list: (B, n) block ids, S = n * block_size key slots;
    2. ``seen`` (B, S): slot j of sequence b holds a key its query sees, from the window's first
       position to the query's own. Every other slot (the padding, a block's unwritten tail)
       is masked, and set to 0 in k and v: such a slot may hold anything, even NaN, and
       ``0 * NaN`` would reach the output;
    3. the B queries, their H heads folded as the single-sequence decode folds them
       (n_rep = H / K query rows per K/V head): (B, K, n_rep, D), one SDPA call with ``seen``
       as its mask -> (B, K, n_rep, D).

    SDPA pads nothing itself: a masked key adds exp(-inf) = 0. The sums run over other lengths
    than one sequence's call, so a row may differ from it in the last bits: this path is not
    batch invariant, and runs only where the native kernel does not (:func:`_attend_batch`).
    """
    B, H, D = len(rows), q.shape[1], q.shape[3]
    K, size = k_pool.shape[2], batch.block_size
    tables = batch.tables_for(window)
    lists, ends, firsts = [], [], []
    for b in rows:
        query = batch.starts[b]  # the position of sequence b's one query
        skip = max(0, query - window + 1) // size if window is not None else 0
        lists.append(tables[b][skip:])
        ends.append(query + 1 - skip * size)  # slots 0 .. ends-1 hold its keys up to the query
        firsts.append(query - window + 1 - skip * size if window is not None else 0)  # its window's first slot
    n = max(len(t) for t in lists)
    blocks = torch.tensor([t + [0] * (n - len(t)) for t in lists], dtype=torch.long, device=k_pool.device)  # (B, n)
    slot = torch.arange(n * size, device=k_pool.device)  # (S,)
    seen = (slot < torch.tensor(ends, device=slot.device)[:, None]) & (slot >= torch.tensor(firsts, device=slot.device)[:, None])
    hidden = ~seen[:, :, None, None]  # (B, S, 1, 1)
    # in place: index_select made fresh copies, so zeroing them touches no pool slot
    k = k_pool.index_select(0, blocks.view(-1)).view(B, n * size, K, D).masked_fill_(hidden, 0).transpose(1, 2)  # (B, K, S, D)
    v = v_pool.index_select(0, blocks.view(-1)).view(B, n * size, K, D).masked_fill_(hidden, 0).transpose(1, 2)
    segments = batch.segments()
    at = torch.tensor([segments[b][0] for b in rows], device=q.device)  # (B,): each query's row in the N
    q_rows = q[0].index_select(1, at).transpose(0, 1).reshape(B, K, H // K, D)  # (B, K, n_rep, D)
    o = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=seen[:, None, None, :], scale=scale)  # (B, K, n_rep, D)
    out[0, :, at] = o.reshape(B, H, D).transpose(0, 1)
