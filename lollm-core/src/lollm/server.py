"""``lollm serve``: an OpenAI-compatible HTTP server for one model.

::

    POST /v1/chat/completions   messages ─► chat template ─► token ids ─┐
    POST /v1/completions        prompt text (or ids) ─► token ids ──────┤
                                                                        ▼
                 one worker thread, requests in arrival order: generate(…, prompt_cache)
                                                                        │
                 JSON, or server-sent events (``stream: true``) ◄───────┘
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", ...} and request counters

Requests and answers follow OpenAI's API, so its clients (the ``openai``
package, editors, agent tools) talk to it unchanged; see docs/serving.md.

* One model, one thread: requests wait in a queue and run one at a time
  through one :class:`~lollm.prompt_cache.PromptCache`, so a client that sends
  its growing conversation again reuses what its last request computed
  (``usage.prompt_tokens_details.cached_tokens`` says how much).
* A client that goes away (a closed stream, a dropped connection) cancels its
  generation at the next token.
* A bad request gets a 4xx with an OpenAI-style error body
  (``{"error": {"message", "type", "param", "code"}}``) that names the field;
  a bug gets a 500 with the same shape and no traceback (it goes to the log).
* Message text from clients is encoded with special-token parsing off
  (``Tokenizer.encode_chat(parse_special=False)``): a message cannot forge
  ``<|im_end|>``. A /v1/completions prompt is raw model input, parsed as is.
* Under tensor parallelism (``torchrun … -m lollm serve --tp N``, docs/tensor-parallel.md)
  rank 0 serves HTTP; before each generation its worker broadcasts the job (ids,
  resolved sampling with a concrete seed, stops) and the other ranks, in
  :meth:`ModelServer.follow`, run the same generation in lockstep (the collectives
  need every rank); before each step rank 0's cancel flag is broadcast, so a
  client that goes away stops every rank at the same token.
* Bound to 127.0.0.1 unless told otherwise; ``--api-key`` makes every /v1
  request show ``Authorization: Bearer KEY``.

Starlette (routing, requests, streaming responses) and uvicorn (the HTTP
server) come with the ``lollm-core[serve]`` extra; this module imports them
only inside :func:`create_app` and :func:`serve`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from lollm.errors import LollmError
from lollm.generate import GenerationResult, TokenLogprobs, generate, stop_token_ids
from lollm.prompt_cache import PromptCache
from lollm.sampling import SamplingParams, resolve_sampling

log = logging.getLogger("lollm.server")

#: Fields a client may send that change nothing here, ignored when null or neutral.
IGNORED = {"user": None, "metadata": None, "store": None, "service_tier": None, "parallel_tool_calls": None,
           "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
           "presence_penalty": 0, "frequency_penalty": 0, "n": 1, "best_of": 1, "echo": False, "suffix": None}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
COMMON_FIELDS = {"model", "max_tokens", "seed", "stop", "stream", "stream_options", *SAMPLING_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = ("role", "content", "name", "reasoning_content")
#: Template variables a request may not set through chat_template_kwargs (the server sets them).
RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt"}
FINISH_REASON = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length", "cancelled": "stop"}


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI-style error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- reading a request --------------------------------------------------------------


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in IGNORED and value in (None, IGNORED[name]):
            continue
        raise ApiError(400, f"unsupported parameter {name!r} (value {value!r}): lollm serve does not implement it",
                       param=name, code="unsupported_parameter")


def _number(body: dict[str, Any], name: str, *, integer: bool = False, low: float | None = None,
            high: float | None = None, open_low: bool = False) -> Any:
    """``body[name]`` checked to be a number in range, or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"{name!r} must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    if low is not None and (value <= low if open_low else value < low):
        raise ApiError(400, f"{name!r} must be {'>' if open_low else '>='} {low}, got {value}", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"{name!r} must be <= {high}, got {value}", param=name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name!r} must be true or false, got {value!r}", param=name)
    return value


def _stops(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most 16 of them, got {value!r}",
                       param="stop")
    return stops


def _messages(value: Any) -> list[dict[str, str]]:
    """The chat messages as the template takes them: role, content (text parts joined), name."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'", param=where)
        for key, item in message.items():
            if key not in MESSAGE_FIELDS and item is not None:
                raise ApiError(400, f"{where}.{key} is not supported (only {', '.join(MESSAGE_FIELDS)})",
                               param=f"{where}.{key}")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ApiError(400, f"{where}.content[{j}]: only text parts are supported",
                                   param=f"{where}.content[{j}]")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        entry = {"role": role, "content": content}
        for key in ("name", "reasoning_content"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise ApiError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
                entry[key] = message[key]
        out.append(entry)
    return out


# -- one generation -----------------------------------------------------------------------


@dataclass
class Job:
    """One request's generation, as the worker thread runs it."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    logprobs: int | None
    cancel: threading.Event = field(default_factory=threading.Event)
    on_text: Callable[[str], None] | None = None
    on_token: Callable[[int, TokenLogprobs | None], None] | None = None


