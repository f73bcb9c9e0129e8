"""``lollm serve``: an OpenAI-compatible HTTP server for one model.

::

    POST /v1/chat/completions   messages ─► chat template ─► token ids ─┐
    POST /v1/completions        prompt text (or ids) ─► token ids ──────┤   (in a thread pool, off the event loop)
                                                                        ▼
                 a bounded queue (503 + Retry-After when full) ─► the batched engine: one thread steps it,
                 every request joins the running batch at the next step (lollm.engine.driver)
                                                                        │
                 JSON, or server-sent events (``stream: true``) ◄───────┘
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", ...}, request counters and how requests are batched
    GET  /metrics               Prometheus text format (lollm.serve.metrics)
    GET  /openapi.json          the OpenAPI 3.0 description of the endpoints above
    GET  /                      a chat page (lollm/serve/static/chat.html) that streams through /v1/chat/completions

Once it listens, :func:`serve` logs a banner (URL, model, family, context, a curl
line, the chat page) and every generation logs one line (:func:`request_line`:
endpoint, prompt / cached / generated tokens, time to first token, tok/s, finish).

Requests and answers follow OpenAI's API, so its clients (the ``openai``
package, editors, agent tools) talk to it unchanged; see docs/serving.md.

* Many requests, one batch: requests run through :class:`lollm.engine.Engine`
  (continuous batching over a paged KV cache with prefix caching, docs/batching.md):
  a request joins the running batch at the engine's next step, leaves it the step
  it ends, and reuses every full KV block of its prompt that an earlier request
  left in the pool (``usage.prompt_tokens_details.cached_tokens`` says how much).
  At most ``max_queue`` requests wait; one more gets a 503 with ``Retry-After``.
* One request at a time where the engine cannot serve: tensor parallel (``--tp``),
  speculative decoding (``--mtp``), a family whose model has no ``cache_layers()``.
  Then one worker thread runs requests in arrival order through one
  :class:`~lollm.generate.prompt_cache.PromptCache`, so a client that sends its growing
  conversation again reuses what its last request computed.
* One request cannot stall the others: the event loop only reads bodies (at
  most :func:`body_limit` bytes) and writes answers. Parsing the JSON (at most
  :data:`MAX_JSON_DEPTH` levels deep), checking the fields, rendering the
  template and tokenizing run in a thread pool (Starlette's
  ``run_in_threadpool``), after a size check that refuses a text too long to
  fit the context before it is tokenized (:meth:`ModelServer.check_text_size`).
* A client that goes away (a closed stream, a dropped connection) cancels its
  generation at the next token; in the engine its KV blocks go back to the pool.
* A bad request gets a 4xx with an OpenAI-style error body
  (``{"error": {"message", "type", "param", "code"}}``) that names the field;
  a bug gets a 500 with the same shape and one log line (type, message, where;
  the traceback is logged at DEBUG level).
* Message text from clients is encoded with special-token parsing off
  (``Tokenizer.encode_chat(parse_special=False)``): a message cannot forge
  ``<|im_end|>``. A /v1/completions prompt is raw model input, parsed as is.
* Under tensor parallelism (``torchrun … -m lollm serve --tp N``, docs/tensor-parallel.md)
  rank 0 serves HTTP; before each generation its worker broadcasts the job (ids,
  resolved sampling with a concrete seed, stops) and the other ranks, in
  :meth:`ModelServer.follow`, run the same generation in lockstep (the collectives
  need every rank); before each step rank 0's cancel flag is broadcast, so a
  client that goes away stops every rank at the same token (:mod:`lollm.load.ranks`:
  ``broadcast``, ``follow``, ``agree``).
* With ``tools`` the chat template shows them to the model and the answer's
  text is read for calls (:mod:`lollm.serve.tools`: one format per template kind,
  a parser shared by the streamed and the whole answer); ``tool_choice``
  "required" or a named function makes the generation follow a grammar of the
  calls (:mod:`lollm.generate.structured`). docs/tools.md.
* Bound to 127.0.0.1 unless told otherwise; ``--api-key`` makes every /v1
  request show ``Authorization: Bearer KEY``.

Starlette (routing, requests, streaming responses) and uvicorn (the HTTP
server) come with the ``lollm-core[serve]`` extra; this module imports them
only inside the functions that use them (:func:`create_app`, the handlers of
:class:`Routes`, :func:`serve`), so it loads without them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import reprlib
import secrets
import shlex
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator

from lollm.load import ranks
from lollm.errors import LollmError, TokenizerError
from lollm.generate.loop import GenerationResult, TokenLogprobs, generate, stop_token_ids
from lollm.generate.prompt_cache import PromptCache
from lollm.generate.sampling import SEED_MAX, SamplingParams, resolve_sampling
from lollm.engine.driver import EngineLoop, QueueFull, serve_kv_blocks
from lollm.serve.metrics import CONTENT_TYPE, metrics_for
from lollm.generate.structured import CompiledConstraint, ConstraintError, OutputConstraint, compile_constraint, open_object
from lollm.serve.tools import ToolCall, ToolCallParser, ToolRequest, ToolRequestError, read_tools, template_tool_calls

log = logging.getLogger("lollm.serve.server")

#: Fields a client may send that change nothing here, ignored when null or neutral.
IGNORED = {"user": None, "metadata": None, "store": None, "service_tier": None, "parallel_tool_calls": None,
           "logit_bias": {}, "tools": [], "tool_choice": "none",
           "presence_penalty": 0, "frequency_penalty": 0, "n": 1, "best_of": 1, "echo": False, "suffix": None}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
COMMON_FIELDS = {"model", "max_tokens", "seed", "stop", "stream", "stream_options", "response_format", *SAMPLING_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs",
                               "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id")
#: Template variables a request may not set through chat_template_kwargs (the server sets them).
RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt"}
FINISH_REASON = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length", "cancelled": "stop"}

# -- the server's limits (docs/serving.md, "Limits") ---------------------------------------

#: A request body may hold BODY_BYTES_BASE + BODY_BYTES_PER_POSITION * context bytes (see body_limit).
BODY_BYTES_BASE = 1 << 20
BODY_BYTES_PER_POSITION = 64
#: Bytes of an oversized body read (and dropped) before its 413 is sent, so that a client that
#: writes its whole body before it reads the answer sees the 413 rather than a reset connection.
DRAIN_BYTES = 64 << 20
#: How deep a request's JSON may nest: OpenAI's bodies need 4 (messages[i].content[j].text).
MAX_JSON_DEPTH = 32
#: The largest integer a request field may hold (a seed goes up to 2**64-1).
MAX_INTEGER = SEED_MAX
#: Requests that may wait for the engine (or the single worker) before a 503 (lollm serve --max-queue).
DEFAULT_MAX_QUEUE = 128
#: Requests the engine runs at once (lollm serve --max-running): the issue's 16 concurrent clients on a CPU.
DEFAULT_MAX_RUNNING = 16
#: Tokens in one engine step (lollm serve --max-batch-tokens): decode tokens plus prefill chunks.
DEFAULT_MAX_BATCH_TOKENS = 256
#: Seconds a client told 503 (a full queue) is asked to wait before it tries again.
RETRY_AFTER_SECONDS = 1


def body_limit(context: int) -> int:
    """Most bytes a request body may have for a server of ``context`` positions.

    1 MiB plus 64 bytes a position: a prompt that fills the context takes about
    4 bytes a token as plain text, up to about 12 with every character
    JSON-escaped (``\\u00e9``), and about 8 as a list of token ids. 4096
    positions (the default --ctx-size): 1.25 MiB; 131,072: 9 MiB.
    """
    return BODY_BYTES_BASE + BODY_BYTES_PER_POSITION * context


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token of ``tokenizer`` can stand for (at least 1).

    The UTF-8 length of the longest vocabulary string, added tokens included:
    a byte-level token (``'Ġhello'``) spells each byte with one character of 1
    or 2 UTF-8 bytes, and a SentencePiece token spells a space as ``▁`` (3
    bytes) and a byte as ``<0xNN>`` (6), so no token stands for more bytes
    than its string has. Unused ids (holes in the vocabulary) are skipped.
    """
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        try:
            text = tokenizer.id_to_token(token_id)
        except TokenizerError:
            continue
        longest = max(longest, len(text.encode("utf-8", "surrogatepass")))
    return longest


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI-style error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers  # extra HTTP headers of the answer (a 503's Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def internal_error(where: str, error: BaseException) -> ApiError:
    """The 500 answer to a bug met while answering ``where`` (``"POST /v1/completions"``), logged in one line.

    The line names an error id (also in the answer), the exception's type, the
    first line of its message and the innermost frame; the traceback goes to the
    log at DEBUG level only.
    """
    ident = uuid.uuid4().hex[:12]
    frames = traceback.extract_tb(error.__traceback__)
    at = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    first = (str(error).splitlines() or [""])[0][:300]
    log.error("%s: internal error %s: %s: %s%s", where, ident, type(error).__name__, first, at)
    log.debug("internal error %s", ident, exc_info=error)
    return ApiError(500, f"internal error {ident} (see the server log)", kind="server_error")


