"""The gemma2 cache: a ring buffer per sliding-window layer, a full KV cache per global layer.

Gemma 2 has two kinds of layer, so it has two kinds of cache (see
docs/sliding-window.md for the whole story, with pictures)::

    global layer   k, v: (1, K, max_tokens, D)   every position ever seen
    sliding layer  k, v: (1, K, R, D)            only the last R = min(W, max_tokens)
                                                 positions, position p in slot p % R

A sliding-window layer's query at position p sees the keys of positions
``p-W+1 .. p`` (W of them, itself included). So once a position is W behind
the newest token, no query will ever read it again, and its slot can be
reused: the ring needs W slots, whatever the length of the text. Gemma 2
alternates sliding and global layers; at its full 8192-token context
(gemma-2-2b: 13 rings of 4096 positions, 13 full caches of 8192) the cache is
three quarters of a plain KV cache.

Everything is allocated once; writes are slice assignments into the
preallocated tensors (no per-step allocation or concatenation):

* decode (T == 1): write the new key into slot ``p % R``, then attend over the
  filled slots. Their order in the ring is not position order, and need not
  be: attention is a weighted sum over keys, which does not depend on their
  order (RoPE already baked each key's position into it).
* prefill or a chunk (T > 1): the queries need the W-1 positions before the
  chunk too. Those are read out of the ring in position order and put in front
  of the new keys (one copy per prefill, not per token); the mask
  (made by ``lollm.attention``) then applies causality and the window. Only
  then are the last R of the new keys written into the ring.

Going back (the prompt cache, docs/serving.md)
---------------------------------------------
A global layer can return to any earlier length: each position keeps its row.
A ring cannot always: once it has wrapped, the slots of old positions hold
newer ones. A query at position n reads positions ``n-W+1 .. n``; after
positions ``0 .. written-1`` went through a ring of R slots it holds
``written-R .. written-1`` only. So ``rollback(n)`` is exact when nothing was
overwritten (``written <= R``) or when ``n-(W-1) >= written-R``; a wrapped
ring has R = W, so that is ``n >= written-1``: one step back at most (or back to 0, an empty cache).
(``written`` is the highest length ever reached: a rollback does not
un-write the ring.) Further back, core restores a ``snapshot()``: a copy of
every ring at one length (W positions per sliding layer, e.g. 15 MiB for
Gemma 3 270M in float32), taken at turn boundaries.
"""

from __future__ import annotations

import torch

from lollm.errors import GenerationError

from .config import SLIDING, Gemma2Config


