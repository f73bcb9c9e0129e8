"""The one generate loop every family shares.

::

    prompt ids ─► prefill (all prompt positions in one forward, fills the cache)
               ─► sample ─► decode (one position per forward, reads the cache) ─► sample ─► …
               ─► stop: an end-of-sequence id, a stop string, max_new_tokens, or the context is full

A family provides only ``model.forward(ids, cache)`` and ``model.new_cache``
(see :mod:`lollm.model`); it never writes its own loop. With a
:class:`~lollm.prompt_cache.PromptCache` the cache outlives the call, and the
prefill runs only the part of the prompt the cache does not hold yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from lollm.attention import use_backend
from lollm.checks import ConfigReader
from lollm.errors import GenerationError
from lollm.memory import check_cache_fits
from lollm.prompt_cache import PromptCache
from lollm.sampling import Sampler, SamplingParams


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


@dataclass
class GenerationResult:
    """What a generation produced and how long it took.

    prompt_ids / new_ids: token ids of the prompt and of the generated tokens
    (the end-of-sequence id, when it stopped the loop, is included in new_ids).
    text: the generated text (up to a stop string, not including it).
    stop_reason: "eos", "stop_string", "max_new_tokens", "context" or "cancelled".
    prefill_seconds: the prompt's forward plus the first sample;
    decode_seconds: every later step.
    reused_tokens: prompt positions a prompt cache already held (not prefilled again).
    logprobs: with ``logprobs=N``, one :class:`TokenLogprobs` per id of new_ids.
    """

    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "max_new_tokens"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    drafted: int = 0  # speculative decoding: draft tokens proposed
    accepted: int = 0  # and how many of them the main model confirmed
    reused_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        prefilled = len(self.prompt_ids) - self.reused_tokens
        return prefilled / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(len(self.new_ids) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


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


def stop_token_ids(generation_config: dict, config: dict, tokenizer: Any = None) -> set[int]:
    """End-of-sequence ids from generation_config.json, config.json and the tokenizer, together.

    Each file's ``eos_token_id`` is one id or a list of ids (ConfigError naming the file otherwise).
    """
    ids = set(ConfigReader(generation_config, "generation_config.json").token_ids("eos_token_id"))
    ids |= set(ConfigReader(config, "config.json").token_ids("eos_token_id"))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class _StopStringWatcher:
    """Holds back just enough streamed text to never print the start of a stop string."""

    def __init__(self, stop_strings: Iterable[str]):
        self.stops = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything decoded so far
        self.emitted = 0  # how many characters of it were handed out

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit now, whether a stop string was hit)."""
        self.text += piece
        # the stop string that starts first wins, whatever its place in the list
        hits = [at for stop in self.stops if (at := self.text.find(stop, max(0, self.emitted - len(stop)))) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out, True
        safe_end = max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : safe_end]
        self.emitted = safe_end
        return out, False

    def finish(self, tail: str) -> str:
        out, _ = self.feed(tail)
        rest = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out + rest


