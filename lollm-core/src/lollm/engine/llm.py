"""Offline batch generation: many prompts in, their completions out, through one engine.

::

    from lollm import LLM, SamplingParams
    llm = LLM("path/to/qwen2.5-coder-0.5b-instruct.gguf")
    for c in llm.generate(["Write a haiku about tea.", "Name three sorting algorithms."],
                          SamplingParams(temperature=0), max_new_tokens=64):
        print(c.index, c.finish_reason, c.text)

:class:`LLM` loads a checkpoint the way ``lollm run`` does (the checkpoint, its family, the
threads and the ``--think`` flag through :func:`lollm.cli.checks.open_checkpoint`, then
:func:`lollm.load.pipeline.open_model` with packed GGUF weights kept packed). :meth:`LLM.generate`
hands **every** prompt to one :class:`lollm.engine.Engine` at once and steps it until all are
done: each step is one forward over every running request (docs/batching.md), which is where
the throughput comes from. The completions come back in input order, whatever order they
finished in.

Chat or raw text, as ``lollm run`` decides it: a text prompt goes through the chat template
(as one user message, after an optional ``system`` message) when the checkpoint has a
template, and stays raw text when it has none (a note says so once). ``chat=False`` is
``--no-chat`` (raw text always); ``chat=True`` insists on the template (an error without
one). Token-id prompts (``list[list[int]]``) are taken as they are. :meth:`LLM.chat` takes
conversations (lists of ``{"role", "content"}`` messages) instead.

What cannot run batched runs one prompt after another through the single-sequence loop
(:func:`lollm.generate.loop.generate`), with the same results: a family whose model has no
``cache_layers()``, or a model split over ranks (``tp > 1``). :attr:`LLM.batched` says
which, :attr:`LLM.single_reason` why, and a warning on the ``lollm`` logger says it once.

Every request of a batch is checked before any of them runs; a bad one raises
:class:`lollm.errors.GenerationError` naming it (``prompt 3: ...``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from lollm.errors import GenerationError
from lollm.sampling_params import SamplingParams

log = logging.getLogger("lollm")

#: The most requests the engine runs at once when the caller gives no EngineConfig (more wait their turn).
MAX_RUNNING = 64
#: ``max_new_tokens`` when the caller gives none: ``lollm run``'s default.
DEFAULT_MAX_NEW_TOKENS = 256


class PromptError(GenerationError):
    """One prompt of a batch is bad: ``index`` is its place in the list (0-based, as Python counts),
    ``detail`` what is wrong. The message reads ``prompts[3]: the prompt has ... tokens, ...``."""

    def __init__(self, index: int, detail: str):
        super().__init__(f"prompts[{index}]{'' if detail.startswith(':') else ' '}{detail}")
        self.index, self.detail = index, detail.lstrip(": ")


@dataclass
class Completion:
    """One prompt's result.

    index:          the prompt's place in the input list (the list of completions keeps that order).
    prompt:         the prompt as given: a str, a list of token ids, or a conversation (list of messages).
    prompt_ids:     the ids that ran (after the chat template).
    text:           the generated text, up to a stop string (excluded) or an end-of-sequence id (excluded).
    token_ids:      the generated ids (an end-of-sequence id that ended it included, as ``lollm run`` reports them).
    finish_reason:  "eos", "stop_string", "max_new_tokens" or "context".
    cached_tokens:  prompt tokens the engine's prefix cache supplied (not computed again).
    token_times:    seconds from the request's submission to each generated token (one per id of ``token_ids``).
                    Batched, every prompt of a call is submitted at its start, so the first time includes
                    the wait for a place in the batch; one by one, a prompt is submitted when its turn comes.
    logprobs:       with ``logprobs=N``: one :class:`lollm.generate.loop.TokenLogprobs` per generated id.
    batched:        whether it ran through the engine (False: the single-sequence loop).
    """

    index: int
    prompt: Any
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "max_new_tokens"
    cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    batched: bool = True

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def ttft(self) -> float:
        """Time to first token, seconds (0.0 when nothing was generated)."""
        return self.token_times[0] if self.token_times else 0.0

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between each generated token and the next (len(token_ids) - 1 values)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, per second of decoding (0.0 for fewer than two tokens)."""
        if len(self.token_times) < 2 or self.token_times[-1] <= self.token_times[0]:
            return 0.0
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


@dataclass
class _Request:
    """One prompt of a call, checked and encoded: what the engine (or the loop) is asked to do."""

    index: int
    prompt: Any
    ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int


