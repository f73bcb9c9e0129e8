"""Reading a request of ``lollm serve``: the JSON body, its fields, the messages, ``response_format``.

Everything here is plain Python over the parsed body: no HTTP, no model. A request the
server refuses is an :class:`ApiError` that names the field; a request read and checked
becomes a :class:`Job` (what the engine or the single worker runs) inside a :class:`PreparedRequest`
(the job and how to answer), made by :meth:`lollm.serve.model_server.ModelServer.prepare`.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

from lollm.errors import TokenizerError
from lollm.generate.sequence import TokenLogprobs
from lollm.generate.structured import CompiledConstraint, OutputConstraint, open_object
from lollm.sampling_params import SEED_MAX, SamplingParams
from lollm.serve.tools import ToolRequest, template_tool_calls
from lollm.tokenizer import Tokenizer

log = logging.getLogger("lollm.serve.server")  # one logger for the whole server (docs/serving.md)

#: A request body as :func:`parse_body` gives it: a JSON object (values: str, int, float, bool, None, list, dict).
Body = dict[str, object]

#: Fields a client may send that change nothing here, ignored when null or neutral.
IGNORED = {"user": None, "metadata": None, "store": None, "service_tier": None, "parallel_tool_calls": None,
           "logit_bias": {}, "tools": [], "tool_choice": "none",
           "presence_penalty": 0, "frequency_penalty": 0, "n": 1, "best_of": 1, "echo": False, "suffix": None}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
COMMON_FIELDS = {"model", "max_tokens", "seed", "stop", "stream", "stream_options", "response_format", *SAMPLING_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs",
                               "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id")
#: Template variables a request may not set through chat_template_kwargs (the server sets them).
RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt"}

# -- the server's limits (docs/serving.md, "Limits") ---------------------------------------

#: A request body may hold BODY_BYTES_BASE + BODY_BYTES_PER_POSITION * context bytes, plus IMAGE_BODY_BYTES
#: when the model reads images (see body_limit).
BODY_BYTES_BASE = 1 << 20
BODY_BYTES_PER_POSITION = 64
#: The room images add to the body limit of a server whose model reads images: 48 MiB, so that one image of
#: lollm.vision.image.MAX_BYTES (32 MiB of file) fits as base64 (4/3 of it: 42.7 MiB), or a few phone photos
#: (a 4 MB JPEG is 5.3 MB as base64: nine of them), while the body stays under app.DRAIN_BYTES (64 MiB).
IMAGE_BODY_BYTES = 48 << 20
#: How deep a request's JSON may nest: OpenAI's bodies need 4 (messages[i].content[j].text).
MAX_JSON_DEPTH = 32
#: The largest integer a request field may hold (a seed goes up to 2**64-1).
MAX_INTEGER = SEED_MAX


def body_limit(context: int, images: bool = False) -> int:
    """Most bytes a request body may have for a server of ``context`` positions (``images``: its model reads images).

    1 MiB plus 64 bytes a position: a prompt that fills the context takes about
    4 bytes a token as plain text, up to about 12 with every character
    JSON-escaped (``\\u00e9``), and about 8 as a list of token ids. 4096
    positions (the default --ctx-size): 1.25 MiB; 131,072: 9 MiB. A model that
    reads images adds :data:`IMAGE_BODY_BYTES` (48 MiB): an image travels as a
    base64 ``data:`` URL, 4/3 of its file's size.
    """
    return BODY_BYTES_BASE + BODY_BYTES_PER_POSITION * context + (IMAGE_BODY_BYTES if images else 0)


def body_limit_rule(images: bool) -> str:
    """What :func:`body_limit` is made of, in words, for the 413's message (``images``: as there)."""
    rule = f"1 MiB plus {BODY_BYTES_PER_POSITION} bytes per position of its context, lollm serve --ctx-size"
    if images:
        return rule + f", plus {IMAGE_BODY_BYTES >> 20} MiB for images, sent as base64 data: URLs"
    return rule


def longest_token_bytes(tokenizer: Tokenizer) -> int:
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

    def body(self) -> dict[str, dict[str, str | None]]:
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