# -- reading a request --------------------------------------------------------------

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel = 80, 80, 3


def _show(value: Any) -> str:
    """``repr(value)`` cut short (long strings, big lists, deep nesting), for error messages."""
    return _SHOW.repr(value)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body ``raw`` (JSON, UTF-8) as a dict; ApiError 400 when it is not one.

    Refused: invalid JSON, ``NaN`` / ``Infinity`` (Python's json reads them, JSON
    has no such numbers), integers of more than 4,300 digits (Python's limit),
    and nesting deeper than :data:`MAX_JSON_DEPTH` (checked without recursion;
    what is too deep for the parser itself ends in its RecursionError, caught).
    """
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return body


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string inside ``value`` (values of objects, items of lists), without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in IGNORED and value in (None, IGNORED[name]):
            continue
        raise ApiError(400, f"unsupported parameter {_show(name)} (value {_show(value)}): lollm serve does not "
                            f"implement it", param=name[:100], code="unsupported_parameter")


def _number(body: dict[str, Any], name: str, *, integer: bool = False, low: float | None = None,
            high: float | None = None, open_low: bool = False) -> Any:
    """``body[name]`` checked to be a number in range, or None when absent or null.

    Integers lie within +-:data:`MAX_INTEGER` and other numbers are finite
    (JSON's ``1e400`` reads as infinity), whatever ``low`` and ``high`` say.
    """
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"{name!r} must be {'an integer' if integer else 'a number'}, got {_show(value)}", param=name)
    if isinstance(value, int) and abs(value) > MAX_INTEGER or isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name!r} is out of range: {_show(value)}", param=name)
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
        raise ApiError(400, f"{name!r} must be true or false, got {_show(value)}", param=name)
    return value


def _stops(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most 16 of them, got {_show(value)}",
                       param="stop")
    return stops


def _stream_options(body: dict[str, Any]) -> bool:
    """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    return bool(options.get("include_usage", False))


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives each chat token's logprobs list (``logprobs`` + ``top_logprobs``), None: no logprobs."""
    top = _number(body, "top_logprobs", integer=True, low=0, high=20)
    if _flag(body, "logprobs"):
        return top or 0
    if top is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return None


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
                raise ApiError(400, f"{where}.{_show(key)} is not supported (only {', '.join(MESSAGE_FIELDS)})",
                               param=f"{where}.{key[:100]}")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}", param=f"{where}.role")
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
        entry: dict[str, Any] = {"role": role, "content": content}
        for key in ("name", "reasoning_content", "tool_call_id"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise ApiError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
                entry[key] = message[key]
        if message.get("tool_calls") and role == "assistant":
            entry["tool_calls"] = template_tool_calls(message["tool_calls"], where)
        out.append(entry)
    return out


# -- response_format: structured output (lollm.generate.structured, docs/structured-output.md) ----------

#: ``response_format.type`` -> the key holding its value: OpenAI's three, and lollm's two extensions.
RESPONSE_FORMATS = {"text": None, "json_object": None, "json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}


def response_format(value: Any) -> OutputConstraint | None:
    """The request's ``response_format`` as an :class:`OutputConstraint` (None: free text); ApiError 400 when malformed.

    ``{"type": "text"}``; ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": true}}`` (enforced whatever ``strict`` says: a keyword
    that cannot be enforced is refused, never skipped; ``strict: true`` also requires every object
    to say ``"additionalProperties": false``, as OpenAI's strict mode does); and two extensions:
    ``{"type": "regex", "regex": "[0-9]+"}`` and ``{"type": "grammar", "grammar": "start: ..."}``
    (llguidance's Lark syntax).
    """
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:  # a dict or list as 'type' is unhashable
        raise ApiError(400, f"'response_format' must be an object whose 'type' is one of {', '.join(RESPONSE_FORMATS)}, "
                            f"got {_show(value)}", param="response_format")
    key = RESPONSE_FORMATS[kind]
    if set(value) - {"type", key}:
        raise ApiError(400, f"'response_format' of type {kind!r} takes only {sorted({'type', key} - {None})}, got {_show(value)}",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint.json_object()
    if kind == "json_schema":
        spec = value.get(key)
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict) or \
                not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", True), (bool, type(None))):
            raise ApiError(400, "'response_format.json_schema' must be an object like {\"name\": \"...\", \"schema\": {...}, "
                                "\"strict\": true}", param="response_format.json_schema")
        gap = open_object(spec["schema"]) if spec.get("strict") is True else None
        if gap is not None:  # OpenAI's strict mode: every object closed, else a 400 (it refuses them too)
            where = f"response_format.json_schema.schema{gap}"
            raise ApiError(400, f"{where} is an object without \"additionalProperties\": false, which 'strict': true "
                                "requires (as OpenAI's strict mode does); add it, or send 'strict': false to allow "
                                "extra keys", param=where)
        return OutputConstraint.json_schema(spec["schema"], name=spec.get("name"))
    if not isinstance(value.get(key), str) or not value[key]:
        raise ApiError(400, f"'response_format.{key}' must be a non-empty string", param=f"response_format.{key}")
    return OutputConstraint(kind, value[key])


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
    endpoint: str = ""  # the path it came in on, for its log line
    tools: ToolRequest | None = None  # the request's tools: the answer's text is read for calls (lollm.serve.tools)
    constraint: CompiledConstraint | None = None  # the output follows it (response_format, a forced tool call)


@dataclass
class Prepared:
    """A request read, checked and tokenized (:meth:`ModelServer.prepare`): its job and how to answer."""

    job: Job
    streaming: bool
    include_usage: bool


class ModelServer:
    """The served model, how requests run (the engine, or one worker thread) and the request counters (no HTTP here).

    loaded:           a :class:`lollm.load.pipeline.LoadedModel`.
    name:             the model id clients send (``"model"``).
    context:          positions one request may use (prompt + answer), at most the model's.
    sampling_flags:   server-wide sampling settings (``lollm serve --temperature`` ...), under a request's own.
    template_flags:   server-wide template variables (``--think``), under a request's chat_template_kwargs.
    draft_tokens:     MTP draft tokens per step (0: off).
    api_key:          when set, every /v1 request must carry ``Authorization: Bearer <api_key>``.
    max_body_bytes:   the largest request body, in bytes (default: :func:`body_limit` of the context).
    batched:          run requests through the batched engine when the model can (see :attr:`single_reason`).
    max_running:      the engine's most requests at once (its ``max_sequences``).
    kv_blocks:        the engine's KV pool in blocks (None: :func:`lollm.engine.driver.serve_kv_blocks`).
    max_batch_tokens: the engine's most tokens per step.
    max_queue:        the most requests waiting to run; one more is a 503.

    Raises LollmError when the KV pool cannot hold one request of the whole context.
    """

    def __init__(self, loaded: Any, *, name: str, context: int, sampling_flags: dict[str, Any] | None = None,
                 template_flags: dict[str, Any] | None = None, draft_tokens: int = 0, api_key: str | None = None,
                 max_body_bytes: int | None = None, batched: bool = True, max_running: int = DEFAULT_MAX_RUNNING,
                 kv_blocks: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_queue: int = DEFAULT_MAX_QUEUE):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = name
        self.context = min(context, self.model.max_context)
        self.sampling_flags = {k: v for k, v in (sampling_flags or {}).items() if v is not None}
        self.template_flags = dict(template_flags or {})
        self.draft_tokens = draft_tokens
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes or body_limit(self.context)
        #: no token stands for more bytes of text than this (the early prompt-length check)
        self.token_bytes_bound = longest_token_bytes(self.tokenizer)
        self.stop_ids = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, self.tokenizer)
        self.created = int(time.time())
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.group = getattr(loaded, "tp", None)  # the --tp group (lollm.load.tensor_parallel.Group), else None
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
            self.busy = 0  # jobs the worker is running (0 or 1)
            self.metrics = metrics_for(self._single_stats, kv_blocks=False)

    def _single_reason(self) -> str | None:
        """Why this model cannot run through the engine here (None: it can)."""
        if self.group is not None:
            return "--tp runs one request at a time (the engine does not split a model over ranks yet)"
        if self.draft_tokens > 0:
            return "--mtp runs one request at a time (the engine does not decode speculatively)"
        if not hasattr(self.model, "cache_layers"):
            family = getattr(getattr(getattr(self.loaded, "family", None), "family", None), "name", None)
            return (f"the {family or type(self.model).__name__} family cannot run batched yet (its model has no "
                    f"cache_layers()): one request at a time")
        return None

    def _start_engine(self, max_running: int, kv_blocks: int | None, max_batch_tokens: int) -> EngineLoop:
        """The engine over the model and the thread that steps it (with this server's metrics)."""
        from lollm.engine import Engine, EngineConfig

        for flag, value in (("--max-running", max_running), ("--max-batch-tokens", max_batch_tokens), ("--kv-blocks", kv_blocks)):
            if value is not None and value < 1:
                raise LollmError(f"{flag} must be >= 1, got {value}")
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
        if self.api_key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect or missing API key: send the header 'Authorization: Bearer <key>' with the "
                                "key given to lollm serve --api-key", code="invalid_api_key")

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            raise ApiError(400, f"the request has no 'model': name the model this server serves, {self.name!r}",
                           param="model", code="missing_required_parameter")
        if model != self.name:
            raise ApiError(404, f"the model {_show(model)} does not exist here; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def prepare(self, raw: bytes, kind: str) -> Prepared:
        """A request body of ``kind`` ("chat" or "completion") parsed, checked and tokenized; ApiError when refused.

        Runs in a thread of the pool, never on the event loop: the template and
        the tokenizer take time in proportion to the text. Every cheap check (the
        JSON, the model, the fields, the sampling values, the text's size) comes
        before them.
        """
        body = parse_body(raw)
        self.check_model(body)
        _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
        logprobs = _chat_logprobs(body) if kind == "chat" else _number(body, "logprobs", integer=True, low=0, high=20)
        streaming, include_usage = _flag(body, "stream"), _stream_options(body)
        limit, sampling, stop = self.settings(body)
        constraint = self.compile(response_format(body.get("response_format")))
        tools = self.tools(body, constraint) if kind == "chat" else None
        ids = self.chat_ids(body, tools) if kind == "chat" else self.completion_ids(body)
        job = self.job(body, ids, limit, sampling, stop + (tools.stops() if tools else []), logprobs)
        job.constraint, job.tools = constraint, tools
        if tools is not None and tools.grammar is not None:
            job.constraint = self.compile(tools.grammar, "tools")
        return Prepared(job, streaming, include_usage)

    def tools(self, body: dict[str, Any], constraint: CompiledConstraint | None) -> ToolRequest | None:
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

    def settings(self, body: dict[str, Any]) -> tuple[int | None, SamplingParams, list[str]]:
        """The request's token limit (None: the rest of the context), resolved sampling and stop strings."""
        limit = _number(body, "max_completion_tokens", integer=True, low=1)
        limit = _number(body, "max_tokens", integer=True, low=1) if limit is None else limit
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
        return limit, sampling, _stops(body)

    def job(self, body: dict[str, Any], ids: list[int], limit: int | None, sampling: SamplingParams, stop: list[str],
            logprobs: int | None) -> Job:
        """The generation of a request whose prompt is ``ids``; ApiError 400 when the prompt leaves no room."""
        if len(ids) >= self.context:
            raise self._too_long(body, f"the prompt has {len(ids)} tokens")
        room = self.context - len(ids)
        return Job(ids=ids, max_tokens=min(limit or room, room), sampling=sampling, stop=stop, logprobs=logprobs)

    def _too_long(self, body: dict[str, Any], what: str) -> ApiError:
        return ApiError(400, f"{what}, but the server's context is {self.context} (lollm serve --ctx-size); "
                             f"shorten it", param="messages" if "messages" in body else "prompt",
                        code="context_length_exceeded")

    def check_text_size(self, body: dict[str, Any], size: int) -> None:
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

    def chat_ids(self, body: dict[str, Any], tools: ToolRequest | None = None) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                           param="messages")
        try:
            messages = _messages(body.get("messages"))
        except ToolRequestError as error:
            raise ApiError(400, str(error), param=error.param) from None
        flags = dict(self.template_flags)
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
            for key in extra:
                if key in RESERVED_TEMPLATE_VARIABLES or not self.tokenizer.chat_template_reads(key):
                    raise ApiError(400, f"chat_template_kwargs: the chat template does not read {_show(key)}",
                                   param=f"chat_template_kwargs.{key[:100]}")
            flags.update(extra)
        if tools is not None:
            flags["tools"] = tools.tools
        self.check_text_size(body, text_bytes(messages) + text_bytes(extra) + text_bytes(flags.get("tools")))
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=False, **flags)
        except LollmError as error:  # the template rejected the messages (raise_exception) or failed
            raise ApiError(400, str(error), param="messages") from None

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
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
                                    f"{_show(bad[:5])}", param="prompt")
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
    def submit(self, job: Job) -> Future:
        """Start ``job``; a Future of its GenerationResult (None: cancelled before it began).

        ApiError 503 (with ``Retry-After``) when ``max_queue`` requests already wait.
        """
        try:
            if self.engine_loop is not None:
                return self.engine_loop.submit(job)
            with self._single_lock:
                if self.pending >= self.max_queue:
                    raise QueueFull(f"{self.pending} requests are waiting (lollm serve --max-queue {self.max_queue})")
                self.pending += 1
            return self.worker.submit(self._run_next, job)
        except QueueFull as full:
            raise ApiError(503, f"the server is busy: {full}; try again shortly", kind="server_error",
                           code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None

    def _run_next(self, job: Job) -> GenerationResult | None:
        """The single worker takes the next job: it stops waiting and runs (:meth:`run`)."""
        with self._single_lock:
            self.pending -= 1
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
        if result is not None:
            if outcome == "cancelled":
                log.info("client went away: generation cancelled after %d tokens", len(result.new_ids))
            log.info("%s", request_line(job.endpoint, result))
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
            speculative_tokens=self.draft_tokens, prompt_cache=self.cache, logprobs=job.logprobs,
            should_stop=should_stop, constraint=job.constraint,
        )

    # -- --tp: the ranks other than 0 (lollm.load.ranks) ------------------------------------------
    def follow(self) -> None:
        """A rank other than 0 under --tp: run each job rank 0 broadcasts, in its order, until rank 0 says stop.

        :func:`lollm.load.ranks.follow`. The jobs come with rank 0's resolved sampling
        and seed, so every rank samples the same tokens from the same
        (all-gathered) logits, and its prompt cache holds what rank 0's holds.
        """
        ranks.follow(self.group, self._follow_job)

    def _follow_job(self, message: tuple[Any, ...]) -> None:
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