class ModelServer:
    """The served model, its prompt cache, the worker thread and the request counters (no HTTP here).

    loaded:         a :class:`lollm.pipeline.LoadedModel`.
    name:           the model id clients send (``"model"``).
    context:        positions of the prompt cache (the longest prompt + answer).
    sampling_flags: server-wide sampling settings (``lollm serve --temperature`` ...), under a request's own.
    template_flags: server-wide template variables (``--think``), under a request's chat_template_kwargs.
    draft_tokens:   MTP draft tokens per step (0: off).
    api_key:        when set, every /v1 request must carry ``Authorization: Bearer <api_key>``.
    """

    def __init__(self, loaded: Any, *, name: str, context: int, sampling_flags: dict[str, Any] | None = None,
                 template_flags: dict[str, Any] | None = None, draft_tokens: int = 0, api_key: str | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = name
        self.cache = PromptCache(self.model, context)
        self.sampling_flags = {k: v for k, v in (sampling_flags or {}).items() if v is not None}
        self.template_flags = dict(template_flags or {})
        self.draft_tokens = draft_tokens
        self.api_key = api_key
        self.stop_ids = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, self.tokenizer)
        self.created = int(time.time())
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lollm-generate")
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.group = getattr(loaded, "tp", None)  # the --tp group (lollm.tensor_parallel.Group), else None

    # -- requests ---------------------------------------------------------------------
    def check_auth(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect or missing API key: send the header 'Authorization: Bearer <key>' with the "
                                "key given to lollm serve --api-key", code="invalid_api_key")

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model != self.name:
            raise ApiError(404, f"the model {model!r} does not exist here; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def job(self, body: dict[str, Any], ids: list[int], *, logprobs: int | None) -> Job:
        """The generation settings of a request whose prompt is ``ids``."""
        if len(ids) >= self.cache.max_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, but the server's context is {self.cache.max_tokens} "
                                f"(lollm serve --ctx-size); shorten it", param="messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        limit = _number(body, "max_completion_tokens", integer=True, low=1)
        limit = _number(body, "max_tokens", integer=True, low=1) if limit is None else limit
        room = self.cache.max_tokens - len(ids)
        user = {**self.sampling_flags}
        for name in SAMPLING_FIELDS:
            value = _number(body, name, integer=name == "top_k")
            if value is not None:
                user[name] = value
        if user.get("top_k") == -1:
            user["top_k"] = 0  # -1: off, as vLLM spells it
        seed = _number(body, "seed", integer=True)
        try:
            sampling = resolve_sampling(user, self.loaded.checkpoint.generation_config,
                                        self.loaded.family.family.sampling_defaults, seed=seed)
        except LollmError as error:
            raise ApiError(400, str(error)) from None
        return Job(ids=ids, max_tokens=min(limit or room, room), sampling=sampling, stop=_stops(body), logprobs=logprobs)

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                           param="messages")
        messages = _messages(body.get("messages"))
        flags = dict(self.template_flags)
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
            for key in extra:
                if key in RESERVED_TEMPLATE_VARIABLES or not self.tokenizer.chat_template_reads(key):
                    raise ApiError(400, f"chat_template_kwargs: the chat template does not read {key!r}",
                                   param=f"chat_template_kwargs.{key}")
            flags.update(extra)
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=False, **flags)
        except LollmError as error:  # the template rejected the messages (raise_exception) or failed
            raise ApiError(400, str(error), param="messages") from None

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
            if bad:
                raise ApiError(400, f"'prompt' holds token ids outside the vocabulary (0 .. {self.model.vocab_size - 1}): "
                                    f"{bad[:5]}", param="prompt")
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")
        if not ids:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return ids

    # -- the worker thread ----------------------------------------------------------------
    def run(self, job: Job) -> GenerationResult | None:
        """Generate one job (in the worker thread); None when it was cancelled before it began."""
        if job.cancel.is_set():
            self.counts["cancelled"] += 1
            return None
        try:
            if self.group is not None:  # --tp: the other ranks run the same job (follow)
                if job.sampling.seed is None:  # every rank must draw the same tokens: one seed, chosen here
                    job.sampling = dataclasses.replace(job.sampling, seed=secrets.randbits(63))
                self._broadcast([(job.ids, job.max_tokens, job.sampling, job.stop, job.logprobs)])
            result = self._generate(job)
        except BaseException:
            self.counts["failed"] += 1
            raise
        if result.stop_reason == "cancelled":
            self.counts["cancelled"] += 1
            log.info("client went away: generation cancelled after %d tokens", len(result.new_ids))
        else:
            self.counts["completed"] += 1
        return result

    def _generate(self, job: Job) -> GenerationResult:
        should_stop = job.cancel.is_set if self.group is None else lambda: self._agree(job.cancel.is_set())
        return generate(
            self.model, job.ids, max_new_tokens=job.max_tokens, sampling=job.sampling, stop_ids=self.stop_ids,
            stop_strings=job.stop, tokenizer=self.tokenizer, on_text=job.on_text, on_token=job.on_token,
            speculative_tokens=self.draft_tokens, prompt_cache=self.cache, logprobs=job.logprobs,
            should_stop=should_stop,
        )

    # -- --tp: the ranks other than 0 ---------------------------------------------------------
    def _broadcast(self, message: list[Any]) -> Any:
        """Rank 0's ``message[0]`` on every rank (``torch.distributed.broadcast_object_list``)."""
        import torch.distributed as dist

        dist.broadcast_object_list(message, src=0)
        return message[0]

    def _agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank: asked before each step, so every rank stops at the same token."""
        import torch
        import torch.distributed as dist

        where = self.group.device if self.group.backend == "nccl" else "cpu"
        value = torch.tensor([int(flag)], dtype=torch.int32, device=where)
        dist.broadcast(value, src=0)
        return bool(value.item())

    def follow(self) -> None:
        """A rank other than 0 under --tp: run each job rank 0 broadcasts, in its order, until rank 0 says stop (None).

        The jobs come with rank 0's resolved sampling and seed, so every rank
        samples the same tokens from the same (all-gathered) logits, and its
        prompt cache holds what rank 0's holds. An error rank 0's generation
        also meets (a LollmError) is rank 0's to report; this rank waits for the next job.
        """
        while True:
            message = self._broadcast([None])
            if message is None:
                return
            ids, max_tokens, sampling, stop, logprobs = message
            try:
                self._generate(Job(ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stop, logprobs=logprobs))
            except LollmError:
                pass

    def stop_followers(self) -> bool:
        """Rank 0 under --tp, at the end: tell the other ranks to return from :meth:`follow`.

        Best effort: False when they did not take the message (Ctrl-C reached them too and they are gone).
        """
        try:
            self.worker.submit(self._broadcast, [None]).result(timeout=60)
            return True
        except Exception as error:
            log.info("--tp: the other ranks did not take the stop message: %s", error)
            return False

    # -- answers ----------------------------------------------------------------------------
    def usage(self, result: GenerationResult) -> dict[str, Any]:
        prompt, completion = len(result.prompt_ids), len(result.new_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": result.reused_tokens}}

    def content_logprobs(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """Chat-style logprobs: token text, log-probability, UTF-8 bytes, and the top alternatives."""

        def one(token: int, logprob: float) -> dict[str, Any]:
            data = self.tokenizer.token_bytes(token)
            return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}

        return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    def text_logprobs(self, entries: list[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
        """Completions-style (legacy) logprobs: parallel lists, offsets into the generated text."""
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            text = self.tokenizer.token_bytes(e.token).decode("utf-8", errors="replace")
            tokens.append(text)
            offset += len(text)
        top = [{self.tokenizer.token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in e.top} for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": offsets}

    def content_entries(self, result: GenerationResult) -> list[TokenLogprobs]:
        """The logprobs of the answer's tokens (an end-of-sequence token that stopped it is not content)."""
        entries = result.logprobs
        return entries[:-1] if entries and result.stop_reason == "eos" else entries