@torch.inference_mode()
def generate(
    model: Any,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    stop_strings: Iterable[str] = (),
    tokenizer: Any = None,
    on_text: Callable[[str], None] | None = None,
    speculative_tokens: int = 0,
    prompt_cache: PromptCache | None = None,
    logprobs: int | None = None,
    on_token: Callable[[int, TokenLogprobs | None], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    attn: str | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    ``tokenizer`` (with ``stream_decoder()``) is needed for text output and stop
    strings; without it only ids are produced. ``on_text`` receives each piece
    of text as soon as it is safe to print (whole UTF-8 characters, never the
    beginning of a stop string). The model runs on its own device; ids are
    moved there.

    ``speculative_tokens > 0`` turns on self-speculative decoding with the
    model's draft head (see :func:`_speculative_steps`); the output is exactly
    the same as without it.

    ``prompt_cache`` keeps the cache between calls (see :mod:`lollm.prompt_cache`):
    the context is then its ``max_tokens``. ``logprobs=N`` records the
    log-probability of each new token and of the N most likely ones
    (``result.logprobs``); ``on_token(id, logprobs or None)`` is called for each new
    token as it is chosen (a caller interrupted by Ctrl-C still knows what was
    generated); ``should_stop()`` is asked before each further step, and True ends the
    generation with stop reason "cancelled" (a client that went away, Ctrl-C).
    ``attn`` names the attention backend to run with (:mod:`lollm.attention`; None:
    the current one).
    Raises GenerationError for an empty prompt, a non-positive
    ``max_new_tokens``, a prompt that does not fit the context, a prompt id outside
    the model's vocabulary, or a cache larger than the device's free memory
    (:func:`lollm.memory.check_cache_fits`); AttentionBackendError for an unknown or
    unusable backend.
    """
    if attn is not None:
        with use_backend(attn):
            return generate(model, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                            stop_strings=stop_strings, tokenizer=tokenizer, on_text=on_text,
                            speculative_tokens=speculative_tokens, prompt_cache=prompt_cache, logprobs=logprobs,
                            on_token=on_token, should_stop=should_stop)
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
    stop_strings = list(stop_strings)
    if stop_strings and tokenizer is None:
        raise GenerationError("stop strings need a tokenizer to decode the generated text")
    check_prompt_ids(prompt_ids, model.vocab_size)
    if prompt_cache is None:  # a prompt cache checked its own allocation when it made its cache
        check_cache_fits(model, min(len(prompt_ids) + max_new_tokens + max(speculative_tokens, 0), context))
    max_new_tokens = min(max_new_tokens, context - len(prompt_ids))
    device = next(model.parameters()).device
    result = GenerationResult(prompt_ids=list(prompt_ids))
    sampler = Sampler(sampling)
    decoder = tokenizer.stream_decoder(skip_special_tokens=True) if tokenizer is not None else None
    watcher = _StopStringWatcher(stop_strings)
    history = torch.tensor(prompt_ids, dtype=torch.long)  # for the repetition penalty

    def pick(logits_row: torch.Tensor, seen: torch.Tensor) -> int:
        """The sampler's choice, with the model's log-probabilities recorded when asked."""
        token = sampler(logits_row, seen)
        if logprobs is not None:
            result.logprobs.append(token_logprobs(logits_row, token, logprobs))
        return token

    def emit(piece: str) -> None:
        if piece:
            result.text += piece
            if on_text is not None:
                on_text(piece)

    # 1. Prefill: the whole prompt in one forward; only the last position's logits are needed.
    #    A prompt cache runs only the part of the prompt it does not hold yet.
    start = time.perf_counter()
    if prompt_cache is None:
        # room for the drafts a speculative step writes before it rolls back, never past the context
        cache = model.new_cache(min(len(prompt_ids) + max_new_tokens + max(speculative_tokens, 0), context))
        logits = model(torch.tensor([prompt_ids], dtype=torch.long, device=device), cache, logits_to_keep=1)
    else:
        cache, logits = prompt_cache.prefill(prompt_ids, device)
        result.reused_tokens = prompt_cache.last.reused
    next_id = pick(logits[0, -1], history)
    result.prefill_seconds = time.perf_counter() - start

    # 2. Decode: feed back one token at a time until a stop condition.
    #    With a draft head, each step may yield several tokens (draft, then verify).
    start = time.perf_counter()
    if speculative_tokens > 0:
        if not getattr(model, "has_draft_head", False):
            raise GenerationError("this model has no draft head (e.g. MTP weights), so it cannot decode speculatively")
        steps = _speculative_steps(model, cache, pick, next_id, history, speculative_tokens, result, device)
    else:
        steps = None
    while True:
        if steps is not None:
            next_id = next(steps)
        result.new_ids.append(next_id)
        if on_token is not None:
            on_token(next_id, result.logprobs[-1] if logprobs is not None else None)
        history = torch.cat([history, torch.tensor([next_id])])
        if next_id in stop_ids:
            result.stop_reason = "eos"
            break
        if decoder is not None:
            piece, hit = watcher.feed(decoder.push(next_id))
            emit(piece)
            if hit:
                result.stop_reason = "stop_string"
                break
        if len(result.new_ids) >= max_new_tokens:
            result.stop_reason = "max_new_tokens" if cache.length + 1 < context else "context"
            break
        if should_stop is not None and should_stop():
            result.stop_reason = "cancelled"
            break
        if steps is None:
            logits = model(torch.tensor([[next_id]], dtype=torch.long, device=device), cache)
            next_id = pick(logits[0, -1], history)
    result.decode_seconds = time.perf_counter() - start

    if steps is not None:
        steps.close()
    # 3. Whatever text the stream decoder and the stop-string watcher still hold.
    if decoder is not None and result.stop_reason != "stop_string":
        emit(watcher.finish(decoder.flush()))
    # 4. A prompt cache records what its cache now holds, for the next prompt.
    if prompt_cache is not None:
        prompt_cache.finish(result.prompt_ids + result.new_ids)
    return result


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """Log-probabilities of ``token`` and of the ``top`` most likely ids under ``logits`` ((V,), any float dtype)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, min(top, logp.numel())) if top > 0 else None
    pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprobs(token, float(logp[token]), pairs)


def _speculative_steps(model, cache, sampler, first_id: int, history: torch.Tensor, k: int, result: GenerationResult, device):
    """Yield the tokens of self-speculative decoding, one at a time (draft k, verify in one forward).

    The model drafts ``k`` tokens after ``pending`` (the newest token, not yet
    in the cache) with its cheap draft head: ``model.draft(cache, pending, k)``.
    The main model then runs once over ``[pending, d1 … dk]`` and, at each of
    those positions, the sampler picks the token the main model would have
    produced. Drafts are accepted while they equal those picks; the first pick
    that differs (or the pick after the last draft) is the bonus token. The
    cache is rolled back to the accepted prefix (``cache.rollback(length)``).
    Because every emitted token is the main model's own pick, made with the
    same sampler in the same order, the output equals plain decoding exactly.
    """
    yield first_id
    pending = first_id
    seen = history.clone()
    seen = torch.cat([seen, torch.tensor([first_id])])
    while True:
        room = cache.max_tokens - cache.length - 1  # positions left after `pending`
        drafts = model.draft(cache, pending, min(k, room)) if room > 0 else []
        start = cache.length
        ids = torch.tensor([[pending] + drafts], dtype=torch.long, device=device)
        logits = model(ids, cache)  # (1, 1 + len(drafts), V)
        accepted = 0
        for i in range(len(drafts) + 1):
            if i < len(drafts):
                result.drafted += 1  # a draft counts once the loop gets to judge it
            pick = sampler(logits[0, i], seen)
            seen = torch.cat([seen, torch.tensor([pick])])
            if i < len(drafts) and pick == drafts[i]:
                accepted += 1
                result.accepted += 1  # counted as it is emitted, so a stop mid-step reports it right
                yield pick
                continue
            # the main model disagrees (or all drafts were accepted): keep the cache up to here
            cache.rollback(start + 1 + accepted)
            pending = pick
            yield pick
            break