# -- /openapi.json -------------------------------------------------------------------------------
#
# Written by hand, small and true to what the handlers accept: a request the schema allows may
# still be refused (a template that rejects the messages, a prompt longer than the context, a
# temperature so small the logits overflow), but never with a status the schema does not list.


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


_INTEGER = {"type": "integer", "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER}
_COMMON_REQUEST = {
    "max_tokens": _nullable({**_INTEGER, "minimum": 1, "description": "default: the rest of the context"}),
    "temperature": _nullable({"type": "number", "minimum": 0, "description": "0: greedy"}),
    "top_p": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}),
    "top_k": _nullable({**_INTEGER, "minimum": -1, "description": "-1 or 0: off"}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True}),
    "seed": _nullable({**_INTEGER, "minimum": 0}),
    "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}}]}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
}
#: The fields that change nothing here, with the only values accepted (null, or the neutral one).
_IGNORED_REQUEST = {name: {"nullable": True, "enum": [value], "description": "accepted, changes nothing"}
                    for name, value in IGNORED.items()}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_FUNCTION_CALL = {"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"type": "string"}, "arguments": {"type": "string", "description": "a JSON object, as text"}}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]}, "function": _FUNCTION_CALL}}
_MESSAGE = {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {"role": {"type": "string", "enum": list(ROLES)},
                   "content": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}],
                                         "description": "null only for an assistant message with tool_calls"}),
                   "name": _nullable({"type": "string"}), "reasoning_content": _nullable({"type": "string"}),
                   "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL, "description": "an assistant's calls"}),
                   "tool_call_id": _nullable({"type": "string", "description": "a tool message: the call it answers"})},
}
_TOOLS_REQUEST = {
    "tools": _nullable({"type": "array", "maxItems": 128, "description": "functions the model may call (docs/tools.md)",
                        "items": {"type": "object", "required": ["type", "function"], "properties": {
                            "type": {"type": "string", "enum": ["function"]},
                            "function": {"type": "object", "required": ["name"], "properties": {
                                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                "description": {"type": "string"}, "parameters": {"type": "object"}}}}}}),
    "tool_choice": _nullable({"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
}
_RESPONSE_FORMAT = _nullable({"type": "object", "required": ["type"], "description": "docs/structured-output.md", "properties": {
    "type": {"type": "string", "enum": list(RESPONSE_FORMATS)},
    "json_schema": {"type": "object", "required": ["schema"], "properties": {
        "name": {"type": "string"}, "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})}},
    "regex": {"type": "string", "minLength": 1}, "grammar": {"type": "string", "minLength": 1}}})
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
_FINISH = {"type": "string", "enum": ["stop", "length"]}
_CHAT_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
_CHAT_ANSWER = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": _CHAT_FINISH, "logprobs": _nullable({"type": "object"}),
        "message": {"type": "object", "required": ["role", "content"],
                    "properties": {"role": {"type": "string"}, "content": _nullable({"type": "string"}),
                                   "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}}}}}
_COMPLETION_ANSWER = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
        "logprobs": _nullable({"type": "object"})}}}}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}}
