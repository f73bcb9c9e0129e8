"""The engine driver: the one loop that steps an :class:`lollm.engine.Engine`, and what each request reads of it.

::

    callers (any thread)                  the stepping thread (EngineLoop.step, in a loop)
    ─────────────────────────             ──────────────────────────────────────────────
    submit(job) ─► inbox ───────────────► engine.add_request(...)      joins at the next step
                                           engine.step()  ─► EngineOutput per request
    on_text / on_token ◄─ EngineRun.feed ◄─┘  text, stop strings, logprobs (lollm.generate.loop.stream_text)
    future.result() ◄──── the GenerationResult once the request ends (or engine.abort on a stop string)
    job.cancel (client gone) ───────────► engine.abort(id): its blocks return to the pool

Every caller of the engine goes through this one loop body, :meth:`EngineLoop.step`, run one of
two ways:

* **in a background thread** (``EngineLoop(engine, ...)``): ``lollm serve``; HTTP handlers
  :meth:`~EngineLoop.submit` jobs from the event loop and wait on their Futures;
* **in the caller's thread** (``EngineLoop(engine, ..., background=False)``): ``lollm.LLM.generate``
  (and ``lollm run`` with several prompts), ``lollm bench --concurrency`` and the conformance kit's
  batching checks :meth:`~EngineLoop.add` their jobs, then call :meth:`~EngineLoop.step` (or
  :meth:`~EngineLoop.run_until_done`) themselves.

The engine works in token ids. Everything a request needs on top of them is the single-sequence
loop's own machinery, run once per request by its :class:`EngineRun` (the one output adapter):
the incremental detokenizer and the stop-string watcher of :func:`lollm.generate.loop.stream_text`
(fed one :class:`~lollm.generate.sequence.Step` at a time as the engine makes it), collected into a
:class:`~lollm.generate.loop.GenerationResult` as ``generate`` collects it. So a request reads the
same through the engine as through ``generate``; only the forward it rides in is shared.

The queue in front of the engine may be bounded (:class:`QueueFull` when ``max_queue`` requests
already wait): a server that accepted every request would hold each of them for ever longer
instead of telling the client to come back (``503`` with ``Retry-After``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from lollm.engine.cache import pool_blocks
from lollm.engine.engine import DEFAULT_POSITIONS_PER_SEQUENCE, Engine, EngineOutput
from lollm.engine.scheduler import Request
from lollm.errors import GenerationError
from lollm.generate.loop import GenerationResult, stream_text
from lollm.generate.sequence import Step, StopReason, TokenLogprobs
from lollm.generate.structured import CompiledConstraint
from lollm.model import CausalLM
from lollm.sampling_params import SamplingParams
from lollm.tokenizer.tokenizer import Tokenizer
from lollm.vision.spec import ImageBatch

log = logging.getLogger("lollm.serve.server")

__all__ = ["DEFAULT_POSITIONS_PER_SEQUENCE", "EngineJob", "EngineLoop", "EngineRun", "Job", "QueueFull",
           "serve_kv_blocks"]


class QueueFull(Exception):
    """More requests wait for the engine than the server's ``--max-queue``."""


class ToolsView(Protocol):
    """What the driver asks of a request's tools (:class:`lollm.serve.tools.ToolRequest`): the tokenizer to decode with."""

    def text_of(self, tokenizer: Tokenizer) -> Tokenizer: ...


class Job(Protocol):
    """One request as the driver reads it (:class:`lollm.serve.server.Job` and :class:`EngineJob` are two).

    ids: the prompt's token ids; max_tokens: its token budget; sampling, logprobs (N or None),
    constraint (compiled, or None): as :func:`lollm.generate.loop.generate` takes them; stop: stop strings;
    cancel: set it to end the request (a client that went away); on_token(id, logprobs or None) and
    on_text(piece): called as its tokens come; tools: the tools view of its answer, or None;
    images (optional): the prompt's placed :class:`lollm.vision.spec.ImageBatch`, or None.
    """

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    logprobs: int | None
    cancel: threading.Event
    on_text: Callable[[str], None] | None
    on_token: Callable[[int, TokenLogprobs | None], None] | None
    tools: ToolsView | None
    constraint: CompiledConstraint | None


