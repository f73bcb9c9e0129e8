"""The batched engine behind ``lollm serve``: one thread steps it, every request reads its own tokens.

::

    HTTP handlers (event loop)            engine thread (EngineLoop.run)
    ─────────────────────────             ──────────────────────────────────────────────
    submit(job) ─► inbox ───────────────► engine.add_request(...)      joins at the next step
                                           engine.step()  ─► EngineOutput per request
    on_text / on_token ◄─ EngineRun.feed ◄─┘  text, stop strings, logprobs (lollm.generate.loop.stream_text)
    future.result() ◄──── the GenerationResult once the request ends (or engine.abort on a stop string)
    job.cancel (client gone) ───────────► engine.abort(id): its blocks return to the pool

The engine (:mod:`lollm.engine`) works in token ids. Everything a request needs on top of
them is the single-sequence loop's own machinery, run once per request: the incremental
detokenizer and the stop-string watcher of :func:`lollm.generate.loop.stream_text` (fed one
:class:`~lollm.generate.loop.Step` at a time as the engine makes it), the tool-call reading and
the answers' shapes of :mod:`lollm.serve.server`. So a request reads the same through the engine
as through ``generate``; only the forward it rides in is shared.

The queue in front of the engine is bounded (:class:`QueueFull` when ``max_queue`` requests
already wait): a server that accepted every request would hold each of them for ever longer
instead of telling the client to come back (``503`` with ``Retry-After``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from lollm.errors import GenerationError, LollmError
from lollm.generate.loop import GenerationResult, Step, stream_text

log = logging.getLogger("lollm.serve.server")

#: Positions per sequence the default pool leaves room for, at most (the engine's own default).
DEFAULT_POSITIONS_PER_SEQUENCE = 2048


class QueueFull(Exception):
    """More requests wait for the engine than the server's ``--max-queue``."""