#: The most characters of a refusal's message its log line keeps (a message may quote what the client sent).
REFUSAL_LOG_CHARS = 300


def log_refusal(where: str, error: ApiError) -> None:
    """One log line (INFO) for a request the server refuses, beside uvicorn's access line, which gives no reason:
    ``where`` (``"POST /v1/chat/completions"``), the status, the error code (else its type), the message
    (cut at :data:`REFUSAL_LOG_CHARS`, one line). A 500 has its line from :func:`internal_error` and a 499
    (the client went away) is no refusal: neither is logged here."""
    if error.status in (499, 500):
        return
    message = " ".join(error.message.split())
    if len(message) > REFUSAL_LOG_CHARS:
        message = message[:REFUSAL_LOG_CHARS] + "..."
    param = f", param {error.param}" if error.param else ""
    log.info("%s: refused %d %s%s: %s", where, error.status, error.code or error.kind, param, message)


# -- reading a request --------------------------------------------------------------

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel = 80, 80, 3


def short_repr(value: object) -> str:
    """``repr(value)`` cut short (long strings, big lists, deep nesting), for error messages."""
    return _SHOW.repr(value)


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> Body:
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


def text_bytes(value: object) -> int:
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


def check_fields(body: Body, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in IGNORED and value in (None, IGNORED[name]):
            continue
        raise ApiError(400, f"unsupported parameter {short_repr(name)} (value {short_repr(value)}): lollm serve does not "
                            f"implement it", param=name[:100], code="unsupported_parameter")


def number(body: Body, name: str, *, integer: bool = False, low: float | None = None,
            high: float | None = None, open_low: bool = False) -> int | float | None:
    """``body[name]`` checked to be a number in range, or None when absent or null.

    Integers lie within +-:data:`MAX_INTEGER` and other numbers are finite
    (JSON's ``1e400`` reads as infinity), whatever ``low`` and ``high`` say.
    """
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"{name!r} must be {'an integer' if integer else 'a number'}, got {short_repr(value)}", param=name)
    if isinstance(value, int) and abs(value) > MAX_INTEGER or isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name!r} is out of range: {short_repr(value)}", param=name)
    if low is not None and (value <= low if open_low else value < low):
        raise ApiError(400, f"{name!r} must be {'>' if open_low else '>='} {low}, got {value}", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"{name!r} must be <= {high}, got {value}", param=name)
    return value


def flag(body: Body, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name!r} must be true or false, got {short_repr(value)}", param=name)
    return value


def stops(body: Body) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most 16 of them, got {short_repr(value)}",
                       param="stop")
    return stops


def stream_options(body: Body) -> bool:
    """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    return bool(options.get("include_usage", False))


def chat_logprobs(body: Body) -> int | None:
    """How many alternatives each chat token's logprobs list (``logprobs`` + ``top_logprobs``), None: no logprobs."""
    top = number(body, "top_logprobs", integer=True, low=0, high=20)
    if flag(body, "logprobs"):
        return top or 0
    if top is not None:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return None