_ERRORS = {
    "400": "a malformed body or field, an unsupported field, a prompt longer than the context (context_length_exceeded)",
    "401": "--api-key is set and the request's key is missing or wrong (invalid_api_key)",
    "404": "a model this server does not serve (model_not_found)",
    "413": "a body over the server's size limit (request_too_large)",
    "500": "a bug in lollm (the server log has one line about it)",
    "503": "the queue is full (lollm serve --max-queue): try again after Retry-After seconds (server_overloaded)",
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation_operation(summary: str, request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    errors = {status: _json(_ERROR, text) for status, text in _ERRORS.items()}
    errors["503"]["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    ok = _json(answer, "the answer; with stream: true, server-sent events (data: {chunk} ... data: [DONE])")
    event = {"type": "object", "required": ["data"], "description": "one server-sent event (as OpenAPI 3.2 reads a stream)",
             "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE] at the end"}}}
    ok["content"]["text/event-stream"] = {"schema": event}
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": ok, **errors}}


def openapi_schema(server: ModelServer) -> dict[str, Any]:
    """The OpenAPI 3.0 description of ``server``'s endpoints (served at ``/openapi.json``)."""
    model = {"type": "string", "enum": [server.name], "description": "the served model's name (404 for any other)"}
    chat = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
        **_IGNORED_REQUEST, "model": model, **_COMMON_REQUEST, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": _COMMON_REQUEST["max_tokens"], "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20, "description": "needs logprobs: true"}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "variables the chat template reads"}),
        "response_format": _RESPONSE_FORMAT, **_TOOLS_REQUEST}}
    token = {"type": "integer", "minimum": 0, "maximum": server.model.vocab_size - 1}
    ids = {"type": "array", "minItems": 1, "items": token}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [text, ids]}}]}
    completion = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
        **_IGNORED_REQUEST, "model": model, **_COMMON_REQUEST, "prompt": prompt,
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}), "response_format": _RESPONSE_FORMAT}}
    listing = {"type": "object", "required": ["object", "data"], "properties": {"object": {"type": "string"}, "data": {
        "type": "array", "items": {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}}}}
    health = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    paths = {
        "/v1/chat/completions": {"post": _generation_operation("chat: messages through the chat template", chat, _CHAT_ANSWER)},
        "/v1/completions": {"post": _generation_operation("completion of a prompt (text or token ids)", completion,
                                                          _COMPLETION_ANSWER)},
        "/v1/models": {"get": {"summary": "the one model served", "responses": {
            "200": _json(listing, "the model list"), "401": _json(_ERROR, _ERRORS["401"]), "500": _json(_ERROR, _ERRORS["500"])}}},
        "/health": {"get": {"summary": "whether the server is up, and its request counters (no key needed)",
                            "responses": {"200": _json(health, "the server is up")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics: running and waiting requests, KV blocks, tokens, time to "
                                        "first token (no key needed)", "responses": {
            "200": {"description": "Prometheus' text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            "501": _json(_ERROR, "prometheus-client is not installed")}}},
    }
    schema: dict[str, Any] = {"openapi": "3.0.3", "info": {"title": "lollm serve", "version": _version()}, "paths": paths}
    if server.api_key is not None:
        schema["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
            for operation in paths[path].values():
                operation["security"] = [{"bearer": []}]
    return schema


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lollm-core")
    except PackageNotFoundError:
        return "unknown"


# -- HTTP ------------------------------------------------------------------------------------


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes (1 MiB plus "
                         f"{BODY_BYTES_PER_POSITION} bytes per position of its context, lollm serve --ctx-size)",
                    code="request_too_large")


async def read_limited(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``: at most ``limit`` bytes, else ApiError 413.

    An oversized body is still read, and dropped, up to :data:`DRAIN_BYTES`
    (then the connection is given up), so that a client that writes all of
    its body before it reads the answer gets the 413. Nothing is kept past
    ``limit``; a Content-Length above DRAIN_BYTES is refused before any is read.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_BYTES:
        raise _too_large(limit)
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
        raise _too_large(limit)
    return b"".join(chunks)


async def wait(server: ModelServer, request: Any, job: Job) -> GenerationResult | None:
    """Run ``job`` (:meth:`ModelServer.submit`); cancel it if the client disconnects meanwhile (or the server stops).

    ApiError 503 at once when the queue is full.
    """
    future = asyncio.wrap_future(server.submit(job))
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


def sse(payload: Any) -> str:
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

    def __init__(self, server: ModelServer, plan: Prepared, chunk: Callable[..., dict[str, Any]], where: str):
        self.server, self.plan, self.chunk, self.where = server, plan, chunk, where
        #: with tools, the text is read for calls before it is sent (lollm.serve.tools); calls sent so far
        self.parser: ToolCallParser | None = plan.job.tools.parser() if plan.job.tools is not None else None
        self.calls = 0
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        plan.job.on_text, plan.job.on_token = self.on_text, self.on_token

    def start(self) -> None:
        """Submit the job (ApiError 503 when the queue is full); its end comes to :meth:`settled`."""
        self.server.submit(self.plan.job).add_done_callback(self.settled)

    def response(self):
        """The Starlette StreamingResponse of :meth:`events`; when it ends, however it ends, the job is cancelled."""
        from starlette.responses import StreamingResponse

        cancel = self.plan.job.cancel

        class Response(StreamingResponse):
            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                try:
                    await super().__call__(scope, receive, send)
                finally:  # a no-op after the end; stops a generation whose client went away, even before the first event
                    cancel.set()

        return Response(self.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- the generating thread's side ---------------------------------------------------------
    def put(self, item: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_text(self, piece: str) -> None:
        self.put(("text", piece))

    def on_token(self, token: int, logprobs: TokenLogprobs | None) -> None:
        if logprobs is not None and token not in self.server.stop_ids:
            self.put(("token", logprobs))

    def settled(self, future: Future) -> None:
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
        yield sse(self.chunk("", None, "tool_calls" if self.calls and finish == "stop" else finish))
        if self.plan.include_usage and result is not None:
            yield sse({**self.chunk("", None, None), "choices": [], "usage": self.server.usage(result)})

    async def events(self):
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
                else:  # done
                    for event in self.finished(value, pending):
                        yield event
                    break
            yield "data: [DONE]\n\n"
        except Exception as error:  # a bug while writing the events
            yield self.failed(error)
        finally:
            self.plan.job.cancel.set()  # no-op after the end; stops the generation of a client that went away


def stream(server: ModelServer, plan: Prepared, chunk: Callable[..., dict[str, Any]], where: str):
    """The StreamingResponse of ``plan``'s generation as server-sent events (:class:`EventStream`); ApiError 503 when full."""
    events = EventStream(server, plan, chunk, where)
    events.start()
    return events.response()


# -- the answers' shapes (OpenAI's) -------------------------------------------------------------


def request_line(endpoint: str, result: GenerationResult) -> str:
    """One request's log line: endpoint, prompt / cached / generated tokens, time to first token, tok/s, finish.

    Time to first token is the prefill (the uncached part of the prompt's
    forward plus the first sample), in milliseconds; tok/s counts the tokens
    after the first over the decode time (``-`` when there were none).
    """
    new = len(result.new_ids)
    speed = f"{(new - 1) / result.decode_seconds:.1f}" if new > 1 and result.decode_seconds > 0 else "-"
    finish = FINISH_REASON[result.stop_reason] if result.stop_reason != "cancelled" else "cancelled"
    return (f"{endpoint or '-'}: prompt {len(result.prompt_ids)} tokens (cached {result.reused_tokens}), "
            f"generated {new}, first token {1000 * result.prefill_seconds:.0f} ms, {speed} tok/s, finish {finish}")


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
    return [f"lollm serve: {server.name} ({family}, context {server.context}) at {root}/v1"
            + (" (API key required)" if server.api_key else ""),
            f"chat page: {root}/",
            f"try: curl {root}/v1/{endpoint} -H 'Content-Type: application/json'{key} -d {shlex.quote(body)}",
            batching]


def _base(server: ModelServer, kind: str) -> dict[str, Any]:
    """The fields every answer (and every streamed chunk) of one request shares."""
    if kind == "chat":
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.name}
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.name,
            "object": "text_completion"}


def _chat_chunks(server: ModelServer, base: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    def chunk(text, entries, finish, calls=None):
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = calls
        lp = {"content": server.content_logprobs(entries)} if entries else None
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    return chunk


def _completion_chunks(server: ModelServer, base: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    offset = [0]

    def chunk(text, entries, finish):
        lp = None
        if entries:
            lp = server.text_logprobs(entries, offset[0])
            offset[0] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}]}

    return chunk


def _chat_answer(server: ModelServer, base: dict[str, Any], job: Job, result: GenerationResult) -> dict[str, Any]:
    lp = {"content": server.content_logprobs(server.content_entries(result))} if job.logprobs is not None else None
    message, finish = {"role": "assistant", "content": result.text}, FINISH_REASON[result.stop_reason]
    if job.tools is not None:  # the text read for calls (lollm.serve.tools), as a stream would have sent it
        content, calls = job.tools.answer(result.text, result.stop_reason)
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.message_entry() for c in calls]}
            finish = "tool_calls" if finish == "stop" else finish  # cut by max_tokens: still "length"
        else:
            message["content"] = content
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}],
            "usage": server.usage(result)}


def _completion_answer(server: ModelServer, base: dict[str, Any], job: Job, result: GenerationResult) -> dict[str, Any]:
    lp = server.text_logprobs(server.content_entries(result)) if job.logprobs is not None else None
    return {**base,
            "choices": [{"index": 0, "text": result.text, "logprobs": lp, "finish_reason": FINISH_REASON[result.stop_reason]}],
            "usage": server.usage(result)}


#: The chat page may run its own inline script and style and talk to this server only (no other origin, no frames).
CHAT_PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                 "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def chat_page_html() -> str:
    """The chat page served at ``/``: ``lollm/serve/static/chat.html``, one file with its style and script (no network)."""
    return resources.files("lollm.serve").joinpath("static", "chat.html").read_text(encoding="utf-8")


CHUNKS = {"chat": _chat_chunks, "completion": _completion_chunks}
ANSWERS = {"chat": _chat_answer, "completion": _completion_answer}


def error_response(error: ApiError, headers: dict[str, str] | None = None):
    """The JSONResponse of ``error``: its OpenAI-style body with its status."""
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers={**(error.headers or {}), **(headers or {})})


