"""The prompt cache: keep a conversation's cache between generations and reuse what the next prompt shares.

A chat client sends the whole conversation again at every turn. Without a
prompt cache each turn prefills all of it; with one, the cache still holds
what the previous turn computed, and only the new part runs::

    turn 1 prompt   [system, user 1, assistant header]
    the cache then  [system, user 1, assistant header, answer 1 ..]
    turn 2 prompt   [system, user 1, assistant header, answer 1, end, user 2, assistant header]
                     \\________________ reused ______________/  \\_____ prefilled ______/

How far back a cache can go is the family's business (:class:`lollm.model.Cache`):
a full KV cache can return to any length, a sliding-window ring only a step
once it has wrapped, and a recurrent state (Qwen3.5's DeltaNet) not at all.
Those caches offer snapshots instead: copies of their small state at one
length. This module decides, for each new prompt (:meth:`PromptCache.prefill`):

1. ``common``: the longest common prefix of the ids the cache holds and the
   new prompt, at most ``len(prompt) - 1`` (the last prompt token always runs:
   its logits choose the first new token);
2. the cache is exactly at ``common``: keep it (a conversation that grew);
3. else, if the cache can roll back to ``common``: roll back;
4. else, the newest snapshot at or before ``common``: restore it;
5. else start from an empty cache (a full prefill).

It never reuses a state it cannot prove right: a generation that did not
finish (an exception, Ctrl-C in the middle of a forward) leaves the cache
marked unknown, and only snapshots (whose positions nothing has rewritten)
or a fresh start are used after it.

Snapshots are taken, from caches that offer them, at two points of each
turn: just before the prompt's last token (so that the same prompt, or one
that continues it, finds a state to resume from) and at the end of the
generation. The newest ``max_snapshots`` are kept; any above a point the
cache goes back to are dropped (their positions are about to be rewritten).

Capacity: the cache is allocated once, for ``max_tokens`` positions (the
session's context, ``--ctx-size``), and kept; a conversation that outgrows it
is an error naming the context, like a prompt longer than the model's. The
memory is the family's per-position cost times ``max_tokens`` (Qwen2.5-0.5B in
float32: 24 KiB per position, 96 MiB for 4096) plus the snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lollm.errors import GenerationError
from lollm.generate.memory import check_cache_fits
from lollm.generate.prefill import run_prompt
from lollm.generate.sequence import check_request
from lollm.model import Cache, CausalLM


@dataclass
class CacheReuse:
    """What the prompt cache did for one prompt.

    prompt_tokens: the prompt's length.
    reused:        positions taken from the cache (not run again).
    prefilled:     positions run through the model (``prompt_tokens - reused``).
    how:           "extend" (the cache held a prefix as it was), "rollback", "snapshot", or "cold".
    """

    prompt_tokens: int
    reused: int
    prefilled: int
    how: str


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """One model's cache kept across generations, the ids it holds, and snapshots of its state.

    model:         a :class:`lollm.model.CausalLM`.
    max_tokens:    capacity in positions (default and upper bound: ``model.max_context``; at least 2,
                   GenerationError below).
    max_snapshots: how many snapshots to keep at most (0: none; then a cache that cannot
                   roll back is reused only when the new prompt continues it as it is).

    Attributes: ``cache`` (the family's cache, or None before the first prompt),
    ``ids`` (the token ids of positions ``0 .. len(ids)-1``), ``snapshots``
    (``(length, state)`` pairs, oldest first), ``last`` (the :class:`CacheReuse`
    of the newest prompt).
    """

    def __init__(self, model: CausalLM, max_tokens: int | None = None, *, max_snapshots: int = 4):
        if max_tokens is not None and max_tokens < 2:
            raise GenerationError(f"the prompt cache needs room for at least 2 positions, got {max_tokens}")
        self.model = model
        self.max_tokens = min(max_tokens or model.max_context, model.max_context)
        self.max_snapshots = max_snapshots
        self.cache: Cache | None = None
        self.ids: list[int] = []
        self.snapshots: list[tuple[int, object]] = []  # (length, what cache.snapshot() returned)
        self.last: CacheReuse | None = None
        # False from the start of a prefill until finish(): if the generation dies in
        # between, the cache's state is unknown and only snapshots may be reused.
        self._consistent = True

    def reset(self) -> None:
        """Forget the conversation (the memory is given back; the next prompt starts cold)."""
        self.cache = None
        self.ids = []
        self.snapshots = []
        self._consistent = True

    def prefill(self, prompt_ids: list[int], device: torch.device) -> tuple[Cache, torch.Tensor]:
        """Make the cache hold ``prompt_ids``, running only what it does not hold yet.

        ``device``: the model's, where the ids go. Returns the cache and the logits of the
        prompt's last position, (1, 1, vocab) float; ``self.last`` says how much was reused.
        Raises GenerationError for an empty prompt, one that fills ``max_tokens`` or holds an id outside
        the vocabulary (:func:`lollm.generate.sequence.check_request`), or a new cache that does not
        fit the device's free memory (:func:`lollm.generate.memory.check_cache_fits`).
        """
        check_request(self.model, prompt_ids, context=self.max_tokens, holder="session")
        reused, how = self._go_back_to(common_prefix_length(self.ids, prompt_ids[:-1]))
        cache = self.cache
        self.snapshots = [(n, s) for n, s in self.snapshots if n <= reused]
        self.ids = list(prompt_ids[:reused])
        self._consistent = False

        # Run the rest. A cache that keeps snapshots gets one just before the last token,
        # where the same prompt (or one that continues it) can resume.
        rest = prompt_ids[reused:]
        if self.max_snapshots and hasattr(cache, "snapshot") and len(rest) > 1:
            run_prompt(self.model, rest[:-1], cache, device)
            self.ids = list(prompt_ids[:-1])
            self._take_snapshot()
            rest = rest[-1:]
        logits = run_prompt(self.model, rest, cache, device)  # in chunks (lollm.generate.prefill)
        self.last = CacheReuse(len(prompt_ids), reused, len(prompt_ids) - reused, how)
        return cache, logits

    def finish(self, ids: list[int]) -> None:
        """Record what the cache holds after a generation: ``ids`` is the prompt plus every generated id.

        The last generated id was never run (nothing needed its logits), and a
        speculative step may have left unconfirmed drafts beyond it: the cache
        holds the first ``cache.length`` positions of that sequence at most.
        """
        cache = self.cache
        known = min(cache.length, len(ids))
        if cache.length > known and _can_rollback(cache, known):
            cache.rollback(known)  # drafts that were never emitted
        self.ids = list(ids[:known])
        self._consistent = True
        if cache.length == known:
            self._take_snapshot()

    # -- the decision ------------------------------------------------------------
    def _go_back_to(self, common: int) -> tuple[int, str]:
        """Bring the cache to the longest reusable prefix of at most ``common`` positions; return (length, how)."""
        cache = self.cache
        if cache is not None and self._consistent:
            if cache.length == common == len(self.ids) and common > 0:
                return common, "extend"
            if common > 0 and common <= len(self.ids) and _can_rollback(cache, common):
                cache.rollback(common)
                return common, "rollback"
        usable = [(n, s) for n, s in self.snapshots if 0 < n <= common]
        if cache is not None and usable:
            n, state = usable[-1]
            cache.restore(state)
            return n, "snapshot"
        # a fresh start: an empty cache (rolled back to 0 where the family allows it, else a new one)
        if cache is not None and self._consistent and _can_rollback(cache, 0):
            cache.rollback(0)
        else:
            self.cache = None  # give the old memory back before allocating the new
            check_cache_fits(self.model, self.max_tokens)
            self.cache = self.model.new_cache(self.max_tokens)
        self.snapshots = []
        return 0, "cold"

    def _take_snapshot(self) -> None:
        """Keep a snapshot at the cache's current length (caches that offer them), the newest ``max_snapshots``."""
        cache = self.cache
        if not self.max_snapshots or not hasattr(cache, "snapshot"):
            return
        if self.snapshots and self.snapshots[-1][0] >= cache.length:
            return  # one at this length (or later) already
        self.snapshots.append((cache.length, cache.snapshot()))
        del self.snapshots[: -self.max_snapshots]


def _can_rollback(cache: Cache, length: int) -> bool:
    """A cache that does not say it can roll back, cannot (except to where it already is)."""
    if length == cache.length:
        return True
    can = getattr(cache, "can_rollback", None)
    return bool(can is not None and can(length))