def single_reason(model: Any, *, tp: Any = None, family: str | None = None) -> str | None:
    """Why ``model`` must run one request at a time (None: it can run through the engine).

    tp: the model's tensor-parallel group (``LoadedModel.tp``), None on one process.
    """
    if tp is not None:
        return "a model split over ranks (--tp) runs one prompt at a time: the engine does not split a model yet"
    if not hasattr(model, "cache_layers"):
        return (f"the {family or type(model).__name__} family cannot run batched (its model has no cache_layers()): "
                f"one prompt at a time through the single-sequence loop")
    return None


class LLM:
    """A loaded model and the engine that runs batches of prompts through it (vLLM's ``LLM`` shape).

    model:    a checkpoint folder, a .gguf file or a Hugging Face repo id (as ``lollm run MODEL``).
    family:   the family's name when several installed plugins claim the checkpoint (``--family``).
    device, dtype, threads, weights, quantize, group_size, attn, think: as ``lollm run``'s flags of the
              same names (``weights="auto"``: a GGUF's quantized blocks stay packed on the CPU).
    engine:   a :class:`lollm.engine.EngineConfig` to run every call with (its pool persists between calls,
              and its prefix cache with it); None: each call's engine is sized from its requests
              (:func:`engine_config_for`), and kept while later calls fit in it.

    Raises what loading raises (LollmError subclasses: a missing file, an unknown type, a bad flag).
    """

    def __init__(self, model: str, *, family: str | None = None, device: str = "auto", dtype: str = "auto",
                 threads: int | None = None, engine: Any = None, weights: str = "auto", quantize: str | None = None,
                 group_size: int = 32, attn: str | None = None, think: bool | None = None):
        from lollm.load.pipeline import check_threads, open_checkpoint
        from lollm.load.options import LoadOptions
        from lollm.load.pipeline import open_model

        check_threads(threads)
        options = LoadOptions(device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                              group_size=group_size, family=family)
        checkpoint, _, template_flags = open_checkpoint(str(model), options, threads=threads, think=think, mtp=False)
        self._setup(open_model(checkpoint, options), engine, template_flags)

    @classmethod
    def from_loaded(cls, loaded: Any, *, engine: Any = None, template_flags: dict[str, bool] | None = None) -> "LLM":
        """An LLM over a model already loaded (a :class:`lollm.load.pipeline.LoadedModel`): ``lollm run`` uses this."""
        self = cls.__new__(cls)
        self._setup(loaded, engine, dict(template_flags or {}))
        return self

    def _setup(self, loaded: Any, engine: Any, template_flags: dict[str, bool]) -> None:
        from lollm.generate.loop import stop_token_ids
        from lollm.sampling_params import resolve_sampling

        checkpoint = loaded.checkpoint
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.template_flags = template_flags
        self.stop_ids = frozenset(stop_token_ids(checkpoint.generation_config, checkpoint.config, self.tokenizer))
        #: the sampling ``lollm run`` uses without flags: generation_config.json, then the family's defaults
        self.default_sampling = resolve_sampling({}, checkpoint.generation_config, loaded.family.family.sampling_defaults,
                                                 generation_config_name=str(checkpoint.path / "generation_config.json"))
        self.engine_config = engine
        self.single_reason = single_reason(self.model, tp=loaded.tp, family=loaded.family.family.name)
        self._engine: Any = None
        self._noted_raw = False
        if self.single_reason is not None:
            log.warning("lollm.LLM: %s", self.single_reason)

    @property
    def batched(self) -> bool:
        """True when calls run through the batched engine, False when one prompt at a time."""
        return self.single_reason is None

    # -- the public calls ---------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Iterable[str] = (), chat: bool | None = None,
                 system: str | None = None, parse_special: bool = True, logprobs: int | None = None,
                 constraint: Any = None, on_completion: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Complete every prompt; the completions in input order.

        prompts:        one str, a list of str, or a list of token-id lists (taken as they are).
        sampling:       one :class:`SamplingParams` for all, one per prompt, or None (:attr:`default_sampling`:
                        generation_config.json, then the family's defaults, as ``lollm run`` without flags).
        max_new_tokens: the most tokens per prompt (within the model's context).
        stop:           stop strings: the text ends just before the first one (as ``lollm run --stop``).
        chat:           None: text prompts through the chat template when the checkpoint has one (raw text
                        otherwise, noted once); False: raw text; True: the template, an error without one.
        system:         a system message before each text prompt (needs the chat template).
        parse_special:  special-token text in a prompt becomes control tokens (``--parse-special``).
        logprobs:       N: each token's log-probability and the N most likely (``Completion.logprobs``).
        constraint:     a :class:`lollm.generate.structured.OutputConstraint` (or one compiled for this model) every
                        output follows.
        on_completion:  called with each completion as it finishes (in finishing order).

        Raises GenerationError naming the bad input: no prompts, a prompt of the wrong type or empty, an
        id outside the vocabulary, a prompt that fills the context, a sampling list of another length.
        """
        texts = _prompt_list(prompts)
        ids = [self._encode(p, i, chat=chat, system=system, parse_special=parse_special) for i, p in enumerate(texts)]
        return self._run(texts, ids, sampling, max_new_tokens=max_new_tokens, stop=stop, logprobs=logprobs,
                         constraint=constraint, on_completion=on_completion)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Iterable[str] = (), logprobs: int | None = None,
             constraint: Any = None, on_completion: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        Each is rendered by the checkpoint's chat template with the assistant's turn opened, then
        runs as :meth:`generate` runs its prompts. Raises GenerationError for a checkpoint without a
        chat template, no conversations, or a conversation that is not a non-empty list of messages.
        """
        if self.tokenizer.chat_template is None:
            raise GenerationError("LLM.chat: the checkpoint has no chat template; use LLM.generate(..., chat=False)")
        if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        convs = _prompt_list(conversations, what="conversation")
        ids = []
        for i, conv in enumerate(convs):
            if not isinstance(conv, (list, tuple)) or not conv or not all(isinstance(m, dict) for m in conv):
                raise GenerationError(f"conversation {i}: expected a non-empty list of messages (dicts), got {conv!r:.80}")
            ids.append(self.tokenizer.encode_chat(list(conv), add_generation_prompt=True, **self.template_flags))
        return self._run(convs, ids, sampling, max_new_tokens=max_new_tokens, stop=stop, logprobs=logprobs,
                         constraint=constraint, on_completion=on_completion)

    # -- from prompts to requests -------------------------------------------------------------

    def _encode(self, prompt: Any, index: int, *, chat: bool | None, system: str | None, parse_special: bool) -> list[int]:
        """The ids of one prompt of :meth:`generate` (see its ``chat``)."""
        if isinstance(prompt, (list, tuple)):
            return list(prompt)  # token ids, checked with the others in _requests
        if not prompt:
            raise PromptError(index, "is empty: there is nothing to continue")
        has_template = self.tokenizer.chat_template is not None
        if chat and not has_template:
            raise GenerationError("chat=True: the checkpoint has no chat template (give chat=False for raw text)")
        if chat is False or not has_template:
            if system is not None:
                raise GenerationError("system= needs the chat template; it cannot be used with raw text (chat=False, "
                                      "or a checkpoint without a template)")
            if chat is None and not self._noted_raw:
                log.warning("lollm.LLM: the checkpoint has no chat template; using the prompts as raw text")
                self._noted_raw = True
            return self.tokenizer.encode(prompt, parse_special=parse_special)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=parse_special,
                                          **self.template_flags)

    def _requests(self, prompts: list[Any], all_ids: list[list[int]], sampling: Any,
                  max_new_tokens: int) -> list[_Request]:
        """Every request checked before any runs; GenerationError naming the first bad one."""
        from lollm.generate.loop import check_prompt_ids

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        settings = _sampling_list(sampling, len(prompts), self.default_sampling)
        context = self.model.max_context
        for i, ids in enumerate(all_ids):
            try:
                if not ids:
                    raise GenerationError("the prompt is empty: there is nothing to continue")
                check_prompt_ids(ids, self.model.vocab_size)
                if len(ids) >= context:
                    raise GenerationError(f"the prompt has {len(ids)} tokens, but the model's context is {context}")
            except GenerationError as exc:
                raise PromptError(i, f": {exc}") from None
        return [_Request(i, p, ids, s, max_new_tokens) for i, (p, ids, s) in enumerate(zip(prompts, all_ids, settings))]

    def _compiled(self, constraint: Any) -> Any:
        """``constraint`` compiled for this model's vocabulary (once per call; None stays None)."""
        from lollm.generate.structured import CompiledConstraint, OutputConstraint, compile_constraint

        if constraint is None:
            return None
        if isinstance(constraint, CompiledConstraint):
            if constraint.vocab_size != self.model.vocab_size:
                raise GenerationError(f"the constraint was compiled for {constraint.vocab_size} ids, the model has "
                                      f"{self.model.vocab_size}")
            return constraint
        if not isinstance(constraint, OutputConstraint):
            raise GenerationError(f"constraint must be a lollm.generate.structured.OutputConstraint, got {type(constraint).__name__}")
        return compile_constraint(constraint, self.tokenizer, vocab_size=self.model.vocab_size, stop_ids=self.stop_ids)

    # -- running them -------------------------------------------------------------------------

    def _run(self, prompts: list[Any], all_ids: list[list[int]], sampling: Any, *, max_new_tokens: int,
             stop: Iterable[str], logprobs: int | None, constraint: Any,
             on_completion: Callable[[Completion], None] | None) -> list[Completion]:
        """Check the requests, then run them batched (or one by one); the completions in input order."""
        requests = self._requests(prompts, all_ids, sampling, max_new_tokens)
        stop = list(stop) if not isinstance(stop, str) else [stop]
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise GenerationError(f"logprobs must be a whole number >= 0, got {logprobs!r}")
        compiled = self._compiled(constraint)
        run = self._run_batched if self.batched else self._run_single
        done = run(requests, stop=stop, logprobs=logprobs, constraint=compiled, on_completion=on_completion)
        return [done[r.index] for r in requests]

    def _run_single(self, requests: list[_Request], *, stop: list[str], logprobs: int | None, constraint: Any,
                    on_completion: Callable[[Completion], None] | None) -> dict[int, Completion]:
        """One request after another through the single-sequence loop (the reference the engine is held to)."""
        from lollm.generate.loop import generate

        done: dict[int, Completion] = {}
        for req in requests:
            times: list[float] = []
            start = time.perf_counter()
            result = generate(self.model, req.ids, max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                              stop_ids=self.stop_ids, stop_strings=stop, tokenizer=self.tokenizer, logprobs=logprobs,
                              on_token=lambda token, lp: times.append(time.perf_counter() - start),
                              attn=self.loaded.attn, constraint=constraint)
            done[req.index] = Completion(req.index, req.prompt, list(req.ids), result.text, result.new_ids,
                                         result.stop_reason, 0, times, result.logprobs, batched=False)
            if on_completion is not None:
                on_completion(done[req.index])
        return done

    def _run_batched(self, requests: list[_Request], *, stop: list[str], logprobs: int | None, constraint: Any,
                     on_completion: Callable[[Completion], None] | None) -> dict[int, Completion]:
        """Every request into one engine at once, then steps until all are done (docs/offline-batch.md)."""
        from lollm.attention import use_backend

        engine = self._engine_for(requests)
        runs: dict[str, _Run] = {}
        done: dict[int, Completion] = {}
        try:
            for req in requests:
                rid = engine.add_request(req.ids, sampling=req.sampling, max_new_tokens=req.max_new_tokens,
                                         stop_ids=self.stop_ids, logprobs=logprobs, constraint=constraint)
                runs[rid] = _Run(req, engine.requests[rid], self.tokenizer, self.stop_ids, stop)
            with use_backend(self.loaded.attn):
                while engine.has_unfinished():
                    for out in engine.step():
                        run = runs.get(out.request_id)
                        if run is None or not run.feed(out.step):
                            continue
                        if not out.finished:  # a stop string: the engine does not know it, so it is told
                            engine.abort(out.request_id)
                        del runs[out.request_id]
                        done[run.request.index] = run.completion()
                        if on_completion is not None:
                            on_completion(done[run.request.index])
        except BaseException:
            self._engine = None  # an engine left holding half-run requests: the next call starts afresh
            raise
        return done

    def _engine_for(self, requests: list[_Request]) -> Any:
        """The engine for this call: the one kept from earlier calls when this batch fits it, else a new one.

        Raises GenerationError naming a request that cannot fit the pool even alone.
        """
        from lollm.engine import Engine

        config = self.engine_config or engine_config_for(self.model, requests_positions(self.model, requests))
        kept = self._engine
        if kept is None or (self.engine_config is None and (kept.kv.num_blocks < config.kv_blocks or
                                                             kept.config.max_sequences < config.max_sequences)):
            self._engine = None  # let the old pool go before the new one is made
            self._engine = kept = Engine(self.model, config)
        for req, need in zip(requests, requests_positions(self.model, requests)):
            if need > kept.capacity:
                raise PromptError(req.index, f": {len(req.ids)} prompt + {need - len(req.ids)} new tokens "
                                      f"cannot fit the engine's KV pool ({kept.capacity} positions): give the "
                                      f"EngineConfig more kv_blocks, or ask for fewer tokens")
        return kept


class _Run:
    """One request on its way through the engine: its text (stop strings, end-of-sequence ids) and token times.

    The engine works in ids; the text is :func:`lollm.generate.loop.stream_text`'s, fed one
    :class:`~lollm.generate.loop.Step` at a time as the engine makes it, so a prompt reads the same
    batched as through ``generate`` alone.
    """

    def __init__(self, request: _Request, record: Any, tokenizer: Any, stop_ids: frozenset[int], stop: list[str]):
        from lollm.generate.loop import stream_text

        self.request, self.record = request, record  # record: the engine's Request (cached tokens)
        self.submitted = time.perf_counter()
        self.ids: list[int] = []
        self.times: list[float] = []
        self.logprobs: list[Any] = []
        self.text, self.reason = "", "max_new_tokens"
        self._steps: deque = deque()
        # stream_text pulls steps from an iterator: this one hands out the step just fed (never empty when asked)
        self._pieces = stream_text(iter(self._steps.popleft, None), tokenizer, stop_ids=stop_ids, stop_strings=stop)

    def feed(self, step: Any) -> bool:
        """Take the engine's next token; True when the request is over (its finish reason is set)."""
        self._steps.append(step)
        piece = next(self._pieces)  # exactly one TextStep per Step
        self.ids.append(step.token)
        self.times.append(step.time - self.submitted)
        if step.logprobs is not None:
            self.logprobs.append(step.logprobs)
        self.text += piece.text
        if piece.stop_reason is None:
            return False
        self.reason = piece.stop_reason
        return True

    def completion(self) -> Completion:
        req = self.request
        return Completion(req.index, req.prompt, list(req.ids), self.text, self.ids, self.reason,
                          self.record.cached_tokens, self.times, self.logprobs, batched=True)


# -- sizing the engine from the requests --------------------------------------------------------


def requests_positions(model: Any, requests: Sequence[Any]) -> list[int]:
    """Positions each request may reach: its prompt plus its token budget, within the model's context."""
    context = model.max_context
    return [len(r.ids) + min(r.max_new_tokens, context - len(r.ids)) for r in requests]


def engine_config_for(model: Any, positions: Sequence[int], *, max_running: int = MAX_RUNNING,
                      max_batch_tokens: int = 256) -> Any:
    """An :class:`lollm.engine.EngineConfig` sized for requests that reach ``positions`` positions each.

    Room for the ``min(len(positions), max_running)`` longest requests at once (their blocks added up,
    so none is preempted), at most half the device's free memory; more requests than that wait
    their turn. Raises GenerationError when even the longest request alone does not fit that half.
    """
    from lollm.engine import EngineConfig
    from lollm.engine.cache import pool_room

    if not positions:
        raise GenerationError("no requests to size the engine for")
    size = EngineConfig.block_size
    blocks = sorted((-(-n // size) for n in positions), reverse=True)
    running = min(len(blocks), max_running)
    wanted = sum(blocks[:running])
    room = pool_room(model, size)
    if room.free_bytes is not None:
        if blocks[0] > room.half_free_blocks:
            raise GenerationError(f"a request of {max(positions)} positions "
                                  f"needs {blocks[0] * room.block_bytes / 2**20:.0f} MiB of KV blocks, but half the free "
                                  f"memory is {room.free_bytes / 2 / 2**20:.0f} MiB: ask for fewer tokens")
        wanted = min(wanted, room.half_free_blocks)
    return EngineConfig(kv_blocks=max(wanted, blocks[0]), max_sequences=running, max_batch_tokens=max_batch_tokens)


# -- the inputs' shapes ---------------------------------------------------------------------------


def _prompt_list(prompts: Any, what: str = "prompt") -> list[Any]:
    """``prompts`` as a list: one str, a list of str, or a list of id lists (GenerationError naming a bad one)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise GenerationError(f"{what}s must be a str or a list, got {type(prompts).__name__}")
    if not prompts:
        raise GenerationError(f"no {what}s: give at least one")
    if what == "prompt":
        for i, p in enumerate(prompts):
            ok = isinstance(p, str) or (isinstance(p, (list, tuple)) and all(type(t) is int for t in p))
            if not ok:
                raise PromptError(i, f": expected a str or a list of token ids (ints), got {p!r:.80}")
        if len({isinstance(p, str) for p in prompts}) > 1:
            raise GenerationError("prompts mix text and token ids: give all of one kind")
    return list(prompts)


def _sampling_list(sampling: Any, count: int, default: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per prompt: ``sampling`` repeated, the list given, or ``default``."""
    if sampling is None:
        return [default] * count
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    if not isinstance(sampling, (list, tuple)) or not all(isinstance(s, SamplingParams) for s in sampling):
        raise GenerationError(f"sampling must be a SamplingParams, a list of them or None, got {sampling!r:.80}")
    if len(sampling) != count:
        raise GenerationError(f"{len(sampling)} SamplingParams for {count} prompts: give one, or one per prompt")
    return list(sampling)
