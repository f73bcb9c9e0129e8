"""The one generate loop every family shares, in three layers.

::

    prompt ids ─► prefill (the prompt's positions, in chunks of lollm.generate.prefill.PREFILL_CHUNK_TOKENS, fill the cache)
               ─► sample ─► decode (one position per forward, reads the cache) ─► sample ─► …
               ─► stop: an end-of-sequence id, a stop string, max_new_tokens, or the context is full

1. :func:`generate_steps`, the *step generator*: the prefill, then one decode step
   per ``next()``; it yields one :class:`Step` per new token (its id, its
   log-probabilities when asked) and stops only when the token budget or the
   context is spent. With a :class:`~lollm.generate.drafting.Drafter` (a draft head, prompt
   lookup) it decodes speculatively and still yields one token at a time. This is the piece a batched engine builds on.
2. :func:`stream_text`: on top of the steps, the text: detokenized pieces (whole
   UTF-8 characters), end-of-sequence ids, stop strings, a cancel check; one
   :class:`TextStep` per step, the last one saying why the generation stopped.
3. :func:`generate`: drives both with callbacks (``on_token``, ``on_text``) and
   returns a :class:`GenerationResult` (ids, text, stop reason, timings).

::

    for step in generate_steps(model, ids, max_new_tokens=32, sampling=SamplingParams(temperature=0.0)):
        print(step.token, step.finish)

A family provides only ``model.forward(ids, cache)`` and ``model.new_cache``
(see :mod:`lollm.model`); it never writes its own loop. With a
:class:`~lollm.generate.prompt_cache.PromptCache` the cache outlives the call, and the
prefill runs only the part of the prompt the cache does not hold yet.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from lollm.attention import use_backend
from lollm.load.checks import ConfigReader
from lollm.generate.drafting import Drafter, MtpDrafter
from lollm.errors import GenerationError
from lollm.generate.memory import check_cache_fits
from lollm.generate.prompt_cache import PromptCache
from lollm.generate.sequence import Sequence, Step, StopReason, TokenLogprobs, check_request
# Moved to lollm.generate.sequence; still importable from here until lollm-core 0.3 (docs/plugins.md, 10).
from lollm.generate.sequence import check_prompt_ids, token_logprobs  # noqa: F401
from lollm.generate.structured import CompiledConstraint
from lollm.model import Cache, CausalLM
from lollm.sampling_params import SamplingParams
from lollm.tokenizer.stream import StreamDecoder
from lollm.tokenizer.tokenizer import Tokenizer


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
    stop_reason: str = StopReason.MAX_NEW_TOKENS
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


def stop_token_ids(generation_config: dict, config: dict, tokenizer: Tokenizer | None = None) -> set[int]:
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


# -- layer 1: the step generator ---------------------------------------------------------------


def generate_steps(
    model: CausalLM,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    speculative_tokens: int = 0,
    prompt_cache: PromptCache | None = None,
    logprobs: int | None = None,
    constraint: CompiledConstraint | None = None,
    drafter: Drafter | None = None,
    images: Any = None,
) -> Iterator[Step]:
    """The step generator: the prefill, then one decode step per ``next()``, one :class:`Step` per new token.

    The layer everything else reads (:func:`stream_text`, :func:`generate`) and the one
    a batched engine builds on: a request's whole state between two steps is one
    :class:`~lollm.generate.sequence.Sequence` (its cache, sampler, ids so far), and a step is one forward.
    ``prompt_ids``: a list of ints (``0 .. model.vocab_size - 1``).

    The request is checked now (:func:`~lollm.generate.sequence.check_request`: GenerationError for an
    empty prompt, ``max_new_tokens < 1``, a prompt that fills the context, an id
    outside the vocabulary, a constraint for another vocabulary; then :func:`_check_run`:
    a cache that does not fit the device, speculative tokens without a draft head, both
    ``speculative_tokens`` and a ``drafter``);
    the model runs only as the steps are asked for.

    * The first ``next()`` runs the prefill: ``model(ids (1, P) long, cache,
      logits_to_keep=1)`` -> logits (1, 1, V), and yields the first token; with a
      ``prompt_cache``, only the part of the prompt it does not hold yet runs.
    * Each later ``next()`` runs one forward over the newest token, ids (1, 1),
      and yields the next. A ``drafter`` (:mod:`lollm.generate.drafting`: the model's
      draft head, prompt lookup) proposes up to ``drafter.tokens`` tokens, verified
      in one forward over (1, 1 + k) ids (:func:`_speculative_steps`); the steps
      are still yielded one at a time, and the tokens are exactly those of plain
      decoding. ``speculative_tokens = k > 0`` is short for
      ``drafter=MtpDrafter(tokens=k)``.
    * The repetition penalty sees the prompt and every token yielded so far;
      ``logprobs=N`` fills ``Step.logprobs`` (the model's own distribution, N
      alternatives).
    * ``constraint`` (:func:`lollm.generate.structured.compile_constraint`, for this model's vocabulary):
      before each pick, the ids it forbids get ``-inf`` (a fresh matcher per call), so every
      token, drafts included, is one the constraint allows; the end-of-sequence ids are
      allowed only once the output is complete.
    * ``images``: the prompt's :class:`lollm.vision.spec.ImageBatch` (docs/vision.md), given to the
      prefill's forwards (a model that reads images: :class:`lollm.model.VisionLM`). Not with a
      ``prompt_cache``, which matches prompts by their ids alone (GenerationError).
    * At most ``min(max_new_tokens, context - len(prompt_ids))`` steps: the last
      one says why in ``Step.finish``. A caller may stop asking sooner (an
      end-of-sequence id, a stop string, a cancel): no forward runs past the
      last step it asked for.

    The generator runs under ``torch.inference_mode`` with the current attention
    backend (wrap the loop in ``lollm.attention.use_backend`` to choose it). The
    model runs on its own device; ids are moved there. With a ``prompt_cache``,
    closing the generator (or running it to the end) records what the cache holds
    (``PromptCache.finish``). Errors from the model or the sampler
    (GenerationError for non-finite logits) come out of ``next()``.
    """
    drafter = _one_drafter(speculative_tokens, drafter)
    context = model.max_context if prompt_cache is None else prompt_cache.max_tokens
    budget = check_request(model, prompt_ids, max_new_tokens, context=context, constraint=constraint,
                           holder="model" if prompt_cache is None else "session")
    _check_run(model, len(prompt_ids) + budget, prompt_cache, drafter)
    if images is not None and prompt_cache is not None:
        raise GenerationError("a prompt with images cannot use the prompt cache: it matches prompts by token ids, "
                              "and every image's placeholder ids are the same")
    seq = Sequence(model, prompt_ids, sampling, budget=budget, context=context, logprobs=logprobs, constraint=constraint,
                   images=images)
    return _steps(seq, prompt_cache, drafter)


def _check_run(model: CausalLM, positions: int, prompt_cache: PromptCache | None, drafter: Drafter | None) -> None:
    """What only the single-sequence loop needs: its own cache of ``positions`` (plus the drafts) fits the
    device's free memory (:func:`lollm.generate.memory.check_cache_fits`; a prompt cache checked its own when
    it made it), and the drafter can serve the model (``drafter.check``). GenerationError otherwise."""
    if prompt_cache is None:
        extra = drafter.tokens if drafter is not None else 0
        check_cache_fits(model, min(positions + extra, model.max_context))
    if drafter is not None:
        drafter.check(model)


def _one_drafter(speculative_tokens: int, drafter: Drafter | None) -> Drafter | None:
    """The generation's drafter: ``drafter``, or the draft head for ``speculative_tokens > 0``, or None."""
    if speculative_tokens > 0 and drafter is not None:
        raise GenerationError("give either speculative_tokens (the draft head) or a drafter, not both")
    return MtpDrafter(tokens=speculative_tokens) if speculative_tokens > 0 else drafter


