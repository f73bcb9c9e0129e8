"""What the shared generate loop expects of a family's model.

This is documentation in code: :class:`CausalLM` is a ``typing.Protocol``, so
a family's ``nn.Module`` satisfies it by having the attributes and methods
below, without inheriting from anything in core.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Cache(Protocol):
    """A family's decoding cache (KV cache, recurrent state …), preallocated for ``max_tokens``.

    ``length`` is the number of positions already stored; the model's forward
    writes the new positions and advances it.

    The prompt cache (:mod:`lollm.generate.prompt_cache`) keeps one cache alive between
    generations and reuses the part of it that the next prompt shares. What a
    cache can offer for that is said by three optional methods; core decides
    with them and never guesses:

    * ``can_rollback(length)`` / ``rollback(length)``: forget the positions from
      ``length`` on. A full KV cache can go back to any length; a sliding-window
      ring only as far as it still holds the keys the next queries need; a
      recurrent state (DeltaNet, Mamba) cannot go back at all, except inside the
      short forward it recorded for speculative decoding. A cache without
      ``can_rollback`` is treated as one that cannot roll back.
    * ``snapshot()`` / ``restore(snapshot)``: copy the part of the state that a
      rollback cannot recover (recurrent states, sliding-window rings) at the
      current length, and bring it back later, setting ``length`` to the
      snapshot's. Core takes snapshots only from caches that have the method,
      and restores one only while every position before it is unchanged (the
      positions below a snapshot are never rewritten while core keeps it).
    """

    length: int
    max_tokens: int

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding, the prompt cache; optional otherwise)."""

    def can_rollback(self, length: int) -> bool:
        """Whether :meth:`rollback` to ``length`` would leave the cache exact (optional)."""

    def undoable_tokens(self) -> int:
        """The most positions the next forward may write such that :meth:`rollback` to any length after the
        current one stays exact (optional; speculative decoding sizes its drafts by it, none: no limit)."""

    def snapshot(self) -> Any:
        """A copy of what a rollback cannot recover, at the current ``length`` (optional)."""

    def restore(self, snapshot: Any) -> None:
        """Return to the state of ``snapshot``: its tensors and its length (optional)."""


class CausalLM(Protocol):
    """A decoder-only language model as the loop, the parity gate and the benchmark use it.

    Attributes:
      vocab_size:   size of the logits' last dimension.
      max_context:  the longest sequence the model supports (config ``max_position_embeddings``).
      num_layers:   number of decoder layers (for the parity report).
      eos_token_ids: end-of-sequence ids named in config.json (may be empty).

    Optional, for the batched engine (:mod:`lollm.engine`; the seam is :mod:`lollm.batch`):
      cache_layers(): what each cache layer holds. A model without it runs in the
                      single-sequence loop only; the engine refuses it, saying so.
    """

    vocab_size: int
    max_context: int
    num_layers: int
    eos_token_ids: tuple[int, ...]

    def new_cache(self, max_tokens: int) -> Cache:
        """A fresh, empty cache able to hold ``max_tokens`` positions (batch 1)."""

    def cache_layers(self) -> list[Any]:
        """Optional: one :class:`lollm.batch.CacheLayer` per layer of the cache, in the order
        ``cache.update(layer, ...)`` numbers them: its kind (full, sliding, shared, recurrent), the
        K heads and width D it stores, a window, a recurrent state's shapes. The engine sizes its
        KV pool and state slots from it; a model without it cannot run in :class:`lollm.engine.Engine`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        hidden_states: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the decoder on ``input_ids`` and return logits.

        input_ids:      (1, T) int64 token ids; positions start at ``cache.length``
                        (0 without a cache).
        cache:          updated in place with the T new positions (``None``: no cache,
                        positions 0..T-1, used by the parity gate). In an engine step it is
                        a :class:`lollm.engine.cache.PagedCache`: the T tokens are those of
                        several sequences end to end, ``cache.length`` is a
                        :class:`lollm.batch.Batch` (each sequence's start and positions),
                        ``update(layer, k, v)`` returns the layer's KV pool, ``check_room``
                        checks T against the layout and ``advance`` does nothing (the engine
                        advances each sequence after the step). A family reads positions
                        with :func:`lollm.batch.token_positions` and passes the start to
                        :func:`lollm.attention.attend` unchanged, so both cases are one code path.
        logits_to_keep: 0 for logits of every position, N for the last N only
                        (prefill needs only the last one), or a (R,) int64 tensor of row
                        indices (an engine step keeps the last token of each sequence;
                        :func:`lollm.batch.keep_logit_rows` handles all three).
        hidden_states:  when a list is given, the model appends (1, T, hidden) tensors
                        in transformers' ``output_hidden_states`` order: the embeddings,
                        the output of each layer but the last, and the final-normed
                        output of the last layer (so the parity gate can name the first
                        diverging layer).
        Returns (1, T or logits_to_keep or R, vocab_size) float logits.
        """

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


