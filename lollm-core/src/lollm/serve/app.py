"""The HTTP side of ``lollm serve``: the Starlette application, its routes, and the uvicorn server that runs it.

Starlette (routing, requests, streaming responses) and uvicorn (the HTTP
server) come with the ``lollm-core[serve]`` extra; this module imports them
only inside the functions that use them (:func:`create_app`, the handlers of
:class:`Routes`, :func:`serve`), so it loads without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shlex
import threading
import time
import weakref
from importlib import resources
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from lollm.errors import LollmError
from lollm.generate.loop import GenerationResult
from lollm.serve import messages as anthropic_messages
from lollm.serve.responses import Responses
from lollm.serve.answers import ANSWERS, CHUNKS, answer_base
from lollm.serve.error_shapes import anthropic_error
from lollm.serve.metrics import CONTENT_TYPE
from lollm.serve.model_server import ModelServer
from lollm.serve.models import ServedModels, check_metrics_available
from lollm.serve.guard import Guard, GuardConfig
from lollm.serve.openapi import openapi_schema
from lollm.serve.requests import ApiError, Job, internal_error, log_refusal
from lollm.serve.stream import ChunkShaper, stream
from lollm.serve.thinking_budget import budgeted

# Lazy imports below: starlette and uvicorn are the optional ``serve`` extra, imported inside the
# functions that use them (and here for type checkers only), so this module loads without them.
if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

log = logging.getLogger("lollm.serve.server")  # one logger for the whole server (docs/serving.md)

#: Bytes of an oversized body read (and dropped) before its 413 is sent, so that a client that
#: writes its whole body before it reads the answer sees the 413 rather than a reset connection.
DRAIN_BYTES = 64 << 20


# -- HTTP ------------------------------------------------------------------------------------


def too_large(limit: int, rule: str) -> ApiError:
    """The 413 of a body over ``limit`` bytes; ``rule``: what the limit is made of (lollm.serve.requests.body_limit_rule)."""
    return ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes ({rule})",
                    code="request_too_large")


async def read_limited(request: Request, limit: int, rule: str) -> bytes:
    """The body of a Starlette ``request``: at most ``limit`` bytes, else ApiError 413 saying ``rule`` (:func:`too_large`).

    An oversized body is still read, and dropped, up to :data:`DRAIN_BYTES`
    (then the connection is given up), so that a client that writes all of
    its body before it reads the answer gets the 413. Nothing is kept past
    ``limit``; a Content-Length above DRAIN_BYTES is refused before any is read.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_BYTES:
        raise too_large(limit, rule)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        else:
            chunks = []
            if size > DRAIN_BYTES:
                break
    if size > limit:
        raise too_large(limit, rule)
    return b"".join(chunks)


async def wait(server: ModelServer, request: Request, job: Job) -> GenerationResult | None:
    """Run ``job`` (:meth:`ModelServer.submit`); cancel it if the client disconnects meanwhile (or the server stops).

    ApiError 503 at once when the queue is full, and when the server's shutdown ends the job
    (lollm.serve.shutdown: queued when it began, or still running at its deadline).
    """
    future = asyncio.wrap_future(server.submit(job))
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.25)
            result = future.result() if done else None
            if job.shutdown and (result is None or result.stop_reason == "cancelled"):
                raise ApiError(503, "the server is shutting down: the request was stopped", kind="server_error",
                               code="server_shutting_down")
            if done:
                return result
            if not job.cancel.is_set() and await request.is_disconnected():
                job.cancel.set()
    finally:
        if not future.done():
            job.cancel.set()


def banner(server: ModelServer, family: str, host: str, port: int) -> list[str]:
    """The lines ``lollm serve`` prints once it listens: where, what, a curl line to paste, and how requests run."""
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = "127.0.0.1"
    root = f"http://{shown}:{port}"
    if server.tokenizer.chat_template is not None:
        endpoint, body = "chat/completions", {"model": server.name, "messages": [{"role": "user", "content": "Hello!"}]}
    else:  # a base model: its /v1/chat/completions answers 400, so the line shows a plain prompt
        endpoint, body = "completions", {"model": server.name, "prompt": "Once upon a time", "max_tokens": 32}
    body = json.dumps(body)
    key = ' -H "Authorization: Bearer $LOLLM_API_KEY"' if server.api_key else ""  # the key itself is never printed
    if server.engine_loop is not None:
        config = server.engine_loop.engine.config
        batching = (f"batched: up to {config.max_sequences} requests at once, {config.kv_blocks} KV blocks of "
                    f"{config.block_size}, {config.max_batch_tokens} tokens a step, {server.max_queue} may wait")
    else:
        batching = f"note: {server.single_reason}"
    lines = [f"lollm serve: {server.name} ({family}, context {server.context}) at {root}/v1"
             + (" (API key required: export LOLLM_API_KEY=<the key> for the curl line below)" if server.api_key else ""),
             f"chat page: {root}/",
             f"try: curl {root}/v1/{endpoint} -H 'Content-Type: application/json'{key} -d {shlex.quote(body)}",
             batching]
    if server.reads_images:  # where its tower comes from, and the body limit that carries images
        source = f"mmproj {server.towers.mmproj}" if server.towers.mmproj else "its checkpoint"
        lines.append(f"images: image_url parts as data: URLs, bodies up to {server.max_body_bytes / 2**20:.1f} MiB; "
                     f"the vision tower from {source}, loaded on the first image")
    return lines


