"""Streamed answers of ``lollm serve`` (``stream: true``): server-sent events, in the shape of each API (a :class:`Shaper`)."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Protocol, Union

from lollm.errors import LollmError
from lollm.generate.loop import GenerationResult
from lollm.generate.sequence import TokenLogprobs
from lollm.serve.answers import FINISH_REASON, SHUTDOWN, Chunk, usage
from lollm.serve.model_server import ModelServer
from lollm.serve.reasoning import ReasoningSplitter
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
#: any thread when the server's shutdown ends the stream (lollm.serve.shutdown).
Item = tuple[str, Union[str, TokenLogprobs, GenerationResult, BaseException, None]]


def sse(payload: object, event: str | None = None) -> str:
    """One server-sent event carrying ``payload`` as JSON (named ``event`` when given: Anthropic's and Responses' way)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Shaper(Protocol):
    """One API's shape of a streamed answer: each piece of the generation becomes the events that API sends.

    ``entries``: the logprobs of the tokens since the last event (Chat Completions sends them;
    the other APIs drop them). Every method returns the events to send, in order.
    """

    def opening(self) -> list[str]: ...

    def reasoning(self, text: str, entries: list[TokenLogprobs]) -> list[str]: ...

    def text(self, text: str, entries: list[TokenLogprobs]) -> list[str]: ...

    def call(self, call: ToolCall, entries: list[TokenLogprobs]) -> list[str]: ...

    def closing(self, result: GenerationResult | None, entries: list[TokenLogprobs]) -> list[str]: ...

    def failure(self, error: ApiError) -> list[str]: ...


class ChunkShaper:
    """OpenAI's streamed chunks (Chat Completions and Completions): ``data: {chunk}`` events, then ``data: [DONE]``."""

    def __init__(self, chunk: Chunk, include_usage: bool):
        self.chunk, self.include_usage = chunk, include_usage
        self.calls = 0  # tool calls sent so far (each has its index)

    def opening(self) -> list[str]:
        return [sse(self.chunk(None, None, None))]  # the first chunk: the assistant's role

    def reasoning(self, text: str, entries: list[TokenLogprobs]) -> list[str]:
        return [sse(self.chunk("", entries, None, reasoning=text))]

    def text(self, text: str, entries: list[TokenLogprobs]) -> list[str]:
        return [sse(self.chunk(text, entries, None))]

    def call(self, call: ToolCall, entries: list[TokenLogprobs]) -> list[str]:
        deltas = call.deltas(self.calls)
        self.calls += 1
        return [sse(self.chunk("", entries if i == 0 else None, None, [delta])) for i, delta in enumerate(deltas)]

    def closing(self, result: GenerationResult | None, entries: list[TokenLogprobs]) -> list[str]:
        events = [sse(self.chunk("", entries, None))] if entries else []
        finish = FINISH_REASON[result.stop_reason] if result is not None else "stop"
        events.append(sse(self.chunk("", None, "tool_calls" if self.calls and finish == "stop" else finish)))
        if self.include_usage and result is not None:
            events.append(sse({**self.chunk("", None, None), "choices": [], "usage": usage(result)}))
        return events + ["data: [DONE]\n\n"]

    def failure(self, error: ApiError) -> list[str]:
        return [sse(error.body()), "data: [DONE]\n\n"]


