"""The batch seam: how a family's forward runs many sequences in one pass.

At batch 1, a decode step reads every weight once to produce one token: the
cores wait on memory, not on arithmetic. The engine (:mod:`lollm.engine`) runs
the new tokens of B sequences through one forward instead, laid end to end::

    sequence 0: 1 decode token   sequence 1: a prefill chunk of 3   sequence 2: 1 decode token
    input_ids (1, N=5):  [ a | b c d | e ]
    positions (N,):      [ 17| 0 1 2 | 40 ]     each token's own position in its own sequence

Every matmul of the model (projections, MLP, output head) treats the N tokens as
N rows and reads the weights once for all of them. Only two things are per
sequence: the position (RoPE angles) and which keys a query may read (attention,
and a recurrent layer's state). So a family's forward needs three small things to
run an engine step, all in this module's vocabulary:

* ``start``: a family writes ``start = 0 if cache is None else cache.length``. For one
  sequence that is an int; in an engine step the cache's ``length`` is a
  :class:`Batch`: each sequence's own cached length, and where its tokens sit.
  :func:`token_positions` turns either into the (N,) positions for RoPE, and
  :func:`lollm.attention.attend` accepts either as its ``start``.
* ``logits_to_keep``: an int (the last N rows) or, in an engine step, a (B,) tensor of
  row indices (the last token of each sequence), as transformers accepts it.
* :class:`CacheLayer`: the model's ``cache_layers()`` says what each cache layer
  holds (full attention, a sliding window, shared keys, a recurrent state), so the
  engine can size one pool of KV blocks and one state slot per sequence for it.

The cache a family's forward receives in an engine step is
:class:`lollm.engine.cache.PagedCache`: ``update(layer, k, v)`` writes the new keys
into the pool and hands back the layer's pool, ``check_room`` and ``advance`` are the
engine's business. docs/batching.md is the lesson.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CacheLayer:
    """What one layer of a family's cache holds, as the engine needs to know it.

    kind:         "full" (keys of every position), "sliding" (attention reads the last
                  ``window`` positions; the engine still pages every block), "shared"
                  (reads another layer's keys, stores nothing: gemma4's shared KV), or
                  "recurrent" (a fixed-size state per sequence: DeltaNet, conv windows).
    num_kv_heads: K, the key/value heads stored (full and sliding layers).
    head_dim:     D, the width of each stored head (full and sliding layers).
    window:       W for a sliding layer, None otherwise.
    state:        recurrent layers: name -> shape of one sequence's state tensor,
                  e.g. ``{"conv": (3, 6144), "recurrent": (16, 128, 128)}``.
    state_dtype:  the dtype of those states (float32 for a delta-rule state).
    """

    kind: str
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None
    state: dict[str, tuple[int, ...]] = field(default_factory=dict)
    state_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.kind not in ("full", "sliding", "shared", "recurrent"):
            raise ValueError(f"CacheLayer kind {self.kind!r}: want full, sliding, shared or recurrent")
        if self.kind in ("full", "sliding") and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError(f"a {self.kind} CacheLayer needs num_kv_heads and head_dim, got {self.num_kv_heads}, {self.head_dim}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(f"a window belongs to sliding layers only (kind {self.kind!r}, window {self.window})")

    @property
    def stores_keys(self) -> bool:
        return self.kind in ("full", "sliding")


@dataclass
class Batch:
    """The layout of one engine step: B sequences' new tokens laid end to end as N tokens.

    starts:       (B,) ints: positions each sequence already holds in the cache (its length).
    counts:       (B,) ints: new tokens each sequence brings in this step (1 for decode,
                  up to the chunk size for a prefill chunk); N = sum(counts).
    block_tables: B lists of block ids: sequence b's position p lives in block
                  ``block_tables[b][p // block_size]`` at offset ``p % block_size``;
                  they cover ``starts[b] + counts[b]`` positions.
    block_size:   positions per KV block.
    state_slots:  (B,) ints: the row of each sequence in the recurrent-state storage.
    window_tables: for a model with sliding-window layers: B block tables into those layers'
                  own pool (:class:`lollm.engine.cache.KVPool`), as long as ``block_tables``,
                  with -1 for the blocks that left every window (released: no query of
                  this step or later reads them); None when the engine keeps no such pool.
    window:       the window W those tables were released by (the largest of the model's).
    positions:    (N,) int64: token i of sequence b sits at ``starts[b] + i``.
    slots:        (N,) int64: the flat pool slot each new token's keys go to,
                  ``block * block_size + offset``.
    window_slots: (N,) int64: the same in the sliding-window layers' pool (None without one).
    last_rows:    (B,) int64: the row of each sequence's last token in the N (whose logits
                  the engine samples from).
    """

    starts: list[int]
    counts: list[int]
    block_tables: list[list[int]]
    block_size: int
    state_slots: list[int]
    window_tables: list[list[int]] | None = None
    window: int | None = None
    positions: torch.Tensor = field(init=False)
    slots: torch.Tensor = field(init=False)
    window_slots: torch.Tensor | None = field(init=False)
    last_rows: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.positions = torch.tensor([p for start, count in zip(self.starts, self.counts, strict=True)
                                       for p in range(start, start + count)], dtype=torch.long)
        self.slots = self._slots(self.block_tables, "block table")
        self.window_slots = None
        if self.window_tables is not None:
            if self.window is None or self.window < 1 or len(self.window_tables) != len(self.block_tables):
                raise ValueError(f"window tables want a window >= 1 and one table per sequence, got window "
                                 f"{self.window} and {len(self.window_tables)} tables for {len(self.block_tables)}")
            self.window_slots = self._slots(self.window_tables, "window table")
        ends = torch.tensor(self.counts, dtype=torch.long).cumsum(0)
        self.last_rows = ends - 1

    def _slots(self, tables: list[list[int]], what: str) -> torch.Tensor:
        """(N,) int64: the flat slot ``block * block_size + offset`` of each new token in ``tables``."""
        slots = []
        for start, count, table in zip(self.starts, self.counts, tables, strict=True):
            if len(table) * self.block_size < start + count:
                raise ValueError(f"a {what} of {len(table)} blocks cannot hold {start + count} positions")
            for p in range(start, start + count):
                block = table[p // self.block_size]
                if block < 0:
                    raise ValueError(f"a {what} has no block for position {p}, which this step writes")
                slots.append(block * self.block_size + p % self.block_size)
        return torch.tensor(slots, dtype=torch.long)

    def tables_for(self, window: int | None) -> list[list[int]]:
        """The block tables a layer reads: the window tables for a sliding-window layer (``window`` set)
        where the engine keeps them, else ``block_tables``. ValueError for a window larger than the one
        the window tables were released by (that layer would need keys already given back)."""
        if window is None or self.window_tables is None:
            return self.block_tables
        if window > self.window:
            raise ValueError(f"a layer with a window of {window} reads window tables released for a window of {self.window}")
        return self.window_tables

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def segments(self) -> list[tuple[int, int]]:
        """(first row, end row) of each sequence's tokens in the N: sequence b is ``x[:, lo:hi]``."""
        out, lo = [], 0
        for count in self.counts:
            out.append((lo, lo + count))
            lo += count
        return out


def token_positions(start: int | Batch, T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The position of each of the T new tokens: (T,) int64 on ``device``.

    ``start`` an int: one sequence, positions ``start .. start+T-1``. ``start`` a
    :class:`Batch` (an engine step): each token's position in its own sequence.
    """
    if isinstance(start, Batch):
        if start.num_tokens != T:
            raise ValueError(f"the batch lays out {start.num_tokens} tokens, the forward got {T}")
        return start.positions.to(device)
    return torch.arange(start, start + T, device=device)


def keep_logit_rows(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The rows of x (1, T, C) whose logits a forward returns: all (0), the last N (an int N),
    or the given rows (a (R,) int64 tensor: an engine step keeps each sequence's last token)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep.to(x.device)]
    return x[:, -logits_to_keep:] if logits_to_keep else x
