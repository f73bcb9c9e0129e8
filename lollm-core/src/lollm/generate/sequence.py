"""One request's state between two steps: :class:`Sequence`, its check, and why a generation stops.

The single-sequence loop (:mod:`lollm.generate.loop`) keeps one :class:`Sequence` for its request;
the batched engine (:mod:`lollm.engine`) keeps one per request it runs. A sequence does the three
things a step needs, whoever steps it::

    seq.forward(ids) ─► logits (T, V)      one forward over its own cache (the loop; the engine
                                           runs one forward for every sequence of a batch instead)
    seq.choose(row)  ─► Step               its sampler, its grammar mask, its log-probabilities
    seq.check(step)  ─► Step.finish        why it stops here, or None: a StopReason

:func:`check_request` is the one check of a request before it starts (the loop, the engine, the
prompt cache and ``lollm.LLM`` all call it), so an empty prompt reads the same everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

import torch

from lollm.errors import GenerationError
from lollm.generate.prefill import run_prompt
from lollm.generate.sampling import Sampler
from lollm.generate.structured import CompiledConstraint, TokenMatcher
from lollm.model import Cache, CausalLM
from lollm.sampling_params import SamplingParams


class StopReason:
    """Why a generation stopped: one name per stop condition, the strings results and reports carry.

    EOS:            an end-of-sequence id was chosen (it is in the ids, not in the text).
    STOP_STRING:    the text reached a stop string (the text ends just before it).
    MAX_NEW_TOKENS: the token budget is spent.
    CONTEXT:        the context has no room for the position after the last token.
    CANCELLED:      the caller stopped it (a client that went away, Ctrl-C, an abort).
    """

    EOS: Final = "eos"
    STOP_STRING: Final = "stop_string"
    MAX_NEW_TOKENS: Final = "max_new_tokens"
    CONTEXT: Final = "context"
    CANCELLED: Final = "cancelled"


#: The one message for an empty prompt (the CLI's own flag checks say which flag was empty).
EMPTY_PROMPT = "the prompt is empty: there is nothing to continue"


@dataclass
class TokenLogprobs:
    """The model's log-probabilities at one generated position (natural log, float).

    token / logprob: the chosen id and its log-probability;
    top: the ``n`` most likely ids with theirs, most likely first.
    They come from the model's own distribution (``log_softmax`` of the logits),
    before the repetition penalty, temperature and filters reshape it for sampling.
    """

    token: int
    logprob: float
    top: list[tuple[int, float]]


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """GenerationError unless every id is a row of the model's embedding (``0 .. vocab_size - 1``).

    A tokenizer that does not belong to the model (or a tokenizer file that names ids past
    the embedding) would otherwise fail deep inside the embedding lookup.
    """
    bad = next((i for i in prompt_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size), None)
    if bad is not None:
        raise GenerationError(
            f"the prompt holds the token id {bad!r}, but the model's vocabulary has ids 0 .. {vocab_size - 1}; "
            f"does the tokenizer belong to this model?"
        )


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """Log-probabilities of ``token`` and of the ``top`` most likely ids under ``logits`` ((V,), any float dtype)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, min(top, logp.numel())) if top > 0 else None
    pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprobs(token, float(logp[token]), pairs)


@dataclass
class Step:
    """One new token, as :meth:`Sequence.choose` makes it (and :func:`lollm.generate.loop.generate_steps` yields it).

    token:    the chosen id (an int, ``0 .. model.vocab_size - 1``).
    logprobs: its :class:`TokenLogprobs` when the generation asked for ``logprobs=N``, else None.
    time:     ``time.perf_counter()`` when it was chosen (the first step's: the prefill is done).
    drafted:  speculative decoding: a draft token was judged at this position;
    accepted: and it was this token (the main model confirmed the draft).
    finish:   None while more steps may follow; on the last step, why no step follows
              (a :class:`StopReason`: MAX_NEW_TOKENS, CONTEXT, or EOS for a sequence that
              was given ``stop_ids``, as the engine's are).
    """

    token: int
    logprobs: TokenLogprobs | None = None
    time: float = 0.0
    drafted: bool = False
    accepted: bool = False
    finish: str | None = None


