"""Offline batch generation: many prompts in, their completions out, through one engine.

::

    from lollm import LLM, SamplingParams
    llm = LLM("path/to/qwen2.5-coder-0.5b-instruct.gguf")
    for c in llm.generate(["Write a haiku about tea.", "Name three sorting algorithms."],
                          SamplingParams(temperature=0), max_new_tokens=64):
        print(c.index, c.finish_reason, c.text)

:class:`LLM` loads a checkpoint the way ``lollm run`` does (the checkpoint, its family, the
threads and the ``--think`` flag through :func:`lollm.load.pipeline.open_checkpoint`, then
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

A prompt may carry images: an :class:`lollm.engine.llm_images.ImagePrompt` (text and images), as
``lollm run --image`` reads them, or a conversation's image parts (lollm.engine.llm_images says
how); text and image prompts batch together, and the engine's prefix cache shares an image's
blocks only for the same pixels.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, Union

from lollm.engine.llm_images import ImagePrompt, read_chat_images, read_prompt_images, with_placeholders
from lollm.errors import GenerationError, ImageError
from lollm.generate.structured import CompiledConstraint, OutputConstraint, compile_constraint
from lollm.sampling_params import SamplingParams, resolve_sampling

# Lazy imports below (inside the methods): the engine, the loop and torch load on the first call that needs
# them, so that ``from lollm import LLM`` stays torch-free (lollm/__init__.py). Types only for the checker here:
if TYPE_CHECKING:
    from lollm.engine.driver import EngineRun
    from lollm.engine.engine import Engine, EngineConfig
    from lollm.generate.loop import GenerationResult
    from lollm.generate.sequence import TokenLogprobs
    from lollm.load.pipeline import LoadedModel
    from lollm.model import CausalLM
    from lollm.vision.spec import ImageBatch, VisionTower

log = logging.getLogger("lollm")

#: One prompt as a caller gives it: text, text with images, token ids, or a conversation (a list of
#: ``{"role", "content"}`` messages).
Prompt = Union[str, ImagePrompt, Sequence[int], Sequence[dict]]
#: The sampling of a call: one for every prompt, one per prompt, or None (the checkpoint's defaults).
SamplingChoice = Union[SamplingParams, Sequence[SamplingParams], None]

#: The most requests the engine runs at once when the caller gives no EngineConfig (more wait their turn).
MAX_RUNNING = 64
#: ``max_new_tokens`` when the caller gives none: ``lollm run``'s default.
DEFAULT_MAX_NEW_TOKENS = 256
#: The most tokens one engine step runs when the caller gives no EngineConfig (more, to hold a longer image whole).
DEFAULT_BATCH_TOKENS = 256


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
    prompt:         the prompt as given: a str, an ImagePrompt, a list of token ids, or a conversation (list of messages).
    prompt_ids:     the ids that ran (after the chat template; each image's placeholder expanded to its tokens).
    text:           the generated text, up to a stop string (excluded) or an end-of-sequence id (excluded).
    token_ids:      the generated ids (an end-of-sequence id that ended it included, as ``lollm run`` reports them).
    finish_reason:  "eos", "stop_string", "max_new_tokens" or "context".
    cached_tokens:  prompt tokens the engine's prefix cache supplied (not computed again).
    token_times:    seconds from the request's submission to each generated token (one per id of ``token_ids``).
                    Batched, every prompt of a call is submitted at its start, so the first time includes
                    the wait for a place in the batch; one by one, a prompt is submitted when its turn comes.
    logprobs:       with ``logprobs=N``: one :class:`lollm.generate.sequence.TokenLogprobs` per generated id.
    batched:        whether it ran through the engine (False: the single-sequence loop).
    """

    index: int
    prompt: Prompt
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "max_new_tokens"
    cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
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
    prompt: Prompt
    ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    budget: int  # max_new_tokens within the context (lollm.generate.sequence.check_request)
    images: ImageBatch | None = None  # the prompt's placed images (an ImagePrompt), None for text