@torch.inference_mode()
def _steps(seq: Sequence, prompt_cache: PromptCache | None, drafter: Drafter | None) -> Iterator[Step]:
    """The body of :func:`generate_steps`: prefill, then plain or speculative decoding."""
    try:
        if prompt_cache is not None:  # only the part of the prompt it does not hold yet runs
            seq.cache, logits = prompt_cache.prefill(seq.prompt_ids, seq.device)
            row = logits[0, -1]
        else:
            row = seq.prefill(drafter.tokens if drafter else 0)
        first = seq.check(seq.choose(row))
        yield first
        if not first.finish:
            yield from (_speculative_steps(seq, first.token, drafter) if drafter else _plain_steps(seq, first.token))
    except GeneratorExit:  # the caller stopped asking: the cache is as the last step left it
        _record(seq, prompt_cache)
        raise
    _record(seq, prompt_cache)


def _record(seq: Sequence, prompt_cache: PromptCache | None) -> None:
    """A prompt cache records what its cache now holds, for the next prompt."""
    if prompt_cache is not None and seq.cache is not None:
        prompt_cache.finish(seq.prompt_ids + seq.new_ids)


def _plain_steps(seq: Sequence, pending: int) -> Iterator[Step]:
    """One forward over the newest token per step."""
    while True:
        step = seq.check(seq.choose(seq.forward([pending])[-1]))
        yield step
        if step.finish:
            return
        pending = step.token


