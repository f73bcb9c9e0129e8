"""The served model and how its requests run: the batched engine, or one worker thread (no HTTP here).

:class:`ModelServer` holds the model, its tokenizer and the server's settings; it turns a
request body into a :class:`~lollm.serve.requests.PreparedRequest` job (:meth:`ModelServer.prepare`),
runs jobs (:meth:`ModelServer.submit`), counts how they end and, under ``--tp``, keeps the
other ranks in step (:meth:`ModelServer.follow`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from lollm.errors import GenerationError, LollmError
from lollm.model import CausalLM
from lollm.tokenizer import Tokenizer
from lollm.load import ranks
from lollm.load.pipeline import LoadedModel
from lollm.generate.loop import GenerationResult, generate, stop_token_ids
from lollm.generate.prompt_cache import PromptCache
from lollm.sampling_params import SamplingParams, check_sampling_value, resolve_sampling
from lollm.generate.structured import CompiledConstraint, ConstraintError, OutputConstraint, compile_constraint
from lollm.engine import Engine, EngineConfig
from lollm.engine.engine import why_not_batched
from lollm.engine.driver import EngineLoop, QueueFull, serve_kv_blocks
from lollm.serve.answers import SHUTDOWN, request_line
from lollm.serve.guard import check_authorization
from lollm.serve.images import Towers, image_prompt, reads_images
from lollm.serve.metrics import metrics_for
from lollm.serve.requests import (CHAT_FIELDS, COMPLETION_FIELDS, RESERVED_TEMPLATE_VARIABLES, SAMPLING_FIELDS, ApiError,
                                  Body, Job, PreparedRequest, body_limit, body_limit_rule, chat_logprobs, check_fields, flag,
                                  longest_token_bytes, number, parse_body, read_messages, response_format, short_repr,
                                  stops, stream_options, text_bytes)
from lollm.serve.reasoning import EFFORTS, after_thinking, opening
from lollm.serve.tool_formats import ToolRequestError
from lollm.serve.tools import ToolRequest, read_tools
from lollm.vision.spec import ImageBatch

log = logging.getLogger("lollm.serve.server")  # one logger for the whole server (docs/serving.md)

#: Requests that may wait for the engine (or the single worker) before a 503 (lollm serve --max-queue).
DEFAULT_MAX_QUEUE = 128
#: Requests the engine runs at once (lollm serve --max-running): the issue's 16 concurrent clients on a CPU.
DEFAULT_MAX_RUNNING = 16
#: Tokens in one engine step (lollm serve --max-batch-tokens): decode tokens plus prefill chunks.
DEFAULT_MAX_BATCH_TOKENS = 256
#: Seconds a client told 503 (a full queue) is asked to wait before it tries again.
RETRY_AFTER_SECONDS = 1

#: What rank 0 broadcasts to the other ranks under --tp, per job: ids, max_tokens, sampling (with its seed),
#: stop strings, logprobs, the output constraint (uncompiled: each rank compiles its own).
FollowedJob = tuple[list[int], int, SamplingParams, list[str], "int | None", "OutputConstraint | None"]


class ModelServer:
    """The served model, how requests run (the engine, or one worker thread) and the request counters (no HTTP here).

    loaded:           a :class:`lollm.load.pipeline.LoadedModel`.
    name:             the model id clients send (``"model"``).
    context:          positions one request may use (prompt + answer), at most the model's.
    sampling_flags:   server-wide sampling settings (``lollm serve --temperature`` ...), under a request's own.
    template_flags:   server-wide template variables (``--think``), under a request's chat_template_kwargs.
    draft_tokens:     MTP draft tokens per step (0: off).
    api_key:          when set, every /v1 request must carry ``Authorization: Bearer <api_key>``.
    max_body_bytes:   the largest request body, in bytes (default: :func:`body_limit` of the context, with room for
                      images when the model reads them: :func:`lollm.serve.images.reads_images`).
    mmproj:           a GGUF model's vision tower, llama.cpp's mmproj file (``lollm serve --mmproj``).
    batched:          run requests through the batched engine when the model can (see :attr:`single_reason`).
    max_running:      the engine's most requests at once (its ``max_sequences``).
    kv_blocks:        the engine's KV pool in blocks (None: :func:`lollm.engine.driver.serve_kv_blocks`).
    max_batch_tokens: the engine's most tokens per step.
    max_queue:        the most requests waiting to run; one more is a 503.

    Raises LollmError when the KV pool cannot hold one request of the whole context.
    """

    def __init__(self, loaded: LoadedModel, *, name: str, context: int, sampling_flags: dict[str, float | None] | None = None,
                 template_flags: dict[str, object] | None = None, draft_tokens: int = 0, api_key: str | None = None,
                 max_body_bytes: int | None = None, batched: bool = True, max_running: int = DEFAULT_MAX_RUNNING,
                 kv_blocks: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_queue: int = DEFAULT_MAX_QUEUE, mmproj: str | None = None):
        self.loaded = loaded
        self.model: CausalLM = loaded.model
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.name = name
        self.context = min(context, self.model.max_context)
        self.sampling_flags = {k: v for k, v in (sampling_flags or {}).items() if v is not None}
        self.template_flags = dict(template_flags or {})
        self.draft_tokens = draft_tokens
        self.api_key = api_key
        #: whether the model may read images (the body limit's room for them, /v1/models' vision flag)
        self.reads_images = reads_images(loaded.family.family, loaded.checkpoint, mmproj)
        self.max_body_bytes = max_body_bytes or body_limit(self.context, self.reads_images)
        self.body_rule = body_limit_rule(self.reads_images)  # what the limit is made of, for a 413
        #: no token stands for more bytes of text than this (the early prompt-length check)
        self.token_bytes_bound = longest_token_bytes(self.tokenizer)
        self.stop_ids = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, self.tokenizer)
        self.created = int(time.time())
        self.towers = Towers(loaded, name, mmproj)  # the vision tower, opened by the first image request
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        #: jobs submitted whose Future is not done yet, by id(job); closing: the server is shutting down
        self.live: dict[int, Job] = {}
        self._live_lock = threading.Lock()
        self.closing = False
        self.group = getattr(loaded, "tp", None)  # the --tp group (lollm.load.process_group.Group), else None
        if max_queue < 1:  # a request waits in the queue before it runs, even on an idle server
            raise LollmError(f"--max-queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        #: why requests run one at a time (None: they run through the engine)
        self.single_reason = self._single_reason() if batched else "batching is off"
        self.engine_loop: EngineLoop | None = None
        self.cache: PromptCache | None = None
        if self.single_reason is None:
            self.engine_loop = self._start_engine(max_running, kv_blocks, max_batch_tokens)
        else:
            self.cache = PromptCache(self.model, self.context)
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lollm-generate")
            self._single_lock = threading.Lock()
            self.pending = 0  # jobs given to the worker that have not started
            self.queued: dict[int, Job] = {}  # those jobs, by id(job)
            self.busy = 0  # jobs the worker is running (0 or 1)
            self.metrics = metrics_for(self._single_stats, kv_blocks=False)

    def _single_reason(self) -> str | None:
        """Why this model cannot run through the engine here (None: it can): the engine's one answer."""
        family = getattr(getattr(getattr(self.loaded, "family", None), "family", None), "name", None)
        return why_not_batched(self.model, tp=self.group, speculative="--mtp" if self.draft_tokens > 0 else None,
                               family=family)

    def _start_engine(self, max_running: int, kv_blocks: int | None, max_batch_tokens: int) -> EngineLoop:
        """The engine over the model and the thread that steps it (with this server's metrics)."""
        for option, value in (("--max-running", max_running), ("--max-batch-tokens", max_batch_tokens), ("--kv-blocks", kv_blocks)):
            if value is not None and value < 1:
                raise LollmError(f"{option} must be >= 1, got {value}")
        config = EngineConfig(max_sequences=max_running, max_batch_tokens=max_batch_tokens)
        blocks = kv_blocks or serve_kv_blocks(self.model, self.context, max_running, config.block_size)
        if blocks * config.block_size < self.context:
            raise LollmError(f"--kv-blocks {blocks} hold {blocks * config.block_size} positions, fewer than one request of "
                             f"the context ({self.context}, --ctx-size) needs: give at least "
                             f"{-(-self.context // config.block_size)} blocks, or lower --ctx-size")
        engine = Engine(self.model, dataclasses.replace(config, kv_blocks=blocks))
        self.metrics = metrics_for(engine.stats, kv_blocks=True)
        return EngineLoop(engine, tokenizer=self.tokenizer, stop_ids=self.stop_ids, max_queue=self.max_queue,
                          report=self.report, metrics=self.metrics)

    def close(self) -> None:
        """Stop the engine thread, or the worker (requests still running are not answered)."""
        if self.engine_loop is not None:
            self.engine_loop.close()
        else:
            self.worker.shutdown(wait=False, cancel_futures=True)

    # -- requests ---------------------------------------------------------------------
    def check_auth(self, authorization: str | None) -> None:
        """The request's ``Authorization`` header against the key (:func:`lollm.serve.guard.check_authorization`):
        ApiError 401 with ``WWW-Authenticate: Bearer`` unless it is ``Bearer <api_key>``; nothing without a key."""
        check_authorization(authorization, self.api_key)

    def check_model(self, body: Body) -> None:
        model = body.get("model")
        if model is None:
            raise ApiError(400, f"the request has no 'model': name the model this server serves, {self.name!r}",
                           param="model", code="missing_required_parameter")
        if model != self.name:
            raise ApiError(404, f"the model {short_repr(model)} does not exist here; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def prepare(self, raw: bytes, kind: str) -> PreparedRequest:
        """A request body of ``kind`` ("chat" or "completion") parsed, checked and tokenized; ApiError when refused.

        Runs in a thread of the pool, never on the event loop: the template and
        the tokenizer take time in proportion to the text. Every cheap check (the
        JSON, the model, the fields, the sampling values, the text's size) comes
        before them.
        """
        return self.prepare_body(parse_body(raw), kind)

    def prepare_body(self, body: Body, kind: str) -> PreparedRequest:
        """:meth:`prepare` of a body already parsed: a Chat Completions or Completions request as a dict.

        The Messages and Responses APIs (lollm.serve.messages, lollm.serve.responses)
        translate their requests into a chat body and come here.
        """
        self.check_model(body)
        check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
        logprobs = chat_logprobs(body) if kind == "chat" else number(body, "logprobs", integer=True, low=0, high=20)
        streaming, include_usage = flag(body, "stream"), stream_options(body)
        limit, sampling, stop = self.settings(body)
        wanted = response_format(body.get("response_format"))
        constraint = self.compile(wanted)
        tools = self.tools(body, constraint) if kind == "chat" else None
        ids, images = self.chat_ids(body, tools) if kind == "chat" else (self.completion_ids(body), None)
        job = self.job(body, ids, limit, sampling, stop + (tools.stops() if tools else []), logprobs)
        job.images = images
        job.tools = tools
        job.reasoning = opening(self.tokenizer, ids) if kind == "chat" else None
        param = "response_format"
        if tools is not None and tools.grammar is not None:
            wanted, param = tools.grammar, "tools"
        if wanted is not None:  # bound to what follows the thinking (lollm.serve.reasoning)
            job.constraint = self.compile(after_thinking(wanted, job.reasoning), param)
        return PreparedRequest(job, streaming, include_usage)

    def tools(self, body: Body, constraint: CompiledConstraint | None) -> ToolRequest | None:
        """The request's tools (:func:`lollm.serve.tools.read_tools`); ApiError 400 naming the field when refused."""
        try:
            tools = read_tools(body, self.tokenizer.tool_chat_template(), self.tokenizer)
            if tools is not None and constraint is not None:  # auto too: the format's grammar rules out every call
                raise ToolRequestError("'response_format' and 'tools' (unless tool_choice is 'none') each set what the "
                                       "answer may be, and no tool call fits a response_format: send one of them",
                                       "tool_choice")
            return tools
        except ToolRequestError as error:
            raise ApiError(400, str(error), param=error.param) from None

    def settings(self, body: Body) -> tuple[int | None, SamplingParams, list[str]]:
        """The request's token limit (None: the rest of the context), resolved sampling and stop strings."""
        limit = number(body, "max_completion_tokens", integer=True, low=1)
        limit = number(body, "max_tokens", integer=True, low=1) if limit is None else limit
        user = {**self.sampling_flags}
        for name in SAMPLING_FIELDS:
            value = number(body, name, integer=name == "top_k")
            if value is not None:
                try:  # the request's own value: its 400 names the field, never a command-line flag
                    check_sampling_value(name, value)
                except GenerationError as error:
                    raise ApiError(400, f"{name!r}: {error}", param=name) from None
                user[name] = value
        if user.get("top_k") == -1:
            user["top_k"] = 0  # -1: off, as vLLM spells it
        seed = number(body, "seed", integer=True)
        try:
            sampling = resolve_sampling(user, self.loaded.checkpoint.generation_config,
                                        self.loaded.family.family.sampling_defaults, seed=seed)
        except LollmError as error:
            raise ApiError(400, str(error)) from None
        return limit, sampling, stops(body)

    def job(self, body: Body, ids: list[int], limit: int | None, sampling: SamplingParams, stop: list[str],
            logprobs: int | None) -> Job:
        """The generation of a request whose prompt is ``ids``; ApiError 400 when the prompt leaves no room."""
        if len(ids) >= self.context:
            raise self._too_long(body, f"the prompt has {len(ids)} tokens")
        room = self.context - len(ids)
        return Job(ids=ids, max_tokens=min(limit or room, room), sampling=sampling, stop=stop, logprobs=logprobs)

    def _too_long(self, body: Body, what: str) -> ApiError:
        return ApiError(400, f"{what}, but the server's context is {self.context} (lollm serve --ctx-size); "
                             f"shorten it", param="messages" if "messages" in body else "prompt",
                        code="context_length_exceeded")

    def check_text_size(self, body: Body, size: int) -> None:
        """Refuse, before tokenizing, a prompt whose text (``size`` UTF-8 bytes) cannot fit the context.

        No token stands for more than ``token_bytes_bound`` bytes, so such a text
        has at least ``size / token_bytes_bound`` tokens; a prompt must leave one
        position free. (A tokenizer whose normalizer deletes text, or that fuses
        unknown characters into one id, could fit more; a prompt that long is
        refused all the same.)
        """
        if size > (self.context - 1) * self.token_bytes_bound:
            raise self._too_long(body, f"the prompt has {size:,} bytes of text, at least {size // self.token_bytes_bound:,} "
                                       f"tokens (no token of this model stands for more than {self.token_bytes_bound} bytes)")

    def chat_ids(self, body: Body, tools: ToolRequest | None = None) -> tuple[list[int], ImageBatch | None]:
        """The chat prompt's ids and, when its messages hold images, their ImageBatch (lollm.serve.images)."""
        if self.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                           param="messages")
        images: list = []
        try:
            messages = read_messages(body.get("messages"), images)
        except ToolRequestError as error:
            raise ApiError(400, str(error), param=error.param) from None
        flags = {**self.template_flags, **self.thinking_flag(body)}
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
            for key in extra:
                if key in RESERVED_TEMPLATE_VARIABLES or not self.tokenizer.chat_template_reads(key):
                    raise ApiError(400, f"chat_template_kwargs: the chat template does not read {short_repr(key)}",
                                   param=f"chat_template_kwargs.{key[:100]}")
            flags.update(extra)
        if tools is not None:
            flags["tools"] = tools.tools
        self.check_text_size(body, text_bytes(messages) + text_bytes(extra) + text_bytes(flags.get("tools")))
        try:
            if images:  # the tower first: a text model's 400 names the model
                tower = self.towers.tower()
                self.check_image_path()
                return image_prompt(messages, images, tower, self.tokenizer, model=self.name, context=self.context, **flags)
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=False, **flags), None
        except LollmError as error:  # the template rejected the messages (raise_exception) or failed
            raise ApiError(400, str(error), param="messages") from None

    def check_image_path(self) -> None:
        """ApiError 400 when this server cannot run an image request on its model: a decoder that does not take
        images in an engine step (``batches_images``), or a model split over ranks (--tp: the ranks share no images)."""
        if self.group is not None:
            raise ApiError(400, f"model {self.name!r} is split over ranks (--tp), which do not run images: serve it "
                                "on one process", param="messages")
        if self.engine_loop is not None and not getattr(self.model, "batches_images", False):
            raise ApiError(400, f"model {self.name!r} reads images, but its decoder does not take them in the batched "
                                "engine yet (batches_images): lollm run --image reads them", param="messages")

    def thinking_flag(self, body: Body) -> dict[str, bool]:
        """``{"enable_thinking": bool}`` from the request's ``reasoning_effort`` (``{}`` when absent; "none": off,
        any other effort: on); ApiError 400 when it is not an effort, or the template has no such switch.

        A request's ``chat_template_kwargs`` still wins over it, as it wins over ``lollm serve --think``.
        """
        effort = body.get("reasoning_effort")
        if effort is None:
            return {}
        if effort not in EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {short_repr(effort)}",
                           param="reasoning_effort")
        if not self.tokenizer.chat_template_reads("enable_thinking"):
            raise ApiError(400, f"'reasoning_effort': the chat template of {self.name!r} has no thinking switch (it does "
                                "not read enable_thinking); send the request without it", param="reasoning_effort")
        return {"enable_thinking": effort != "none"}

    def completion_ids(self, body: Body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            self.check_text_size(body, len(prompt.encode("utf-8", "surrogatepass")))
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if len(prompt) >= self.context:
                raise self._too_long(body, f"the prompt has {len(prompt)} tokens")
            bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
            if bad:
                raise ApiError(400, f"'prompt' holds token ids outside the vocabulary (0 .. {self.model.vocab_size - 1}): "
                                    f"{short_repr(bad[:5])}", param="prompt")
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")
        if not ids:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return ids

    def compile(self, constraint: OutputConstraint | None, param: str = "response_format") -> CompiledConstraint | None:
        """``constraint`` compiled for the served model (None stays None); ApiError 400 naming what cannot be enforced.

        ``param``: the field the constraint came from (``tools`` for a forced tool call).
        """
        if constraint is None:
            return None
        try:
            return compile_constraint(constraint, self.tokenizer, vocab_size=self.model.vocab_size, stop_ids=self.stop_ids)
        except ConstraintError as error:
            raise ApiError(400, str(error), param=param, code=f"unsupported_{param}") from None

    # -- running a job: the engine, or the single worker --------------------------------------
    def submit(self, job: Job) -> Future[GenerationResult | None]:
        """Start ``job``; a Future of its GenerationResult (None: cancelled before it began).

        ApiError 503 (with ``Retry-After``) when ``max_queue`` requests already wait.
        """
        if self.closing:
            raise ApiError(503, "the server is shutting down", kind="server_error", code="server_shutting_down")
        try:
            if self.engine_loop is not None:
                future = self.engine_loop.submit(job)
            else:
                with self._single_lock:
                    if self.pending >= self.max_queue:
                        raise QueueFull(f"{self.pending} requests are waiting (lollm serve --max-queue {self.max_queue})")
                    self.pending += 1
                    self.queued[id(job)] = job
                future = self.worker.submit(self._run_next, job)
        except QueueFull as full:
            raise ApiError(503, f"the server is busy: {full}; try again shortly", kind="server_error",
                           code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        with self._live_lock:
            self.live[id(job)] = job
        future.add_done_callback(lambda _: self._forget(job))
        return future

    def _forget(self, job: Job) -> None:
        with self._live_lock:
            self.live.pop(id(job), None)

    def live_jobs(self) -> int:
        """Jobs submitted and not ended yet (queued or running)."""
        with self._live_lock:
            return len(self.live)

    # -- shutdown (lollm.serve.shutdown) ----------------------------------------------------------
    def end_for_shutdown(self, job: Job) -> None:
        """End ``job`` because the server stops: marked, cancelled, its answer told at once (any thread)."""
        job.shutdown = True
        job.cancel.set()
        if job.on_shutdown is not None:
            job.on_shutdown()

    def begin_shutdown(self) -> int:
        """Refuse new jobs (503) and end every queued one now; running ones go on. Returns how many were queued.

        The engine ends its queued requests (in its inbox, or waiting without a token) at its next
        step (:meth:`lollm.engine.driver.EngineLoop.shed_waiting`); the single worker's are ended here.
        """
        self.closing = True
        if self.engine_loop is not None:
            queued = self.engine_loop.waiting()
            self.engine_loop.shed_waiting(self.end_for_shutdown)
            return queued
        with self._single_lock:
            queued = list(self.queued.values())
        for job in queued:
            self.end_for_shutdown(job)
        return len(queued)

    def stop_all(self) -> int:
        """The shutdown's deadline: end every job still live (:meth:`end_for_shutdown`). Returns how many."""
        with self._live_lock:
            jobs = list(self.live.values())
        for job in jobs:
            self.end_for_shutdown(job)
        return len(jobs)

    def _run_next(self, job: Job) -> GenerationResult | None:
        """The single worker takes the next job: it stops waiting and runs (:meth:`run`)."""
        with self._single_lock:
            self.pending -= 1
            self.queued.pop(id(job), None)
            self.busy += 1
        try:
            return self.run(job)
        finally:
            with self._single_lock:
                self.busy -= 1

    def _single_stats(self) -> dict[str, int]:
        return {"running": self.busy, "waiting": self.pending}

    def report(self, job: Job, result: GenerationResult | None, outcome: str) -> None:
        """A job ended ("completed", "cancelled", "failed"): the counters, its log line, the metrics."""
        self.counts[outcome] += 1
        if outcome == "cancelled":  # one line for every cancellation, before the first token too
            made = f"after {len(result.new_ids)} tokens" if result is not None and result.new_ids else "before its first token"
            why = "server shutting down: generation stopped" if getattr(job, "shutdown", False) else \
                "client went away: generation cancelled"
            log.info("%s %s", why, made)
        if result is not None:  # a job the shutdown stopped: its client was told "shutdown", so is the log
            stopped = getattr(job, "shutdown", False) and result.stop_reason == "cancelled"
            images = len(job.images.images) if getattr(job, "images", None) is not None else 0
            log.info("%s", request_line(job.endpoint, dataclasses.replace(result, stop_reason=SHUTDOWN) if stopped else result,
                                        images))
        if self.metrics is not None:
            if self.engine_loop is None and result is not None:  # the engine counts its tokens as they come
                self.metrics.generated.inc(len(result.new_ids))
                if result.new_ids:
                    self.metrics.ttft.observe(result.prefill_seconds)
            self.metrics.finished(outcome, len(job.ids), result.reused_tokens if result is not None else 0)

    def run(self, job: Job) -> GenerationResult | None:
        """Generate one job on the single path (in the worker thread); None when it was cancelled before it began."""
        if job.cancel.is_set():
            self.report(job, None, "cancelled")
            return None
        try:
            if self.group is not None:  # --tp: the other ranks run the same job (follow)
                if job.sampling.seed is None:  # every rank must draw the same tokens: one seed, chosen here
                    job.sampling = dataclasses.replace(job.sampling, seed=secrets.randbits(63))
                constraint = job.constraint.constraint if job.constraint is not None else None
                ranks.broadcast(self.group, (job.ids, job.max_tokens, job.sampling, job.stop, job.logprobs, constraint))
            result = self._generate(job)
        except BaseException:
            self.report(job, None, "failed")
            raise
        self.report(job, result, "cancelled" if result.stop_reason == "cancelled" else "completed")
        return result

    def _generate(self, job: Job) -> GenerationResult:
        should_stop = job.cancel.is_set if self.group is None else lambda: ranks.agree(self.group, job.cancel.is_set())
        return generate(
            self.model, job.ids, max_new_tokens=job.max_tokens, sampling=job.sampling, stop_ids=self.stop_ids,
            stop_strings=job.stop, tokenizer=job.tools.text_of(self.tokenizer) if job.tools else self.tokenizer,
            on_text=job.on_text, on_token=job.on_token,
            speculative_tokens=self.draft_tokens, logprobs=job.logprobs, should_stop=should_stop, constraint=job.constraint,
            # images: no prompt cache (it matches prompts by ids, and every image's placeholder ids are the same)
            prompt_cache=self.cache if job.images is None else None, images=job.images,
        )

    # -- --tp: the ranks other than 0 (lollm.load.ranks) ------------------------------------------
    def follow(self) -> None:
        """A rank other than 0 under --tp: run each job rank 0 broadcasts, in its order, until rank 0 says stop.

        :func:`lollm.load.ranks.follow`. The jobs come with rank 0's resolved sampling
        and seed, so every rank samples the same tokens from the same
        (all-gathered) logits, and its prompt cache holds what rank 0's holds.
        """
        ranks.follow(self.group, self._follow_job)

    def _follow_job(self, message: FollowedJob) -> None:
        """One job rank 0 broadcast; an error rank 0's generation also meets (a LollmError) is rank 0's to report."""
        ids, max_tokens, sampling, stop, logprobs, constraint = message
        try:
            self._generate(Job(ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stop, logprobs=logprobs,
                               constraint=self.compile(constraint)))
        except LollmError:
            pass

    def stop_followers(self) -> bool:
        """Rank 0 under --tp, at the end: tell the other ranks to return from :meth:`follow`.

        Best effort: False when they did not take the message (Ctrl-C reached them too and they are gone).
        """
        try:
            self.worker.submit(ranks.broadcast, self.group, None).result(timeout=60)
            return True
        except Exception as error:
            log.info("--tp: the other ranks did not take the stop message: %s", error)
            return False