def guarded(handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """The async method ``handler(self, request)`` whose errors become JSON answers.

    ApiError as it says, LollmError (bad input found deeper: tokenizer, sampler) 400,
    a client gone while its body was read 499 (nobody to answer), any other exception 500.
    """

    @functools.wraps(handler)
    async def endpoint(self: Any, request: Any):
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        try:
            return await handler(self, request)
        except ApiError as error:
            return error_response(error)
        except LollmError as error:
            return error_response(ApiError(400, str(error)))
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as error:
            return error_response(internal_error(f"{request.method} {request.url.path}", error))

    return endpoint


class Routes:
    """The HTTP handlers of one :class:`ModelServer`, one method per route; :func:`create_app` wires them."""

    def __init__(self, server: ModelServer):
        self.server = server
        self.schema = openapi_schema(server)

    async def generation(self, request: Any, kind: str):
        """POST of ``kind`` ("chat" or "completion"): the answer as JSON, or as server-sent events."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse

        server = self.server
        server.check_auth(request.headers.get("authorization"))
        raw = await read_limited(request, server.max_body_bytes)
        plan = await run_in_threadpool(server.prepare, raw, kind)  # JSON, checks, template, tokens: off the loop
        plan.job.endpoint = request.url.path
        base = _base(server, kind)
        if plan.streaming:
            return stream(server, plan, CHUNKS[kind](server, base), f"POST {request.url.path}")
        result = await wait(server, request, plan.job)
        if result is None:
            raise ApiError(499, "the request was cancelled")
        return JSONResponse(ANSWERS[kind](server, base, plan.job, result))

    @guarded
    async def chat_completions(self, request: Any):
        return await self.generation(request, "chat")

    @guarded
    async def completions(self, request: Any):
        return await self.generation(request, "completion")

    @guarded
    async def models(self, request: Any):
        from starlette.responses import JSONResponse

        self.server.check_auth(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [
            {"id": self.server.name, "object": "model", "created": self.server.created, "owned_by": "lollm"}]})

    @guarded
    async def chat_page(self, request: Any):  # the page asks for the key itself: no auth here, it holds no data
        from starlette.responses import HTMLResponse

        return HTMLResponse(chat_page_html(), headers={"Cache-Control": "no-cache", "Content-Security-Policy": CHAT_PAGE_CSP})

    @guarded
    async def health(self, request: Any):
        from starlette.responses import JSONResponse

        server = self.server
        batching = None
        if server.engine_loop is not None:
            config = server.engine_loop.engine.config
            batching = {"max_running": config.max_sequences, "kv_blocks": config.kv_blocks,
                        "block_size": config.block_size, "max_queue": server.max_queue,
                        "prefix_caching": server.engine_loop.engine.scheduler.prefix_caching}
        return JSONResponse({"status": "ok", "model": server.name, "requests": dict(server.counts), "batching": batching})

    @guarded
    async def metrics(self, request: Any):
        """Prometheus' text format (lollm.serve.metrics); 501 when prometheus-client is not installed."""
        from starlette.responses import Response

        if self.server.metrics is None:
            raise ApiError(501, "/metrics needs prometheus-client: pip install 'lollm-core[serve]'", kind="server_error")
        return Response(self.server.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    @guarded
    async def openapi(self, request: Any):
        from starlette.responses import JSONResponse

        return JSONResponse(self.schema)

    async def http_error(self, request: Any, error: Any):
        """Starlette's HTTPException (an unknown path: 404, a wrong method: 405) as an OpenAI-style error."""
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path[:200]}: {error.detail}"
        return error_response(ApiError(error.status_code, message, kind=kind), headers=error.headers)


def create_app(server: ModelServer):
    """The Starlette application serving ``server``: the routes of :class:`Routes`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    routes = Routes(server)
    return Starlette(routes=[
        Route("/", routes.chat_page, methods=["GET"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/openapi.json", routes.openapi, methods=["GET"]),
    ], exception_handlers={HTTPException: routes.http_error})


def serve(server: ModelServer, *, host: str = "127.0.0.1", port: int = 8000, family: str = "") -> None:
    """Serve until Ctrl-C (uvicorn); once it listens, log :func:`banner` (the URL, the model, a curl line)."""
    try:
        import uvicorn
    except ImportError:
        raise LollmError("lollm serve needs the serve extra: pip install 'lollm-core[serve]' (starlette, uvicorn)") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    runner = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port, log_level="info"))
    lines = banner(server, family, host, port)
    threading.Thread(target=announce, args=(runner, lines), name="lollm-banner", daemon=True).start()
    runner.run()


def announce(runner: Any, lines: list[str]) -> None:
    """Log ``lines`` (the :func:`banner`) once the uvicorn ``runner`` listens (its ``started`` flag); nothing if it stops first."""
    while not runner.started:
        if runner.should_exit:
            return
        time.sleep(0.05)
    for line in lines:
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