def _speculative_steps(seq: Sequence, pending: int, drafter: Drafter) -> Iterator[Step]:
    """The steps of speculative decoding (draft up to k, verify in one forward), yielded one at a time.

    The drafter guesses up to ``k = drafter.tokens`` tokens after ``pending`` (the
    newest token, not yet in the cache): the model's draft head, or a copy of an
    earlier passage (:mod:`lollm.generate.drafting`). The main model then runs once over
    ``[pending, d1 … dk]`` and, at each of those positions, the sampler picks the
    token the main model would have produced. Drafts are accepted while they equal
    those picks; the first pick that differs (or the pick after the last draft) is
    the bonus token. The cache is rolled back to the accepted prefix
    (``cache.rollback(length)``), also after the last step, so that it ends as plain
    decoding leaves it. Because every emitted token is the main model's own pick,
    made with the same sampler in the same order (a seeded sampler draws once per
    emitted token either way), the output equals plain decoding exactly, greedy or
    sampled; with no drafts a step is a plain decode step.
    """
    cache = seq.cache
    while True:
        room = min(drafter.tokens, cache.max_tokens - cache.length - 1, _undoable(cache) - 1)  # drafts after `pending`
        history = seq.prompt_ids + seq.new_ids  # ends with `pending`
        drafts = drafter.propose(seq.model, cache, history, room) if room > 0 else []
        start = cache.length
        logits = seq.forward([pending] + drafts)  # (1 + len(drafts), V)
        for i in range(len(drafts) + 1):
            step = seq.choose(logits[i], drafted=i < len(drafts))  # a draft counts once the loop gets to judge it
            step.accepted = i < len(drafts) and step.token == drafts[i]
            if not step.accepted or len(seq.new_ids) + 1 >= seq.budget:  # a miss, or the last step
                if cache.length != start + 1 + i:
                    cache.rollback(start + 1 + i)  # keep the cache up to here, as plain decoding would
                pending = step.token
            yield seq.check(step)
            if step.finish:
                return
            if not step.accepted:
                break


def _undoable(cache: Cache) -> int:
    """How many positions the next forward may write and still be rolled back exactly (``cache.undoable_tokens()``,
    where the cache limits it: a wrapped sliding-window ring; else as many as it holds)."""
    undoable = getattr(cache, "undoable_tokens", None)
    return undoable() if undoable is not None else cache.max_tokens


# -- layer 2: text, stop strings, end-of-sequence ids, cancel ------------------------------------


@dataclass
class TextStep:
    """One step of :func:`stream_text`: the :class:`Step`, the text it lets out, and whether it is the last.

    text:        text safe to show now: whole UTF-8 characters, never the beginning of
                 a stop string (often "" while a character or a possible stop string is
                 incomplete); the last TextStep also carries whatever was held back.
    stop_reason: None while the generation goes on; on the last TextStep one of
                 "eos", "stop_string", "max_new_tokens", "context", "cancelled"
                 (the meanings of :attr:`GenerationResult.stop_reason`).
    """

    step: Step
    text: str
    stop_reason: str | None = None