def single_reason(model: CausalLM, *, tp: object = None, family: str | None = None) -> str | None:
    """Why ``model`` must run one request at a time (None: it can run through the engine):
    :func:`lollm.engine.engine.why_not_batched` (kept under this name for callers of lollm 0.2)."""
    from lollm.engine.engine import why_not_batched

    return why_not_batched(model, tp=tp, family=family)


class LLM:
    """A loaded model and the engine that runs batches of prompts through it (vLLM's ``LLM`` shape).

    model:    a checkpoint folder, a .gguf file or a Hugging Face repo id (as ``lollm run MODEL``).
    family:   the family's name when several installed plugins claim the checkpoint (``--family``).
    device, dtype, threads, weights, quantize, group_size, attn, think: as ``lollm run``'s flags of the
              same names (``weights="auto"``: a GGUF's quantized blocks stay packed on the CPU).
    mmproj:   a GGUF model's vision tower, llama.cpp's mmproj file (``lollm run --mmproj``), read on the first
              :class:`ImagePrompt`; a safetensors checkpoint holds its own tower.
    engine:   a :class:`lollm.engine.EngineConfig` to run every call with (its pool persists between calls,
              and its prefix cache with it); None: each call's engine is sized from its requests
              (:func:`engine_config_for`), and kept while later calls fit in it.

    Raises what loading raises (LollmError subclasses: a missing file, an unknown type, a bad flag).
    """

    def __init__(self, model: str, *, family: str | None = None, device: str = "auto", dtype: str = "auto",
                 threads: int | None = None, engine: EngineConfig | None = None, weights: str = "auto", quantize: str | None = None,
                 group_size: int = 32, attn: str | None = None, think: bool | None = None, mmproj: str | None = None):
        from lollm.load.options import LoadOptions, check_threads
        from lollm.load.pipeline import open_checkpoint, open_model

        check_threads(threads)
        options = LoadOptions(device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                              group_size=group_size, family=family)
        prepared = open_checkpoint(str(model), options, threads=threads, think=think, mtp=False)  # every choice, once
        self._setup(open_model(prepared.checkpoint, prepared.options), engine, prepared.template_flags)
        self.name, self.mmproj = str(model), mmproj

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, *, engine: EngineConfig | None = None, template_flags: dict[str, bool] | None = None) -> "LLM":
        """An LLM over a model already loaded (a :class:`lollm.load.pipeline.LoadedModel`): ``lollm run`` uses this."""
        self = cls.__new__(cls)
        self._setup(loaded, engine, dict(template_flags or {}))
        return self

    def _setup(self, loaded: LoadedModel, engine: EngineConfig | None, template_flags: dict[str, bool]) -> None:
        from lollm.generate.loop import stop_token_ids

        checkpoint = loaded.checkpoint
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.template_flags = template_flags
        self.stop_ids = frozenset(stop_token_ids(checkpoint.generation_config, checkpoint.config, self.tokenizer))
        #: the sampling ``lollm run`` uses without flags: generation_config.json, then the family's defaults
        self.default_sampling = resolve_sampling({}, checkpoint.generation_config, loaded.family.family.sampling_defaults,
                                                 generation_config_name=str(checkpoint.path / "generation_config.json"))
        self.engine_config = engine
        self.single_reason = single_reason(self.model, tp=loaded.tp, family=loaded.family.family.name)
        self._engine: Engine | None = None
        self._noted_raw = False
        self.name: str | None = None  # how errors name the model (None: the checkpoint's spec)
        self.mmproj: str | None = None  # a GGUF model's tower file (``mmproj=``)
        self._tower: VisionTower | None = None  # opened by the first ImagePrompt
        if self.single_reason is not None:
            log.warning("lollm.LLM: %s", self.single_reason)

    @property
    def batched(self) -> bool:
        """True when calls run through the batched engine, False when one prompt at a time."""
        return self.single_reason is None

    # -- the public calls ---------------------------------------------------------------------

    def generate(self, prompts: str | ImagePrompt | Sequence[str | ImagePrompt] | Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Iterable[str] = (), chat: bool | None = None,
                 system: str | None = None, parse_special: bool = True, logprobs: int | None = None,
                 constraint: OutputConstraint | CompiledConstraint | None = None,
                 on_completion: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Complete every prompt; the completions in input order.

        prompts:        one str or ImagePrompt, a list of them, or a list of token-id lists (taken as they are). An
                        :class:`ImagePrompt` is text with images (lollm.engine.llm_images): they run as
                        ``lollm run --image`` runs them, batched with the others.
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
        Raises ImageError, before anything runs: an image refused by lollm.vision.image (naming
        ``prompts[i].images[j]``), images for a model without a vision tower (naming the model), images
        the context cannot hold.
        """
        texts = _prompt_list(prompts)
        pictures = {i: read_prompt_images(p, i) for i, p in enumerate(texts) if isinstance(p, ImagePrompt)}
        ids, images = [], []
        for i, p in enumerate(texts):
            if pictures.get(i):
                got = self._encode_images(p.text, pictures[i], i, chat=chat, system=system, parse_special=parse_special)
            else:
                text = p.text if isinstance(p, ImagePrompt) else p
                got = self._encode(text, i, chat=chat, system=system, parse_special=parse_special), None
            ids.append(got[0])
            images.append(got[1])
        return self._run(texts, ids, sampling, max_new_tokens=max_new_tokens, stop=stop, logprobs=logprobs,
                         constraint=constraint, on_completion=on_completion, images=images)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop: Iterable[str] = (), logprobs: int | None = None,
             constraint: OutputConstraint | CompiledConstraint | None = None,
             on_completion: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        Each is rendered by the checkpoint's chat template with the assistant's turn opened, then
        runs as :meth:`generate` runs its prompts. A message's content may be a list of parts with images,
        ``{"type": "image", "image": X}`` (X a PIL image, a path or bytes) or ``{"type": "image_url",
        "image_url": {"url": "data:..."}}``: the template writes each image's placeholder
        (:func:`lollm.engine.llm_images.read_chat_images`). Raises GenerationError for a checkpoint without a
        chat template, no conversations, or a conversation that is not a non-empty list of messages; ImageError,
        before anything runs, as :meth:`generate` for its images (naming ``conversations[i][m].content[j]``).
        """
        if self.tokenizer.chat_template is None:
            raise GenerationError("LLM.chat: the checkpoint has no chat template; use LLM.generate(..., chat=False)")
        if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        convs = _prompt_list(conversations, what="conversation")
        for i, conv in enumerate(convs):
            if not isinstance(conv, (list, tuple)) or not conv or not all(isinstance(m, dict) for m in conv):
                raise GenerationError(f"conversation {i}: expected a non-empty list of messages (dicts), got {conv!r:.80}")
        read = [read_chat_images(list(conv), i) for i, conv in enumerate(convs)]  # every image checked first
        ids, images = [], []
        for i, (messages, pictures) in enumerate(read):
            if pictures:
                got = self._encode_chat_images(messages, pictures, i)
            else:
                got = self.tokenizer.encode_chat(messages, add_generation_prompt=True, **self.template_flags), None
            ids.append(got[0])
            images.append(got[1])
        return self._run(convs, ids, sampling, max_new_tokens=max_new_tokens, stop=stop, logprobs=logprobs,
                         constraint=constraint, on_completion=on_completion, images=images)

    # -- from prompts to requests -------------------------------------------------------------

    def _encode(self, prompt: Prompt, index: int, *, chat: bool | None, system: str | None, parse_special: bool) -> list[int]:
        """The ids of one prompt of :meth:`generate` (see its ``chat``)."""
        if isinstance(prompt, (list, tuple)):
            return list(prompt)  # token ids, checked with the others in _requests
        if not prompt:
            raise PromptError(index, "is empty: there is nothing to continue")
        if not self._templated(chat, system):
            return self.tokenizer.encode(prompt, parse_special=parse_special)
        return self.tokenizer.encode_chat(_messages(prompt, system), add_generation_prompt=True,
                                          parse_special=parse_special, **self.template_flags)

    def _templated(self, chat: bool | None, system: str | None) -> bool:
        """Whether a text prompt goes through the chat template (see :meth:`generate`'s ``chat``); GenerationError
        for ``chat=True`` or ``system=`` without a template to honour them."""
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
            return False
        return True

    def _encode_images(self, text: str, pictures: list, index: int, *, chat: bool | None, system: str | None,
                       parse_special: bool) -> tuple[list[int], ImageBatch]:
        """The ids and placed images of an :class:`ImagePrompt` (its images read already): the placeholders, the
        chat template (as :meth:`_encode` decides), then :func:`lollm.vision.load.prepare_prompt` (the tower runs
        here). ImageError naming ``prompts[index]`` for placeholders that do not match, or a context too short."""
        from lollm.vision.load import prepare_prompt

        if not parse_special:
            raise GenerationError(f"prompts[{index}]: an ImagePrompt needs parse_special=True (each image's "
                                  "placeholder tokens are special tokens)")
        tower = self._vision()
        text = with_placeholders(text, len(pictures), tower.spec.placeholder)
        templated = self._templated(chat, system)
        if templated:
            text = self.tokenizer.apply_chat_template(_messages(text, system), **self.template_flags)
        try:
            ready = prepare_prompt(text, pictures, tower, self.tokenizer, model=self.name,
                                   max_context=self.model.max_context, add_special_tokens=not templated)
        except ImageError as error:
            raise ImageError(f"prompts[{index}]: {error}") from None
        return ready.ids, ready.images

    def _encode_chat_images(self, messages: list[dict], pictures: list, index: int) -> tuple[list[int], ImageBatch]:
        """The ids and placed images of a conversation whose image parts are ``{"type": "image"}`` (its images read
        already): the tower, the template's placeholders expanded (:func:`lollm.vision.chat.encode_chat_with_images`),
        the placement. ImageError naming ``conversations[index]``."""
        from lollm.vision.chat import encode_chat_with_images
        from lollm.vision.prompt import encode_images, place_images

        tower = self._vision()
        encoded = encode_images(tower, pictures)
        try:
            ids = encode_chat_with_images(messages, [e.embeds.shape[0] for e in encoded], tower.spec, self.tokenizer,
                                          model=self.name, parse_special=True, **self.template_flags)
            return ids, place_images(ids, tower.spec, encoded, max_context=self.model.max_context)
        except ImageError as error:
            raise ImageError(f"conversations[{index}]: {error}") from None

    def _vision(self) -> VisionTower:
        """The model's vision tower, opened once (``mmproj``: from that file). ImageError naming the model when it
        has none, or when it cannot run images: a model split over ranks, or (batched) a decoder without
        ``batches_images``."""
        if self._tower is None:
            from lollm.vision.load import open_vision
            from lollm.vision.prompt import require_tower

            self.name = self.name or str(self.loaded.checkpoint.spec)
            if self.loaded.tp is not None:
                raise ImageError(f"model {self.name} is split over ranks (tp), which do not run images: load it on "
                                 "one process")
            tower = require_tower(open_vision(self.loaded, self.mmproj), self.name)
            if self.batched and not getattr(self.model, "batches_images", False):
                raise ImageError(f"model {self.name} reads images, but its decoder does not take them in an engine "
                                 "step (batches_images): lollm run --image reads them, one prompt at a time")
            self._tower = tower
        return self._tower

    def _requests(self, prompts: list[Prompt], all_ids: list[list[int]], sampling: SamplingChoice,
                  max_new_tokens: int, constraint: CompiledConstraint | None, images: list) -> list[_Request]:
        """Every request checked before any runs (:func:`lollm.generate.sequence.check_request`); GenerationError
        naming the first bad one."""
        from lollm.generate.sequence import check_max_new_tokens, check_request

        check_max_new_tokens(max_new_tokens)
        settings = _sampling_list(sampling, len(prompts), self.default_sampling)
        budgets = []
        for i, ids in enumerate(all_ids):
            try:
                budgets.append(check_request(self.model, ids, max_new_tokens, constraint=constraint))
            except GenerationError as exc:
                raise PromptError(i, f": {exc}") from None
        return [_Request(i, p, ids, s, max_new_tokens, budget, im)
                for i, (p, ids, s, budget, im) in enumerate(zip(prompts, all_ids, settings, budgets, images))]

    def _compiled(self, constraint: OutputConstraint | CompiledConstraint | None) -> CompiledConstraint | None:
        """``constraint`` compiled for this model's vocabulary (once per call; None stays None); one compiled
        already is checked against the vocabulary with the requests (:func:`~lollm.generate.sequence.check_request`)."""
        if constraint is None or isinstance(constraint, CompiledConstraint):
            return constraint
        if not isinstance(constraint, OutputConstraint):
            raise GenerationError(f"constraint must be a lollm.generate.structured.OutputConstraint, got {type(constraint).__name__}")
        return compile_constraint(constraint, self.tokenizer, vocab_size=self.model.vocab_size, stop_ids=self.stop_ids)

    # -- running them -------------------------------------------------------------------------

    def _run(self, prompts: list[Prompt], all_ids: list[list[int]], sampling: SamplingChoice, *, max_new_tokens: int,
             stop: Iterable[str], logprobs: int | None, constraint: OutputConstraint | CompiledConstraint | None,
             on_completion: Callable[[Completion], None] | None, images: list | None = None) -> list[Completion]:
        """Check the requests, then run them batched (or one by one); the completions in input order.
        images: one ImageBatch or None per prompt (None: no prompt has images)."""
        compiled = self._compiled(constraint)
        requests = self._requests(prompts, all_ids, sampling, max_new_tokens, compiled, images or [None] * len(prompts))
        stop = list(stop) if not isinstance(stop, str) else [stop]
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise GenerationError(f"logprobs must be a whole number >= 0, got {logprobs!r}")
        run = self._run_batched if self.batched else self._run_single
        done = run(requests, stop=stop, logprobs=logprobs, constraint=compiled, on_completion=on_completion)
        return [done[r.index] for r in requests]

    def _run_single(self, requests: list[_Request], *, stop: list[str], logprobs: int | None,
                    constraint: CompiledConstraint | None,
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
                              attn=self.loaded.attn, constraint=constraint, images=req.images)
            done[req.index] = Completion(req.index, req.prompt, list(req.ids), result.text, result.new_ids,
                                         result.stop_reason, 0, times, result.logprobs, batched=False)
            if on_completion is not None:
                on_completion(done[req.index])
        return done

    def _run_batched(self, requests: list[_Request], *, stop: list[str], logprobs: int | None,
                     constraint: CompiledConstraint | None,
                     on_completion: Callable[[Completion], None] | None) -> dict[int, Completion]:
        """Every request into one engine at once, stepped by the engine driver in this thread until all are done
        (docs/offline-batch.md); the first request that fails raises its error."""
        from lollm.attention import use_backend
        from lollm.engine.driver import EngineJob, EngineLoop

        driver = EngineLoop(self._engine_for(requests), tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                            background=False)
        runs = [driver.add(EngineJob(req.ids, req.max_new_tokens, req.sampling, stop, logprobs, constraint, index=req.index,
                                     images=req.images)) for req in requests]
        by_index = {req.index: req for req in requests}
        done: dict[int, Completion] = {}
        try:
            with use_backend(self.loaded.attn):
                for _ in driver.steps():
                    for run in [r for r in runs if r.future.done()]:  # in finishing order
                        runs.remove(run)
                        req = by_index[run.job.index]
                        done[req.index] = _completion(req, run, run.future.result())  # a failed one raises here
                        if on_completion is not None:
                            on_completion(done[req.index])
        except BaseException:
            self._engine = None  # an engine left holding half-run requests: the next call starts afresh
            raise
        return done

    def _engine_for(self, requests: list[_Request]) -> Engine:
        """The engine for this call: the one kept from earlier calls when this batch fits it, else a new one.

        Raises GenerationError naming a request that cannot fit the pool even alone, or whose image is longer
        than one engine step holds (a given EngineConfig's ``max_batch_tokens``).
        """
        from lollm.engine.engine import Engine

        positions = [len(r.ids) + r.budget for r in requests]
        widest = [max((im.end - im.start for im in r.images.images), default=0) if r.images else 0 for r in requests]
        config = self.engine_config or engine_config_for(self.model, positions,
                                                         max_batch_tokens=max(DEFAULT_BATCH_TOKENS, *widest))
        kept = self._engine
        if kept is None or (self.engine_config is None and (kept.kv.num_blocks < config.kv_blocks or
                                                             kept.config.max_sequences < config.max_sequences or
                                                             kept.config.max_batch_tokens < config.max_batch_tokens)):
            self._engine = None  # let the old pool go before the new one is made
            self._engine = kept = Engine(self.model, config)
        for req, need in zip(requests, positions):
            if need > kept.capacity:
                raise PromptError(req.index, f": {len(req.ids)} prompt + {need - len(req.ids)} new tokens "
                                      f"cannot fit the engine's KV pool ({kept.capacity} positions): give the "
                                      f"EngineConfig more kv_blocks, or ask for fewer tokens")
        for req, tokens in zip(requests, widest):
            if tokens > kept.config.max_batch_tokens:  # one engine step holds a whole image
                raise PromptError(req.index, f": an image of {tokens} tokens does not fit one engine step "
                                             f"(max_batch_tokens {kept.config.max_batch_tokens}): give the EngineConfig "
                                             f"a max_batch_tokens of at least {tokens}")
        return kept


def _completion(req: _Request, run: EngineRun, result: GenerationResult) -> Completion:
    """A request's :class:`Completion` from its run through the engine driver (token times from its submission)."""
    return Completion(req.index, req.prompt, list(req.ids), result.text, result.new_ids, result.stop_reason,
                      result.reused_tokens, [t - run.submitted for t in run.times], result.logprobs, batched=True)


# -- sizing the engine from the requests --------------------------------------------------------


def engine_config_for(model: CausalLM, positions: Sequence[int], *, max_running: int = MAX_RUNNING,
                      max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> EngineConfig:
    """An :class:`lollm.engine.EngineConfig` sized for requests that reach ``positions`` positions each.

    Room for the ``min(len(positions), max_running)`` longest requests at once, at most half the device's
    free memory (:func:`lollm.engine.cache.pool_blocks`); more requests than that wait their turn.
    Raises GenerationError when even the longest request alone does not fit in the free memory.
    """
    from lollm.engine.cache import pool_blocks
    from lollm.engine.engine import EngineConfig

    running = min(len(positions), max_running)
    blocks = pool_blocks(model, positions, block_size=EngineConfig.block_size, max_running=running)
    return EngineConfig(kv_blocks=blocks, max_sequences=running, max_batch_tokens=max_batch_tokens)


# -- the inputs' shapes ---------------------------------------------------------------------------


def _prompt_list(prompts: object, what: str = "prompt") -> list[Prompt]:
    """``prompts`` as a list: one str or ImagePrompt, a list of them, or a list of id lists (GenerationError naming a
    bad one)."""
    if isinstance(prompts, (str, ImagePrompt)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise GenerationError(f"{what}s must be a str or a list, got {type(prompts).__name__}")
    if not prompts:
        raise GenerationError(f"no {what}s: give at least one")
    if what == "prompt":
        for i, p in enumerate(prompts):
            ok = isinstance(p, (str, ImagePrompt)) or (isinstance(p, (list, tuple)) and all(type(t) is int for t in p))
            if not ok:
                raise PromptError(i, f": expected a str or a list of token ids (ints) or an ImagePrompt, got {p!r:.80}")
        if len({isinstance(p, (str, ImagePrompt)) for p in prompts}) > 1:
            raise GenerationError("prompts mix text and token ids: give all of one kind")
    return list(prompts)


def _sampling_list(sampling: SamplingChoice, count: int, default: SamplingParams) -> list[SamplingParams]:
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


def _messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """The chat messages of one text prompt: the system message (when given), then the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