class VisionLM(CausalLM, Protocol):
    """A decoder that reads images (plugin contract 3: vision; docs/vision.md).

    Its family declares ``Capabilities(vision=True)`` and a ``Family.vision`` loader that returns the
    :class:`lollm.vision.spec.VisionTower`; the decoder itself takes one more keyword:

    ``forward(input_ids, cache, *, images=None, ...)``

    images: a :class:`lollm.vision.spec.ImageBatch` (the sequence's images, each with its (n, C)
            embeddings already projected to the decoder's width, its start position and pixel hash),
            or None for text. The family embeds ``input_ids`` (the image positions hold the placeholder
            id), then calls :func:`lollm.vision.prompt.scatter_images` to put each image's rows in place,
            then applies its own rule for image positions: Gemma 3 lets the tokens of one image attend
            to each other in both directions; Qwen3.5 gives them M-RoPE positions from ``grid``.
            An image's positions must all fall in one forward (a prefill chunk never cuts one);
            decode steps pass ``images=None``.

    ``batches_images = True`` (a class attribute) says the forward also takes images in an engine step:
    ``images`` is then a list with one ImageBatch or None per sequence of the step's Batch
    (:mod:`lollm.vision.step` has the helpers). Without it the engine refuses image requests.
    """

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        hidden_states: list[torch.Tensor] | None = None,
        images: Any = None,
    ) -> torch.Tensor: ...


class LensModel(CausalLM, Protocol):
    """A model that ``lollm trace`` can read layer by layer (optional: a family without it gets no logit lens).

    What a trace takes from a model (see docs/trace.md):

    * the hidden states, through ``forward(..., hidden_states=[])`` (the contract above);
    * the attention probabilities: nothing to add, a family whose attention calls
      :func:`lollm.attention.attend` is recorded by :func:`lollm.trace.attention.recording`;
    * its own internals, if it wants: ``lollm.trace.record_series / record_choice /
      record_softcap`` called from its forward (no-ops outside a trace);
    * the logit lens, through this method.
    """

    def logit_lens(self, hidden: torch.Tensor, *, normed: bool = False) -> torch.Tensor:
        """What the output would be if the decoder stopped at ``hidden``: (1, T, C) -> (1, T, vocab) float logits.

        ``hidden`` is one entry of ``hidden_states`` (a residual stream). The final norm is
        applied unless ``normed`` (the last entry of ``hidden_states`` is already normed),
        then the output head and every transform forward applies after it (a final-logit
        soft-cap), so that the lens of the last entry equals forward's own logits (the
        trace tests hold the two against each other).
        """


class DraftModel(CausalLM, Protocol):
    """A model with a draft head for self-speculative decoding (e.g. Qwen3.5's MTP head).

    has_draft_head: True when the checkpoint carried the head's weights.

    ``draft(cache, pending, num_tokens)`` proposes ``num_tokens`` greedy tokens
    that follow ``pending`` (the newest token, not yet written to the cache),
    using whatever the last forward left in the cache (e.g. the final hidden
    state). It must not change what the main model's cache holds for positions
    ``< cache.length``. The loop then verifies ``[pending, *drafts]`` with one
    ordinary forward and calls ``cache.rollback(length)`` to drop the rejected
    positions, so the cache must be able to forget the positions written by
    its most recent forward.
    """

    has_draft_head: bool

    def draft(self, cache: Cache, pending: int, num_tokens: int) -> list[int]: ...