def stream_text(
    steps: Iterable[Step],
    tokenizer: Tokenizer | None = None,
    *,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    stop_strings: Iterable[str] = (),
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[TextStep]:
    """The steps of :func:`generate_steps` with their text, until a stop condition; one :class:`TextStep` each.

    Checked after each step, in this order: an id of ``stop_ids`` ("eos": its
    text is left out), a stop string completed by the step's text ("stop_string":
    the text ends just before it), the step's own ``finish``, then
    ``should_stop()`` ("cancelled"; asked once per step that is not the last, so
    under ``--tp`` every rank asks it equally often). ``tokenizer`` (with
    ``stream_decoder()``) turns ids into text; without it every text is "".
    Stops asking ``steps`` for more after the last TextStep. Raises
    GenerationError now for stop strings without a tokenizer.
    """
    stop_strings = list(stop_strings)
    if stop_strings and tokenizer is None:
        raise GenerationError("stop strings need a tokenizer to decode the generated text")
    decoder = tokenizer.stream_decoder(skip_special_tokens=True) if tokenizer is not None else None
    return _text_steps(steps, decoder, _StopStringWatcher(stop_strings), stop_ids, should_stop)


def _text_steps(steps: Iterable[Step], decoder: StreamDecoder | None, watcher: _StopStringWatcher, stop_ids: set[int] | frozenset[int],
                should_stop: Callable[[], bool] | None) -> Iterator[TextStep]:
    """The body of :func:`stream_text`: decode each step, check the stops in their order, flush at the end."""
    for step in steps:
        text, reason = "", None
        if step.token in stop_ids:
            reason = StopReason.EOS
        elif decoder is not None:
            text, hit = watcher.feed(decoder.push(step.token))
            reason = StopReason.STOP_STRING if hit else None
        if reason is None:
            reason = step.finish or (StopReason.CANCELLED if should_stop is not None and should_stop() else None)
        if reason is not None and reason != StopReason.STOP_STRING and decoder is not None:
            text += watcher.finish(decoder.flush())  # what the decoder and the watcher still hold
        yield TextStep(step, text, reason)
        if reason is not None:
            return


# -- layer 3: callbacks and the result ---------------------------------------------------------


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    stop_strings: Iterable[str] = (),
    tokenizer: Tokenizer | None = None,
    on_text: Callable[[str], None] | None = None,
    speculative_tokens: int = 0,
    prompt_cache: PromptCache | None = None,
    logprobs: int | None = None,
    on_token: Callable[[int, TokenLogprobs | None], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    attn: str | None = None,
    constraint: CompiledConstraint | None = None,
    drafter: Drafter | None = None,
    images: Any = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    ``tokenizer`` (with ``stream_decoder()``) is needed for text output and stop
    strings; without it only ids are produced. ``on_text`` receives each piece
    of text as soon as it is safe to print (whole UTF-8 characters, never the
    beginning of a stop string). The model runs on its own device; ids are
    moved there.

    ``drafter`` (:mod:`lollm.generate.drafting`) turns on speculative decoding: drafts
    verified in one forward (see :func:`_speculative_steps`); the output is exactly
    the same as without it. ``speculative_tokens > 0`` is short for the model's
    draft head, ``drafter=MtpDrafter(tokens=speculative_tokens)``.

    ``prompt_cache`` keeps the cache between calls (see :mod:`lollm.generate.prompt_cache`):
    the context is then its ``max_tokens``. ``logprobs=N`` records the
    log-probability of each new token and of the N most likely ones
    (``result.logprobs``); ``on_token(id, logprobs or None)`` is called for each new
    token as it is chosen (a caller interrupted by Ctrl-C still knows what was
    generated); ``should_stop()`` is asked before each further step, and True ends the
    generation with stop reason "cancelled" (a client that went away, Ctrl-C).
    ``attn`` names the attention backend to run with (:mod:`lollm.attention`; None:
    the current one). ``constraint``: the output follows it (:mod:`lollm.generate.structured`;
    see :func:`generate_steps`). ``images``: the prompt's ImageBatch (docs/vision.md; see :func:`generate_steps`).

    This is :func:`generate_steps` read through :func:`stream_text`, with the callbacks.
    Raises GenerationError for an empty prompt, a non-positive
    ``max_new_tokens``, a prompt that does not fit the context, a prompt id outside
    the model's vocabulary, a cache larger than the device's free memory
    (:func:`lollm.generate.memory.check_cache_fits`), stop strings without a tokenizer, or
    speculative tokens without a draft head; AttentionBackendError for an unknown or
    unusable backend.
    """
    with use_backend(attn):
        steps = generate_steps(model, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                               speculative_tokens=speculative_tokens, prompt_cache=prompt_cache, logprobs=logprobs,
                               constraint=constraint, drafter=drafter, images=images)
        with closing(steps):  # a prompt cache records what it holds when the steps close
            pieces = stream_text(steps, tokenizer, stop_ids=stop_ids, stop_strings=stop_strings, should_stop=should_stop)
            result = _collect(pieces, GenerationResult(prompt_ids=list(prompt_ids)), on_token, on_text)
    if prompt_cache is not None:
        result.reused_tokens = prompt_cache.last.reused
    return result


def _collect(pieces: Iterator[TextStep], result: GenerationResult, on_token: Callable[[int, TokenLogprobs | None], None] | None,
             on_text: Callable[[str], None] | None) -> GenerationResult:
    """Read ``pieces`` into ``result`` (ids, logprobs, text, counts, timings), calling the callbacks on the way."""
    start = first = time.perf_counter()
    for piece in pieces:
        step = piece.step
        if not result.new_ids:
            first = step.time
            result.prefill_seconds = first - start  # the prompt's forward plus the first sample
        result.new_ids.append(step.token)
        result.drafted += step.drafted
        result.accepted += step.accepted
        if step.logprobs is not None:
            result.logprobs.append(step.logprobs)
        if on_token is not None:
            on_token(step.token, step.logprobs)
        if piece.text:
            result.text += piece.text
            if on_text is not None:
                on_text(piece.text)
        if piece.stop_reason is not None:
            result.stop_reason = piece.stop_reason
    result.decode_seconds = time.perf_counter() - first
    return result