class EventStream:
    """The server-sent events of one streamed generation (``stream: true``), in the shape of one API.

    The engine thread (or the single worker) generates and puts what it makes on a queue
    (:meth:`on_text`, :meth:`on_token`, then the result or the error, :meth:`settled`);
    :meth:`events`, on the event loop, reads the text (the thinking split off by
    :class:`~lollm.serve.reasoning.ReasoningSplitter`, then tool calls by
    :class:`~lollm.serve.tools.ToolCallParser`) and hands each piece to the
    :class:`Shaper`, whose events it sends. The job is submitted by :meth:`start`, before
    the answer begins, so a full queue is still a plain 503. An error after the first event
    is sent as an error event (a bug: one log line, as for a 500).
    """

    def __init__(self, server: ModelServer, plan: PreparedRequest, shaper: Shaper, where: str):
        self.server, self.plan, self.shaper, self.where = server, plan, shaper, where
        job = plan.job
        #: with tools, the text is read for calls before it is sent (lollm.serve.tools)
        self.parser: ToolCallParser | None = job.tools.parser() if job.tools is not None else None
        self.splitter = ReasoningSplitter(job.reasoning) if job.reasoning is not None else None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        job.on_text, job.on_token = self.on_text, self.on_token
        job.on_shutdown = lambda: self.put(("shutdown", None))
        self.new_ids: list[int] = []  # the tokens generated so far (the usage of a stream the shutdown ends)

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
        self.new_ids.append(token)
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
    def failed(self, error: BaseException) -> list[str]:
        if isinstance(error, LollmError):
            log.info("%s: generation refused: %s", self.where, error)
            return self.shaper.failure(ApiError(400, str(error)))
        return self.shaper.failure(internal_error(self.where, error))

    def read(self, pieces: list[tuple[str, str]], pending: list[TokenLogprobs]) -> Iterator[str]:
        """The events of ``pieces`` (("reasoning" | "content", text)): content is read for tool calls; logprobs ride along."""
        for kind, text in pieces:
            if kind == "reasoning":
                yield from self.shaper.reasoning(text, self.take(pending))
                continue
            for event in self.parser.feed(text) if self.parser is not None else [text]:
                yield from self.piece(event, pending)

    def piece(self, event: str | ToolCall, pending: list[TokenLogprobs]) -> list[str]:
        if isinstance(event, ToolCall):
            return self.shaper.call(event, self.take(pending))
        return self.shaper.text(event, self.take(pending))

    @staticmethod
    def take(pending: list[TokenLogprobs]) -> list[TokenLogprobs]:
        taken = list(pending)
        pending.clear()
        return taken

    def split(self, piece: str) -> list[tuple[str, str]]:
        return self.splitter.feed(piece) if self.splitter is not None else [("content", piece)]

    def finished(self, result: GenerationResult | None, pending: list[TokenLogprobs]) -> Iterator[str]:
        """The last events: thinking, text or calls held back, then the shaper's end (finish reason, usage)."""
        if result is not None:
            if self.splitter is not None:
                yield from self.read(self.splitter.finish(), pending)
            if self.parser is not None:
                for event in self.parser.finish(closed=self.plan.job.tools.closed_by(result.stop_reason)):
                    yield from self.piece(event, pending)
        yield from self.shaper.closing(result, self.take(pending))

    async def events(self) -> AsyncIterator[str]:
        """The events: the shaper's opening, then the pieces as they come, then its closing."""
        pending: list[TokenLogprobs] = []
        try:
            for event in self.shaper.opening():
                yield event
            while True:
                kind, value = await self.queue.get()
                if kind == "token":
                    pending.append(value)
                elif kind == "text":
                    for event in self.read(self.split(value), pending):
                        yield event
                elif kind == "shutdown":  # the server stops (lollm.serve.shutdown): the last events now
                    stopped = GenerationResult(prompt_ids=list(self.plan.job.ids), new_ids=list(self.new_ids),
                                               stop_reason=SHUTDOWN)
                    for event in self.finished(stopped, pending):
                        yield event
                    break
                elif kind == "error":
                    for event in self.failed(value):
                        yield event
                    break
                else:  # done
                    for event in self.finished(value, pending):
                        yield event
                    break
        except Exception as error:  # a bug while writing the events
            for event in self.failed(error):
                yield event
        finally:
            self.plan.job.cancel.set()  # no-op after the end; stops the generation of a client that went away


def stream(server: ModelServer, plan: PreparedRequest, shaper: Shaper, where: str) -> StreamingResponse:
    """The StreamingResponse of ``plan``'s generation as server-sent events (:class:`EventStream`); ApiError 503 when full."""
    events = EventStream(server, plan, shaper, where)
    events.start()
    return events.response()
