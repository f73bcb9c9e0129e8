"""Drafters: where the guesses of speculative decoding come from.

Speculative decoding splits a decode step in two::

    draft   a cheap guess of the next k tokens            (a Drafter, this module)
    verify  one forward of the main model over 1 + k ids  (lollm.generate.loop._speculative_steps, one path for all)

The verify step keeps only the tokens the main model picks itself (its own sampler,
position by position), so a drafter changes the speed, never the output. A drafter
only has to propose; it is free to be wrong.

Two drafters:

* :class:`MtpDrafter`: the checkpoint's own draft head (Qwen3.5's multi-token
  prediction layer, ``model.draft``); see docs/families/qwen3_5.md.
* :class:`PromptLookupDrafter`: no model at all. The text generated often repeats
  text already seen (code edited and written back, a quoted passage, a list that
  continues a pattern): find the latest earlier place where the last ``n`` tokens
  occurred, in the prompt or the output so far, and propose the tokens that followed
  it there. This is "prompt lookup decoding" (A. Saxena, 2023), also
  ``prompt_lookup_num_tokens`` in transformers and ``examples/lookup`` in llama.cpp
  (which keeps n-gram statistics instead of searching).

A generation receives one drafter (``generate(..., drafter=PromptLookupDrafter(tokens=8))``);
``lollm run --prompt-lookup`` / ``--mtp`` choose one with :func:`drafter_from_flags`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lollm.errors import GenerationError

# Lazy imports below: torch, in PromptLookupDrafter.propose, so that the CLI can name a drafter
# (drafter_from_flags, while it checks its flags) before torch is imported. lollm.model imports torch,
# so its protocols are imported for the annotations only.
if TYPE_CHECKING:
    from lollm.model import Cache, CausalLM, DraftModel


@dataclass(frozen=True)
class Drafter:
    """The contract: ``propose`` at most ``tokens`` guesses of what follows ``history``.

    tokens: the most drafts proposed per step (>= 1); the cache keeps room for them.
    name:   how the statistics line names it ("MTP", "prompt lookup").
    """

    tokens: int = 3
    name = "drafter"

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise GenerationError(f"{self.name}: draft tokens must be an int >= 1, got {self.tokens!r}")

    def check(self, model: CausalLM) -> None:
        """GenerationError when this drafter cannot serve ``model`` (checked before the prefill)."""

    def propose(self, model: CausalLM, cache: Cache, history: list[int], num_tokens: int) -> list[int]:
        """At most ``num_tokens`` token ids guessed to follow ``history`` (a list of ints; fewer, even none, is fine).

        history: the prompt and every token emitted so far; its last id is the pending
                 one (emitted, not yet run, so not yet in ``cache``).
        cache:   the main model's cache, holding ``history[:-1]``; a drafter must leave
                 it as it is (the verify forward writes it next).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class MtpDrafter(Drafter):
    """Drafts with the model's own draft head: ``model.draft(cache, pending, num_tokens)`` (qwen3_5's MTP layer).

    The head keeps its own small cache and must run on every step, so it is asked even
    when ``num_tokens`` is small. GenerationError from :meth:`check` when the model was
    built without the head's weights.
    """

    name = "MTP"

    def check(self, model: CausalLM) -> None:
        if not getattr(model, "has_draft_head", False):
            raise GenerationError("this model has no draft head (e.g. MTP weights), so it cannot decode speculatively")

    def propose(self, model: DraftModel, cache: Cache, history: list[int], num_tokens: int) -> list[int]:
        # a DraftModel: check() refused any other model before the prefill
        return model.draft(cache, history[-1], num_tokens)


@dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    """Drafts by copying: the tokens that followed the latest earlier occurrence of the last n tokens.

    For ``n`` from ``max_ngram`` down to ``min_ngram``: the suffix ``history[-n:]`` is
    searched for in ``history[:-1]`` (the prompt and the output so far); at the latest
    place it occurs, the (at most ``num_tokens``) tokens after it are the drafts. The
    longest n-gram that matches wins (fewer, better guesses); no match, no drafts (the
    step is then a plain decode step). Matching is exact on token ids.
    """

    max_ngram: int = 3
    min_ngram: int = 2
    name = "prompt lookup"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise GenerationError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, model: CausalLM, cache: Cache, history: list[int], num_tokens: int) -> list[int]:
        import torch

        if num_tokens < 1:
            return []
        ids = torch.tensor(history, dtype=torch.long)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            # window i is ids[i : i + n], for every i whose window ends before the last id
            windows = ids[:-1].unfold(0, n, 1)  # (L - n, n)
            hits = (windows == ids[-n:]).all(dim=1).nonzero()
            if hits.numel():
                after = int(hits[-1]) + n  # the latest occurrence; what followed it
                return history[after : after + num_tokens]
        return []


def drafter_from_flags(*, mtp: bool, prompt_lookup: bool, draft_tokens: int) -> Drafter | None:
    """The drafter ``lollm run --mtp`` / ``--prompt-lookup`` ask for, with ``--draft-tokens``; None for neither.

    GenerationError when both are asked for (one drafter per generation) or for
    ``draft_tokens < 1``.
    """
    if mtp and prompt_lookup:
        raise GenerationError("--mtp and --prompt-lookup are two drafters; choose one")
    if mtp:
        return MtpDrafter(tokens=draft_tokens)
    if prompt_lookup:
        return PromptLookupDrafter(tokens=draft_tokens)
    return None