def check_max_new_tokens(max_new_tokens: object) -> int:
    """``max_new_tokens`` as given, or GenerationError unless it is a whole number >= 1."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    return max_new_tokens


def check_request(model: CausalLM, prompt_ids: list[int], max_new_tokens: int | None = None, *,
                  context: int | None = None, holder: str = "model",
                  constraint: CompiledConstraint | None = None) -> int:
    """The token budget of a request, ``min(max_new_tokens, context - len(prompt_ids))``; GenerationError when it cannot run.

    context:        positions the request may use (None: the model's ``max_context``);
    holder:         whose context that is, for the message ("model", or "session" for a prompt cache);
    max_new_tokens: None for a prompt alone (the prompt cache's prefill): the budget is then what the
                    context leaves.
    constraint:     a compiled constraint the output follows: it must be compiled for this vocabulary.

    Refused, in this order: an empty prompt (:data:`EMPTY_PROMPT`), ``max_new_tokens`` that is not a
    whole number >= 1, a prompt that fills the context, an id outside the vocabulary
    (:func:`check_prompt_ids`), a constraint compiled for another vocabulary.
    """
    context = model.max_context if context is None else context
    if not prompt_ids:
        raise GenerationError(EMPTY_PROMPT)
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens)
    if len(prompt_ids) >= context:
        raise GenerationError(f"the prompt has {len(prompt_ids)} tokens, but the {holder}'s context is {context}")
    check_prompt_ids(prompt_ids, model.vocab_size)
    if constraint is not None and constraint.vocab_size != model.vocab_size:
        raise GenerationError(f"the constraint was compiled for {constraint.vocab_size} ids, the model has {model.vocab_size}")
    room = context - len(prompt_ids)
    return room if max_new_tokens is None else min(max_new_tokens, room)


class Sequence:
    """One request's state between two steps: its cache, sampler, grammar matcher, the ids so far.

    model:      the family's model (:class:`lollm.model.CausalLM`).
    prompt_ids: the prompt, a list of ints (checked by :func:`check_request` first).
    sampling:   its :class:`SamplingParams` (one :class:`Sampler` per sequence: a seeded request draws
                from its own generator, so it samples alike alone and in a batch).
    budget:     the most tokens it generates (:func:`check_request`'s answer);
    context:    the positions it may use (prompt + answer).
    logprobs:   N: each step carries its :class:`TokenLogprobs` with N alternatives (None: none).
    constraint: the output follows it (a fresh :class:`TokenMatcher` per sequence).
    stop_ids:   ids that end it (the engine's end-of-sequence ids; the loop leaves them to
                :func:`lollm.generate.loop.stream_text`, which also flushes the text).
    images:     the prompt's :class:`lollm.vision.spec.ImageBatch` (docs/vision.md), passed to the
                prefill's forwards; None for text.

    ``cache`` is the loop's own cache (:meth:`prefill` makes it, or a prompt cache hands one over);
    the engine keeps a sequence's keys in its pool instead and never sets it.
    """

    def __init__(self, model: CausalLM, prompt_ids: list[int], sampling: SamplingParams, *, budget: int, context: int,
                 logprobs: int | None = None, constraint: CompiledConstraint | None = None,
                 stop_ids: frozenset[int] = frozenset(), images: Any = None):
        self.model, self.prompt_ids, self.logprobs, self.images = model, list(prompt_ids), logprobs, images
        self.budget, self.context, self.stop_ids = budget, context, frozenset(stop_ids)
        self.device = next(model.parameters()).device
        self.sampler = Sampler(sampling)
        self.seen = torch.tensor(prompt_ids, dtype=torch.long)  # for the repetition penalty
        self.new_ids: list[int] = []
        self.cache: Cache | None = None
        self.matcher: TokenMatcher | None = constraint.matcher() if constraint is not None else None

    def prefill(self, extra: int) -> torch.Tensor:
        """Make its own cache and run the prompt, in chunks (:mod:`lollm.generate.prefill`); the logits of its last position, (V,).

        ``extra``: room for the drafts a speculative step writes before it rolls back (never past the context).
        """
        self.cache = self.model.new_cache(min(len(self.prompt_ids) + self.budget + extra, self.context))
        # in chunks of lollm.generate.prefill.PREFILL_CHUNK_TOKENS: the activations stay bounded whatever the prompt's length
        return run_prompt(self.model, self.prompt_ids, self.cache, self.device, self.images)[0, -1]

    def forward(self, ids: list[int]) -> torch.Tensor:
        """One step: the logits (len(ids), V) of ``ids`` run after what its cache holds."""
        return self.model(torch.tensor([ids], dtype=torch.long, device=self.device), self.cache)[0]

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to apply (no penalty, constraint or logprobs): the pick is the argmax,
        which the batched engine takes for many rows at once."""
        p = self.sampler.params
        return p.greedy and p.repetition_penalty == 1.0 and self.matcher is None and self.logprobs is None

    def choose(self, logits_row: torch.Tensor, *, drafted: bool = False, pick: int | None = None) -> Step:
        """The sampler's choice from ``logits_row`` (V,), with its log-probabilities when asked.

        With a constraint, the pick is among the ids its matcher allows, and the matcher
        advances by it: call this only for a token that will be emitted (speculative
        decoding does: a draft is emitted only when it equals this pick). ``pick``: the
        token already chosen (the engine's batched argmax for a :attr:`plain_greedy` row).
        """
        allowed = self.matcher.allowed() if self.matcher is not None else None
        token = pick if pick is not None else self.sampler(logits_row, self.seen, allowed)
        if self.matcher is not None:
            self.matcher.accept(token)
        self.seen = torch.cat([self.seen, torch.tensor([token])])
        lp = token_logprobs(logits_row, token, self.logprobs) if self.logprobs is not None else None
        return Step(token, lp, time.perf_counter(), drafted=drafted)

    def check(self, step: Step) -> Step:
        """Count ``step`` as emitted; when no step may follow, ``step.finish`` says why (a :class:`StopReason`).

        EOS for an id of ``stop_ids``; else, once the budget is spent, MAX_NEW_TOKENS, or CONTEXT when
        the context has no room for the position after this token.
        """
        self.new_ids.append(step.token)
        if step.token in self.stop_ids:
            step.finish = StopReason.EOS
        elif len(self.new_ids) >= self.budget:
            fits = len(self.prompt_ids) + len(self.new_ids) < self.context
            step.finish = StopReason.MAX_NEW_TOKENS if fits else StopReason.CONTEXT
        return step