# -- HTTP ------------------------------------------------------------------------------------


def create_app(server: ModelServer):
    """The Starlette application serving ``server``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def read_body(request: Request, fields: set[str]) -> dict[str, Any]:
        server.check_auth(request.headers.get("authorization"))
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        server.check_model(body)
        _check_fields(body, fields)
        return body

    async def wait(request: Request, job: Job) -> GenerationResult | None:
        """Run ``job`` on the worker; cancel it if the client disconnects meanwhile (or the server stops)."""
        future = asyncio.get_running_loop().run_in_executor(server.worker, server.run, job)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=0.25)
                if done:
                    return future.result()
                if not job.cancel.is_set() and await request.is_disconnected():
                    job.cancel.set()
        finally:
            if not future.done():
                job.cancel.set()

    def stream(job: Job, chunk: Callable[..., dict[str, Any]], include_usage: bool):
        """Server-sent events of one generation: ``chunk(text, logprobs, finish_reason)`` makes each payload."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731  (from the worker thread)
        job.on_text = lambda piece: put(("text", piece))
        job.on_token = lambda token, lp: put(("token", lp)) if lp is not None and token not in server.stop_ids else None

        def work() -> None:
            try:
                put(("done", server.run(job)))
            except BaseException as error:  # reported to the client as an error event
                put(("error", error))

        def sse(payload: Any) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def events():
            loop.run_in_executor(server.worker, work)
            pending: list[TokenLogprobs] = []
            try:
                yield sse(chunk(None, None, None))  # the first chunk: the assistant's role
                while True:
                    kind, value = await queue.get()
                    if kind == "token":
                        pending.append(value)
                    elif kind == "text":
                        yield sse(chunk(value, pending, None))
                        pending = []
                    elif kind == "error":
                        log.error("generation failed", exc_info=value)
                        message = str(value) if isinstance(value, LollmError) else "internal error (see the server log)"
                        yield sse(ApiError(500, message, kind="server_error").body())
                        break
                    else:  # done
                        result: GenerationResult | None = value
                        if pending:
                            yield sse(chunk("", pending, None))
                        reason = FINISH_REASON[result.stop_reason] if result is not None else "stop"
                        yield sse(chunk("", None, reason))
                        if include_usage and result is not None:
                            yield sse({**chunk("", None, None), "choices": [], "usage": server.usage(result)})
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # no-op after the end; stops the generation of a client that went away

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def stream_options(body: dict[str, Any]) -> bool:
        options = body.get("stream_options")
        if options is None:
            return False
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}",
                           param="stream_options")
        return bool(options.get("include_usage", False))

    async def chat_completions(request: Request):
        body = await read_body(request, CHAT_FIELDS)
        logprobs = None
        top = _number(body, "top_logprobs", integer=True, low=0, high=20)
        if _flag(body, "logprobs"):
            logprobs = top or 0
        elif top is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        streaming = _flag(body, "stream")
        include_usage = stream_options(body)
        job = server.job(body, server.chat_ids(body), logprobs=logprobs)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.name}

        if streaming:
            def chunk(text, entries, finish):
                delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
                lp = {"content": server.content_logprobs(entries)} if entries else None
                return {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

            return stream(job, chunk, include_usage)
        result = await wait(request, job)
        if result is None:
            raise ApiError(499, "the request was cancelled")
        lp = {"content": server.content_logprobs(server.content_entries(result))} if logprobs is not None else None
        return JSONResponse({
            **base, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": lp,
                         "finish_reason": FINISH_REASON[result.stop_reason]}],
            "usage": server.usage(result),
        })

    async def completions(request: Request):
        body = await read_body(request, COMPLETION_FIELDS)
        logprobs = _number(body, "logprobs", integer=True, low=0, high=20)
        streaming = _flag(body, "stream")
        include_usage = stream_options(body)
        job = server.job(body, server.completion_ids(body), logprobs=logprobs)
        base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.name,
                "object": "text_completion"}

        if streaming:
            offset = [0]

            def chunk(text, entries, finish):
                lp = None
                if entries:
                    lp = server.text_logprobs(entries, offset[0])
                    offset[0] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}]}

            return stream(job, chunk, include_usage)
        result = await wait(request, job)
        if result is None:
            raise ApiError(499, "the request was cancelled")
        lp = server.text_logprobs(server.content_entries(result)) if logprobs is not None else None
        return JSONResponse({
            **base,
            "choices": [{"index": 0, "text": result.text, "logprobs": lp, "finish_reason": FINISH_REASON[result.stop_reason]}],
            "usage": server.usage(result),
        })

    async def models(request: Request):
        server.check_auth(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [
            {"id": server.name, "object": "model", "created": server.created, "owned_by": "lollm"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": server.name, "requests": dict(server.counts)})

    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    async def lollm_error(request: Request, error: LollmError):  # bad input found deeper (tokenizer, sampler)
        return error_response(ApiError(400, str(error)))

    async def http_error(request: Request, error: HTTPException):
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind))

    async def internal_error(request: Request, error: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(ApiError(500, "internal error (see the server log)", kind="server_error"))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {ApiError: api_error, LollmError: lollm_error, HTTPException: http_error, Exception: internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)


def serve(server: ModelServer, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until Ctrl-C (uvicorn)."""
    try:
        import uvicorn
    except ImportError:
        raise LollmError("lollm serve needs the serve extra: pip install 'lollm-core[serve]' (starlette, uvicorn)") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    uvicorn.run(create_app(server), host=host, port=port, log_level="info")


def require_serve_extra() -> None:
    """LollmError naming the extra when starlette or uvicorn is missing (checked before the model loads)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise LollmError(
            f"lollm serve needs the serve extra ({error.name} is missing): pip install 'lollm-core[serve]'"
        ) from None