@dataclass
class EngineJob:
    """A :class:`Job` for callers without a server: ``lollm.LLM``, the batching benchmark, the kit's checks.

    index: the caller's own number for it (``LLM``: the prompt's place in its list).
    """

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    constraint: CompiledConstraint | None = None
    on_text: Callable[[str], None] | None = None
    on_token: Callable[[int, TokenLogprobs | None], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    tools: ToolsView | None = None
    index: int = 0
    images: ImageBatch | None = None


def serve_kv_blocks(model: CausalLM, context: int, max_running: int, block_size: int) -> int:
    """Blocks of the pool ``lollm serve`` makes when ``--kv-blocks`` is not given (:func:`lollm.engine.cache.pool_blocks`).

    Room for ``max_running`` sequences of ``min(context, 2048)`` positions, and at least for one
    request that fills the context; at most half the device's free memory, but never less than
    one full context (then the request waits for memory rather than being refused). Raises
    LollmError (a GenerationError) when even one context does not fit in the free memory.
    """
    positions = [min(context, DEFAULT_POSITIONS_PER_SEQUENCE)] * max_running
    return pool_blocks(model, positions, block_size=block_size, max_running=max_running, at_least=context,
                       advice="lower --ctx-size")


class EngineRun:
    """One request on its way through the engine: its text, stops and result, fed one token at a time.

    job:       the request (a :class:`Job`: ids, limits, sampling, stops, callbacks, cancel flag).
    tokenizer: what turns its ids into text (with tools, the tool-reading view of the tokenizer); None: no text.
    stop_ids:  the model's end-of-sequence ids.

    :meth:`feed` runs one :class:`Step` through :func:`lollm.generate.loop.stream_text` (decoder, stop
    strings, end-of-sequence ids) and into :attr:`result`, as ``generate`` collects it, calling
    ``job.on_token`` and ``job.on_text`` on the way. :attr:`times` holds each token's
    ``perf_counter`` (the benchmark's and ``LLM``'s token times); :attr:`future` resolves to the
    result once the request ends (None if cancelled before it began, the error if it failed).
    """

    def __init__(self, job: Job, tokenizer: Tokenizer | None, stop_ids: frozenset[int]):
        self.job, self.stop_ids = job, frozenset(stop_ids)
        self.future: Future[GenerationResult | None] = Future()
        self.result = GenerationResult(prompt_ids=list(job.ids))
        self.request: Request | None = None  # the engine's record (cached tokens), once added
        self.request_id: str | None = None
        self.submitted = time.perf_counter()
        self.first: float | None = None  # perf_counter of the first token
        self.times: list[float] = []
        self._steps: deque[Step] = deque()
        # stream_text pulls steps from an iterator: this one hands out the step just fed (never empty when asked)
        self._pieces = stream_text(iter(self._steps.popleft, None), tokenizer, stop_ids=self.stop_ids,
                                   stop_strings=job.stop)

    def feed(self, step: Step) -> bool:
        """Take the engine's next token for this request; True when the request is over (its stop_reason is set)."""
        self._steps.append(step)
        piece = next(self._pieces)  # exactly one TextStep per Step
        result = self.result
        if self.first is None:
            self.first = step.time
            result.prefill_seconds = step.time - self.submitted  # the wait in the queue included: time to first token
        result.new_ids.append(step.token)
        self.times.append(step.time)
        if step.logprobs is not None:
            result.logprobs.append(step.logprobs)
        if self.job.on_token is not None:
            self.job.on_token(step.token, step.logprobs)
        if piece.text:
            result.text += piece.text
            if self.job.on_text is not None:
                self.job.on_text(piece.text)
        result.decode_seconds = step.time - self.first
        if piece.stop_reason is None:
            return False
        result.stop_reason = piece.stop_reason
        return True


class StepMetrics(Protocol):
    """What the driver tells a server's metrics (:class:`lollm.serve.metrics.ServerMetrics`)."""

    def engine_step(self, requests: int) -> None: ...

    def token(self, time_to_first: float | None = None) -> None: ...


#: ``report(job, result or None, outcome)``: a request ended, outcome "completed", "cancelled" or "failed".
Report = Callable[[Job, GenerationResult | None, str], None]


class EngineLoop:
    """The engine driver: the one loop that steps an :class:`lollm.engine.Engine`, and its inbox.

    engine:     the engine (its ``step`` runs on the stepping thread only).
    tokenizer:  the model's tokenizer (None: ids only, no text); stop_ids: its end-of-sequence ids.
    max_queue:  the most requests that may wait (not yet running) before :meth:`submit` refuses (None: no bound).
    report:     ``report(job, result or None, outcome)`` once a request ends, outcome "completed",
                "cancelled" or "failed" (the server's counters, log line and metrics).
    metrics:    a :class:`StepMetrics` (the server's), or None.
    background: True: a daemon thread runs :meth:`run` (the server); False: the caller steps it in its
                own thread (:meth:`step`, :meth:`steps`, :meth:`run_until_done`).
    """

    def __init__(self, engine: Engine, *, tokenizer: Tokenizer | None = None, stop_ids: frozenset[int] | set[int] = frozenset(),
                 max_queue: int | None = None, report: Report | None = None, metrics: StepMetrics | None = None,
                 background: bool = True):
        self.engine, self.tokenizer, self.stop_ids = engine, tokenizer, frozenset(stop_ids)
        self.max_queue, self.report, self.metrics = max_queue, report, metrics
        self.inbox: deque[EngineRun] = deque()
        self.active: dict[str, EngineRun] = {}
        self.wake = threading.Condition()
        self.stopped = False
        #: set by shed_waiting: called at the next step on the job of every request not yet running
        self.shedding: Callable[[Job], None] | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(target=self.run, name="lollm-engine", daemon=True)
            self.thread.start()

    # -- any thread ---------------------------------------------------------------------------
    def waiting(self) -> int:
        """Requests not running yet: in this inbox, or in the engine's waiting queue (preempted ones too)."""
        return len(self.inbox) + self.engine.stats()["waiting"]

    def add(self, job: Job) -> EngineRun:
        """Queue ``job`` (it joins the engine at the next step); its :class:`EngineRun`. QueueFull when full."""
        tokenizer = job.tools.text_of(self.tokenizer) if job.tools is not None else self.tokenizer
        run = EngineRun(job, tokenizer, self.stop_ids)
        with self.wake:
            if self.max_queue is not None and self.waiting() >= self.max_queue:
                raise QueueFull(f"{self.waiting()} requests are waiting (lollm serve --max-queue {self.max_queue})")
            self.inbox.append(run)
            self.wake.notify()
        return run

    def submit(self, job: Job) -> Future[GenerationResult | None]:
        """Queue ``job``; a Future of its GenerationResult (None if cancelled before it began). QueueFull when full."""
        return self.add(job).future

    def busy(self) -> bool:
        """True while a request waits in the inbox or is in the engine."""
        return bool(self.inbox) or self.engine.has_unfinished()

    def shed_waiting(self, end: Callable[[Job], None]) -> None:
        """Any thread: at the next step, call ``end(job)`` for each request not running yet (a server shutting down).

        "Not running": in the inbox, or in the engine's waiting queue without a token. ``end`` is expected
        to set the job's cancel flag, so the same step takes those requests out (outcome "cancelled").
        """
        with self.wake:
            self.shedding = end
            self.wake.notify()

    def close(self) -> None:
        """Stop the thread after its current step (requests still in it are not answered)."""
        with self.wake:
            self.stopped = True
            self.wake.notify()

    # -- the stepping thread ------------------------------------------------------------------
    def run(self) -> None:
        """The background thread: until closed, wait for work, then :meth:`step`."""
        while True:
            with self.wake:
                while not (self.inbox or self.engine.has_unfinished() or self.stopped):
                    self.wake.wait()
                if self.stopped:
                    return
            self.step()

    def steps(self) -> Iterator[list[EngineOutput]]:
        """In the caller's thread: :meth:`step` until no request is left, yielding each step's outputs."""
        while self.busy():
            yield self.step()

    def run_until_done(self) -> None:
        """In the caller's thread: :meth:`step` until every request added so far has ended."""
        for _ in self.steps():
            pass

    def step(self) -> list[EngineOutput]:
        """The loop body: take new requests, abort those cancelled, run one engine step, dispatch its tokens.

        Returns the step's outputs (empty when the engine had nothing to run).
        """
        with self.wake:
            new = list(self.inbox)
        for run in new:
            self._add(run)
            with self.wake:  # left in the inbox until the engine holds it: never uncounted by waiting()
                self.inbox.popleft()
        if self.shedding is not None:
            self._shed()
        for run in [r for r in self.active.values() if r.job.cancel.is_set()]:
            self.engine.abort(run.request_id)
            self._end(run, "cancelled")
        return self._step() if self.engine.has_unfinished() else []

    def _shed(self) -> None:
        """The stepping thread: hand every request not running yet to the ``end`` of :meth:`shed_waiting`."""
        with self.wake:
            end, self.shedding = self.shedding, None
        running = {id(req) for req in self.engine.scheduler.running}
        for run in list(self.active.values()):
            if id(run.request) not in running and run.request.generated == 0:
                end(run.job)

    def _add(self, run: EngineRun) -> None:
        """Hand a request to the engine (a refused one ends here, its error in its Future)."""
        job = run.job
        if job.cancel.is_set():
            self._settle(run, None, "cancelled")
            return
        try:
            run.request_id = self.engine.add_request(job.ids, sampling=job.sampling, max_new_tokens=job.max_tokens,
                                                     stop_ids=self.stop_ids, logprobs=job.logprobs,
                                                     constraint=job.constraint, images=getattr(job, "images", None))
        except GenerationError as error:
            self._settle(run, error, "failed")
            return
        run.request = self.engine.requests[run.request_id]
        self.active[run.request_id] = run

    def _step(self) -> list[EngineOutput]:
        """One engine step; each new token goes to its request, which may end (a stop string: engine.abort)."""
        try:
            outputs = self.engine.step()
        except Exception as error:  # a failing forward: every request in flight gets the error, the engine goes on empty
            for run in list(self.active.values()):
                self.engine.abort(run.request_id)
                self.active.pop(run.request_id)
                self._settle(run, error, "failed")
            return []
        if self.metrics is not None and outputs:
            self.metrics.engine_step(len(outputs))
        for out in outputs:
            run = self.active.get(out.request_id)
            if run is None:
                continue
            first = run.first is None
            try:
                over = run.feed(out.step)
            except Exception as error:  # the decoder or a callback failed: this request ends with the error
                self.engine.abort(run.request_id)
                self.active.pop(run.request_id)
                self._settle(run, error, "failed")
                continue
            if self.metrics is not None:
                self.metrics.token(run.first - run.submitted if first else None)
            if over:
                if not out.finished:  # a stop string: the engine does not know it, so it is told
                    self.engine.abort(run.request_id)
                self._end(run, "completed")
        return outputs

    def _end(self, run: EngineRun, outcome: str) -> None:
        """A request that ran in the engine is over: its result (cached tokens from the engine) goes out."""
        self.active.pop(run.request_id, None)
        if outcome == "cancelled":
            run.result.stop_reason = StopReason.CANCELLED
        run.result.reused_tokens = run.request.cached_tokens
        self._settle(run, run.result, outcome)

    def _settle(self, run: EngineRun, value: GenerationResult | BaseException | None, outcome: str) -> None:
        """Report the end (counters, log line, metrics), then resolve the request's Future."""
        result = value if isinstance(value, GenerationResult) else None
        try:
            if self.report is not None:
                self.report(run.job, result, outcome)
        except Exception:  # a report must never take the engine thread down
            log.exception("reporting a finished request failed")
        if isinstance(value, BaseException):
            run.future.set_exception(value)
        else:
            run.future.set_result(value)