#: The chat page may run its own inline script and style and talk to this server only (no other origin, no frames);
#: its <img> elements show data: URLs only (the thumbnails of the images it attaches, read from the user's files).
CHAT_PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                 "img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def chat_page_html() -> str:
    """The chat page served at ``/``: ``lollm/serve/static/chat.html``, one file with its style and script (no network)."""
    return resources.files("lollm.serve").joinpath("static", "chat.html").read_text(encoding="utf-8")


ErrorShape = Callable[[ApiError], dict]  # an ApiError -> the JSON body of its answer, in one API's shape


def openai_error(error: ApiError) -> dict:
    return error.body()


def error_response(error: ApiError, headers: dict[str, str] | None = None, shape: ErrorShape = openai_error) -> JSONResponse:
    """The JSONResponse of ``error``: its body in ``shape`` (OpenAI's by default), with its status."""
    from starlette.responses import JSONResponse

    return JSONResponse(shape(error), status_code=error.status, headers={**(error.headers or {}), **(headers or {})})


Handler = Callable[["Routes", "Request"], Awaitable["Response"]]  # an async method of Routes


def guarded_as(shape: ErrorShape) -> Callable[[Handler], Handler]:
    """:func:`guarded`, with errors answered in ``shape`` (Anthropic's for /v1/messages)."""

    def guard(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def endpoint(self: Routes, request: Request) -> Response:
            from starlette.requests import ClientDisconnect
            from starlette.responses import Response

            where = f"{request.method} {request.url.path}"
            try:
                return await handler(self, request)
            except ApiError as error:
                log_refusal(where, error)
                return error_response(error, shape=shape)
            except LollmError as error:
                log_refusal(where, ApiError(400, str(error)))
                return error_response(ApiError(400, str(error)), shape=shape)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as error:
                return error_response(internal_error(where, error), shape=shape)

        return endpoint

    return guard


#: The async method ``handler(self, request)`` whose errors become JSON answers (OpenAI's shape): ApiError as it
#: says, LollmError (bad input found deeper: tokenizer, sampler) 400, a client gone while its body was read 499
#: (nobody to answer), any other exception 500.
guarded = guarded_as(openai_error)


class Routes:
    """The HTTP handlers of the models served (:class:`ServedModels`), one method per route; :func:`create_app` wires them."""

    def __init__(self, models: ServedModels):
        self.served = models
        self.schema = openapi_schema(models)
        self.responses = Responses()  # the Responses API and its store of responses (previous_response_id)

    @contextlib.asynccontextmanager
    async def model_for(self, raw: bytes, chat: str | None = None) -> AsyncIterator[ModelServer]:
        """The ModelServer of the model the body names (:meth:`ServedModels.use`: loaded first if need be), held
        while inside; ApiError 413 when the body is over that model's own limit. ``chat``: the conversation's
        field when the request needs a chat template (refused before a load when the model has none)."""
        async with self.served.use(raw, chat) as server:
            if len(raw) > server.max_body_bytes:
                raise too_large(server.max_body_bytes, server.body_rule)
            yield server

    async def generation(self, request: Request, kind: str) -> Response:
        """POST of ``kind`` ("chat" or "completion"): the answer as JSON, or as server-sent events."""
        self.served.check_auth(request.headers.get("authorization"))
        raw = await read_limited(request, self.served.max_body_bytes, self.served.body_rule)
        async with self.model_for(raw, "messages" if kind == "chat" else None) as server:
            return await self.generate(request, server, raw, kind)

    async def generate(self, request: Request, server: ModelServer, raw: bytes, kind: str) -> Response:
        """:meth:`generation` on the model chosen."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse

        plan = await run_in_threadpool(server.prepare, raw, kind)  # JSON, checks, template, tokens: off the loop
        plan.job.endpoint = self.log_name(request, server)
        base = answer_base(server.name, kind)
        if plan.streaming:
            shaper = ChunkShaper(CHUNKS[kind](server.tokenizer, base), plan.include_usage)
            return stream(server, plan, shaper, f"POST {request.url.path}")
        result = await wait(server, request, plan.job)
        if result is None:
            raise ApiError(499, "the request was cancelled")
        return JSONResponse(ANSWERS[kind](server.tokenizer, base, plan.job, result))

    def log_name(self, request: Request, server: ModelServer) -> str:
        """What a request's log line starts with: its path, and with several models the model's name
        (``/v1/chat/completions (gemma)``)."""
        return request.url.path if len(self.served.entries) == 1 else f"{request.url.path} ({server.name})"

    async def authorized_body(self, request: Request) -> bytes:
        """The body of a request whose key is checked: ``Authorization: Bearer``, or ``x-api-key`` (Anthropic's clients)."""
        key = request.headers.get("x-api-key")
        self.served.check_auth(request.headers.get("authorization") or (f"Bearer {key}" if key else None), x_api_key=True)
        return await read_limited(request, self.served.max_body_bytes, self.served.body_rule)

    async def api_generation(self, request: Request, prepare: Callable, shaper: Callable, answer: Callable,
                             chat: str) -> Response:
        """POST of one of the other APIs (Messages, Responses): ``prepare(server, raw)`` makes the plan,
        ``shaper(server, plan)`` shapes its stream, ``answer(server, plan, result)`` its whole answer;
        ``chat``: the API's conversation field (both need a chat template)."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse

        raw = await self.authorized_body(request)
        async with self.model_for(raw, chat) as server:
            plan = await run_in_threadpool(prepare, server, raw)
            plan.job.endpoint = self.log_name(request, server)
            server = budgeted(server, plan)  # a thinking budget runs in two phases (lollm.serve.thinking_budget)
            if plan.streaming:
                return stream(server, plan, shaper(server, plan), f"POST {request.url.path}")
            result = await wait(server, request, plan.job)
            if result is None:
                raise ApiError(499, "the request was cancelled")
            return JSONResponse(await run_in_threadpool(answer, server, plan, result))

    @guarded_as(anthropic_error)
    async def messages(self, request: Request) -> Response:
        return await self.api_generation(request, anthropic_messages.prepare, anthropic_messages.MessagesShaper,
                                         anthropic_messages.answer, "messages")

    @guarded_as(anthropic_error)
    async def count_tokens(self, request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse

        raw = await self.authorized_body(request)
        async with self.model_for(raw, "messages") as server:
            return JSONResponse(await run_in_threadpool(anthropic_messages.count_tokens, server, raw))

    @guarded
    async def create_response(self, request: Request) -> Response:
        api = self.responses
        return await self.api_generation(request, api.prepare, api.shaper, api.answer, "input")

    @guarded
    async def get_response(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        await self.authorized_body(request)
        return JSONResponse(self.responses.retrieve(request.path_params["response_id"]))

    @guarded
    async def chat_completions(self, request: Request) -> Response:
        return await self.generation(request, "chat")

    @guarded
    async def completions(self, request: Request) -> Response:
        return await self.generation(request, "completion")

    @guarded
    async def models(self, request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse

        self.served.check_auth(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": await run_in_threadpool(self.served.listing)})

    @guarded
    async def chat_page(self, request: Request) -> Response:
        from starlette.responses import HTMLResponse

        # the page asks for the key itself: no auth here, it holds no data
        return HTMLResponse(chat_page_html(), headers={"Cache-Control": "no-cache", "Content-Security-Policy": CHAT_PAGE_CSP})

    @guarded
    async def health(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        entries = list(self.served.entries.values())
        if len(entries) == 1:
            server = entries[0].server
            return JSONResponse({"status": "ok", "model": server.name, "requests": dict(server.counts),
                                 "batching": batching(server)})
        return JSONResponse({"status": "ok", "models": [  # several: one entry per model (docs/serving.md)
            {"id": e.name, "loaded": e.server is not None, "loads": e.loads, "waiting": e.waiting, "error": e.error,
             "requests": dict(e.server.counts) if e.server else None,
             "batching": batching(e.server) if e.server else None} for e in entries]})

    @guarded
    async def metrics(self, request: Request) -> Response:
        """Prometheus' text format (lollm.serve.metrics); 501 when prometheus-client is not installed."""
        from starlette.responses import Response

        check_metrics_available()
        return Response(self.served.render_metrics(), headers={"Content-Type": CONTENT_TYPE})

    @guarded
    async def openapi(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse(self.schema)

    async def http_error(self, request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's HTTPException (an unknown path: 404, a wrong method: 405) as an OpenAI-style error."""
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path[:200]}: {error.detail}"
        refusal = ApiError(error.status_code, message, kind=kind)
        log_refusal(f"{request.method} {request.url.path[:200]}", refusal)
        return error_response(refusal, headers=error.headers)


def served(server: ModelServer | ServedModels) -> ServedModels:
    """``server`` as :class:`ServedModels` (one ModelServer: a server of that one model)."""
    return server if isinstance(server, ServedModels) else ServedModels.one(server)


def batching(server: ModelServer) -> dict[str, object] | None:
    """How ``server``'s requests are batched (/health): the engine's settings; None on the one-at-a-time path."""
    if server.engine_loop is None:
        return None
    config = server.engine_loop.engine.config
    return {"max_running": config.max_sequences, "kv_blocks": config.kv_blocks, "block_size": config.block_size,
            "max_queue": server.max_queue, "prefix_caching": server.engine_loop.engine.scheduler.prefix_caching}


def create_app(server: ModelServer | ServedModels) -> Starlette:
    """The Starlette application serving ``server`` (one model, or several: :class:`ServedModels`): :class:`Routes`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    routes = Routes(served(server))
    return Starlette(routes=[
        Route("/", routes.chat_page, methods=["GET"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/messages", routes.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
        Route("/v1/responses", routes.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", routes.get_response, methods=["GET"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/openapi.json", routes.openapi, methods=["GET"]),
    ], exception_handlers={HTTPException: routes.http_error})


def serve(server: ModelServer | ServedModels, *, host: str = "127.0.0.1", port: int = 8000, family: str = "",
          shutdown_timeout: float = 20.0, guard: GuardConfig | None = None) -> bool:
    """Serve until SIGTERM or Ctrl-C (uvicorn); once it listens, log :func:`banner` (the URL, the model, a curl line).

    The application is wrapped in :class:`lollm.serve.guard.Guard` (Host, Origin, CORS, JSON bodies;
    ``guard``: who may talk to it, default the bound ``host`` alone); the shutdown lets running requests
    go on for ``shutdown_timeout`` seconds, then ends them (:mod:`lollm.serve.shutdown`) and returns
    True when a signal (SIGTERM, SIGINT) stopped it. With several models (:class:`ServedModels`), the first
    is loaded now (:meth:`ServedModels.load_first`) and the banner names it, then the others.
    """
    try:
        import uvicorn

        from lollm.serve.shutdown import DrainingServer
    except ImportError:
        raise LollmError("lollm serve needs the serve extra: pip install 'lollm-core[serve]' (starlette, uvicorn)") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    models = served(server)
    first = models.load_first()
    app = Guard(create_app(models), guard or GuardConfig(bound=host))
    # lifespan off: the application has no startup or shutdown hooks, and uvicorn's lifespan task, cancelled by a
    # second Ctrl-C (force quit), would log starlette's CancelledError traceback
    config = uvicorn.Config(app, host=host, port=port, log_level="info", lifespan="off")
    runner = DrainingServer(config, models, shutdown_timeout)
    loaded_first = weakref.ref(first)  # not the model itself: this frame lives as long as the server, and an
    del first, server                  # unloaded model must be freed (the registry alone holds a loaded one)

    def lines(bound: int) -> list[str]:  # the banner, made once the port is known (--port 0: the one the OS chose)
        first = loaded_first()
        if first is None:  # a request for another model unloaded it before the banner came (a tight budget)
            return [f"lollm serve: {models.served_list()} at http://{host}:{bound}/v1"]
        text = banner(first, family, host, bound)
        if len(models.entries) > 1:
            budget = f", --memory-budget {models.budget_bytes / 1e9:g} GB" if models.budget_bytes is not None else ""
            text.insert(1, f"also served (loaded on first use{budget}): "
                           + ", ".join(name for name in models.names if name != first.name))
        return text

    threading.Thread(target=announce, args=(runner, lines), name="lollm-banner", daemon=True).start()
    try:
        runner.run()
    finally:
        models.close()  # the engine threads stop after its step (every request has been answered by now)
    if runner.stopped_line() is None:
        return False
    log.info("%s", runner.stopped_line())
    return True


def announce(runner: uvicorn.Server, lines: Callable[[int], list[str]]) -> None:
    """Log ``lines(port)`` (the :func:`banner`) once the uvicorn ``runner`` listens (its ``started`` flag), with the port
    it bound (``--port 0`` lets the OS choose one: the URLs printed must answer); nothing if it stops first."""
    while not runner.started:
        if runner.should_exit:
            return
        time.sleep(0.05)
    port = runner.config.port
    for server in getattr(runner, "servers", []):
        for sock in server.sockets:
            port = sock.getsockname()[1]
    for line in lines(port):
        log.info("%s", line)


def require_serve_extra() -> None:
    """LollmError naming the extra when starlette or uvicorn is missing (checked before the model loads)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise LollmError(
            f"lollm serve needs the serve extra ({error.name} is missing): pip install 'lollm-core[serve]'"
        ) from None