class FullKV:
    """Keys and values of one global layer, for up to ``max_tokens`` positions.

    k, v: (1, K, max_tokens, D), allocated once; positions ``0 .. length-1`` are filled.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, max_tokens: int, *, device, dtype):
        self.k = torch.zeros(1, num_kv_heads, max_tokens, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values of positions ``start .. start+T-1``; return those of ``0 .. start+T-1``.

        k, v: (1, K, T, D) -> (1, K, start+T, D), views into the cache (no copy).
        """
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class SlidingWindowKV:
    """Keys and values of one sliding-window layer: a ring of R = min(W, max_tokens) slots.

    Position p lives in slot ``p % R``. k, v: (1, K, R, D), allocated once; their
    size depends on the window, never on the length of the text.
    """

    def __init__(self, window: int, num_kv_heads: int, head_dim: int, max_tokens: int, *, device, dtype):
        self.window = window
        self.slots = min(window, max_tokens)
        self.k = torch.zeros(1, num_kv_heads, self.slots, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys/values of positions ``start .. start+T-1``; return the ones the queries read.

        k, v: (1, K, T, D). Returns (1, K, S, D):
          * T == 1: the filled slots of the ring (positions ``max(0, start-W+1) .. start``,
            in ring order), views into the cache;
          * T > 1: positions ``max(0, start-(W-1)) .. start+T-1`` in position order
            (as ``lollm.attention.key_positions`` describes them), a new tensor.
        """
        T = k.shape[2]
        if T == 1:  # decode: write first, then read the whole (filled part of the) ring
            slot = start % self.slots
            self.k[:, :, slot : slot + 1] = k
            self.v[:, :, slot : slot + 1] = v
            filled = min(start + 1, self.slots)
            return self.k[:, :, :filled], self.v[:, :, :filled]
        # prefill / chunk: read the earlier positions the chunk can see *before* the
        # write, which may overwrite them
        first = max(0, start - (self.window - 1))
        if first < start:
            old_k, old_v = self._read(first, start)
            k_all, v_all = torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2)
        else:
            k_all, v_all = k, v
        self._write(start, k, v)
        return k_all, v_all

    def holds_window_before(self, length: int, written: int) -> bool:
        """Whether queries from position ``length`` on find their keys here, after ``written`` positions went in.

        The ring holds positions ``written-R .. written-1``; the query at ``length``
        needs ``length-(W-1) .. length-1`` of them (none before position 0).
        """
        oldest_kept = max(0, written - self.slots)
        return oldest_kept == 0 or length - (self.window - 1) >= oldest_kept

    def undoable_tokens(self, length: int, written: int) -> int:
        """The most positions a forward from ``length`` may write and still go back to ``length + 1`` exactly.

        After it, the ring has taken in positions up to ``w = max(written, length + T)``; going
        back to ``length + 1`` needs ``w <= R`` (nothing overwritten) or
        ``length + 1 - (W - 1) >= w - R`` (see ``holds_window_before``). At least 1: a
        forward of one token is never rolled back.
        """
        bound = max(self.slots, length + 2 - self.window + self.slots)
        return max(1, bound - length) if written <= bound else 1

    def _read(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions ``first .. end-1`` (all still in the ring), in position order."""
        slots = torch.arange(first, end, device=self.k.device) % self.slots
        return self.k.index_select(2, slots), self.v.index_select(2, slots)

    def _write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put the last R of the T new positions into their slots (at most two slice copies)."""
        T = k.shape[2]
        keep = min(T, self.slots)
        k, v = k[:, :, T - keep :], v[:, :, T - keep :]
        slot = (start + T - keep) % self.slots  # slot of the first position kept
        head = min(keep, self.slots - slot)  # how many fit before the end of the ring
        self.k[:, :, slot : slot + head] = k[:, :, :head]
        self.v[:, :, slot : slot + head] = v[:, :, :head]
        if head < keep:  # the rest wraps around to slot 0
            self.k[:, :, : keep - head] = k[:, :, head:]
            self.v[:, :, : keep - head] = v[:, :, head:]


class Gemma2Cache:
    """The cache of a whole gemma2 model (batch 1): one FullKV or SlidingWindowKV per layer.

    Attributes:
      layers:     per decoder layer, its cache (the kind follows ``config.layer_types``).
      length:     positions processed so far; the next forward's tokens start there.
      max_tokens: capacity in positions (what the global layers hold).
      written:    the highest ``length`` reached: the rings hold positions up to there
                  (after a rollback, more than ``length``; see "Going back" above).
    """

    def __init__(self, config: Gemma2Config, max_tokens: int, *, device, dtype):
        K, D = config.num_key_value_heads, config.head_dim
        self.layers = [
            SlidingWindowKV(config.sliding_window, K, D, max_tokens, device=device, dtype=dtype)
            if layer_type == SLIDING
            else FullKV(K, D, max_tokens, device=device, dtype=dtype)
            for layer_type in config.layer_types
        ]
        self.length = 0
        self.max_tokens = max_tokens
        self.written = 0

    def check_room(self, T: int) -> None:
        """Raise GenerationError when T more positions do not fit."""
        if self.length + T > self.max_tokens:
            raise GenerationError(
                f"the KV cache holds {self.max_tokens} positions: {self.length} are used and {T} more do not fit"
            )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values of ``layer`` (at positions from ``length`` on); return what it reads."""
        return self.layers[layer].update(k, v, self.length)

    def advance(self, T: int) -> None:
        """Mark T more positions as processed (once per forward, after the last layer)."""
        self.length += T
        self.written = max(self.written, self.length)

    def _rings(self) -> list[SlidingWindowKV]:
        return [layer for layer in self.layers if isinstance(layer, SlidingWindowKV)]

    def undoable_tokens(self) -> int:
        """The most positions the next forward may write such that a rollback to any length after the current
        one stays exact (speculative decoding asks, to size its drafts); the rings decide, at least 1."""
        return min((r.undoable_tokens(self.length, self.written) for r in self._rings()), default=self.max_tokens)

    def can_rollback(self, length: int) -> bool:
        """Whether :meth:`rollback` to ``length`` is exact: back to 0 (an empty cache), or every ring
        still holds the window before ``length``."""
        if length == 0:
            return True
        return 0 < length <= self.length and all(r.holds_window_before(length, self.written) for r in self._rings())

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on; GenerationError where a ring no longer holds what that needs."""
        if not self.can_rollback(length):
            raise GenerationError(
                f"cannot roll the cache back from {self.length} to {length} positions: the sliding-window rings "
                f"(window {self._rings()[0].window if self._rings() else '-'}) have overwritten positions it needs"
            )
        self.length = length
        if length == 0:
            self.written = 0  # an empty cache: what the rings hold is never read again

    def snapshot(self) -> tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A copy of every ring at the current length (the global layers need none: their rows stay)."""
        return self.length, self.written, [(r.k.clone(), r.v.clone()) for r in self._rings()]

    def restore(self, snapshot: tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Put the rings of ``snapshot`` back and return to its length.

        Exact as long as no position below the snapshot's length was rewritten
        since it was taken (the prompt cache drops snapshots above any point it
        goes back to, so that holds).
        """
        length, written, rings = snapshot
        for ring, (k, v) in zip(self._rings(), rings):
            ring.k.copy_(k)
            ring.v.copy_(v)
        self.length, self.written = length, written

    def nbytes(self) -> int:
        """Memory held by the cache's tensors, in bytes."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k, layer.v))