def serve_kv_blocks(model: Any, context: int, max_running: int, block_size: int) -> int:
    """Blocks of the pool ``lollm serve`` makes when ``--kv-blocks`` is not given.

    Room for ``max_running`` sequences of ``min(context, 2048)`` positions, and at least for one
    request that fills the context; at most half the device's free memory, but never less than
    one full context (then the request waits for memory rather than being refused). Raises
    LollmError when even one context does not fit in the free memory.
    """
    from lollm.engine.cache import pool_room

    room = pool_room(model, block_size)
    one_context = -(-context // block_size)
    wanted = max(one_context, max_running * -(-min(context, DEFAULT_POSITIONS_PER_SEQUENCE) // block_size))
    if room.free_bytes is None:
        return wanted
    if one_context * room.block_bytes > room.free_bytes:
        raise LollmError(f"the KV pool needs {one_context * room.block_bytes / 2**20:.0f} MiB for one request of the "
                         f"context ({context} positions), but {room.free_bytes / 2**20:.0f} MiB are free: lower --ctx-size")
    return max(one_context, min(wanted, room.half_free_blocks))


class EngineRun:
    """One request on its way through the engine: its text, stops and result, fed one token at a time.

    job:       the request's :class:`lollm.serve.server.Job` (ids, limits, sampling, stops, callbacks, cancel flag).
    tokenizer: what turns its ids into text (with tools, the tool-reading view of the tokenizer).
    stop_ids:  the model's end-of-sequence ids.

    :meth:`feed` runs one :class:`Step` through :func:`lollm.generate.loop.stream_text` (decoder, stop
    strings, end-of-sequence ids) and into the :class:`GenerationResult`, as ``generate`` collects
    it, calling ``job.on_token`` and ``job.on_text`` on the way.
    """

    def __init__(self, job: Any, tokenizer: Any, stop_ids: set[int]):
        self.job, self.stop_ids = job, frozenset(stop_ids)
        self.future: Future = Future()
        self.result = GenerationResult(prompt_ids=list(job.ids))
        self.request: Any = None  # the engine's Request record, once added
        self.request_id: str | None = None
        self.submitted = time.perf_counter()
        self.first: float | None = None  # perf_counter of the first token
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


class EngineLoop:
    """The thread that steps an :class:`lollm.engine.Engine` for a server, and its bounded inbox.

    engine:    the engine (its ``step`` runs on this loop's thread only).
    tokenizer: the served model's tokenizer; stop_ids: its end-of-sequence ids.
    max_queue: the most requests that may wait (not yet running) before :meth:`submit` refuses.
    report:    ``report(job, result or None, outcome)`` once a request ends, outcome "completed",
               "cancelled" or "failed" (the server's counters, log line and metrics).
    metrics:   a :class:`lollm.serve.metrics.ServerMetrics`, or None.
    """

    def __init__(self, engine: Any, *, tokenizer: Any, stop_ids: set[int], max_queue: int,
                 report: Callable[[Any, GenerationResult | None, str], None], metrics: Any = None):
        self.engine, self.tokenizer, self.stop_ids = engine, tokenizer, stop_ids
        self.max_queue, self.report, self.metrics = max_queue, report, metrics
        self.inbox: deque[EngineRun] = deque()
        self.active: dict[str, EngineRun] = {}
        self.wake = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self.run, name="lollm-engine", daemon=True)
        self.thread.start()

    # -- any thread ---------------------------------------------------------------------------
    def waiting(self) -> int:
        """Requests not running yet: in this inbox, or in the engine's waiting queue (preempted ones too)."""
        return len(self.inbox) + self.engine.stats()["waiting"]

    def submit(self, job: Any) -> Future:
        """Queue ``job``; a Future of its GenerationResult (None if cancelled before it began). QueueFull when full."""
        tokenizer = job.tools.text_of(self.tokenizer) if job.tools is not None else self.tokenizer
        run = EngineRun(job, tokenizer, self.stop_ids)
        with self.wake:
            if self.waiting() >= self.max_queue:
                raise QueueFull(f"{self.waiting()} requests are waiting (lollm serve --max-queue {self.max_queue})")
            self.inbox.append(run)
            self.wake.notify()
        return run.future

    def close(self) -> None:
        """Stop the thread after its current step (requests still in it are not answered)."""
        with self.wake:
            self.stopped = True
            self.wake.notify()

    # -- the engine thread --------------------------------------------------------------------
    def run(self) -> None:
        """Until closed: take new requests, abort those whose client went away, run one step, dispatch its tokens."""
        while True:
            with self.wake:
                while not (self.inbox or self.engine.has_unfinished() or self.stopped):
                    self.wake.wait()
                if self.stopped:
                    return
                new = list(self.inbox)
            for run in new:
                self._add(run)
                with self.wake:  # left in the inbox until the engine holds it: never uncounted by waiting()
                    self.inbox.popleft()
            for run in [r for r in self.active.values() if r.job.cancel.is_set()]:
                self.engine.abort(run.request_id)
                self._end(run, "cancelled")
            if self.engine.has_unfinished():
                self._step()

    def _add(self, run: EngineRun) -> None:
        """Hand a request to the engine (a refused one ends here, its error in its Future)."""
        job = run.job
        if job.cancel.is_set():
            self._settle(run, None, "cancelled")
            return
        try:
            run.request_id = self.engine.add_request(job.ids, sampling=job.sampling, max_new_tokens=job.max_tokens,
                                                     stop_ids=self.stop_ids, logprobs=job.logprobs,
                                                     constraint=job.constraint)
        except GenerationError as error:
            self._settle(run, error, "failed")
            return
        run.request = self.engine.requests[run.request_id]
        self.active[run.request_id] = run

    def _step(self) -> None:
        """One engine step; each new token goes to its request, which may end (a stop string: engine.abort)."""
        try:
            outputs = self.engine.step()
        except Exception as error:  # a failing forward: every request in flight gets the error, the engine goes on empty
            for run in list(self.active.values()):
                self.engine.abort(run.request_id)
                self.active.pop(run.request_id)
                self._settle(run, error, "failed")
            return
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

    def _end(self, run: EngineRun, outcome: str) -> None:
        """A request that ran in the engine is over: its result (cached tokens from the engine) goes out."""
        self.active.pop(run.request_id, None)
        if outcome == "cancelled":
            run.result.stop_reason = "cancelled"
        run.result.reused_tokens = run.request.cached_tokens
        self._settle(run, run.result, outcome)

    def _settle(self, run: EngineRun, value: GenerationResult | BaseException | None, outcome: str) -> None:
        """Report the end (counters, log line, metrics), then resolve the request's Future."""
        result = value if isinstance(value, GenerationResult) else None
        try:
            self.report(run.job, result, outcome)
        except Exception:  # a report must never take the engine thread down
            log.exception("reporting a finished request failed")
        if isinstance(value, BaseException):
            run.future.set_exception(value)
        else:
            run.future.set_result(value)