def read_messages(value: object, images: list | None = None) -> list[dict[str, object]]:
    """The chat messages as the template takes them: role, content (text parts joined), name, and an assistant's
    tool calls (arguments as objects: :func:`lollm.serve.tools.template_tool_calls`); ApiError 400 naming the message.

    ``images``: a list that receives each ``image_url`` part's decoded image, in order (:func:`read_image_part`);
    None: image parts are refused like any other non-text part."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with 'role' and 'content'", param=where)
        for key, item in message.items():
            if key not in MESSAGE_FIELDS and item is not None:
                raise ApiError(400, f"{where}.{short_repr(key)} is not supported (only {', '.join(MESSAGE_FIELDS)})",
                               param=f"{where}.{key[:100]}")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {short_repr(role)}", param=f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text, and images when the caller collects them
            content = _content_parts(content, where, images)
        if not isinstance(content, (str, list)):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        entry: dict[str, object] = {"role": role, "content": content}
        for key in ("name", "reasoning_content", "tool_call_id"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise ApiError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
                entry[key] = message[key]
        if message.get("tool_calls") and role == "assistant":
            entry["tool_calls"] = template_tool_calls(message["tool_calls"], where)
        out.append(entry)
    return out


# -- image parts (docs/vision.md) -----------------------------------------------------------

#: Content part types that carry media: images are read, video and audio refused by name.
MEDIA_PARTS = ("image_url", "input_audio", "video_url", "input_video")


def _content_parts(content: list, where: str, images: list | None) -> str | list[dict[str, str]]:
    """A message's content parts: their text joined by newlines; with an image among them, the parts as the
    chat template takes them, ``[{"type": "text", "text": ...}, {"type": "image"}, ...]`` (the template writes
    the family's placeholder for each image: lollm.serve.images). Each image is read into ``images``."""
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        if images is not None and isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
            images.append(read_image_part(part, f"{where}.content[{j}]", len(images) + 1))
            parts.append({"type": "image"})
            continue
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ApiError(400, f"{where}.content[{j}]: only text parts are supported",
                           param=f"{where}.content[{j}]")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


#: OpenAI's image ``detail`` values: accepted, without effect. OpenAI resizes an image by it ("low": one 512-pixel
#: tile); here each vision tower reads an image at its own resolution rule (docs/vision.md), whatever the client asks.
IMAGE_DETAILS = (None, "auto", "low", "high")


def read_image_part(part: dict, where: str, number: int) -> object:
    """One ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` part -> an RGB PIL image.

    Only ``data:`` URLs: the server fetches nothing. ApiError 400 naming ``where`` for another URL,
    an ``image_url.detail`` that is not one of :data:`IMAGE_DETAILS` (all accepted without effect, as for Responses),
    bad base64, a hostile image (lollm.vision.image: bomb, truncated, CMYK, 16-bit, animated, 0x0),
    and for video or audio parts (not supported).
    """
    from lollm.errors import ImageError
    from lollm.vision.image import decode_data_url, decode_image
    from lollm.vision.prompt import UNSUPPORTED_MEDIA

    kind = part.get("type")
    if kind != "image_url":
        raise ApiError(400, f"{where}: {UNSUPPORTED_MEDIA['audio' if 'audio' in kind else 'video']}", param=where)
    url = part.get("image_url")
    detail = url.get("detail") if isinstance(url, dict) else None
    if detail not in IMAGE_DETAILS:  # the Responses API's input_image reads the same (lollm.serve.responses)
        raise ApiError(400, f"{where}.image_url.detail must be one of auto, low, high (or left out), got {detail!r}",
                       param=f"{where}.image_url.detail")
    url = url.get("url") if isinstance(url, dict) else url
    name = f"image {number} of the request ({where})"
    try:
        return decode_image(decode_data_url(url, name=name), name=name)
    except ImageError as error:
        raise ApiError(400, str(error), param=f"{where}.image_url.url") from None


# -- response_format: structured output (lollm.generate.structured, docs/structured-output.md) ----------

#: ``response_format.type`` -> the key holding its value: OpenAI's three, and lollm's two extensions.
RESPONSE_FORMATS = {"text": None, "json_object": None, "json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}


def response_format(value: object) -> OutputConstraint | None:
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
                            f"got {short_repr(value)}", param="response_format")
    key = RESPONSE_FORMATS[kind]
    if set(value) - {"type", key}:
        raise ApiError(400, f"'response_format' of type {kind!r} takes only {sorted({'type', key} - {None})}, got {short_repr(value)}",
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
    reasoning: str | None = None  # where the answer begins for lollm.serve.reasoning (None: no thinking to separate)
    shutdown: bool = False  # ended because the server stops (lollm.serve.shutdown): a 503, or finish_reason "shutdown"
    on_shutdown: Callable[[], None] | None = None  # called (any thread) when it is so ended: a stream ends at once
    images: Any = None  # the prompt's ImageBatch (lollm.serve.images), None for text


@dataclass
class PreparedRequest:
    """A request read, checked and tokenized (:meth:`ModelServer.prepare`): its job and how to answer."""

    job: Job
    streaming: bool
    include_usage: bool
    #: what the answer of another API needs of its request (lollm.serve.responses: the echoed fields, the history)
    extra: dict[str, object] = field(default_factory=dict)

