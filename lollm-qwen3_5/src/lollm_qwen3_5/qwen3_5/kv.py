"""The qwen3_5 hybrid cache: keys/values for attention layers, fixed-size states for DeltaNet layers.

A hybrid model needs two kinds of memory to decode one token at a time::

    full-attention layer  ->  k, v: (1, K, max_tokens, D)     grows with the text (one row per position)
    Gated DeltaNet layer  ->  conv state: (W-1, conv_dim)     the last W-1 inputs of the causal conv
                              recurrent state: (Hv, Dk, Dv)   the delta-rule memory, float32

Everything is allocated once, in :class:`Qwen3_5HybridCache`'s constructor:
``k`` and ``v`` for the full-attention layers (one slot per layer, plus one
for the MTP head's own attention layer when the checkpoint has one), ``conv``
and ``recurrent`` for the DeltaNet layers. A forward writes into them in place;
nothing is concatenated or reallocated per step. The DeltaNet states do not
grow: a 200k-token context costs them no more memory than a 2-token one (for
Qwen3.5-0.8B, 18 layers x 16 heads x 128 x 128 floats = 18 MiB).

``length`` counts the positions stored. The model advances it once per forward.

Rollback (speculative decoding)
-------------------------------
The shared loop verifies draft tokens with one forward over ``[pending, d1 .. dk]``
and then calls ``rollback(length)`` to forget the rejected ones. For the
attention layers that only means lowering ``length`` (the stale rows are
overwritten later). A DeltaNet state, however, has already absorbed every
token of the forward; it cannot be "un-written". Two ways out:

* recompute: keep the state from before the verify step and re-run the accepted
  tokens through every layer (a second forward per step), or
* snapshot: while verifying, keep the state after *each* token, and restore
  the one of the last accepted token.

lollm snapshots, because a verify step is short (k + 1 tokens) and copying
k + 1 states is far cheaper than another forward. So a forward of
``1 < T <= MAX_ROLLBACK_TOKENS`` tokens on a non-empty cache is *recorded*:
the DeltaNet layers run the recurrent form of the delta rule and write the
state after every token into ``state_history``; the conv layers keep the
window of inputs they read (the old W-1 inputs plus the T new ones), from
which the conv state after any token is a slice. ``rollback(n)`` copies those
back. The snapshot buffers are allocated on the first verify step and reused.

A prefill (an empty cache) and a longer multi-token forward are not recorded
(they use the chunked form and may not be rolled back into); a one-token
decode step needs no snapshot either.

Going back further (the prompt cache, docs/serving.md)
-----------------------------------------------------
A conversation's next prompt shares a prefix with what the cache holds, but a
DeltaNet state cannot be cut back to that prefix: it is one matrix that every
token has been folded into. So the prompt cache keeps copies of the small
states at turn boundaries (``snapshot()``: conv and recurrent states and the
length, 18 MiB for Qwen3.5-0.8B) and, to go back, ``restore()``s the newest
one at or before the point where the prompts part; the attention layers' rows
below it are still in place. ``can_rollback`` says where a plain rollback is
enough: the current length, the recorded verify step, or 0 (a fresh start:
states zeroed).

The MTP draft head (see mtp.py) keeps its own small state here too: one K/V
slot, how many of its positions hold confirmed values (``mtp_length``), and,
for every position, the main model's final hidden state and token id
(``hidden``, ``ids``), which it reads when it catches up before drafting.
Keeping them for every position (C values each, e.g. 4 KiB per position for
Qwen3.5-0.8B in float32) lets the head catch up from any point the cache went
back to.

In the batched engine (lollm.engine, docs/batching.md)
-------------------------------------------------------
An engine step runs the new tokens of several sequences end to end through one
forward, and the memory is the engine's: a pool of K/V blocks for every
full-attention layer and, for every DeltaNet layer, one row of conv and
recurrent state per sequence slot (zeroed when a request is admitted). The
forward then receives a :class:`lollm.engine.cache.PagedCache`, and wraps it in
:class:`Qwen3_5EngineCache`, which gives it this module's method names::

    update_kv(slot, start, k, v)   ->  PagedCache.update(layer, k, v): writes the pool, returns the pool
    sequences()                    ->  for each sequence b: its rows (lo, hi) of the step's tokens and
                                       a Qwen3_5SequenceStates, whose conv_state(slot) /
                                       recurrent_state(slot) are views of b's rows (PagedCache.state)

The cache layer index the engine knows is the decoder layer's index: an
attention layer's K/V slot i is layer ``full_attention_layers[i]``, a DeltaNet
layer's state slot j is layer ``linear_attention_layers[j]``. The engine never
rolls a step back and does not draft with the MTP head, so nothing is recorded
and ``remember_last_forward`` keeps nothing there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lollm.batch import Batch
from lollm.errors import GenerationError

from .config import Qwen3_5Config

if TYPE_CHECKING:
    from lollm.engine.cache import PagedCache

#: The longest multi-token forward on a non-empty cache that can be rolled back
#: (a verify step of 1 + up to 15 draft tokens).
MAX_ROLLBACK_TOKENS = 16


class Qwen3_5HybridCache:
    """Preallocated memory of every layer of a qwen3_5 model, for up to ``max_tokens`` positions (batch 1).

    Attributes:
      k, v:        (attention slots, 1, K, max_tokens, D): full-attention layers (+ the MTP layer).
      conv:        (DeltaNet layers, W-1, conv_dim), model dtype: each layer's last W-1 conv inputs.
      recurrent:   (DeltaNet layers, Hv, Dk, Dv), float32: each layer's delta-rule memory.
      length:      positions filled so far; the next forward's tokens start there.
      image_spans: the sequence's images ``[(first position, merged grid (t, h', w'))]`` ([] for text),
                   set by the prefill's forwards, read by every later one for M-RoPE
                   (lollm_qwen3_5.qwen3_5.mrope.sequence_image_spans).
      max_tokens:  capacity in positions.
      recording:   True during a forward whose states are kept for rollback (see the module docstring).
    """

    def __init__(self, config: Qwen3_5Config, max_tokens: int, *, device, dtype: torch.dtype, with_mtp: bool = False):
        c = config
        n_attention = len(c.full_attention_layers) + (1 if with_mtp else 0)
        n_linear = len(c.linear_attention_layers)
        kv_shape = (n_attention, 1, c.num_key_value_heads, max_tokens, c.head_dim)
        self.k = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.v = torch.zeros(kv_shape, device=device, dtype=dtype)
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        self.conv = torch.zeros(n_linear, c.linear_conv_kernel_dim - 1, conv_dim, device=device, dtype=dtype)
        state_shape = (n_linear, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.recurrent = torch.zeros(state_shape, device=device, dtype=torch.float32)
        self.length = 0
        self.image_spans: list[tuple[int, tuple[int, int, int]]] = []
        self.max_tokens = max_tokens
        self._kernel = c.linear_conv_kernel_dim

        # Rollback bookkeeping: the forward being (or last) recorded covers positions
        # record_start .. record_start + record_tokens - 1 (record_tokens 0: nothing recorded).
        self.recording = False
        self.record_start = 0
        self.record_tokens = 0
        self._conv_windows: torch.Tensor | None = None  # (n_linear, W-1+T, conv_dim)
        self._states: torch.Tensor | None = None  # (n_linear, T, Hv, Dk, Dv) float32

        # The MTP head's view (mtp.py): its K/V slot is the last attention slot.
        self.with_mtp = with_mtp
        self.mtp_slot = n_attention - 1 if with_mtp else None
        self.mtp_length = 0  # MTP positions 0 .. mtp_length-1 hold values from confirmed tokens
        # the main model's final-normed hidden state (max_tokens, C) and token id (max_tokens,) of every position
        self.hidden = torch.zeros(max_tokens if with_mtp else 0, c.hidden_size, device=device, dtype=dtype)
        self.ids = torch.zeros(max_tokens if with_mtp else 0, device=device, dtype=torch.long)

    # -- a forward ----------------------------------------------------------
    def begin(self, T: int) -> None:
        """Called by the model before a forward of T tokens: check room, decide whether to record."""
        if self.length + T > self.max_tokens:
            raise GenerationError(
                f"the cache holds {self.max_tokens} positions: {self.length} are used and {T} more do not fit"
            )
        self.recording = self.length > 0 and 1 < T <= MAX_ROLLBACK_TOKENS
        self.record_start = self.length
        self.record_tokens = T if self.recording else 0
        if self.recording and (self._states is None or self._states.shape[1] < T):
            # first verify step (or a longer one than before): room for T snapshots, kept for later steps
            n, H, Dk, Dv = self.recurrent.shape
            self._states = torch.empty(n, T, H, Dk, Dv, device=self.recurrent.device, dtype=torch.float32)
            self._conv_windows = torch.empty(
                n, self._kernel - 1 + T, self.conv.shape[2], device=self.conv.device, dtype=self.conv.dtype
            )

    def advance(self, T: int) -> None:
        """Mark T more positions as filled (once per forward, after the last layer)."""
        self.length += T
        self.recording = False

    # -- full-attention layers ---------------------------------------------
    def update_kv(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values for positions ``start .. start+T-1`` in ``slot``; return the slot's positions ``0 .. start+T-1``.

        k, v: (1, K, T, D) -> (1, K, start+T, D), views into the cache (no copy).
        """
        end = start + k.shape[2]
        self.k[slot, :, :, start:end] = k
        self.v[slot, :, :, start:end] = v
        return self.k[slot, :, :, :end], self.v[slot, :, :, :end]

    # -- Gated DeltaNet layers ----------------------------------------------
    def conv_state(self, slot: int) -> torch.Tensor:
        """The last W-1 conv inputs of DeltaNet layer ``slot``: (W-1, conv_dim), a view to update in place."""
        return self.conv[slot]

    def recurrent_state(self, slot: int) -> torch.Tensor:
        """The delta-rule memory of DeltaNet layer ``slot``: (Hv, Dk, Dv) float32, a view to update in place."""
        return self.recurrent[slot]

    def remember_conv_window(self, slot: int, window: torch.Tensor) -> None:
        """During a recorded forward, keep the conv inputs it read: (W-1+T, conv_dim)."""
        if self.recording:
            self._conv_windows[slot, : window.shape[0]] = window

    def state_history(self, slot: int) -> torch.Tensor:
        """During a recorded forward, where DeltaNet layer ``slot`` writes its state after each token: (T, Hv, Dk, Dv)."""
        return self._states[slot, : self.record_tokens]

    # -- speculative decoding and the prompt cache ---------------------------
    def can_rollback(self, length: int) -> bool:
        """Whether :meth:`rollback` to ``length`` is possible: the current length, 0, or inside the recorded forward."""
        first, last = self.record_start, self.record_start + self.record_tokens
        return length in (self.length, 0) or (first < length < self.length and last == self.length)

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on; allowed inside the last recorded forward, or back to 0.

        Attention layers: ``length`` drops (stale rows get overwritten later).
        DeltaNet layers: the state after position ``length - 1`` is copied back
        from the snapshots of the recorded forward (or zeroed, for 0).
        """
        if length == self.length:
            return
        first, last = self.record_start, self.record_start + self.record_tokens
        if not self.can_rollback(length):
            raise GenerationError(
                f"cannot roll the cache back from {self.length} to {length} positions: the DeltaNet states can only "
                f"return to a position inside the last multi-token forward of at most {MAX_ROLLBACK_TOKENS} tokens "
                f"on a non-empty cache (positions {first + 1} .. {last})"
            )
        if length == 0:
            self.conv.zero_()
            self.recurrent.zero_()
        else:
            j = length - first - 1  # index, within the recorded forward, of the last token kept
            self.recurrent.copy_(self._states[:, j])
            # conv state after token j = the W-1 window inputs ending at it: window rows j+1 .. j+W-1
            self.conv.copy_(self._conv_windows[:, j + 1 : j + self._kernel])
        self._went_back_to(length)

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A copy of the DeltaNet states at the current length (the attention rows below it stay in place)."""
        return self.length, self.conv.clone(), self.recurrent.clone()

    def restore(self, snapshot: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        """Return to the length and DeltaNet states of ``snapshot``.

        Exact as long as no position below the snapshot's length was rewritten
        since it was taken (the prompt cache drops snapshots above any point it
        goes back to, so that holds).
        """
        length, conv, recurrent = snapshot
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)
        self._went_back_to(length)

    def _went_back_to(self, length: int) -> None:
        self.length = length
        self.record_tokens = 0  # the recorded states are spent: no second rollback into the same forward
        # MTP row p pairs h_p with the token at p+1; the token at `length` is not known yet
        # (a verify step knows it: rollback(start+1+accepted) keeps mtp_length = start).
        self.mtp_length = min(self.mtp_length, max(length - 1, 0))

    # -- the MTP head ---------------------------------------------------------
    def remember_last_forward(self, start: int, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep the main model's token ids (T,) and final-normed hidden states (T, C) of positions ``start ..`` for the MTP head."""
        self.ids[start : start + ids.shape[0]] = ids
        self.hidden[start : start + hidden.shape[0]] = hidden


# -- the batched engine ------------------------------------------------------
class Qwen3_5SequenceStates:
    """One sequence's DeltaNet states in an engine step, under the hybrid cache's names.

    ``conv_state(slot)``: (W-1, conv_dim) float32; ``recurrent_state(slot)``: (Hv, Dk, Dv)
    float32: views of sequence b's rows of the engine's state storage, updated in place.
    The engine keeps one dtype for a layer's states, float32, which the delta rule needs;
    the conv inputs it keeps are values of the model's dtype, so reading them back in that
    dtype is exact. Nothing is recorded (``recording`` is False): no step is rolled back.
    """

    recording = False

    def __init__(self, paged: PagedCache, b: int, linear_layers: list[int]):
        self._paged, self._b, self._layers = paged, b, linear_layers

    def conv_state(self, slot: int) -> torch.Tensor:
        return self._paged.state(self._layers[slot], self._b)["conv"]

    def recurrent_state(self, slot: int) -> torch.Tensor:
        return self._paged.state(self._layers[slot], self._b)["recurrent"]

    def remember_conv_window(self, slot: int, window: torch.Tensor) -> None:
        """Nothing: only a recorded (verify) step keeps its conv inputs, and the engine records none."""


class Qwen3_5EngineCache:
    """An engine step's :class:`lollm.engine.cache.PagedCache` under the hybrid cache's method names.

    ``length`` is the step's :class:`lollm.batch.Batch`. Attention layers call
    ``update_kv`` as they do on :class:`Qwen3_5HybridCache`; DeltaNet layers run each
    sequence of ``sequences()`` on its own states (see the module docstring).
    """

    recording = False

    def __init__(self, paged: PagedCache, config: Qwen3_5Config):
        self.paged = paged
        self.length: Batch = paged.length
        self._full = config.full_attention_layers  # attention K/V slot i -> cache layer index
        self._linear = config.linear_attention_layers  # DeltaNet state slot j -> cache layer index

    def begin(self, T: int) -> None:
        """Check that the forward got the T tokens the engine laid out (room was made by its scheduler)."""
        self.paged.check_room(T)

    def advance(self, T: int) -> None:
        """Nothing: the engine advances each sequence's length after the step."""

    def update_kv(self, slot: int, start: Batch, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys/values into the pool; return the layer's pools.

        k, v: (1, K, N, D) -> (num_blocks, block_size, K, D) each, which attention reads
        through each sequence's block table (``start``, the Batch, says where).
        """
        return self.paged.update(self._full[slot], k, v)

    def sequences(self) -> list[tuple[int, int, Qwen3_5SequenceStates]]:
        """(first row, end row, states) of each sequence of the step: its tokens are rows lo:hi."""
        return [(lo, hi, Qwen3_5SequenceStates(self.paged, b, self._linear))
                for b, (lo, hi) in enumerate(self.length.segments())]

    def remember_last_forward(self, start: Batch, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Nothing: the engine does not draft with the MTP head, so it needs no hidden states."""
