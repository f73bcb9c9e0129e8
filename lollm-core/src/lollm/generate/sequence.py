"""One request's state between two steps: :class:`Sequence` (its cache, sampler, ids so far), and its checks.

The single-sequence loop (:mod:`lollm.generate.loop`) and the batched engine (:mod:`lollm.engine`)
both keep one per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lollm.errors import GenerationError
from lollm.generate.drafting import Drafter
from lollm.generate.memory import check_cache_fits
from lollm.generate.prefill import run_prompt
from lollm.generate.prompt_cache import PromptCache
from lollm.generate.sampling import Sampler, SamplingParams


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
    """One new token, as :func:`generate_steps` yields it.

    token:    the chosen id (an int, ``0 .. model.vocab_size - 1``).
    logprobs: its :class:`TokenLogprobs` when the generation asked for ``logprobs=N``, else None.
    time:     ``time.perf_counter()`` when it was chosen (the first step's: the prefill is done).
    drafted:  speculative decoding: a draft token was judged at this position;
    accepted: and it was this token (the main model confirmed the draft).
    finish:   None while more steps may follow; on the last step the generator will
              yield, why: "max_new_tokens" (the budget is spent) or "context" (the
              cache has no room for the position after this token).
    """

    token: int
    logprobs: TokenLogprobs | None = None
    time: float = 0.0
    drafted: bool = False
    accepted: bool = False
    finish: str | None = None


def check_request(model: Any, prompt_ids: list[int], max_new_tokens: int, prompt_cache: PromptCache | None = None,
                  speculative_tokens: int = 0, drafter: Drafter | None = None) -> int:
    """The context a generation of ``prompt_ids`` runs in (positions); GenerationError when it cannot run.

    Refused: an empty prompt, ``max_new_tokens < 1``, a prompt that fills the
    context (the model's ``max_context``, or the prompt cache's ``max_tokens``), an id
    outside the vocabulary, a cache larger than the device's free memory
    (:func:`lollm.generate.memory.check_cache_fits`), speculative tokens without a draft head,
    a drafter that cannot serve the model (``drafter.check``).
    """
    context = model.max_context if prompt_cache is None else prompt_cache.max_tokens
    if not prompt_ids:
        raise GenerationError("the prompt is empty: there is nothing to continue")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) >= context:
        raise GenerationError(
            f"the prompt has {len(prompt_ids)} tokens, but the {'model' if prompt_cache is None else 'session'}'s "
            f"context is {context}"
        )
    check_prompt_ids(prompt_ids, model.vocab_size)
    if prompt_cache is None:  # a prompt cache checked its own allocation when it made its cache
        extra = drafter.tokens if drafter is not None else max(speculative_tokens, 0)
        check_cache_fits(model, min(len(prompt_ids) + max_new_tokens + extra, context))
    if speculative_tokens > 0 and not getattr(model, "has_draft_head", False):
        raise GenerationError("this model has no draft head (e.g. MTP weights), so it cannot decode speculatively")
    if drafter is not None:
        drafter.check(model)
    return context


class _Sequence:
    """One generation's state between steps: the cache, the sampler, the ids seen, the steps yielded."""

    def __init__(self, model: Any, prompt_ids: list[int], sampling: SamplingParams, logprobs: int | None,
                 budget: int, context: int):
        self.model, self.prompt_ids, self.logprobs = model, list(prompt_ids), logprobs
        self.budget, self.context = budget, context
        self.device = next(model.parameters()).device
        self.sampler = Sampler(sampling)
        self.seen = torch.tensor(prompt_ids, dtype=torch.long)  # for the repetition penalty
        self.new_ids: list[int] = []
        self.cache: Any = None
        self.matcher: Any = None  # a lollm.generate.structured.TokenMatcher when the output is constrained

    def prefill(self, prompt_cache: PromptCache | None, extra: int) -> torch.Tensor:
        """Run the prompt (or the part a prompt cache lacks), in chunks (:mod:`lollm.generate.prefill`); the logits of its last position, (V,)."""
        if prompt_cache is not None:
            self.cache, logits = prompt_cache.prefill(self.prompt_ids, self.device)
            return logits[0, -1]
        # room for the drafts (``extra``) a speculative step writes before it rolls back, never past the context
        self.cache = self.model.new_cache(min(len(self.prompt_ids) + self.budget + extra, self.context))
        # in chunks of lollm.generate.prefill.PREFILL_CHUNK_TOKENS: the activations stay bounded whatever the prompt's length
        return run_prompt(self.model, self.prompt_ids, self.cache, self.device)[0, -1]

    def forward(self, ids: list[int]) -> torch.Tensor:
        """The logits (len(ids), V) of ``ids`` run after what the cache holds."""
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

    def emit(self, step: Step) -> Step:
        """``step`` counted as yielded; on the last one, ``finish`` says why no step follows."""
        self.new_ids.append(step.token)
        if len(self.new_ids) >= self.budget:
            step.finish = "max_new_tokens" if self.cache.length + 1 < self.context else "context"
        return step
