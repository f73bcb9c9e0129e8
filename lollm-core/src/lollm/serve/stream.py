"""Streamed answers of ``lollm serve`` (``stream: true``): server-sent events, one per chunk."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Union

from lollm.errors import LollmError
from lollm.generate.loop import GenerationResult
from lollm.generate.sequence import TokenLogprobs
from lollm.serve.answers import FINISH_REASON, Chunk, usage
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import ApiError, PreparedRequest, internal_error
from lollm.serve.tool_formats import ToolCall
from lollm.serve.tools import ToolCallParser

# Lazy import below: starlette is the optional ``serve`` extra, imported where the response is made
# (and here for type checkers only), so this module loads without it.
if TYPE_CHECKING:
    from starlette.responses import StreamingResponse
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("lollm.serve.server")  # one logger for the whole server (docs/serving.md)

#: What the generating thread hands the event loop: ("text", str), ("token", TokenLogprobs),
#: then ("done", GenerationResult | None) or ("error", BaseException); or ("shutdown", None) from
#: any thread when the server stops it (lollm.serve.shutdown).
Item = tuple[str, Union[str, TokenLogprobs, GenerationResult, BaseException, None]]


def sse(payload: object) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStream:
    """The server-sent events of one streamed generation (``stream: true``).

    The engine thread (or the single worker) generates and puts what it makes on a queue
    (:meth:`on_text`, :meth:`on_token`, then the result or the error, :meth:`settled`);
    :meth:`events`, on the event loop, turns each into an event made by
    ``chunk(text, logprobs, finish_reason)``. The job is submitted by :meth:`start`, before
    the answer begins, so a full queue is still a plain 503. An error after the first event
    is sent as an error event (a bug: one log line, as for a 500).
    """

    def __init__(self, server: ModelServer, plan: PreparedRequest, chunk: Chunk, where: str):
        self.server, self.plan, self.chunk, self.where = server, plan, chunk, where
        #: with tools, the text is read for calls before it is sent (lollm.serve.tools); calls sent so far
        self.parser: ToolCallParser | None = plan.job.tools.parser() if plan.job.tools is not None else None
        self.calls = 0
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        plan.job.on_text, plan.job.on_token = self.on_text, self.on_token
        plan.job.on_shutdown = lambda: self.put(("shutdown", None))

    def start(self) -> None:
        """Submit the job (ApiError 503 when the queue is full); its end comes to :meth:`settled`."""
        self.server.submit(self.plan.job).add_done_callback(self.settled)

    def response(self) -> StreamingResponse:
        """The Starlette StreamingResponse of :meth:`events`; when it ends, however it ends, the job is cancelled."""
        from starlette.responses import StreamingResponse

        cancel = self.plan.job.cancel

        class Response(StreamingResponse):
            async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
                try:
                    await super().__call__(scope, receive, send)
                finally:  # a no-op after the end; stops a generation whose client went away, even before the first event
                    cancel.set()

        return Response(self.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- the generating thread's side ---------------------------------------------------------
    def put(self, item: Item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_text(self, piece: str) -> None:
        self.put(("text", piece))

    def on_token(self, token: int, logprobs: TokenLogprobs | None) -> None:
        if logprobs is not None and token not in self.server.stop_ids:
            self.put(("token", logprobs))

    def settled(self, future: Future[GenerationResult | None]) -> None:
        """The job's Future is done: its result, or its error, goes on the queue last."""
        if future.cancelled():  # the server is closing
            self.put(("done", None))
            return
        error = future.exception()
        self.put(("done", future.result()) if error is None else ("error", error))

    # -- the event loop's side ----------------------------------------------------------------
    def failed(self, error: BaseException) -> str:
        if isinstance(error, LollmError):
            log.info("%s: generation refused: %s", self.where, error)
            return sse(ApiError(400, str(error)).body())
        return sse(internal_error(self.where, error).body())

    def pieces(self, events: list[str | ToolCall], pending: list[TokenLogprobs]) -> Iterator[str]:
        """The chunks of generated text (content) and tool calls (``delta.tool_calls``); logprobs ride along."""
        for event in events:
            if isinstance(event, ToolCall):
                for delta in event.deltas(self.calls):
                    yield sse(self.chunk("", pending, None, [delta]))
                    pending.clear()
                self.calls += 1
            else:
                yield sse(self.chunk(event, pending, None))
                pending.clear()

    def finished(self, result: GenerationResult | None, pending: list[TokenLogprobs]) -> Iterator[str]:
        """The last events: text or calls held back, logprobs not sent yet, the finish reason, the usage when asked."""
        if self.parser is not None and result is not None:
            yield from self.pieces(self.parser.finish(closed=self.plan.job.tools.closed_by(result.stop_reason)), pending)
        if pending:
            yield sse(self.chunk("", pending, None))
        finish = FINISH_REASON[result.stop_reason] if result is not None else "stop"
        if self.plan.job.shutdown:  # stopped by the server's shutdown (lollm.serve.shutdown), as vLLM's "abort"
            finish = "shutdown"
        yield sse(self.chunk("", None, "tool_calls" if self.calls and finish == "stop" else finish))
        if self.plan.include_usage and result is not None:
            yield sse({**self.chunk("", None, None), "choices": [], "usage": usage(result)})

    async def events(self) -> AsyncIterator[str]:
        """The events: the assistant's role, then text (with its logprobs) as it comes, the end, ``[DONE]``."""
        pending: list[TokenLogprobs] = []
        try:
            yield sse(self.chunk(None, None, None))  # the first chunk: the assistant's role
            while True:
                kind, value = await self.queue.get()
                if kind == "token":
                    pending.append(value)
                elif kind == "text":
                    for event in self.pieces(self.parser.feed(value) if self.parser else [value], pending):
                        yield event
                elif kind == "error":
                    yield self.failed(value)
                    break
                elif kind == "shutdown":  # the server stops: a clean end now, whatever the engine still does
                    if pending:
                        yield sse(self.chunk("", pending, None))
                    yield sse(self.chunk("", None, "shutdown"))
                    break
                else:  # done
                    for event in self.finished(value, pending):
                        yield event
                    break
            yield "data: [DONE]\n\n"
        except Exception as error:  # a bug while writing the events
            yield self.failed(error)
        finally:
            self.plan.job.cancel.set()  # no-op after the end; stops the generation of a client that went away


def stream(server: ModelServer, plan: PreparedRequest, chunk: Chunk, where: str) -> StreamingResponse:
    """The StreamingResponse of ``plan``'s generation as server-sent events (:class:`EventStream`); ApiError 503 when full."""
    events = EventStream(server, plan, chunk, where)
    events.start()
    return events.response()
